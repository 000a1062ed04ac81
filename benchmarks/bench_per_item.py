"""What a save costs per tensor: one process, ``dcp.async_save`` with a fresh ``VolumeWriter``.

A state of N small tensors (2-3 KiB) and 4 big ones (8 MiB each) under one
``"model"`` key, saved to a local directory or to moto; prints the blocking
and end-to-end time of the best of 3 saves (after a warm-up), in ms and in
microseconds per tensor. ``--profile`` adds cProfile of the last save's
blocking part and of its serialisation (``RankSave.run``), most costly first.

    python -m benchmarks.bench_per_item --tensors 2048,10240 --target dir,moto
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

SAVES = 3
BIG = 4


def make_state(small: int) -> dict[str, Any]:
    import torch

    model = {f"s{i}": torch.randn(512 + i % 256) for i in range(small)}
    model.update({f"big{j}": torch.randn(2 * 2**20) for j in range(BIG)})
    return {"model": model}


@contextlib.contextmanager
def location(target: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if target == "dir":
        with tempfile.TemporaryDirectory(prefix="dcpv-per-item-") as d:
            yield d, {}
        return
    from testkit.emulators import MotoServer

    with MotoServer() as server:
        yield server.create_bucket("per-item"), server.storage_options()


def measure(small: int, target: str, profile: bool) -> str:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter
    from dcp_volumes.checkpoint import _rank_save

    state = make_state(small)
    blocking_prof, save_prof = cProfile.Profile(), cProfile.Profile()
    run = _rank_save.RankSave.run
    profiling = [False]

    def profiled_run(self: Any, planner: Any) -> Any:
        if not profiling[0]:
            return run(self, planner)
        save_prof.enable()
        try:
            return run(self, planner)
        finally:
            save_prof.disable()

    _rank_save.RankSave.run = profiled_run  # type: ignore[method-assign]
    times = []
    with location(target) as (root, options):
        for i in range(SAVES + 1):
            profiling[0] = profile and i == SAVES
            writer = VolumeWriter(f"{root}/n{small}/save{i}", storage_options=options)
            t0 = time.perf_counter()
            if profiling[0]:
                blocking_prof.enable()
            fut = dcp.async_save(state, storage_writer=writer)
            if profiling[0]:
                blocking_prof.disable()
            t1 = time.perf_counter()
            fut.result()
            times.append((t1 - t0, time.perf_counter() - t0))
            writer.close()
    _rank_save.RankSave.run = run  # type: ignore[method-assign]
    blocking = min(t[0] for t in times[1:])
    e2e = min(t[1] for t in times[1:])
    n = small + BIG
    line = (f"{small} small + {BIG} big on {target}: blocking {blocking * 1e3:.1f} ms "
            f"({blocking / n * 1e6:.1f} us/tensor), end to end {e2e * 1e3:.1f} ms "
            f"({e2e / n * 1e6:.1f} us/tensor)")
    if profile:
        for name, prof in (("blocking", blocking_prof), ("RankSave.run", save_prof)):
            print(f"== {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", default="2048,10240", help="small tensor counts")
    p.add_argument("--target", default="dir,moto", help="dir and/or moto")
    p.add_argument("--profile", action="store_true", help="cProfile the last save")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    for target in args.target.split(","):
        for small in (int(x) for x in args.tensors.split(",")):
            print(measure(small, target, args.profile), flush=True)


if __name__ == "__main__":
    main()
