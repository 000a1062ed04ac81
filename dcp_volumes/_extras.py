"""Optional dependencies: the extra that brings a feature's libraries, and the error without it."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from dcp_volumes._exceptions import BackendNotInstalledError

# What each command needs beyond the base install, by extra (pyproject.toml).
DEMO_MODULES = ("moto", "boto3", "s3fs", "matplotlib")
BENCH_MODULES = ("moto", "boto3", "s3fs", "psutil", "matplotlib")


def missing(modules: Sequence[str]) -> list[str]:
    """The top-level modules of ``modules`` that cannot be imported here."""
    return [m for m in modules if not _findable(m)]


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # an import hook that refuses it, a broken install
        return False


def require(extra: str, modules: Sequence[str], *, needed_for: str) -> None:
    """Raise ``BackendNotInstalledError`` naming the install command if a module is missing."""
    absent = missing(modules)
    if absent:
        raise BackendNotInstalledError(
            f"{needed_for} needs {', '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} "
            f"not installed. Fix: pip install 'dcp_volumes[{extra}]'."
        )
