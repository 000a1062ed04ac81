"""The library's goodput records of the demo's jobs, beside the demo's own measurements.

The demo's ranks run ``CheckpointManager`` and ``DataLoader`` as any job does, so the
library records each job's goodput under ``<volume>/ckpt/<job>/goodput/``
(``dcp_volumes.goodput``). The demo reads that report and prints it beside its own
independent figures (its event logs, ``_report.analyse``), put into the library's
categories over the library's window; the ``library`` check passes when they agree
within the issue's tolerance (goodput 1 percentage point, each category 10% or 0.5 s).

How the demo's figures map (the library cannot see what happens before its first
process starts, nor tell the CPU time of a step from its wall time):

* the window starts at the first rank process's start, not at the launcher's torchrun
  start: that difference leaves the demo's start-up; it holds the time between two
  launches of a job (``--shrink``: a planned stop, then a new torchrun), which the
  demo leaves out of its wall: a restart gap;
* ``compute``: the kept steps from the demo's events, split the library's way: from one
  step's end (or the restore's) to the next step's end, less its input wait and the
  save before it (the demo's own table counts CPU time, and the loop's bookkeeping as
  other);
* ``input_wait`` = input wait + each attempt's first batch (which the demo counts in its
  restart or start-up);
* ``startup`` = each attempt's process start -> its restore call (the interpreter, the
  torch import, the process group, the data listing: the demo's restart parts but the
  restore; with no restore call, -> its first step's start); ``restore`` = each
  attempt's restore call (around ``CheckpointManager.restore``, whose span the library
  records); the restore's end -> the first batch in hand, which the demo counts in its
  restart or start-up, the library counts in the first step (``input_wait`` above,
  ``compute``);
* ``restart_gap`` = each restart's kill -> the next attempt's process start (the demo's
  "torchrun: kill -> new processes"), less a preempted attempt's last step -> its exit
  (the library's ``other``: the attempt ends at its last record, where the restart gap
  begins), plus a leg's end -> the next leg's first process start;
* ``lost_work`` = lost work, plus the restore's end -> first batch of an attempt whose
  every step was lost (its first step, lost, holds it in the library);
* ``checkpoint_blocking`` as it is; ``other``: the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dcp_volumes._exceptions import DcpVolumesError
from dcp_volumes.goodput._report import GoodputReport, goodput_report

logger = logging.getLogger(__name__)

#: (label, the library's categories summed) of each compared row.
ROWS = (
    ("compute (kept steps, wall)", ("compute",)),
    ("checkpoint blocking", ("checkpoint_blocking",)),
    ("input wait (first batches too)", ("input_wait",)),
    ("start-up (process start -> restore)", ("startup",)),
    ("restore", ("restore",)),
    ("restart gaps (end -> next process start)", ("restart_gap",)),
    ("work lost and redone", ("lost_work",)),
    ("other (end of job, skew)", ("other",)),
)
GOODPUT_PP = 1.0
CATEGORY_SHARE, CATEGORY_S = 0.10, 0.5


def library_reports(jobs: Mapping[str, Any], root: str,
                    storage_options: Mapping[str, Any]) -> dict[str, GoodputReport]:
    """The library's report of each job that ran the library (``setup == "dcp_volumes"``)."""
    out = {}
    for name, job in jobs.items():
        if job.setup != "dcp_volumes":
            continue
        try:
            out[name] = goodput_report(f"{root}/ckpt/{name}", storage_options=storage_options)
        except DcpVolumesError as exc:
            logger.warning("no goodput report of the %s job: %s", name, exc)
    return out


@dataclass(frozen=True)
class Comparison:
    """The library's figures and the demo's over one window, row by row (seconds)."""

    job: str
    wall: tuple[float, float]
    goodput: tuple[float, float]
    rows: tuple[tuple[str, float, float], ...]

    @property
    def disagreements(self) -> list[str]:
        bad = []
        lib, demo = self.goodput
        if abs(lib - demo) * 100 > GOODPUT_PP:
            bad.append(f"goodput {lib:.1%} vs {demo:.1%}")
        for label, a, b in self.rows:
            if abs(a - b) > max(CATEGORY_S, CATEGORY_SHARE * max(a, b)):
                bad.append(f"{label} {a:.1f} s vs {b:.1f} s")
        return bad

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "wall_s": list(self.wall), "goodput": list(self.goodput),
                "rows": [{"category": label, "library_s": a, "demo_s": b}
                         for label, a, b in self.rows],
                "disagreements": self.disagreements}


def compare(name: str, lib: GoodputReport, demo: Mapping[str, float]) -> Comparison:
    """Row by row; ``demo``: the demo's figures (see ``demo_figures``)."""
    seconds = lib.seconds.to_dict()
    rows = tuple((label, sum(seconds[k] for k in keys), demo[label]) for label, keys in ROWS)
    wall = demo["wall"]
    return Comparison(name, (lib.wall_s, wall),
                      (lib.goodput, demo[ROWS[0][0]] / wall if wall > 0 else 0.0), rows)


def demo_figures(*, wall: float, loop_compute: float, blocking: float, input_wait: float,
                 first_batches: float, pre_restore: float, restore: float, gaps: float,
                 before_first_process: float, lost: float, lost_pre_loop: float = 0.0,
                 preempt_tails: float = 0.0, between_legs: float = 0.0) -> dict[str, float]:
    """The demo's measurements in the library's rows, over the library's window
    (``other``: what the rows above leave of the wall)."""
    rows = {
        "compute (kept steps, wall)": loop_compute,
        "checkpoint blocking": blocking,
        "input wait (first batches too)": input_wait + first_batches,
        "start-up (process start -> restore)": pre_restore,
        "restore": restore,
        "restart gaps (end -> next process start)": gaps - preempt_tails + between_legs,
        "work lost and redone": lost + lost_pre_loop,
    }
    window = wall - before_first_process + between_legs
    return {"wall": window, **rows, ROWS[-1][0]: window - sum(rows.values())}


def render(comparisons: Mapping[str, Comparison]) -> str:
    """The side-by-side table (plain text)."""
    if not comparisons:
        return ""
    names = list(comparisons)
    head = "the library's records (dcp-volumes goodput) / the demo's own measurements"
    width = max(len(label) for label, _ in ROWS) + 4
    lines = [head, "".ljust(width) + "".join(n.rjust(24) for n in names)]

    def cell(a: float, b: float, pct: bool = False) -> str:
        return (f"{a:.1%} / {b:.1%}" if pct else f"{a:.1f} / {b:.1f} s").rjust(24)

    lines.append("wall (first process start on)".ljust(width)
                 + "".join(cell(*comparisons[n].wall) for n in names))
    for i, (label, _) in enumerate(ROWS):
        lines.append(("  " + label).ljust(width) + "".join(
            cell(comparisons[n].rows[i][1], comparisons[n].rows[i][2]) for n in names))
    lines.append("goodput = compute / wall".ljust(width)
                 + "".join(cell(*comparisons[n].goodput, pct=True) for n in names))
    return "\n".join(lines)
