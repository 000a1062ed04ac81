"""A command whose optional libraries are missing says which extra to install, in one line.

Each case runs the real console entry point in a fresh interpreter in which the
named modules cannot be imported (a meta-path finder refuses them), as on a
machine where only the base package was installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from dcp_volumes import _extras

ROOT = Path(__file__).resolve().parents[1]

_HIDE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Hide())
from dcp_volumes.cli import main
sys.exit(main({argv!r}))
"""


def _run_without(
    hidden: set[str], argv: list[str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _HIDE.format(hidden=hidden, argv=argv)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )


@pytest.mark.parametrize("hidden", [{"matplotlib"}, {"moto"}, {"s3fs", "boto3"}])
def test_the_demo_without_its_extra_names_the_install_command(
    hidden: set[str], tmp_path: Path
) -> None:
    proc = _run_without(hidden, ["demo", "--quick", "--workdir", str(tmp_path / "w")], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "pip install 'dcp_volumes[demo]'" in lines[0]
    assert all(name in lines[0] for name in hidden)
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())


def _requirements(extras: dict[str, list[str]], name: str) -> set[str]:
    """Distribution names an extra installs, following ``dcp_volumes[...]`` references."""
    found: set[str] = set()
    for req in extras[name]:
        if req.startswith("dcp_volumes["):
            for inner in req[len("dcp_volumes["):].rstrip("]").split(","):
                found |= _requirements(extras, inner.strip())
        else:
            found.add(re.split(r"[\[<>=;! ]", req, maxsplit=1)[0].lower())
    return found


@pytest.mark.parametrize(("extra", "modules"),
                         [("demo", _extras.DEMO_MODULES), ("bench", _extras.BENCH_MODULES)])
def test_each_extra_installs_what_its_command_checks_for(
    extra: str, modules: tuple[str, ...]
) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(modules) <= _requirements(extras, extra)
