"""CPU per file on loopback: what a cold cache epoch must spend, part by part.

A cold epoch of a read-through cache behind a DataLoader does the work of two
simpler jobs: fetching (the server's side and the client's, and writing the
bytes to a local file) and loading (the DataLoader's transform, collate and
hand-over). This probe runs both on their own, and ours, over the same
``--files`` x ``--mib`` MiB objects on moto's server, and counts the CPU
seconds of the whole process tree (server and workers included) per file:

* ``local``: a stock DataLoader over the same files on local disk, warm;
* ``raw`` / ``raw_to_files``: concurrent GETs (16 threads), the second also
  writing each body to a new local file in 1 MiB pieces;
* ``ours``: VolumeDataset + DataLoader, cold (a fresh cache).

With ``C`` CPU-ms per file for ``local`` plus ``raw_to_files``, no cold epoch
on this machine's cores can beat ``cores / C``, whatever the cache does.

    python benchmarks/probes/loopback_cpu_budget.py [--files 64] [--mib 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from _data_peers import LocalFiles, raw_concurrent_gets, read_local  # noqa: E402
from _raw import raw_store  # noqa: E402

from dcp_volumes import DataLoader, VolumeDataset  # noqa: E402
from tests.emulators import MotoServer  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
SETTLE_S = 6.0


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of ``root`` and every live descendant."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
        times[int(name)] = (int(fields[11]) + int(fields[12])) / TICK
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += times.get(pid, 0.0)
        stack += children.get(pid, [])
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    me, cores = os.getpid(), os.cpu_count() or 1
    with MotoServer("process") as server:
        server.create_bucket("probe")
        client = server.boto3_client()
        body = os.urandom(args.mib << 20)
        keys = [f"d/f{i:05d}" for i in range(args.files)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: client.put_object(Bucket="probe", Key=k, Body=body), keys))
        work = Path(tempfile.mkdtemp(prefix="cpu-budget-"))
        paths = []
        for i in range(args.files):
            paths.append(str(work / f"f{i:05d}"))
            Path(paths[-1]).write_bytes(body)

        def measure(run: Callable[[], object]) -> tuple[float, float]:
            """(files/s, CPU-ms per file) of ``run``, after the usual pause."""
            time.sleep(SETTLE_S)
            c, t = tree_cpu_s(me), time.perf_counter()
            run()
            secs, cpu = time.perf_counter() - t, tree_cpu_s(me) - c
            return args.files / secs, 1000 * cpu / args.files

        def one_round() -> dict[str, tuple[float, float]]:
            row: dict[str, tuple[float, float]] = {}
            loader = torch.utils.data.DataLoader(
                LocalFiles(paths), batch_size=16, num_workers=2, persistent_workers=True,
                prefetch_factor=4)
            list(loader)  # workers up and the files in the page cache: time a warm epoch
            row["local"] = measure(lambda: list(loader))
            for name, out in (("raw", None), ("raw_to_files", tempfile.mkdtemp(dir=work))):
                row[name] = measure(
                    lambda out=out: raw_concurrent_gets(
                        raw_store("s3", server.storage_options(), "probe", 32), keys, 16, out))
            ds = VolumeDataset("s3://probe/d", storage_options=server.storage_options(),
                               cache_dir=tempfile.mkdtemp(dir=work), transform=read_local)
            ours = DataLoader(ds, batch_size=16, num_workers=2)  # workers start in the timing
            row["ours"] = measure(lambda: list(ours))  # and stay up until it is read
            return row

        try:
            rounds = [one_round() for _ in range(args.rounds)]
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{args.files} x {args.mib} MiB on loopback, {cores} cores")
    print(f"{'round':5s} {'case':14s} {'files/s':>8s} {'CPU-ms/file':>12s}")
    for r, row in enumerate(rounds, 1):
        for name, (rate, cpu_ms) in row.items():
            print(f"{r:<5d} {name:14s} {rate:8.1f} {cpu_ms:12.1f}")
        need = row["local"][1] + row["raw_to_files"][1]
        best = 1000 * cores / need
        print(f"{r:<5d} fetch + load >= {need:.1f} CPU-ms/file: at most {best:.0f} files/s on "
              f"{cores} cores = {best / row['raw'][0]:.2f}x the raw GETs; ours "
              f"{row['ours'][0] / row['raw'][0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
