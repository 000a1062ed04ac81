"""What reseeding the global RNGs per sample costs, inside a DataLoader worker and outside.

``VolumeDataset`` calls each sample's transform under the sample's own seed
(torch's CPU generator, numpy's and ``random``'s, see ``data/_rng.py``). This
times ``SampleTransform`` with ``seed_rngs`` on and off around a transform
that reads one file, 20,000 calls each: in a worker process (only seeded
there) and in the main process (seeded, then the caller's states restored).

    python benchmarks/probes/seeding_cost.py [--kib 100]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Iterator

from torch.utils.data import DataLoader, IterableDataset

from dcp_volumes.data._rng import SampleTransform

CALLS = 20_000


def read(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


class Timings(IterableDataset):  # type: ignore[type-arg]
    """Yields (mode, CPU us per call) for seeded and plain calls."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __iter__(self) -> Iterator[tuple[str, float]]:
        for mode, seed_rngs in (("seeded", True), ("plain", False)):
            transform = SampleTransform(read, seed_rngs=seed_rngs)
            t0 = time.process_time()
            for i in range(CALLS):
                transform(self.path, i * 7919 + 12345678901)
            yield mode, (time.process_time() - t0) / CALLS * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", type=int, default=100)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile() as f:
        f.write(os.urandom(args.kib * 1024))
        f.flush()
        probe = Timings(f.name)
        for where, results in (
            ("worker", list(DataLoader(probe, batch_size=None, num_workers=1))),
            ("main process", list(probe)),
        ):
            per = dict(results)
            print(f"{where:12s}: seeded {per['seeded']:6.1f} us, plain {per['plain']:6.1f} us "
                  f"per call; reseeding {per['seeded'] - per['plain']:6.1f} us")


if __name__ == "__main__":
    main()
