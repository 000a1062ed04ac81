"""Tables and plots of the checkpoint benchmark (the measuring stays in bench_checkpoint.py)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from benchmarks._common import fmt, format_table, pyplot

# Our writers in the order the tables show them.
OURS = ("vw_async_fresh", "vw_sync_fresh", "vw_async", "vw_sync", "vw_async_f32")
SHORT = {
    "e2e_vs_floor": "e2e/floor",
    "speedup_vs_best_peer": "x best peer",
    "first_vs_steady": "1st/steady",
    "peak_extra_vs_state": "RSS/state",
    "blocking_vs_memcpy": "block/memcpy",
    "load_vs_floor": "load/floor",
}


def verdict(checks: dict[str, Any]) -> str:
    """PASS, or MISS with each missed target and by how much."""
    missed = [
        f"{SHORT.get(name, name)} {fmt(c['value'])} ({c['target']}, off {c['miss_by']:.0%}"
        + (f"; {c['note']})" if c.get("note") else ")")
        if not math.isnan(c.get("miss_by", math.nan))
        else f"{SHORT.get(name, name)} (not measured)"
        for name, c in checks.items()
        if not c["met"]
    ]
    return "PASS" if not missed else "MISS: " + "; ".join(missed)


def _cell_name(cell: dict[str, Any]) -> str:
    return f"{cell['world_size']} x {cell['size_mib']} MiB"


def summary_table(report: dict[str, Any]) -> str:
    """One row per cell and writer of ours: the ratios the targets are about, and the verdict."""
    headers = [
        "link", "cell", "writer", "e2e s", "e2e/floor", "x best peer", "block/memcpy",
        "1st/steady", "RSS/state", "load/floor", "CPU s/GiB client/server", "targets",
    ]
    rows = []
    for cell in report["cells"]:
        checks = cell["targets"]["checks"]
        load_checks = checks.get("vw_reader", {})
        load = load_checks.get("load_vs_floor", {}).get("value", math.nan)
        for m in OURS:
            s = cell["saves"].get(m)
            if s is None:
                continue
            if s["error"] and not s["e2e_s"]:
                rows.append([cell["link"], _cell_name(cell), m, *["-"] * 8, "FAILED: "
                             + s["error"][:80]])
                continue
            c = checks.get(m, {})
            # The load belongs to the cell; its target is judged with the reused sync
            # writer's row (the checkpoint it reads).
            own = dict(c, **(load_checks if m == "vw_sync" else {}))

            def value(name: str, c: dict[str, Any] = c) -> float:
                return c.get(name, {}).get("value", math.nan)

            rows.append(
                [
                    cell["link"],
                    _cell_name(cell),
                    m,
                    s["steady_e2e_s"],
                    value("e2e_vs_floor"),
                    value("speedup_vs_best_peer"),
                    value("blocking_vs_memcpy"),
                    value("first_vs_steady"),
                    value("peak_extra_vs_state"),
                    load if m == "vw_sync" else math.nan,
                    f"{fmt(s['client_cpu_s_per_gib'])} / {fmt(s['server_cpu_s_per_gib'])}",
                    verdict(own),
                ]
            )
    return format_table(headers, rows)


def headline_cells(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells of the headline table: 2 ranks x 128 MiB where run, else the biggest."""
    cfg = report["config"]
    size = 128 if 128 in cfg["sizes_mib_per_rank"] else max(cfg["sizes_mib_per_rank"])
    ranks = 2 if 2 in cfg["ranks"] else max(cfg["ranks"])
    return [c for c in report["cells"] if c["size_mib"] == size and c["world_size"] == ranks]


