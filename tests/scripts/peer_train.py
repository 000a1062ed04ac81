"""A rank of a two-"node" torchrun job for tests/test_peer_tier.py.

    peer_train.py ROOT OUT save|restore|hold

Every node (torchrun agent) gets its own local tier through ``PEER_LOCAL_DIR``;
``PEER_TEST`` (JSON) holds the storage options and ``saved_world`` (the ranks
that saved). ``save`` saves steps 1 and 2 with ``keep_local=True,
local_replicas=1`` and closes (which waits for the replication); ``hold`` saves
step 1, then step 2 with a slow replication, and waits in a collective until it
is killed; ``restore`` restores into a state holding every saved rank's entry
that this rank loads and checks it exactly (with ``PEER_TEST``'s ``reader_options``,
if any). Each rank writes ``OUT/rank-<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from dcp_volumes import CheckpointManager, Encryption
from dcp_volumes.checkpoint import _peers

_N = 96 * 1024  # floats per rank entry: 384 KiB, several files with file_size below


def entry(step: int, rank: int) -> torch.Tensor:
    return torch.randn(_N, generator=torch.Generator().manual_seed(100 * step + rank))


def common(step: int) -> torch.Tensor:
    return torch.randn(64, 1024, generator=torch.Generator().manual_seed(7 + step))


def state(step: int, ranks: list[int]) -> dict[str, Any]:
    return {"common": common(step), **{f"rank{r}": entry(step, r) for r in ranks}}


def main() -> None:
    root, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    opts = json.loads(os.environ["PEER_TEST"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _peers._CHUNK = 200_000  # several chunks a file: the chunking is exercised
    report: dict[str, Any] = {"node": int(os.environ["GROUP_RANK"]), "rank": rank,
                              "pid": os.getpid(), "local_dir": os.environ["PEER_LOCAL_DIR"]}
    key = opts.get("encryption_key")  # hex: the job encrypts its checkpoints (test_encryption)
    mgr = CheckpointManager(root, storage_options=opts["storage_options"], keep_local=True,
                            local_dir=os.environ["PEER_LOCAL_DIR"], local_replicas=1,
                            writer_options={"file_size": "128KiB"},
                            reader_options=opts.get("reader_options"),
                            encryption=Encryption(key=bytes.fromhex(key), key_id="peer")
                            if key else None)
    if mode in ("save", "hold"):
        mgr.save(1, state(1, [rank]))
        if mode == "hold":
            mgr.wait()
            mgr._peers.wait()  # type: ignore[union-attr]  # step 1 replicated whole
            slow = _peers._take_chunk

            def slow_chunk(item: Any, data: torch.Tensor) -> None:
                with open(os.path.join(out, f"replicating-{rank}"), "w"):
                    pass
                time.sleep(0.2)
                slow(item, data)

            _peers._take_chunk = slow_chunk
        mgr.save(2, state(2, [rank]))
        if mode == "hold":
            mgr.wait()  # committed; the replication goes on in the background
            report["committed"] = 2
            _write(out, rank, report)
            while not os.path.exists(os.path.join(out, "stop")):  # until a node is killed
                time.sleep(0.05)
            started = time.perf_counter()
            mgr.close()  # the replication in flight fails: the exit must not hang
            report["close_seconds"] = time.perf_counter() - started
            _write(out, rank, report)
            os._exit(0)  # the group's other member is gone: no orderly teardown
        mgr.close()
        report["saved"] = 2
    else:
        saved = int(opts["saved_world"])
        mine = [r for r in range(saved) if r % world == rank]
        target = {"common": torch.zeros(64, 1024),
                  **{f"rank{r}": torch.zeros(_N) for r in mine}}
        started = time.perf_counter()
        step = mgr.restore(target)
        report["seconds"] = time.perf_counter() - started
        want = state(2, mine)
        report["step"] = step
        report["exact"] = all(torch.equal(target[k], want[k]) for k in want)
        report["sources"] = mgr.restore_sources
        mgr.close()
    _write(out, rank, report)
    dist.destroy_process_group()


def _write(out: str, rank: int, report: dict[str, Any]) -> None:
    path = os.path.join(out, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
