"""Cold epoch behind the remote-like link: first-batch latency, the rate after it, a timeline.

The full benchmark times whole epochs, DataLoader start-up included (worker
processes, a client each, the first batch), while its raw-GET row connects
outside its timing. This probe separates the two for VolumeDataset. With
``--timeline`` it also times every download (the cache's download step is
wrapped in this process; forked workers inherit the wrapper and append to a
log) and prints, per worker, when the first download started, when the last
ended, and the tail after it (the last batches' transform and collate).

    python benchmarks/probes/remote_cold_steady.py [--files 480] [--kib 100] [--rounds 2]
    python benchmarks/probes/remote_cold_steady.py --files 64 --kib 8192 --rounds 3 --timeline
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _data_peers import read_local  # noqa: E402
from _raw import boto3_client  # noqa: E402

import dcp_volumes.data._cache as cache_module  # noqa: E402
from dcp_volumes import DataLoader, VolumeDataset  # noqa: E402
from tests.emulators import LatencyProxy, MotoServer  # noqa: E402

# Memory freed by the previous round is new to this VM again after this (see bench_data).
SETTLE_S = 6.0
BATCH = 16
LOG = Path(tempfile.gettempdir()) / f"dcpv-cold-timeline-{os.getpid()}.log"
_download = cache_module.FileCache._download


def _timed_download(volume: Any, relpath: str, ref: Any, size: int, *, listed: bool) -> None:
    started = time.time()
    _download(volume, relpath, ref, size, listed=listed)
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()} {started:.4f} {time.time():.4f}\n")


def _print_timeline(t0: float, last_batch: float) -> None:
    per_worker: dict[str, list[tuple[float, float]]] = {}
    for line in LOG.read_text().splitlines():
        pid, start, end = line.split()
        per_worker.setdefault(pid, []).append((float(start) - t0, float(end) - t0))
    for spans in per_worker.values():
        spans.sort()
        last = max(end for _, end in spans)
        mean = sum(end - start for start, end in spans) / len(spans)
        print(f"  worker: first download at {spans[0][0]:.2f} s, last done at {last:.2f} s "
              f"({len(spans)} files, {mean:.2f} s each); tail after it {last_batch - last:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=480)
    ap.add_argument("--kib", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeline", action="store_true", help="time every download too")
    args = ap.parse_args()
    if args.timeline:
        cache_module.FileCache._download = staticmethod(_timed_download)  # type: ignore[method-assign]
    with MotoServer("process") as server:
        server.create_bucket("probe")
        client = server.boto3_client()
        body = os.urandom(args.kib * 1024)
        keys = [f"d/f{i:05d}" for i in range(args.files)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: client.put_object(Bucket="probe", Key=k, Body=body), keys))
        with LatencyProxy.in_front_of(server, latency_s=0.02, bandwidth_bps=200e6) as proxy:
            raw = boto3_client(proxy.endpoint, 32)
            raw.head_bucket(Bucket="probe")
            t0 = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda k: raw.get_object(Bucket="probe", Key=k)["Body"].read(), keys))
            print(f"raw GETs, 16 threads: {args.files / (time.perf_counter() - t0):.0f} files/s")
            for _ in range(args.rounds):
                LOG.unlink(missing_ok=True)
                cache = tempfile.mkdtemp(prefix="dcpv-probe-")
                ds = VolumeDataset("s3://probe/d", storage_options=server.storage_options(
                    proxy.endpoint), cache_dir=cache, transform=read_local)
                loader = DataLoader(ds, batch_size=BATCH, num_workers=2)
                time.sleep(SETTLE_S)
                t0, n, batches = time.time(), 0, []
                for batch in loader:
                    n += len(batch)
                    batches.append(time.time() - t0)
                first, total = batches[0], batches[-1]
                print(f"VolumeDataset cold: {n / total:.0f} files/s, first batch after "
                      f"{first:.2f} s, then {(n - BATCH) / (total - first):.0f} files/s")
                if args.timeline:
                    _print_timeline(t0, total)
                del loader, ds
                shutil.rmtree(cache, ignore_errors=True)
    LOG.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
