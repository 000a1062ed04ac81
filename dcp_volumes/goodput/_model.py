"""Goodput model: what a writer's measured save times mean for a training job.

A job checkpoints every ``interval`` seconds of training. Each save stalls
training for its *blocking* time; an async save commits ``e2e - blocking``
seconds later, and the next save waits for that (back-pressure), so an
interval shorter than the commit lag stalls training for the difference too.
Failures arrive at ``failures_per_day`` (default 8.6: Llama 3's 466
interruptions in 54 days on 16k GPUs); each costs ``restart_s`` plus the work
since the last *committed* checkpoint: on average half a cycle plus the commit
lag. ``overhead`` is the job's other time per second of training (input waits,
bookkeeping; 0 by default). Goodput is the share of wall time spent on training
that is kept::

    cycle    = interval * (1 + overhead) + stall
    stall    = blocking + max(0, (e2e - blocking) - interval)
    lost     = restart + cycle / 2 + (e2e - blocking)      # per failure
    goodput  = interval / cycle * (1 - lost / MTBF)

Young's first-order optimum ``sqrt(2 * stall * MTBF)`` is reported next to the
numerical best interval (a log grid), which also covers the commit lag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_DAY = 86_400.0
DEFAULT_FAILURES_PER_DAY = 8.6
DEFAULT_RESTART_S = 300.0


@dataclass(frozen=True)
class GoodputModel:
    """The job's failure rate and restart cost (validated)."""

    failures_per_day: float = DEFAULT_FAILURES_PER_DAY
    restart_s: float = DEFAULT_RESTART_S

    def __post_init__(self) -> None:
        if not self.failures_per_day > 0:
            raise ValueError(f"failures_per_day must be > 0, not {self.failures_per_day}")
        if self.restart_s < 0:
            raise ValueError(f"restart_s must be >= 0, not {self.restart_s}")

    @property
    def mtbf_s(self) -> float:
        return SECONDS_PER_DAY / self.failures_per_day

    def goodput(self, interval_s: float, blocking_s: float, e2e_s: float, *,
                overhead: float = 0.0) -> float:
        """The share of wall time that is kept training at this checkpoint interval."""
        lag = max(0.0, e2e_s - blocking_s)
        stall = blocking_s + max(0.0, lag - interval_s)
        cycle = interval_s * (1 + max(0.0, overhead)) + stall
        lost = self.restart_s + cycle / 2 + lag
        return max(0.0, interval_s / cycle * (1 - lost / self.mtbf_s))

    def young_interval(self, blocking_s: float) -> float:
        """Young's first-order optimum for a save that stalls training ``blocking_s``."""
        return math.sqrt(2 * max(blocking_s, 1e-6) * self.mtbf_s)

    def intervals(self, points: int = 200) -> list[float]:
        """A log grid of intervals from 1 s to one MTBF."""
        lo, hi = 0.0, math.log10(self.mtbf_s)
        return [10 ** (lo + (hi - lo) * i / (points - 1)) for i in range(points)]

    def best(self, blocking_s: float, e2e_s: float, *,
             overhead: float = 0.0) -> dict[str, float]:
        """The best interval on the grid, its goodput, and Young's interval for comparison."""
        grid = self.intervals()
        values = [self.goodput(t, blocking_s, e2e_s, overhead=overhead) for t in grid]
        i = max(range(len(grid)), key=values.__getitem__)
        young = self.young_interval(blocking_s)
        return {
            "best_interval_s": grid[i],
            "best_goodput": values[i],
            "young_interval_s": young,
            "goodput_at_young": self.goodput(young, blocking_s, e2e_s, overhead=overhead),
        }

    def curve(self, blocking_s: float, e2e_s: float) -> tuple[list[float], list[float]]:
        """(intervals, goodput) for a plot."""
        grid = self.intervals()
        return grid, [self.goodput(t, blocking_s, e2e_s) for t in grid]
