"""The dataset's file table: the files it reads (path, size, etag), listed once, and its digest.

The digest goes into the loader's saved state; a resume whose listing differs
(files added, removed, resized or rewritten) is refused or warned about,
never silently misaligned.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dcp_volumes._exceptions import ConfigurationError, VolumeNotFoundError
from dcp_volumes._volume import FileInfo, Volume, common_root


@dataclass(frozen=True)
class FileTable:
    """The files of a dataset, in table order, with the digest of the listing.

    (The loader's state calls the digest ``manifest``; a checkpoint's manifest
    is another thing, ``checkpoint/_manifest.py``.)
    """

    files: tuple[FileInfo, ...]
    digest: str

    def __len__(self) -> int:
        return len(self.files)


def listing_digest(files: Sequence[FileInfo]) -> str:
    """sha256 over (path, size, etag — or mtime where the store has no etag), in order."""
    h = hashlib.sha256()
    for f in files:
        version = f.etag if f.etag else (repr(f.mtime) if f.mtime is not None else "")
        h.update(f"{f.path}\t{f.size}\t{version}\n".encode())
    return h.hexdigest()


def _visible(path: str, suffixes: tuple[str, ...] | None) -> bool:
    # Hidden files and folders (".DS_Store", ".git/...") are not training data.
    if any(part.startswith(".") for part in path.split("/")):
        return False
    return suffixes is None or path.lower().endswith(suffixes)


def _list_prefix(volume: Volume, concurrency: int) -> list[FileInfo]:
    """All files below the volume root; top-level folders are listed in parallel."""
    if volume.capabilities.local_files or concurrency <= 1:
        return volume.list("")
    dirs = volume.list_dirs("")
    if not dirs:
        return volume.list("")
    top = volume.list("", recursive=False)
    with ThreadPoolExecutor(max_workers=min(concurrency, len(dirs))) as pool:
        parts = list(pool.map(volume.list, dirs))
    merged = {f.path: f for f in top}
    for part in parts:
        merged.update((f.path, f) for f in part)
    return sorted(merged.values(), key=lambda f: f.path)


def _stat_many(volume: Volume, rels: Sequence[str], concurrency: int) -> list[FileInfo]:
    """Size and etag of each file: one listing per folder where files share folders
    (a LIST returns up to 1000 entries), else one stat per file."""
    folders = sorted({rel.rpartition("/")[0] for rel in rels})
    found: dict[str, FileInfo] = {}
    workers = max(1, min(concurrency, len(rels)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        if len(folders) * 4 <= len(rels):
            for listing in pool.map(lambda d: volume.list(d, recursive=False), folders):
                found.update((f.path, f) for f in listing)
        missing = [rel for rel in rels if rel not in found]
        found.update(zip(missing, pool.map(volume.info, missing), strict=True))
    return [found[rel] for rel in rels]


def build_file_table(
    source: str | os.PathLike[str] | Sequence[str],
    *,
    storage_options: Mapping[str, Any] | None,
    suffixes: Sequence[str] | None = None,
    concurrency: int = 16,
) -> tuple[Volume, FileTable]:
    """List a prefix (or stat a list of file URLs) into a file table.

    A prefix lists every file below it (sorted by path; hidden files skipped;
    ``suffixes`` filters by ending, e.g. ``(".jpg", ".png")``). A list keeps
    its order and must name files on one store.
    """
    wanted = tuple(s.lower() for s in suffixes) if suffixes else None
    if isinstance(source, (str, os.PathLike)):
        volume = Volume(os.fspath(source), storage_options=storage_options)
        listed = _list_prefix(volume, concurrency)
        files = [f for f in listed if f.path and _visible(f.path, wanted)]
        where = volume.display_url
    else:
        urls = [os.fspath(u) for u in source]
        if not urls:
            raise ConfigurationError("The file list is empty; pass at least one file URL.")
        root_url, rels = common_root(urls)
        volume = Volume(root_url, storage_options=storage_options)
        files = _stat_many(volume, rels, concurrency)
        where = f"the {len(urls)} listed files"
    if not files:
        raise VolumeNotFoundError(
            f"No files found under {where}: the prefix is empty or does not exist"
            + (f", or no file ends with {list(wanted)}" if wanted else "")
            + ". Fix: check the URL and storage_options, or upload the data first."
        )
    return volume, FileTable(files=tuple(files), digest=listing_digest(files))
