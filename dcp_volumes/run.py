"""``python -m dcp_volumes.run``: run a training script with dcp_volumes routing on.

No change to the training code: routing is turned on (``dcp_volumes.route()``,
from ``DCP_VOLUMES_ROUTE`` / ``DCP_VOLUMES_ROUTE_CONFIG`` or ``--route`` /
``--config``) and then the script runs as ``python script.py`` would run it::

    DCP_VOLUMES_ROUTE=s3://bucket/ python -m dcp_volumes.run train.py --lr 1e-3
    torchrun --nproc-per-node 8 -m dcp_volumes.run train.py --lr 1e-3
    python -m dcp_volumes.run --route s3://bucket/ -m my_package.train

At exit it lets the script's gloo threads finish before Python shuts down
(``_prompt_exit.settle_threads_at_exit``).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dcp_volumes.run",
        description="Run a script with dcp.save/async_save/load routed to dcp_volumes for "
        "the configured URL prefixes.",
    )
    p.add_argument("--route", action="append", default=None, metavar="PREFIX",
                   help="a URL prefix to route (repeatable; default: DCP_VOLUMES_ROUTE or "
                   "the config file)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML/JSON routing config (default: DCP_VOLUMES_ROUTE_CONFIG)")
    p.add_argument("-m", dest="module", default=None, metavar="MODULE",
                   help="run a module, as python -m does")
    p.add_argument("target", nargs=argparse.REMAINDER,
                   help="the script and its arguments (or the module's arguments with -m)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Turn routing on, then run the script (or ``-m`` module) as ``__main__``."""
    args = _parser().parse_args(argv)
    if args.module is None and not args.target:
        _parser().error("give a script to run (or -m MODULE)")
    from dcp_volumes._prompt_exit import settle_threads_at_exit
    from dcp_volumes.checkpoint._routing import route

    route(args.route, config=args.config)
    settle_threads_at_exit()  # the script's process groups may outlive it
    if args.module is not None:
        sys.argv = [args.module, *args.target]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        script, *rest = args.target
        sys.argv = [script, *rest]
        # As `python script.py` does: the script's directory comes first on sys.path.
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
