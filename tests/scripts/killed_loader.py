"""A training process that reads through DataLoader workers, then waits to be killed.

``python -m tests.scripts.killed_loader SRC CACHE PID_DIR``: forkserver workers
each write their pid into PID_DIR; once both have delivered a batch this prints
"ready" and sleeps (tests/test_loader.py SIGKILLs it and watches the workers).
"""

from __future__ import annotations

import os
import sys
import time


def note_pid(worker_id: int) -> None:
    """``worker_init_fn``: leave this worker's pid where the test can find it."""
    with open(os.path.join(os.environ["KILLED_LOADER_PIDS"], f"{worker_id}"), "w") as f:
        f.write(str(os.getpid()))


def main(src: str, cache: str, pid_dir: str) -> None:
    # Run with -m this module is __main__; the workers unpickle note_pid by its real name.
    from dcp_volumes import DataLoader, VolumeDataset
    from tests.scripts.killed_loader import note_pid as importable_note_pid
    from tests.test_data_support import read_id

    os.environ["KILLED_LOADER_PIDS"] = pid_dir
    dataset = VolumeDataset(src, cache_dir=cache, transform=read_id)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context="forkserver",
                        worker_init_fn=importable_note_pid, timeout=60)
    batches = iter(loader)
    next(batches)
    next(batches)  # one from each worker
    print("ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:4])
