"""Run as a script: a training process that used obstore starts a 3-worker loader.

Prints one JSON line: the start method chosen, the fork servers running under
this process once the loader is built (before any ``iter()``) and once the
workers delivered a batch, how many workers that server forked, and how many
torch_shm_manager processes run under this process by then.
"""

from __future__ import annotations

import json
import sys

import psutil


def _fork_servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children()
            if "multiprocessing.forkserver" in " ".join(p.cmdline())]


def main(url: str, options: str, cache: str) -> None:
    from dcp_volumes import DataLoader, VolumeDataset

    opts = json.loads(options)
    ds = VolumeDataset(url, storage_options=opts, cache_dir=cache)  # lists through obstore
    loader = DataLoader(ds, batch_size=2, num_workers=3, timeout=60)
    when_built = [p.pid for p in _fork_servers()]
    next(iter(loader))
    servers = _fork_servers()
    managers = [
        p for p in psutil.Process().children(recursive=True) if p.name().startswith("torch_shm")
    ]
    workers = [p for s in servers for p in s.children() if not p.name().startswith("torch_shm")]
    ctx = loader.multiprocessing_context
    print(json.dumps({
        "start_method": ctx.get_start_method() if ctx is not None else "fork",
        "servers_when_built": when_built,
        "servers": [p.pid for p in servers],
        "workers_of_server": len(workers),
        "managers": len(managers),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
