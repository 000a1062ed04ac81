"""The harness that tests/ and benchmarks/ share (not part of the wheel).

emulators  object-store servers on 127.0.0.1 (moto, Azurite, the GCS emulator)
radosgw    Ceph's S3 gateway on a private one-node cluster
proxy      a TCP proxy that slows, counts and breaks HTTP/1.1 traffic
ranks      run a function on N gloo ranks, started the way torchrun starts them
states     deterministic training states and their bit-exact comparison
ports      free TCP ports
"""
