"""The fenced code blocks of the project's Markdown documents, and a way to run them.

README.md and the documents in docs/ promise that their Python blocks run as written;
``tests/test_readme.py`` and ``tests/test_recipes.py`` keep the promise by
taking the blocks from here and running each in a fresh interpreter
(``run``), with this checkout first on ``PYTHONPATH``.

A block may carry a marker: an HTML comment (which Markdown renderers hide)
on the line right above its opening fence, e.g. ``<!-- readme-test: name -->``.
What a marker means is the business of the test that reads the document.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^```(.*)$")
_MARKER = re.compile(r"^<!--\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    lang: str  # the fence's info string: "python", "bash", "text", or "" for none
    code: str  # the lines between the fences, each ending with a newline
    line: int  # 1-based line of the opening fence, for messages
    marker: str | None  # the text of the HTML comment on the line above the fence

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0]


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order; an unclosed fence fails loudly."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i] != "```":
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: a code fence is never closed")
        above = _MARKER.match(lines[start - 1].strip()) if start > 0 else None
        code = "".join(line + "\n" for line in lines[start + 1 : i])
        out.append(Block(opening.group(1).strip(), code, start + 1, above and above.group(1)))
        i += 1
    return out


def run(
    args: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 240
) -> str:
    """Run ``args`` in a fresh process with this checkout importable; its stdout, or fail.

    The environment is this process's, plus ``PYTHONPATH`` (the checkout) and
    ``OMP_NUM_THREADS=1``, plus ``env`` (which wins).
    """
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc.stdout
