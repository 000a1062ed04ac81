"""Run as a script: a training process that used obstore starts a 3-worker loader.

Prints one JSON line: the start method chosen and how many torch_shm_manager
processes run under this process once the workers delivered a batch.
"""

from __future__ import annotations

import json
import sys

import psutil


def main(url: str, options: str, cache: str) -> None:
    from dcp_volumes import DataLoader, VolumeDataset

    opts = json.loads(options)
    ds = VolumeDataset(url, storage_options=opts, cache_dir=cache)  # lists through obstore
    loader = DataLoader(ds, batch_size=2, num_workers=3, timeout=60)
    next(iter(loader))
    managers = [
        p for p in psutil.Process().children(recursive=True) if p.name().startswith("torch_shm")
    ]
    ctx = loader.multiprocessing_context
    print(json.dumps({
        "start_method": ctx.get_start_method() if ctx is not None else "fork",
        "managers": len(managers),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
