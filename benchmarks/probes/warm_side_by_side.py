"""Warm epoch of VolumeDataset + DataLoader beside a plain local-disk Dataset, alternating.

The full benchmark runs each loader once; this probe alternates the two over
the same warm files several times and also reports CPU microseconds per
sample (main process and workers apart), to tell a real per-sample cost from
machine noise.

    python benchmarks/probes/warm_side_by_side.py [--files 2000] [--rounds 3] [--no-seed-rngs]

``--no-seed-rngs`` runs ours with ``seed_rngs=False``: the share of the
per-sample reseeding of torch/numpy/``random`` in the difference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import torch
from _data_peers import LocalFiles, read_local
from torch.utils.data import DataLoader as TorchLoader

from dcp_volumes import DataLoader, VolumeDataset


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def epoch(loader: object) -> tuple[float, float, float]:
    """(samples/s, main-process CPU us/sample, workers' CPU us/sample)."""
    it = iter(loader)  # type: ignore[call-overload]
    workers = [psutil.Process(w.pid) for w in loader._iterator._workers]  # type: ignore[attr-defined]
    me = psutil.Process()
    m0, w0 = _cpu(me), sum(_cpu(w) for w in workers)
    t0, n = time.perf_counter(), 0
    for batch in it:
        n += batch.shape[0]
    wall = time.perf_counter() - t0
    main = (_cpu(me) - m0) / n * 1e6
    work = (sum(_cpu(w) for w in workers) - w0) / n * 1e6
    return n / wall, main, work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--kib", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-seed-rngs", action="store_true", help="ours with seed_rngs=False")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dcpv-warm-"))
    src = root / "src"
    src.mkdir()
    for i in range(args.files):
        (src / f"f{i:05d}").write_bytes(os.urandom(args.kib * 1024))
    paths = sorted(str(p) for p in src.iterdir())
    local = TorchLoader(LocalFiles(paths), batch_size=16, num_workers=2, shuffle=True,
                        generator=torch.Generator().manual_seed(0), persistent_workers=True,
                        prefetch_factor=4)
    epoch(local)  # page cache and workers warm
    ratios = []
    try:
        for r in range(args.rounds):
            cache = root / f"cache{r}"
            ds = VolumeDataset(str(src), cache_dir=str(cache), transform=read_local, shuffle=True,
                               seed_rngs=not args.no_seed_rngs)
            ours = DataLoader(ds, batch_size=16, num_workers=2)
            epoch(ours)  # cold: fills the cache
            if r % 2:  # alternate which loader goes first
                o, lo = epoch(ours), epoch(local)
            else:
                lo, o = epoch(local), epoch(ours)
            ratios.append(o[0] / lo[0])
            print(f"ours {o[0]:6.0f}/s main {o[1]:4.0f} us workers {o[2]:4.0f} us | local "
                  f"{lo[0]:6.0f}/s main {lo[1]:4.0f} us workers {lo[2]:4.0f} us | ratio "
                  f"{ratios[-1]:.2f}", flush=True)
            del ours, ds
            shutil.rmtree(cache, ignore_errors=True)
        print(f"median warm ratio {statistics.median(ratios):.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
