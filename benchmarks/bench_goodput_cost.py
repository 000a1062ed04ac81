"""What recording goodput costs a training step: microseconds and store requests per step.

Gloo ranks (2 and 4, on one machine) each run a ``CheckpointManager`` over a local
directory root and call ``should_save(step)`` once per step (the step boundary the
recorder marks) plus one ``note_input_wait`` (what the loader reports per batch), with
``goodput=True`` and ``goodput=False``:

* **microseconds per step**: the time those calls take on the training thread (steps
  of ``--step-ms`` sleep, no saves: the recorder's own work, the journal line included);
* **requests per step**: every call the manager makes to the volume (a ``Volume``
  operation: list, put, get...) over a run that saves every ``--interval`` steps,
  divided by the steps. The difference on - off is what recording costs: one put per
  rank with each save and one at close, none per step.

Goal (issue 45): under 0.1% of a 100 ms step (100 us) and no request per step.

::

    python -m benchmarks.bench_goodput_cost            # 2000 steps, 2 and 4 ranks
    python -m benchmarks.bench_goodput_cost --quick    # 300 steps

Writes benchmarks/results/goodput_cost.json (``--quick``: goodput_cost_quick.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import format_table, machine_info, write_json

STEP_GOAL_S = 0.1


def _rank(rank: int, world: int, root: str, goodput: bool, steps: int, step_s: float,
          interval: int) -> dict[str, Any]:
    """One rank: per-step call times without saves, then the volume calls of a run with
    saves every ``interval`` steps."""
    import torch

    from dcp_volumes import CheckpointManager
    from dcp_volumes._volume import _volume
    from dcp_volumes.goodput._recorder import note_input_wait

    calls = [0]
    original = _volume.Volume._call

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    _volume.Volume._call = counted  # type: ignore[method-assign]
    seconds = []
    with CheckpointManager(f"{root}/timing", goodput=goodput, keep_last=1) as mgr:
        for step in range(1, steps + 1):
            time.sleep(step_s)
            t0 = time.perf_counter()
            note_input_wait(0.0)
            mgr.should_save(step)
            seconds.append(time.perf_counter() - t0)
    state = {"w": torch.zeros(256)}
    before = calls[0]
    with CheckpointManager(f"{root}/saving", goodput=goodput, keep_last=1,
                           save_interval_steps=interval) as mgr:
        opened = calls[0]
        for step in range(1, steps + 1):
            note_input_wait(0.0)
            if mgr.should_save(step):
                mgr.save(step, state)
    return {"seconds": seconds[10:], "calls": calls[0] - opened,
            "calls_with_open": calls[0] - before}


def measure(world: int, goodput: bool, steps: int, step_s: float, interval: int,
            work: Path) -> dict[str, Any]:
    from testkit.ranks import run_ranks

    root = str(work / f"w{world}-{'on' if goodput else 'off'}")
    out = run_ranks(_rank, world, root, goodput, steps, step_s, interval, timeout=600)
    seconds = [s for r in out for s in r["seconds"]]
    calls = sum(r["calls"] for r in out) / world
    return {"ranks": world, "goodput": goodput, "steps": steps,
            "median_us": 1e6 * statistics.median(seconds),
            "mean_us": 1e6 * statistics.mean(seconds),
            "p99_us": 1e6 * sorted(seconds)[int(0.99 * (len(seconds) - 1))],
            "requests_per_rank": calls, "requests_per_step": calls / steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("--interval", type=int, default=100, help="save every N steps")
    p.add_argument("--quick", action="store_true", help="300 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 300
    work = Path(tempfile.mkdtemp(prefix="dcpv-bench-goodput-"))
    cells = [measure(w, g, args.steps, args.step_ms / 1000, args.interval, work)
             for w in (2, 4) for g in (False, True)]
    off = {c["ranks"]: c for c in cells if not c["goodput"]}
    print(f"goodput recording, per step ({args.steps} steps, a save every {args.interval}):")
    print(format_table(
        ["ranks", "goodput", "median us", "mean us", "p99 us", "% of 100 ms",
         "requests/step", "extra requests/step"],
        [[c["ranks"], c["goodput"], c["median_us"], c["mean_us"], c["p99_us"],
          100 * c["mean_us"] / (STEP_GOAL_S * 1e6), c["requests_per_step"],
          c["requests_per_step"] - off[c["ranks"]]["requests_per_step"]] for c in cells],
    ))
    doc = {"benchmark": "goodput_cost",
           "command": "python -m benchmarks.bench_goodput_cost " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "steps": args.steps, "step_ms": args.step_ms, "interval": args.interval,
           "cells": cells, "machine": machine_info()}
    path = write_json("goodput_cost_quick.json" if args.quick else "goodput_cost.json", doc)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
