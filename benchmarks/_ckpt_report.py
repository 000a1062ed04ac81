"""Tables and plots of the checkpoint benchmark (the measuring stays in bench_checkpoint.py)."""

from __future__ import annotations

import math
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

_STYLE = {"loopback": "-", "remote": "--", "tbf": ":"}
PLOTTED = ("raw_put", "raw_multipart", "torch_save", "fsspec_t8", "fsspec_async", "s3tc",
           "vw_sync", "vw_async", "vw_sync_fresh", "vw_async_fresh")


def _color(m: str) -> str:
    colors = {
        "raw_put": "black", "raw_multipart": "gray", "memcpy": "gray", "torch_save": "tab:brown",
        "fsspec_t8": "tab:blue", "fsspec_async": "tab:cyan", "s3tc": "tab:purple",
        "vw_sync": "tab:olive", "vw_async": "tab:green", "vw_sync_fresh": "tab:orange",
        "vw_async_fresh": "tab:red", "local_fs": "tab:pink",
    }
    return colors.get(m, "tab:gray")


def _series(
    report: dict[str, Any], link: str, method: str, key: str, *, by: str, fixed: int
) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    other = "world_size" if by == "size_mib" else "size_mib"
    for cell in sorted(report["cells"], key=lambda c: c[by]):
        s = cell["saves"].get(method)
        if cell["link"] != link or cell[other] != fixed or not s or not s["e2e_s"]:
            continue
        xs.append(cell[by])
        ys.append(s[key])
    return xs, ys


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


def plot_all(report: dict[str, Any], stem_path: Path) -> list[Path]:
    """The four figures, as ``<stem>_<figure>.png``; returns their paths."""
    plt = pyplot()
    cfg = report["config"]
    links = cfg["links"]
    top_ranks, top_size = max(cfg["ranks"]), max(cfg["sizes_mib_per_rank"])
    title = f"{cfg['target']}: {report['command']}"
    paths = []

    for fig_name, key, ylabel in (
        ("throughput", "steady_mib_s", "MiB/s, all ranks (steady state, higher is better)"),
        ("blocking", "steady_blocking_s", "blocking s (training waits; lower is better)"),
    ):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        methods = PLOTTED + (("memcpy",) if key == "steady_blocking_s" else ())
        for link in links:
            for m in methods:
                xs, ys = _series(report, link, m, key, by="size_mib", fixed=top_ranks)
                if xs:
                    ax.plot(xs, ys, _STYLE.get(link, "-"), marker="o", color=_color(m),
                            label=f"{m} ({link})")
        ax.set_xscale("log", base=2)
        if key == "steady_blocking_s":
            ax.set_yscale("log")
        ax.set_xlabel(f"state per rank, MiB ({top_ranks} ranks)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{fig_name} vs state size", fontsize=10)
        ax.legend(fontsize=6, ncol=2)
        fig.suptitle(title, fontsize=7)
        path = stem_path.with_name(f"{stem_path.name}_{fig_name}.png")
        _save(fig, path)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for link in links:
        for m in PLOTTED:
            xs, ys = _series(report, link, m, "steady_mib_s", by="world_size", fixed=top_size)
            if xs:
                ax.plot(xs, ys, _STYLE.get(link, "-"), marker="o", color=_color(m),
                        label=f"{m} ({link})")
    ax.set_xlabel(f"ranks ({top_size} MiB each)")
    ax.set_ylabel("MiB/s, all ranks (higher is better)")
    ax.set_title("scaling with ranks", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=7)
    path = stem_path.with_name(f"{stem_path.name}_scaling.png")
    _save(fig, path)
    paths.append(path)

    from benchmarks._goodput import GoodputModel

    g = report["goodput"]
    model = GoodputModel(g["failures_per_day"], g["restart_s"])
    heads = _headline_cells(g["cells"])
    fig, axes = plt.subplots(1, max(1, len(heads)), figsize=(7 * max(1, len(heads)), 5),
                             squeeze=False)
    for ax, cell in zip(axes[0], heads, strict=False):
        for m, w in cell["writers"].items():
            xs, ys = model.curve(w["blocking_s"], w["e2e_s"])
            ax.plot(xs, ys, color=_color(m), label=f"{m}: best {w['best_goodput']:.3%} "
                    f"at {w['best_interval_s']:.0f} s")
            ax.plot([w["best_interval_s"]], [w["best_goodput"]], "o", color=_color(m))
        ax.set_xscale("log")
        best = max((w["best_goodput"] for w in cell["writers"].values()), default=1.0)
        ax.set_ylim(max(0.0, best - 0.05), min(1.0, best + 0.005))
        ax.set_xlabel("checkpoint interval, s")
        ax.set_ylabel("goodput (share of wall time kept)")
        ax.set_title(
            f"{cell['link']}, {cell['world_size']} x {cell['size_mib']} MiB: "
            f"{g['failures_per_day']:g} failures/day, restart {g['restart_s']:.0f} s",
            fontsize=9,
        )
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=7)
    path = stem_path.with_name(f"{stem_path.name}_goodput.png")
    _save(fig, path)
    paths.append(path)
    return paths

