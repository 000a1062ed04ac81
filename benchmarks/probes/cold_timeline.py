"""Timeline of one cold epoch behind the remote-like link: worker start, each download, batches.

Where a short cold epoch's time goes beyond the downloads themselves:
starting the workers, the waves of downloads (``prefetch_threads`` per
worker), and the tail after the last download (the last batches' transform
and collate). Downloads are timed by wrapping the cache's download step in
this process; forked workers inherit the wrapper and append to a log file.

    python benchmarks/probes/cold_timeline.py [--files 64] [--mib 8] [--rounds 2]
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

import dcp_volumes.data._cache as cache_module  # noqa: E402
from dcp_volumes import DataLoader, VolumeDataset  # noqa: E402
from tests.emulators import LatencyProxy, MotoServer  # noqa: E402

LOG = Path(tempfile.gettempdir()) / f"dcpv-cold-timeline-{os.getpid()}.log"
_download = cache_module.FileCache._download


def _timed_download(volume: Any, relpath: str, ref: Any, size: int, *, listed: bool) -> None:
    started = time.time()
    _download(volume, relpath, ref, size, listed=listed)
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()} {started:.4f} {time.time():.4f}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cache_module.FileCache._download = staticmethod(_timed_download)  # type: ignore[method-assign]
    with MotoServer("process") as server:
        server.create_bucket("probe")
        client = server.boto3_client()
        body = os.urandom(args.mib << 20)
        keys = [f"d/f{i:05d}" for i in range(args.files)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: client.put_object(Bucket="probe", Key=k, Body=body), keys))
        with LatencyProxy.in_front_of(server, latency_s=0.02, bandwidth_bps=200e6) as proxy:
            for _ in range(args.rounds):
                LOG.unlink(missing_ok=True)
                cache = tempfile.mkdtemp(prefix="dcpv-probe-")
                ds = VolumeDataset("s3://probe/d", storage_options=server.storage_options(
                    proxy.endpoint), cache_dir=cache, transform=read_local)
                loader = DataLoader(ds, batch_size=16, num_workers=2)
                time.sleep(6)  # memory freed by the previous round is new again (see bench_data)
                t0, batches = time.time(), []
                for _batch in loader:
                    batches.append(time.time() - t0)
                per_worker: dict[str, list[tuple[float, float]]] = {}
                for line in LOG.read_text().splitlines():
                    pid, start, end = line.split()
                    per_worker.setdefault(pid, []).append((float(start) - t0, float(end) - t0))
                print(f"epoch {batches[-1]:.2f} s; batches at "
                      + ", ".join(f"{b:.2f}" for b in batches))
                for spans in per_worker.values():
                    spans.sort()
                    last = max(end for _, end in spans)
                    mean = sum(end - start for start, end in spans) / len(spans)
                    print(f"  worker: first download at {spans[0][0]:.2f} s, last done at "
                          f"{last:.2f} s ({len(spans)} files, {mean:.2f} s each); tail after "
                          f"it {batches[-1] - last:.2f} s")
                del loader, ds
                shutil.rmtree(cache, ignore_errors=True)
    LOG.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
