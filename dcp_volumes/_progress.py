"""Progress bars for people: drawn on a terminal only, as tqdm users expect.

Every bar of the CLI and the demo is made here. A bar goes to stderr and is
drawn only when stderr is a terminal (tqdm's ``disable=None``): redirected to
a file or a CI log, it would leave one ``\\r`` update per refresh there.
"""

from __future__ import annotations

import sys
from typing import IO, Any


def progress_bar(
    *, total: int, desc: str, unit: str = "B", enabled: bool = True, file: IO[str] | None = None
) -> Any:
    """A tqdm bar on ``file`` (default stderr), drawn only when ``enabled`` and a terminal.

    ``unit="B"`` counts bytes (shown as KiB, MiB...); other units count items.
    """
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        file=file if file is not None else sys.stderr,
        disable=None if enabled else True,  # None: off unless the file is a terminal
        leave=False,
    )
