"""FileInfo, and how fsspec's listing entries become it.

fsspec backends disagree on listings: ``find`` returns a dict or a list, not
every ``ls`` takes ``refresh``, and size, etag and mtime go by other keys on
each store. These functions absorb the differences; ``Volume`` wraps them in
its retries and error translation.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec


@dataclass(frozen=True)
class FileInfo:
    """One file on a volume; ``path`` is relative to the volume's root, ``/``-separated."""

    path: str
    size: int
    etag: str | None = None
    mtime: float | None = None


def file_info(raw: Mapping[str, Any], path: str) -> FileInfo:
    """The ``FileInfo`` at ``path`` of one fsspec ``info``/``ls``/``find`` entry."""
    etag = raw.get("ETag") or raw.get("etag") or raw.get("md5Hash") or raw.get("generation")
    mtime = raw.get("mtime") or raw.get("LastModified") or raw.get("last_modified")
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    elif not isinstance(mtime, (int, float)):
        mtime = None
    return FileInfo(
        path=path,
        size=int(raw.get("size") or 0),
        etag=str(etag).strip('"') if etag else None,
        mtime=float(mtime) if mtime is not None else None,
    )


def files_below(
    entries: list[Any], root: str, strip: Callable[[str], str] | None
) -> list[FileInfo]:
    """The files among ``entries``, with paths relative to ``root``, sorted by path.

    ``strip`` removes the protocol from entry names (``None`` on local volumes,
    whose names are OS paths).
    """
    out = []
    for raw in entries:
        if raw.get("type") == "directory":
            continue
        name = str(raw["name"])
        if strip is not None:
            name = strip(name)
        rel = name[len(root) :].lstrip("/") if name.startswith(root) else name
        if strip is None:
            rel = rel.replace(os.sep, "/")
        out.append(file_info(raw, rel))
    return sorted(out, key=lambda f: f.path)


def list_entries(fs: fsspec.AbstractFileSystem, base: str, *, recursive: bool) -> list[Any]:
    """The entries below ``base`` (all levels, or one); a missing prefix lists as empty."""
    if recursive:
        found = fs.find(base, detail=True)
        return list(found.values()) if isinstance(found, dict) else list(found)
    try:
        return list(fs.ls(base, detail=True))
    except FileNotFoundError:
        return []


def list_fresh(fs: fsspec.AbstractFileSystem, base: str) -> list[Any]:
    """The entries directly below ``base``, bypassing any listings cache."""
    try:
        return list(fs.ls(base, detail=True, refresh=True))
    except TypeError:  # backends without a refresh flag
        return list(fs.ls(base, detail=True))
    except FileNotFoundError:
        return []


def directory_names(entries: list[Any]) -> list[str]:
    """The sorted names (last path part) of the directories/prefixes among ``entries``."""
    names = []
    for raw in entries:
        if raw.get("type") == "directory":
            name = str(raw["name"]).rstrip("/").replace(os.sep, "/")
            names.append(name.rsplit("/", 1)[-1])
    return sorted(set(names))


def files_of_keys(
    found: Iterable[tuple[str, int, str | None, float | None]], root_key: str
) -> list[FileInfo]:
    """``(key, size, etag, mtime)`` of objects below ``root_key`` as sorted ``FileInfo``."""
    skip = len(root_key) + 1 if root_key else 0
    files = [FileInfo(path=k[skip:], size=n, etag=e, mtime=m) for k, n, e, m in found]
    return sorted(files, key=lambda f: f.path)
