"""Cold epoch behind the remote-like link: first-batch latency and the rate after it.

The full benchmark times whole epochs, DataLoader start-up included (worker
processes, a client each, the first batch), while its raw-GET row connects
outside its timing. This probe separates the two for VolumeDataset.

    python benchmarks/probes/remote_cold_steady.py [--files 480] [--rounds 2]
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

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _data_peers import to_tensor  # noqa: E402
from _raw import boto3_client  # noqa: E402

from dcp_volumes import DataLoader, VolumeDataset  # noqa: E402
from tests.emulators import LatencyProxy, MotoServer  # noqa: E402


def read_file(path: str) -> object:
    with open(path, "rb") as f:
        return to_tensor(f.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=480)
    ap.add_argument("--kib", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
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
                cache = tempfile.mkdtemp(prefix="dcpv-probe-")
                ds = VolumeDataset("s3://probe/d", storage_options=server.storage_options(
                    proxy.endpoint), cache_dir=cache, transform=read_file)
                loader = DataLoader(ds, batch_size=16, num_workers=2)
                t0, n, first = time.perf_counter(), 0, 0.0
                for batch in loader:
                    n += len(batch)
                    first = first or time.perf_counter() - t0
                total = time.perf_counter() - t0
                print(f"VolumeDataset cold: {n / total:.0f} files/s, first batch after "
                      f"{first:.2f} s, then {(n - 16) / (total - first):.0f} files/s")
                del loader, ds
                shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
