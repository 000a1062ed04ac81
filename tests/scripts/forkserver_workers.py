"""Run as a script: a training process that used obstore starts a 3-worker loader.

Prints one JSON line: the start method chosen, the fork servers running under
this process once the loader is built (before any ``iter()``) and once the
workers delivered a batch, how many workers that server forked, how many
torch_shm_manager processes run under this process by then, and the sample ids
of the whole epoch. An optional fourth argument pins the process to that many
CPUs first; the library logs to stderr at INFO.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import psutil


def _fork_servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children()
            if "multiprocessing.forkserver" in " ".join(p.cmdline())]


def main(url: str, options: str, cache: str, cpus: str = "") -> None:
    if cpus:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: int(cpus)])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from dcp_volumes import DataLoader, VolumeDataset
    from tests.test_data_support import read_id, to_list

    opts = json.loads(options)
    ds = VolumeDataset(url, storage_options=opts, cache_dir=cache,  # lists through obstore
                       transform=read_id)
    loader = DataLoader(ds, batch_size=2, num_workers=3, timeout=60)
    when_built = [p.pid for p in _fork_servers()]
    epoch = iter(loader)
    ids = to_list(next(epoch))
    servers = _fork_servers()
    managers = [
        p for p in psutil.Process().children(recursive=True) if p.name().startswith("torch_shm")
    ]
    workers = [p for s in servers for p in s.children() if not p.name().startswith("torch_shm")]
    ids += [i for batch in epoch for i in to_list(batch)]
    ctx = loader.multiprocessing_context
    print(json.dumps({
        "start_method": ctx.get_start_method() if ctx is not None else "fork",
        "servers_when_built": when_built,
        "servers": [p.pid for p in servers],
        "workers_of_server": len(workers),
        "managers": len(managers),
        "ids": sorted(ids),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:5])
