"""The timeline PNG: one panel per job, one row per rank, time since the job's launch.

Per rank: steps (compute), input waits, save calls (blocking), uploads in
flight (save call -> ``.metadata``), restarts (a kill -> the process group
and the restore), the work that a crash threw away, the kills, and the
preemptions (the SIGTERM on every rank's row, a dotted line to the commit of
the step saved for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dcp_volumes.demo._launcher import JobRecord
from dcp_volumes.demo._report import RunStats, attempts_of, next_attempt

_COLORS = {
    "compute": "#4c9a2a",
    "input wait": "#f0a030",
    "checkpoint blocking": "#d62728",
    "upload in flight": "#1f77b4",
    "start / restart": "#b0b0b0",
    "restore": "#9467bd",
    "lost, redone later": "#000000",
}


_PREEMPT = "#e377c2"


def _spans(xs: list[tuple[float, float]], t0: float) -> list[tuple[float, float]]:
    return [(a - t0, max(b - a, 1e-3)) for a, b in xs if b >= a]


def plot_timeline(jobs: Mapping[str, JobRecord], runs: Mapping[str, RunStats], path: str,
                  *, title: str) -> None:
    """Write the timeline of ``jobs`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    order = [n for n in ("naive", "dcp_volumes", "reference") if n in jobs]
    heights = []
    for n in order:
        ranks = {r for a in attempts_of(jobs[n].run_dir) for r in a.ranks}
        heights.append(max(1, len(ranks)))
    fig, axes = plt.subplots(len(order), 1, figsize=(14, 1.6 + 1.1 * sum(heights)),
                             sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [h + 0.8 for h in heights]})
    for ax, name in zip(axes[:, 0], order, strict=True):
        _panel(ax, jobs[name], runs[name])
    axes[-1, 0].set_xlabel("seconds since the job was launched")
    handles: list[Any] = [Patch(color=c, label=k) for k, c in _COLORS.items()]
    handles.append(Line2D([], [], marker="X", color="#d62728", linestyle="", markersize=10,
                              label="SIGKILL"))
    handles.append(Line2D([], [], marker="v", color=_PREEMPT, linestyle=":", markersize=9,
                              label="SIGTERM (preemption) -> commit"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, 0.995))
    fig.suptitle(title, y=0.955, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax: Any, job: JobRecord, stats: RunStats) -> None:
    attempts = attempts_of(job.run_dir)
    t0 = job.launches[0]
    ranks = sorted({r for a in attempts for r in a.ranks})
    lost_windows: list[tuple[float, float]] = []
    for i, att in enumerate(attempts):
        nxt = next_attempt(attempts, i)
        keep_to = (nxt.restored or 0) if nxt is not None else None
        kill = att.kill
        for r in att.ranks:
            y = ranks.index(r)
            evs = att.ranks[r]
            steps = [e for e in evs if e["ev"] == "step"]
            committed = {e["step"]: e["t"] for e in evs if e["ev"] == "committed"}
            cats = _rank_spans(evs, steps, committed, job.setup)
            for key, color in _COLORS.items():
                if key in ("upload in flight", "lost, redone later") or not cats[key]:
                    continue
                ax.broken_barh(_spans(cats[key], t0), (y - 0.35, 0.5), color=color,
                               linewidth=0)
            if cats["upload in flight"]:
                ax.broken_barh(_spans(cats["upload in flight"], t0), (y + 0.2, 0.15),
                               color=_COLORS["upload in flight"], linewidth=0)
            if keep_to is not None and r == 0:
                lost = [e for e in steps if e["step"] > keep_to]
                if lost and kill is not None:
                    lost_windows.append((lost[0]["t0"], kill["t"]))
            if att.preempted and kill is not None:  # every rank got the SIGTERM
                ax.plot([kill["t"] - t0], [y], marker="v", color=_PREEMPT, markersize=10)
                done = next((e for e in evs if e["ev"] == "preempted"), None)
                commit = committed.get(done["step"]) if done is not None else None
                if commit is not None:
                    ax.plot([kill["t"] - t0, commit - t0], [y, y], linestyle=":",
                            color=_PREEMPT, linewidth=1.5)
            elif kill is not None and r == _kill_rank(att):
                ax.plot([kill["t"] - t0], [y], marker="X", color="#d62728", markersize=11)
    for a, b in lost_windows:
        for y in range(len(ranks)):
            ax.broken_barh(_spans([(a, b)], t0), (y - 0.42, 0.07), color="#000000",
                           linewidth=0)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.4, -0.6)
    ax.set_title(f"{stats.name} ({stats.setup} setup): goodput {stats.goodput:.1%}, "
                 f"{stats.goodput_ex_restart:.1%} with restarts set apart; "
                 f"{len(stats.crashes)} crash(es)", fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _rank_spans(evs: list[dict[str, Any]], steps: list[dict[str, Any]],
                committed: dict[int, float], setup: str) -> dict[str, list[tuple[float, float]]]:
    """What one rank's attempt spent its time on: (start, end) spans by legend entry."""
    restored = next((e for e in evs if e["ev"] == "restored"), None)
    cats: dict[str, list[tuple[float, float]]] = {k: [] for k in _COLORS}
    boot_from = evs[0]["t_proc"]
    cats["start / restart"].append((boot_from, restored["t0"] if restored else boot_from))
    if restored:
        cats["restore"].append((restored["t0"], restored["t1"]))
    for e in steps:
        cats["input wait"].append((e["t0"], e["tf"]))
        cats["compute"].append((e["tf"], e["tc"]))
        if e["save"]:
            cats["checkpoint blocking"].append((e["save"][0], e["save"][1]))
    for e in steps:
        if e["save"] and e["step"] in committed and setup != "naive":
            cats["upload in flight"].append((e["save"][1], committed[e["step"]]))
    return cats


def _kill_rank(att: Any) -> int | None:
    """The rank whose process recorded the attempt's kill."""
    for r, evs in att.ranks.items():
        if any(e["ev"] == "kill" for e in evs):
            return int(r)
    return None
