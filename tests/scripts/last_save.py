"""A training script whose last step is an async CheckpointManager.save(): it returns without
wait()/close(). Usage: last_save.py ROOT STORAGE_OPTIONS_JSON [MANAGER_OPTIONS_JSON [TENSORS]]
(TENSORS tensors of 1 MiB, default 1)."""

import json
import logging
import sys

import torch

from dcp_volumes import CheckpointManager

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
root, options = sys.argv[1], json.loads(sys.argv[2])
writer_options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
tensors = int(sys.argv[4]) if len(sys.argv) > 4 else 1
mgr = CheckpointManager(root, keep_last=2, storage_options=options, **writer_options)
state: dict = {f"w{i}": torch.zeros(512, 512) for i in range(tensors)}
state["step"] = 0
for step in (5, 6, 7):
    for i in range(tensors):
        state[f"w{i}"].fill_(float(step))
    state["step"] = step
    mgr.save(step, state)
print("returning with a save in flight", flush=True)
