"""``python -m dcp_volumes.demo rank SPEC.json``: one training rank, as torchrun starts it."""

from __future__ import annotations

import os
import sys


def _main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "rank":
        sys.exit("usage: python -m dcp_volumes.demo rank SPEC.json  (started by the demo)")
    cpus = os.environ.get("DCP_VOLUMES_DEMO_CPUS")  # the simulated node's own CPUs
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    from dcp_volumes.demo import _rank

    _rank.main(argv[1:])


if __name__ == "__main__":
    _main(sys.argv[1:])
