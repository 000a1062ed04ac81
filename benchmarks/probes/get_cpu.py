"""Client CPU per small GET: dcp_volumes' S3 path against a plain boto3 ``get_object``.

Sequential GETs of the same objects from moto's server (a separate process),
timed by this process's CPU clock (all its threads: obstore works in threads
of its own), so the server's work is not counted: what one GET costs the
process that makes it. Alternates the two a few rounds.

    python benchmarks/probes/get_cpu.py [--files 300] [--kib 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _raw import boto3_client  # noqa: E402

from dcp_volumes._volume import Volume  # noqa: E402
from tests.emulators import MotoServer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--kib", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with MotoServer(mode="process") as server:
        server.create_bucket("get-cpu")
        client = boto3_client(server.endpoint, 4)
        body = os.urandom(args.kib * 1024)
        keys = [f"f{i:05d}" for i in range(args.files)]
        for key in keys:
            client.put_object(Bucket="get-cpu", Key=key, Body=body)
        volume = Volume("s3://get-cpu", storage_options=server.storage_options())
        out = memoryview(bytearray(len(body)))

        def ours() -> None:
            for key in keys:
                volume.read_into(key, 0, out, whole=True)

        def boto3() -> None:
            for key in keys:
                client.get_object(Bucket="get-cpu", Key=key)["Body"].read()

        ours(), boto3()  # connections, the first GET's set-up
        cpu: dict[str, list[float]] = {"dcp_volumes": [], "boto3": []}
        for r in range(args.rounds):
            order = [("dcp_volumes", ours), ("boto3", boto3)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                started = time.process_time()
                fn()
                cpu[name].append((time.process_time() - started) / len(keys) * 1e6)
        for name, values in cpu.items():
            print(f"{name:12s} client CPU per GET: median {statistics.median(values):5.0f} us "
                  f"(rounds {', '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
