"""One rank of ``bench_peer_tier``: save a state, or restore it and time the restore.

    python -m benchmarks._peer_rank ROOT OUT save|restore SIZE_MIB

``BENCH_PEER`` (JSON): this node's ``storage_options`` (its own proxy: a node's
link), ``local_dir``, ``keep_local`` and ``local_replicas``. Writes
``OUT/rank-<r>.json`` with the times, the peak RSS before a save or restore and
after it (a save's: after the replication), a restore's CPU seconds (all its
threads) and sources, whether the restored state is bit for bit the saved one,
and the library's log lines (INFO and up) with their seconds since the save or
restore began: where the time went.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._common import max_rss_lifetime
from dcp_volumes import CheckpointManager

_TENSOR_MIB = 16


def make_state(size_mib: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    n = max(1, size_mib // _TENSOR_MIB)
    return {f"rank{rank}.t{i}": torch.randn(_TENSOR_MIB * 2**18, generator=g) for i in range(n)}


class _Events(logging.Handler):
    """The library's log lines, with their time since ``started``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.started = time.time()
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((round(record.created - self.started, 3), record.getMessage()))


def main() -> None:
    root, out, mode, size_mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cfg = json.loads(os.environ["BENCH_PEER"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mgr = CheckpointManager(
        root, storage_options=cfg["storage_options"], keep_local=cfg["keep_local"],
        local_dir=cfg["local_dir"], local_replicas=cfg["local_replicas"],
        writer_options={"file_size": "32MiB"},
    )
    report: dict[str, Any] = {"rank": rank, "local_dir": cfg["local_dir"]}
    want = make_state(size_mib, rank)
    events = _Events()
    library = logging.getLogger("dcp_volumes")
    library.setLevel(logging.INFO)
    library.addHandler(events)
    if mode == "save":
        report["peak_rss_before"] = max_rss_lifetime()
        dist.barrier()
        started, events.started = time.perf_counter(), time.time()
        mgr.save(1, want)
        report["blocked_s"] = time.perf_counter() - started
        mgr.wait()
        report["committed_s"] = time.perf_counter() - started
        mgr.close()  # waits for the replication
        report["closed_s"] = time.perf_counter() - started
        report["peak_rss"] = max_rss_lifetime()
    else:
        target = {k: torch.empty_like(v) for k, v in want.items()}
        dist.barrier()
        started, events.started = time.perf_counter(), time.time()
        report["peak_rss_before"] = max_rss_lifetime()
        cpu = time.process_time()
        step = mgr.restore(target)
        report["restore_s"] = time.perf_counter() - started
        report["cpu_s"] = time.process_time() - cpu
        report["peak_rss"] = max_rss_lifetime()
        report["exact"] = step == 1 and all(torch.equal(target[k], want[k]) for k in want)
        report["sources"] = mgr.restore_sources
        mgr.close()
    report["events"] = events.lines
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
