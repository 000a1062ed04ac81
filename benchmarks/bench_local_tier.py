"""Local tier benchmark: how much faster a restart restores from the node's own copy.

``CheckpointManager(keep_local=True)`` keeps the newest checkpoint's staged
files on local disk; a restart on the same node reads the files whose
checksum matches the manifest from there and only the rest from the volume.
``restore_comparison`` saves a state to a checkpoint root (``bench
checkpoint`` calls it for every link of its target), then times ``restore``
by a fresh manager, as a restarted job does it:

* ``remote only``: no local tier, every byte comes over the link;
* ``local tier``: all files from the local copy (checksums verified);
* ``local tier, 1 file damaged``: one local file fails its checksum and is
  fetched from the volume, the others are read locally.

Every restore is checked bit for bit against the saved state.

On its own (moto's S3 server, its own process, behind the remote-like link of
the other benchmarks: a proxy adding 20 ms before each request and capping
each connection at 200 Mbit/s)::

    python -m benchmarks.bench_local_tier                 # 256 MiB, 3 repeats
    python -m benchmarks.bench_local_tier --quick         # 32 MiB, 1 repeat
    python -m benchmarks.bench_local_tier --size-mib 512 --repeats 5

Writes benchmarks/results/local_tier.json (``--quick``: local_tier_quick.json).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    REMOTE_BANDWIDTH_BPS,
    REMOTE_LATENCY_S,
    MiB,
    ProxyProcess,
    format_table,
    load_average,
    machine_info,
    write_json,
)
from dcp_volumes import CheckpointManager

_TENSOR_MIB = 16  # the state is made of tensors this large


def make_state(size_mib: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, size_mib // _TENSOR_MIB)
    numel = _TENSOR_MIB * MiB // 4
    return {
        "model": {f"layer{i}": torch.randn(numel, generator=g) for i in range(n)},
        "step": torch.tensor([seed]),
    }


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
        "step": torch.zeros(1, dtype=torch.int64),
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["step"], b["step"]) and all(
        torch.equal(a["model"][k], b["model"][k]) for k in b["model"]
    )


def timed_restore(
    root: str, options: dict[str, Any], want: dict[str, Any], **manager_kw: Any
) -> float:
    """Seconds for a fresh manager's ``restore`` (a restarted job), checked bit for bit."""
    target = empty_like(want)
    with CheckpointManager(root, storage_options=options, **manager_kw) as mgr:
        started = time.perf_counter()
        step = mgr.restore(target)
        seconds = time.perf_counter() - started
    if step != 1 or not same(target, want):
        raise RuntimeError(f"restore returned step {step} or wrong data: the benchmark is invalid")
    return seconds


def damage_one_local_file(local_dir: Path) -> str:
    files = sorted(local_dir.rglob("*.distcp"))
    victim = files[0]
    with open(victim, "r+b") as f:  # same size, different bytes: only a checksum can tell
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return victim.name


ROWS = ("remote only", "local tier", "local tier, 1 file damaged")


def restore_comparison(
    root: str,
    options: dict[str, Any],
    size_mib: int,
    repeats: int,
    *,
    file_size: str = "64MiB",
) -> dict[str, Any]:
    """Save ``size_mib`` under ``root``, then time the three restores ``repeats`` times."""
    work = Path(tempfile.mkdtemp(prefix="dcpv-bench-local-"))
    state = make_state(size_mib, seed=1)
    results: dict[str, list[float]] = {name: [] for name in ROWS}
    try:
        local = work / "nvme"
        with CheckpointManager(
            root,
            storage_options=options,
            keep_local=True,
            local_dir=str(local),
            writer_options={"file_size": file_size},
        ) as mgr:
            started = time.perf_counter()
            mgr.save(1, state)
            blocked = time.perf_counter() - started
            mgr.wait()
            save_seconds = time.perf_counter() - started
        pristine = work / "pristine"
        shutil.copytree(local, pristine)
        n_files = len(list(local.rglob("*.distcp")))
        damaged = ""
        for _ in range(repeats):
            results["remote only"].append(timed_restore(root, options, state))
            results["local tier"].append(
                timed_restore(root, options, state, keep_local=True, local_dir=str(local))
            )
            damaged = damage_one_local_file(local)
            results["local tier, 1 file damaged"].append(
                timed_restore(root, options, state, keep_local=True, local_dir=str(local))
            )
            shutil.rmtree(local)
            shutil.copytree(pristine, local)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    remote = statistics.median(results["remote only"])
    return {
        "size_mib": size_mib,
        "data_files": n_files,
        "repeats": repeats,
        "save": {"blocked_s": blocked, "committed_s": save_seconds},
        "restore_seconds": results,
        "median_seconds": {k: statistics.median(v) for k, v in results.items()},
        "speedup_vs_remote": {k: remote / statistics.median(v) for k, v in results.items()},
        "damaged_file": damaged,
    }


def table(res: dict[str, Any]) -> str:
    med, speedup = res["median_seconds"], res["speedup_vs_remote"]
    rows = [
        [name, med[name], min(secs), res["size_mib"] / med[name], speedup[name]]
        for name, secs in res["restore_seconds"].items()
    ]
    return format_table(["restore", "median s", "best s", "MiB/s", "speed-up"], rows)


def main() -> None:
    from testkit.emulators import MotoServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--file-size",
        default="64MiB",
        help="VolumeWriter file_size: the checkpoint is split into files this big",
    )
    parser.add_argument("--quick", action="store_true", help="32 MiB, 1 repeat (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.repeats = 32, 1
    logging.basicConfig(level=logging.WARNING)
    info = machine_info()
    with MotoServer(mode="process") as s3, ProxyProcess(s3.host, s3.port) as proxy:
        root = f"{s3.create_bucket('bench-local-tier')}/run"
        res = restore_comparison(
            root, s3.storage_options(proxy.endpoint), args.size_mib, args.repeats,
            file_size=args.file_size,
        )
    print(
        f"\nLocal tier: restore of {args.size_mib} MiB ({res['data_files']} data files) by a "
        f"restarted job; link {REMOTE_LATENCY_S * 1000:.0f} ms/request, "
        f"{REMOTE_BANDWIDTH_BPS / 1e6:.0f} Mbit/s per connection; {args.repeats} repeats"
    )
    print(f"save: blocked {res['save']['blocked_s']:.2f} s, "
          f"committed after {res['save']['committed_s']:.2f} s\n")
    print(table(res))
    doc = {
        "benchmark": "local_tier",
        **res,
        "link": {"latency_s": REMOTE_LATENCY_S, "bandwidth_bps": REMOTE_BANDWIDTH_BPS},
        "machine": {**info, "load_average_end": load_average()},
    }
    path = write_json("local_tier_quick.json" if args.quick else "local_tier.json", doc)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
