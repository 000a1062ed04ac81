"""``python -m benchmarks {checkpoint,data,all} ...`` (see ``benchmarks/cli.py``)."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
