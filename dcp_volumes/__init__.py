"""dcp_volumes: fast, fault-tolerant PyTorch checkpoints and training inputs on remote volumes."""
