"""Tables and plots of bench_data.py (kept apart so the benchmark itself stays short)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks._common import REMOTE_BANDWIDTH_BPS, REMOTE_LATENCY_S, MiB, format_table, pyplot

LABELS = {
    "local": "local disk, plain Dataset",
    "naive": "naive fsspec Dataset",
    "filecache": "fsspec filecache",
    "s3tc": "s3torchconnector S3MapDataset",
    "ours": "VolumeDataset + DataLoader",
    "ours_slow_step": "VolumeDataset, step > fetch",
    "raw": "raw concurrent GETs",
}


def _epoch(res: dict[str, Any] | None, i: int) -> dict[str, Any] | None:
    if not res or res["error"] or len(res["epochs"]) <= i:
        return None
    return res["epochs"][i]


def _rate(res: dict[str, Any] | None, i: int) -> float:
    e = _epoch(res, i)
    return e["files_s"] if e else math.nan


# Output
# ---------------------------------------------------------------------------

STARTUP_LABELS = {
    "default": "dcp_volumes.DataLoader, its default after obstore I/O",
    "fork": 'multiprocessing_context="fork"',
}


def startup_table(res: dict[str, Any]) -> str:
    """The workers' start-up: seconds to the first batch per start method."""
    fork = res["median_s"]["fork"]
    rows = [
        [
            STARTUP_LABELS[name],
            res["start_method"][name],
            median,
            ", ".join(f"{s:.2f}" for s in res["rounds_s"][name]),
            median / fork if fork > 0 else math.nan,
        ]
        for name, median in res["median_s"].items()
    ]
    headers = ["loader", "start method", "first batch s (median)", "rounds s", "x fork"]
    return format_table(headers, rows)


def _ms(e: dict[str, Any] | None) -> str:
    if not e or not e["fetch_seconds"]:
        return "-"
    return f"{e['fetch_p50_s'] * 1000:.1f} / {e['fetch_p95_s'] * 1000:.1f}"


def table(rows: dict[str, Any], ref: dict[str, Any] | None = None) -> str:
    headers = [
        "method",
        "epoch 1 (cold) files/s",
        "cold MiB/s",
        "epoch 2 (warm) files/s",
        "warm MiB/s",
        "cold fetch p50/p95 ms",
        "warm fetch p50/p95 ms",
        "warm x local",
        "cold x raw",
    ]
    local, raw = rows.get("local"), rows.get("raw")
    out = []
    for row, res in rows.items():
        label = LABELS.get(row, row)
        if res["compute_s"]:
            label += f" (step {res['compute_s'] * 1000:.0f} ms)"
        if res["error"]:
            out.append([label, f"FAILED: {res['error'][:70]}", *["-"] * 7])
            continue
        c, w = _epoch(res, 0), _epoch(res, 1)
        out.append(
            [
                label,
                c["files_s"] if c else None,
                c["mib_s"] if c else None,
                w["files_s"] if w else None,
                w["mib_s"] if w else None,
                _ms(c),
                _ms(w),
                _rate(res, 1) / _rate(local, 1) if w and local else None,
                _rate(res, 0) / _rate(raw, 0) if c and raw and row != "raw" else None,
            ]
        )
    return format_table(headers, out)


def _bars(
    ax: Any,
    title: str,
    rows: dict[str, Any],
    series: list[tuple[str, Any, str]],
    xlabel: str,
    log: bool,
) -> None:
    """Grouped horizontal bars: one group per row, one bar per series."""
    names = [r for r in rows if not rows[r]["error"]]
    height = 0.8 / len(series)
    for k, (label, value, color) in enumerate(series):
        ys = [i + (k - (len(series) - 1) / 2) * height for i in range(len(names))]
        ax.barh(ys, [value(rows[r]) for r in names], height=height, label=label, color=color)
    labels = []
    for r in names:
        text = LABELS.get(r, r)
        if rows[r]["compute_s"] and r == "ours_slow_step":
            text += f" ({rows[r]['compute_s'] * 1000:.0f} ms)"
        labels.append(text)
    ax.set_yticks(range(len(names)), labels, fontsize=8)
    ax.invert_yaxis()
    if log:
        from matplotlib.ticker import LogFormatter, NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    exps = report["experiments"]
    panels: list[tuple[str, str, dict[str, Any]]] = []
    for exp_name in ("throughput", "remote"):
        for rows in exps.get(exp_name, {}).get("sets", {}).values():
            any_row = next(iter(rows.values()))
            size = any_row["file_bytes"]
            size_s = f"{size / MiB:.0f} MiB" if size >= MiB else f"{size / 1024:.0f} KiB"
            link = (
                "loopback"
                if exp_name == "throughput"
                else (
                    f"remote (+{REMOTE_LATENCY_S * 1000:.0f} ms, "
                    f"{REMOTE_BANDWIDTH_BPS / 1e6:.0f} Mbit/s/conn)"
                )
            )
            title = f"{any_row['files']} x {size_s} files, {link}"
            panels.append((exp_name, title, rows))
    comp = exps.get("compute")
    startup = report.get("worker_startup")
    n = len(panels) + (1 if comp else 0) + (1 if startup else 0)
    cols = 3
    rows_n = max(1, -(-n // cols))
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.2 * cols, 4.2 * rows_n), squeeze=False)
    flat = [ax for row in axes for ax in row]

    def rate(i: int) -> Any:
        return lambda res: _rate(res, i) if _epoch(res, i) else 0.0

    for ax, (exp_name, title, rows) in zip(flat, panels, strict=False):
        series = [("epoch 1 (cold)", rate(0), "tab:blue")]
        if exp_name == "throughput":
            series.append(("epoch 2 (warm)", rate(1), "tab:green"))
        _bars(ax, title, rows, series, "files/s (log scale, higher is better)", log=True)
    if comp:

        def p50(i: int) -> Any:
            return lambda res: ((_epoch(res, i) or {}).get("fetch_p50_s") or 0.0) * 1000

        _bars(
            flat[len(panels)],
            f"time waiting in next(), {comp['compute_s'] * 1000:.0f} ms step per batch",
            comp["sets"]["small"],
            [
                ("fetch p50, epoch 1 (cold)", p50(0), "tab:blue"),
                ("fetch p50, epoch 2 (warm)", p50(1), "tab:green"),
            ],
            "ms per batch (lower is better)",
            log=False,
        )
    if startup:
        ax = flat[n - 1]
        names = list(startup["median_s"])
        ax.barh(
            range(len(names)),
            [startup["median_s"][k] for k in names],
            color=["tab:green" if k == "default" else "tab:gray" for k in names],
        )
        ax.set_yticks(
            range(len(names)),
            [f"{STARTUP_LABELS[k]}\n({startup['start_method'][k]})" for k in names],
            fontsize=8,
        )
        ax.invert_yaxis()
        ax.set_xlabel("seconds to the first batch (median, lower is better)", fontsize=8)
        ax.set_title(
            f"worker start-up: fresh loader, {startup['workers']} workers, warm cache", fontsize=9
        )
    for ax in flat[n:]:
        ax.axis("off")
    fig.suptitle(f"{report['config']['target']}: {report['command']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
