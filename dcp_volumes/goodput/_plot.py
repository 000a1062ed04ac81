"""The timeline PNG of a goodput report: one row per rank, time since the first start.

Per rank and attempt: start-up, restore, each step's input wait (drawn at the
start of the step) and compute, save calls (blocking), uploads in flight (save
call -> commit, a thin bar), steps lost to a restart (black), and the end of each
attempt (an X where it was killed, a triangle where it was preempted).
"""

from __future__ import annotations

from typing import Any

from dcp_volumes.goodput._report import GoodputReport, reduce_record

__all__ = ["plot_timeline"]

COLORS = {
    "compute": "#4c9a2a",
    "input wait": "#f0a030",
    "checkpoint blocking": "#d62728",
    "upload in flight": "#1f77b4",
    "start-up": "#b0b0b0",
    "restore": "#9467bd",
    "lost work": "#000000",
}


def _spans(report: GoodputReport) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """rank -> legend entry -> (start, end) spans, from every rank's record."""
    cutoff: dict[str, int | None] = {}
    for i, att in enumerate(report.attempts):
        later = [n.resumed_from for n in report.attempts[i + 1:] if n.resumed_from is not None]
        cutoff[att.attempt] = min(later) if later else None
    rows: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for record in report.records:
        if not record.events or record.attempt not in cutoff:
            continue
        a = reduce_record(record)
        cats = rows.setdefault(record.rank, {k: [] for k in COLORS})
        cats["start-up"].append((a.start, a.begin))
        for t0, t1 in a.restore_spans:
            cats["restore"].append((t0, t1))
        prev = a.begin
        for step, t, wait in a.boundaries:
            keep = cutoff[record.attempt]
            if keep is not None and step > keep:
                cats["lost work"].append((prev, t))
            else:
                cats["input wait"].append((prev, min(t, prev + wait)))
                cats["compute"].append((min(t, prev + wait), t))
            prev = t
        for step, called, left in a.saves:
            returned = left if left is not None else a.end
            cats["checkpoint blocking"].append((called, returned))
            if step in a.commits:
                cats["upload in flight"].append((returned, a.commits[step]))
    return rows


def plot_timeline(report: GoodputReport, path: str) -> None:
    """Write the timeline of ``report`` to ``path`` (PNG; needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _spans(report)
    ranks = sorted(rows)
    t0 = report.attempts[0].start if report.attempts else 0.0
    fig, ax = plt.subplots(figsize=(14, 1.8 + 0.5 * max(1, len(ranks))))
    # Lost work first: a save inside a lost step stays visible over it.
    order = ["lost work", *(k for k in COLORS if k != "lost work")]
    for y, rank in enumerate(ranks):
        for key in order:
            color = COLORS[key]
            spans = [(a - t0, max(b - a, 1e-3)) for a, b in rows[rank][key] if b >= a]
            if not spans:
                continue
            thin = key == "upload in flight"
            ax.broken_barh(spans, (y + 0.2, 0.12) if thin else (y - 0.35, 0.5), color=color,
                           linewidth=0)
    for a in report.attempts:
        mark = {"killed": "X", "preempted": "v"}.get(a.ended)
        if mark is not None:
            for y in range(len(ranks)):
                ax.plot([a.end - t0], [y], marker=mark, color="#d62728", markersize=9)
    handles: list[Any] = [Patch(color=c, label=k) for k, c in COLORS.items()]
    ax.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
              frameon=False, bbox_to_anchor=(0.5, 1.25))
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.4, -0.6)
    ax.set_xlabel("seconds since the first start (X: killed, v: preempted)")
    ax.set_title(f"{report.root}: goodput {report.goodput:.1%} of {report.wall_s:.0f} s, "
                 f"{len(report.attempts)} attempt(s), {report.lost_steps} step(s) lost",
                 fontsize=9, loc="left", pad=28)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