def headline_table(report: dict[str, Any]) -> str:
    """Every method of the headline cell, one column pair per link: blocking / e2e (x floor)."""
    cells = headline_cells(report)
    if not cells:
        return ""
    methods = list(dict.fromkeys(m for c in cells for m in c["saves"]))
    headers = ["method"] + [f"{c['link']}: blocking / e2e s (x floor)" for c in cells]
    rows = []
    for m in methods:
        row = [cells[0]["saves"].get(m, {}).get("label", m)]
        for c in cells:
            s = c["saves"].get(m)
            if not s or not s["e2e_s"]:
                row.append("-" if not s else "FAILED")
                continue
            row.append(f"{fmt(s['steady_blocking_s'])} / {fmt(s['steady_e2e_s'])} "
                       f"({fmt(s['x_floor'])}x)")
        rows.append(row)
    for reader in ("raw_get", "raw_ranged", "fsspec_reader", "s3tc_reader", "vw_reader",
                   "vw_reader_reshard"):
        if not any(reader in c["loads"] for c in cells):
            continue
        first = next(c["loads"][reader] for c in cells if reader in c["loads"])
        row = [first["label"] + (f" ({first['world_size']} ranks)" if "world_size" in first
                                 else "")]
        for c in cells:
            r = c["loads"].get(reader)
            row.append(f"{fmt(r['steady_s'])} ({fmt(r['x_floor'])}x)" if r and r["seconds"]
                       else "-")
        rows.append(row)
    return format_table(headers, rows)


def save_table(cell: dict[str, Any]) -> str:
    """Every save method of one cell (floors, peers, ours)."""
    headers = [
        "method", "blocking s", "end-to-end s", "MiB/s", "x floor", "peak extra RSS / state",
        "1st save blocking s", "1st save e2e s", "CPU s/GiB client", "CPU s/GiB server",
        "targets",
    ]
    rows = []
    for m, s in cell["saves"].items():
        if s["error"] and not s["e2e_s"]:
            rows.append([s["label"], *["-"] * 9, f"FAILED: {s['error'][:60]}"])
            continue
        checks = cell["targets"]["checks"].get(m)
        rows.append(
            [
                s["label"], s["steady_blocking_s"], s["steady_e2e_s"], s["steady_mib_s"],
                s["x_floor"], s["peak_extra_vs_state"], s["first_blocking_s"], s["first_e2e_s"],
                s["client_cpu_s_per_gib"], s["server_cpu_s_per_gib"],
                verdict(checks) if checks else ("FAILED: " + s["error"][:60] if s["error"] else ""),
            ]
        )
    return format_table(headers, rows)


def load_table(cell: dict[str, Any]) -> str:
    headers = [
        "reader", "load s", "MiB/s", "x floor", "1st load s", "verified", "CPU s/GiB client",
        "CPU s/GiB server", "targets",
    ]
    rows = []
    for r, s in cell["loads"].items():
        label = s["label"] + (f" ({s['world_size']} ranks)" if "world_size" in s else "")
        if s["error"] and not s["seconds"]:
            rows.append([label, *["-"] * 7, f"FAILED: {s['error'][:60]}"])
            continue
        checks = cell["targets"]["checks"].get(r)
        rows.append(
            [
                label, s["steady_s"], s["steady_mib_s"], s["x_floor"], s["first_s"],
                s["verified"], s["client_cpu_s_per_gib"], s["server_cpu_s_per_gib"],
                verdict(checks) if checks else "",
            ]
        )
    return format_table(headers, rows)


def local_tier_table(report: dict[str, Any]) -> str:
    rows = []
    for link, res in report["local_tier"].items():
        for name, med in res["median_seconds"].items():
            row = [link, res["size_mib"], name, med, res["speedup_vs_remote"][name]]
            row.append(
                ("PASS" if res["target"]["met"] else f"MISS ({res['target']['target']})")
                if name == "local tier"
                else ""
            )
            rows.append(row)
    return format_table(["link", "MiB", "restore", "median s", "x faster than remote",
                         "target (>= 3x)"], rows)


def goodput_table(report: dict[str, Any]) -> str:
    """Per writer of the largest cell of each link: best interval and its goodput."""
    g = report["goodput"]
    rows = []
    for cell in _headline_cells(g["cells"]):
        for m, w in sorted(cell["writers"].items(), key=lambda kv: -kv[1]["best_goodput"]):
            rows.append(
                [
                    cell["link"], f"{cell['world_size']} x {cell['size_mib']} MiB", m,
                    w["blocking_s"], w["e2e_s"], w["best_interval_s"], w["young_interval_s"],
                    f"{w['best_goodput']:.4%}",
                ]
            )
    return format_table(
        ["link", "cell", "writer", "blocking s", "e2e s", "best interval s", "Young's s",
         "goodput"],
        rows,
    )


