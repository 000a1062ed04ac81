"""``dcp-volumes goodput ROOT [--json] [--plot PNG]``: the body of the subcommand
(``cli.py`` registers it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from dcp_volumes._extras import require
from dcp_volumes.goodput._report import GoodputReport, goodput_report

__all__ = ["configure", "run"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="root URL of a run (the CheckpointManager's root)")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="also draw the timeline (one row per rank) to this PNG file")


def run(args: argparse.Namespace, storage_options: Mapping[str, Any],
        line: Callable[[str], None], as_json: bool) -> tuple[GoodputReport, dict[str, Any]]:
    """The report of ``args.url``, its lines said through ``line``; returns it and its JSON
    document (with ``plot``: the PNG written, if asked)."""
    report = goodput_report(args.url, storage_options=storage_options)
    doc = report.to_json()
    if args.plot:
        require("plot", ("matplotlib",), needed_for="dcp-volumes goodput --plot")
        from dcp_volumes.goodput._plot import plot_timeline

        plot_timeline(report, args.plot)
        doc["plot"] = args.plot
    if not as_json:
        line(report.text())
        if args.plot:
            line(f"timeline: {args.plot}")
    return report, doc