def _headline_cells(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cell with the most bytes of each link."""
    best: dict[str, dict[str, Any]] = {}
    for c in cells:
        key = c["size_mib"] * c["world_size"]
        cur = best.get(c["link"])
        if cur is None or key > cur["size_mib"] * cur["world_size"]:
            best[c["link"]] = c
    return list(best.values())


def markdown(report: dict[str, Any]) -> str:
    """Every table of a run, for results/<stem>.md."""
    out = [f"# {report['config']['target']}: `{report['command']}`", "",
           "## Headline cell", "", headline_table(report), "",
           "## Targets per cell (ours)", "", summary_table(report), ""]
    for cell in report["cells"]:
        t = cell["targets"]
        out += [
            f"## {cell['link']}: {_cell_name(cell)}", "", save_table(cell), "",
            f"upload floor {fmt(t['floor_s'])} s; memcpy {fmt(t['memcpy_s'], 3)} s; best peer "
            f"{t['best_peer']} {fmt(t['best_peer_s'])} s; download floor "
            f"{fmt(t['raw_download_s'])} s", "", load_table(cell), "",
        ]
    if report["local_tier"]:
        out += ["## Restore from the local tier", "", local_tier_table(report), ""]
    out += ["## Goodput model", "", goodput_table(report), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------
# Each frame answers the question a reader asks of a cell: how far is ours from
# the floor, and from the best peer? So a frame draws ours (sync and async), the
# best peer of each cell and the floor, one frame per link and rank count (or
# size); every method lives in the tables of results/<stem>.md.

# Our writers as plotted: a fresh VolumeWriter per save (the README's first
# example) where the run has it, else the reused one.
_OURS_PLOTTED = (
    (("vw_sync_fresh", "vw_sync"), "ours, dcp.save", "tab:blue", "o"),
    (("vw_async_fresh", "vw_async"), "ours, dcp.async_save", "tab:orange", "s"),
)
_FRESH = {"vw_sync_fresh", "vw_async_fresh"}
_PEER = {"color": "tab:gray", "marker": "^", "linestyle": "-"}
_FLOOR = {"color": "black", "linestyle": "--", "marker": "x", "linewidth": 1.5}
_TARGET = {"color": "black", "linestyle": ":", "marker": "_", "markersize": 12, "linewidth": 1.0}
# A peer's blocking time: the async peers stage; a sync peer blocks for its save.
_PEERS = ("fsspec_t1", "fsspec_t8", "fsspec_async", "s3tc", "torch_save", "local_fs")


def _ok(save: dict[str, Any] | None) -> bool:
    return save is not None and bool(save["e2e_s"])


def _ours(cells: list[dict[str, Any]], candidates: tuple[str, ...]) -> str | None:
    """The first of ``candidates`` that saved in any of ``cells``."""
    return next((m for m in candidates if any(_ok(c["saves"].get(m)) for c in cells)), None)


def _ours_label(label: str, method: str) -> str:
    return f"{label} ({'fresh' if method in _FRESH else 'reused'} writer)"


def _mib(cell: dict[str, Any]) -> float:
    return float(cell["size_mib"] * cell["world_size"])


def _best_blocking_peer(cell: dict[str, Any]) -> str | None:
    peers = [m for m in _PEERS if _ok(cell["saves"].get(m))]
    return min(peers, key=lambda m: cell["saves"][m]["steady_blocking_s"], default=None)


def _frame_series(ax: Any, cells: list[dict[str, Any]], x: str, metric: str) -> None:
    """Draw ours, the best peer and the floor over ``cells`` (sorted by ``x``) into ``ax``.

    ``metric`` is ``throughput`` (MiB/s, all ranks; floor: the raw upload) or
    ``blocking`` (seconds; floor: the memcpy).
    """
    cells = sorted(cells, key=lambda c: c[x])
    xs = [c[x] for c in cells]
    if metric == "throughput":
        floor = [_mib(c) / c["targets"]["floor_s"] for c in cells]
        target = [f / 1.15 for f in floor]
        ax.plot(xs, floor, label="upload floor (fastest raw upload, same bytes)", **_FLOOR)
        ax.plot(xs, target, label="target: e2e <= 1.15x floor", **_TARGET)
        peer_names = [c["targets"].get("best_peer") for c in cells]

        def value(c: dict[str, Any], m: str) -> float:
            return float(c["saves"][m]["steady_mib_s"])
    else:
        floor = [c["targets"]["memcpy_s"] for c in cells]
        ax.plot(xs, floor, label="memcpy floor (copy into warm tensors)", **_FLOOR)
        ax.plot(xs, [2 * f for f in floor], label="target: async <= 2x memcpy", **_TARGET)
        peer_names = [_best_blocking_peer(c) for c in cells]

        def value(c: dict[str, Any], m: str) -> float:
            return float(c["saves"][m]["steady_blocking_s"])

    peers = [(c[x], c, p) for c, p in zip(cells, peer_names, strict=True)
             if p and _ok(c["saves"].get(p))]
    if peers:
        py = [value(c, p) for _, c, p in peers]
        ax.plot([xv for xv, _, _ in peers], py, label="best peer (named at each point)", **_PEER)
        for (xv, _, name), yv in zip(peers, py, strict=True):
            ax.annotate(name, (xv, yv), textcoords="offset points", xytext=(4, -10),
                        fontsize=7, color="dimgray")
    for candidates, label, color, marker in _OURS_PLOTTED:
        m = _ours(cells, candidates)
        if m is None:
            continue
        pts = [(c[x], value(c, m)) for c in cells if _ok(c["saves"].get(m))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker,
                linewidth=2, label=_ours_label(label, m))
    ax.set_xticks(xs, [str(v) for v in xs])
    ax.grid(True, alpha=0.3)


def _grid(report: dict[str, Any], metric: str, *, by: str) -> tuple[Any, int]:
    """One frame per link (rows) and per value of the other axis (columns)."""
    plt = pyplot()
    cfg = report["config"]
    links = [link for link in cfg["links"] if any(c["link"] == link for c in report["cells"])]
    other = "world_size" if by == "size_mib" else "size_mib"
    columns = sorted({c[other] for c in report["cells"]})
    width = max(9.0, 4.6 * len(columns) + 1)
    fig, axes = plt.subplots(max(1, len(links)), max(1, len(columns)),
                             figsize=(width, 3.6 * max(1, len(links)) + 0.8), squeeze=False)
    for i, link in enumerate(links):
        for j, col in enumerate(columns):
            ax = axes[i][j]
            cells = [c for c in report["cells"] if c["link"] == link and c[other] == col]
            if not cells:
                ax.axis("off")
                continue
            _frame_series(ax, cells, by, metric)
            if by == "size_mib":
                ax.set_xscale("log", base=2)
                ax.set_xticks([c[by] for c in cells], [str(c[by]) for c in cells])
                ax.minorticks_off()
                ax.set_xlabel("state per rank, MiB")
                ax.set_title(f"{link}, {col} rank{'s' if col != 1 else ''}", fontsize=10)
            else:
                ax.set_xlabel("ranks")
                ax.set_title(f"{link}, {col} MiB per rank", fontsize=10)
            if metric == "throughput":
                ax.set_ylabel("MiB/s, all ranks (higher is better)")
                ax.set_ylim(bottom=0)
            else:
                from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

                ax.set_yscale("log")
                ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
                ax.yaxis.set_minor_formatter(NullFormatter())
                ax.set_ylabel("blocking s (log; lower is better)")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    ncol = 3 if width >= 13 else 2
    fig.legend([handles[label] for label in labels], labels, loc="lower center",
               ncol=min(ncol, len(labels)), fontsize=8, frameon=False)
    return fig, -(-len(labels) // ncol)


def _save(fig: Any, path: Path, *, title: str, legend_rows: int) -> None:
    width, height = fig.get_size_inches()
    lines = textwrap.wrap(title, width=int(width * 15), break_on_hyphens=False)
    fig.suptitle("\n".join(lines), fontsize=9)
    # Room at the bottom for the shared legend, at the top for the title.
    fig.tight_layout(rect=(0, (0.25 + 0.2 * legend_rows) / height, 1,
                           1 - (0.2 + 0.17 * len(lines)) / height))
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _goodput_figure(report: dict[str, Any], title: str) -> Any:
    """Goodput vs interval for the largest cell of each link: ours, the best peer, the floor."""
    from benchmarks._goodput import GoodputModel

    plt = pyplot()
    g = report["goodput"]
    model = GoodputModel(g["failures_per_day"], g["restart_s"])
    heads = _headline_cells(g["cells"])
    fig, axes = plt.subplots(1, max(1, len(heads)), figsize=(6.5 * max(1, len(heads)), 5.4),
                             squeeze=False)
    for ax, gcell in zip(axes[0], heads, strict=False):
        writers = gcell["writers"]
        cell = next((c for c in report["cells"] if c["link"] == gcell["link"]
                     and c["size_mib"] == gcell["size_mib"]
                     and c["world_size"] == gcell["world_size"]), None)
        curves: list[tuple[str, float, float, dict[str, Any]]] = []
        if cell is not None:
            # No writer does better than this: nothing blocks, and the commit
            # comes when the raw upload of the same bytes would be done.
            curves.append(("ceiling: no blocking, commit at the upload floor", 0.0,
                           cell["targets"]["floor_s"], dict(_FLOOR, marker="")))
        peers = [m for m in writers if not m.startswith("vw_")]
        if peers:
            best = max(peers, key=lambda m: writers[m]["best_goodput"])
            w = writers[best]
            curves.append((f"best peer: {best}", w["blocking_s"], w["e2e_s"],
                           dict(_PEER, marker="")))
        for candidates, label, color, _ in _OURS_PLOTTED:
            m = next((m for m in candidates if m in writers), None)
            if m is not None:
                w = writers[m]
                curves.append((_ours_label(label, m), w["blocking_s"], w["e2e_s"],
                               {"color": color, "marker": "", "linewidth": 2}))
        tops = []
        for label, blocking, e2e, style in curves:
            xs, ys = model.curve(blocking, e2e)
            b = model.best(blocking, e2e)
            tops.append(b["best_goodput"])
            ax.plot(xs, ys, label=f"{label}: best {b['best_goodput']:.3%} at "
                    f"{b['best_interval_s']:.0f} s", **style)
            ax.plot([b["best_interval_s"]], [b["best_goodput"]], "o", color=style["color"])
        ax.set_xscale("log")
        top = max(tops, default=1.0)
        ax.set_ylim(max(0.0, top - 0.05), min(1.0, top + 0.005))
        ax.set_xlabel("checkpoint interval, s")
        ax.set_ylabel("goodput (share of wall time kept)")
        ax.set_title(f"{gcell['link']}, {gcell['world_size']} x {gcell['size_mib']} MiB: "
                     f"{g['failures_per_day']:g} failures/day, restart {g['restart_s']:.0f} s",
                     fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    return fig


def plot_all(report: dict[str, Any], stem_path: Path) -> list[Path]:
    """The four figures, as ``<stem>_<figure>.png``; returns their paths.

    ``throughput``: steady MiB/s vs state per rank, a frame per link and rank
    count; ``blocking``: the same cells' blocking seconds against the memcpy;
    ``scaling``: MiB/s vs ranks, a frame per link and size; ``goodput``: the
    goodput model for the largest cell of each link.
    """
    title = f"{report['config']['target']}: {report['command']}"
    paths = []
    for name, metric, by in (("throughput", "throughput", "size_mib"),
                             ("blocking", "blocking", "size_mib"),
                             ("scaling", "throughput", "world_size")):
        fig, legend_rows = _grid(report, metric, by=by)
        path = stem_path.with_name(f"{stem_path.name}_{name}.png")
        _save(fig, path, title=title, legend_rows=legend_rows)
        paths.append(path)
    fig = _goodput_figure(report, title)
    path = stem_path.with_name(f"{stem_path.name}_goodput.png")
    _save(fig, path, title=title, legend_rows=0)
    paths.append(path)
    return paths
