"""The dataset's file table: the files it reads (path, size, etag), listed once, and its digest.

The digest goes into the loader's saved state; a resume whose listing differs
(files added, removed, resized or rewritten) is refused or warned about,
never silently misaligned. It is computed when first asked for (a state saved
or checked), not at construction, as one hash over the columns.

The table is columns, not a Python object per file: the paths' UTF-8 in one
byte array with their end offsets, sizes, etags the same way, mtimes only
where a file has no etag. A file costs its path and etag bytes plus 12 to 28
bytes, and ``share()`` moves the columns into shared memory, so DataLoader
workers map them (fork, forkserver or spawn) instead of each holding a copy;
a fork touches no per-file object's reference count.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from dcp_volumes._exceptions import ConfigurationError, VolumeNotFoundError
from dcp_volumes._volume import FileInfo, Volume, common_root
from dcp_volumes._world import available_cpus
from dcp_volumes.data import _walk


def _ends(lengths: Sequence[int] | np.ndarray, total: int) -> np.ndarray:
    """End offsets of consecutive byte strings (uint32 while they fit)."""
    dtype = np.uint32 if total < 2**32 else np.int64
    return np.cumsum(np.asarray(lengths, dtype=np.int64)).astype(dtype)


def _blob(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The UTF-8 of ``strings`` back to back, and where each ends."""
    data, lengths = _walk.utf8_joined(strings)
    blob = bytearray(data)  # writable: torch shares it without a warning
    return np.frombuffer(blob, dtype=np.uint8), _ends(lengths, len(blob))


class FileTable:
    """The files of a dataset, in table order, with the digest of the listing.

    (The loader's state keeps the digest under ``file_table``, under ``manifest``
    in states of earlier versions; a checkpoint's manifest is another thing,
    ``checkpoint/_manifest.py``.)
    """

    def __init__(self, columns: dict[str, np.ndarray | None], digest: str | None = None) -> None:
        self._digest = digest  # (None: not computed yet; see ``digest``)
        self._columns = columns
        # The byte tensors behind the columns once shared (they pickle as handles).
        self._tensors: dict[str, torch.Tensor] = {}
        self._bind()

    def _bind(self) -> None:
        c = self._columns
        names, name_ends, sizes = c["names"], c["name_ends"], c["sizes"]
        if names is None or name_ends is None or sizes is None:
            raise ValueError("a file table needs names, name_ends and sizes")
        self._names = memoryview(names.data)
        self._name_ends: np.ndarray = name_ends
        self.sizes: np.ndarray = sizes
        self._etags = memoryview(c["etags"].data) if c["etags"] is not None else None
        self._etag_ends = c["etag_ends"]
        self._mtimes = c["mtimes"]

    @classmethod
    def of(cls, files: Sequence[FileInfo]) -> FileTable:
        """The table of ``files`` (in this order)."""
        return cls.from_columns(
            [f.path for f in files],
            [f.size for f in files],
            [f.etag for f in files],
            [f.mtime for f in files],
        )

    @classmethod
    def from_columns(
        cls,
        paths: Sequence[str],
        sizes: Sequence[int],
        etags: Sequence[str | None] | None,
        mtimes: Sequence[float | None],
    ) -> FileTable:
        """The table of the files ``paths[i]`` (``etags``: None where the store has none)."""
        names, name_ends = _blob(paths)
        etag_blob = etag_ends = mtime_column = None
        if etags is not None and any(etags):
            etag_blob, etag_ends = _blob([e or "" for e in etags])
        if etags is None or not all(etags):
            mtime_column = np.array(mtimes, dtype=np.float64)  # (None: NaN)
        columns: dict[str, np.ndarray | None] = {
            "names": names,
            "name_ends": name_ends,
            "sizes": np.asarray(sizes, dtype=np.int64),
            "etags": etag_blob,
            "etag_ends": etag_ends,
            "mtimes": mtime_column,
        }
        return cls(columns)

    @classmethod
    def of_parts(cls, parts: Sequence[_walk.Part]) -> FileTable:
        """The table of a directory walk's runs (in this order): joined, never a Python
        object per file."""
        lengths = np.frombuffer(bytearray().join(p[1] for p in parts), dtype=np.uint32)
        names = np.frombuffer(bytearray().join(p[0] for p in parts), dtype=np.uint8)
        columns: dict[str, np.ndarray | None] = {
            "names": names,
            "name_ends": _ends(lengths, len(names)),
            "sizes": np.frombuffer(bytearray().join(p[2] for p in parts), dtype=np.int64),
            "etags": None,
            "etag_ends": None,
            "mtimes": np.frombuffer(bytearray().join(p[3] for p in parts), dtype=np.float64),
        }
        return cls(columns)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def digest(self) -> str:
        """sha256 of the listing (paths, sizes, versions, in order), computed when first
        asked for: a loader's state saves it, a resume compares it (``matches``)."""
        if self._digest is None:
            self._digest = _column_digest(self._columns)
        return self._digest

    def matches(self, digest: str) -> bool:
        """Whether ``digest`` (from a saved state) is this listing's: ``digest``, or
        ``listing_digest`` of its entries, which states saved before it carry."""
        if digest == self.digest:
            return True
        if len(digest) != len(self.digest):
            return False
        return digest == listing_digest([self.info(i) for i in range(len(self))])

    def path(self, i: int) -> str:
        """The path (relative to the volume) of file ``i``."""
        ends = self._name_ends
        start = int(ends[i - 1]) if i else 0
        return str(self._names[start : int(ends[i])], "utf-8")

    def info(self, i: int) -> FileInfo:
        """File ``i`` as a listing entry."""
        etag = mtime = None
        etags, ends = self._etags, self._etag_ends
        if etags is not None and ends is not None:
            start = int(ends[i - 1]) if i else 0
            etag = str(etags[start : int(ends[i])], "utf-8") or None
        if self._mtimes is not None:
            m = float(self._mtimes[i])
            mtime = None if math.isnan(m) else m
        return FileInfo(self.path(i), int(self.sizes[i]), etag, mtime)

    def paths(self) -> Iterator[str]:
        return (self.path(i) for i in range(len(self)))

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def nbytes(self) -> int:
        """Bytes the columns hold."""
        return sum(c.nbytes for c in self._columns.values() if c is not None)

    def share(self) -> None:
        """Move the columns into shared memory: processes the table is pickled to (by
        torch's multiprocessing, as DataLoader workers are) map them instead of copying."""
        for name, column in self._columns.items():
            if column is not None and column.nbytes and name not in self._tensors:
                tensor = self._as_bytes(name, column)
                tensor.share_memory_()  # type: ignore[no-untyped-call]
                self._tensors[name] = tensor
                self._columns[name] = tensor.numpy().view(column.dtype)
        self._bind()

    def _as_bytes(self, name: str, column: np.ndarray) -> torch.Tensor:
        shared = self._tensors.get(name)
        if shared is not None:
            return shared
        return torch.from_numpy(np.ascontiguousarray(column).view(np.uint8))

    def __getstate__(self) -> dict[str, Any]:
        # As byte tensors: shared memory pickles as a handle through torch's
        # multiprocessing, and by value through plain pickle (a broadcast to other ranks).
        columns = {
            name: None if column is None else (self._as_bytes(name, column), column.dtype.str)
            for name, column in self._columns.items()
        }
        return {"columns": columns, "digest": self._digest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._digest = state["digest"]
        self._columns, self._tensors = {}, {}
        for name, packed in state["columns"].items():
            if packed is None:
                self._columns[name] = None
                continue
            tensor, dtype = packed
            if tensor.is_shared():
                self._tensors[name] = tensor
            self._columns[name] = tensor.numpy().view(np.dtype(dtype))
        self._bind()


def listing_digest(files: Sequence[FileInfo]) -> str:
    """sha256 over lines (path, size, etag — or mtime where the store has no etag), in
    order: the digest of the listing in states saved before ``FileTable.digest``."""
    return _digest(
        [f.path for f in files], [f.size for f in files], [f.etag for f in files],
        [f.mtime for f in files],
    )


def _digest(
    paths: Sequence[str],
    sizes: Sequence[int],
    etags: Sequence[str | None] | None,
    mtimes: Sequence[float | None],
) -> str:
    h = hashlib.sha256()
    if etags is None and None not in mtimes:  # a directory's walk: the mtime is the version
        for path, size, mtime in zip(paths, sizes, mtimes, strict=True):
            h.update(f"{path}\t{size}\t{mtime!r}\n".encode())
        return h.hexdigest()
    tags = etags if etags is not None else [None] * len(paths)
    for path, size, etag, mtime in zip(paths, sizes, tags, mtimes, strict=True):
        version = etag if etag else (repr(mtime) if mtime is not None else "")
        h.update(f"{path}\t{size}\t{version}\n".encode())
    return h.hexdigest()


# The digest of a table: sha256 over its columns in one canonical form (an absent
# etag column as empty etags; the mtime only where a file has no etag). It tells the
# same listings apart as ``listing_digest`` and costs a hash over the columns' bytes,
# not a formatted line per file. (States saved before it carry ``listing_digest``.)
_DIGEST_HEADER = b"dcp_volumes file table v2\n"


def _column_digest(columns: Mapping[str, np.ndarray | None]) -> str:
    names, name_ends, sizes = columns["names"], columns["name_ends"], columns["sizes"]
    etags, etag_ends, mtimes = columns["etags"], columns["etag_ends"], columns["mtimes"]
    if names is None or name_ends is None or sizes is None:
        raise ValueError("a file table needs names, name_ends and sizes")
    n = len(sizes)
    if etags is None or etag_ends is None:
        etags, etag_ends = np.zeros(0, dtype=np.uint8), np.zeros(n, dtype=np.int64)
    ends = etag_ends.astype("<i8")
    has_etag = np.diff(ends, prepend=0) > 0
    versions = np.full(n, np.nan) if mtimes is None else mtimes.astype("<f8")
    versions[has_etag | np.isnan(versions)] = np.nan  # (one NaN: the same bytes)
    h = hashlib.sha256(_DIGEST_HEADER)
    for column in (names, name_ends.astype("<i8"), sizes.astype("<i8"), etags, ends, versions):
        h.update(column.nbytes.to_bytes(8, "little"))
        h.update(np.ascontiguousarray(column).data)
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
        where = volume.display_url
        if volume.capabilities.local_files and os.path.isdir(volume.root):
            # A directory: walked straight into columns (a listing entry object per
            # file would cost more than the walk's own stat).
            try:
                parts = _walk.walk(volume.root, wanted, threads=concurrency,
                                   processes=min(available_cpus(), 8))
            except OSError:
                parts = []  # (the volume's own listing says what went wrong)
            if parts:
                return volume, FileTable.of_parts(parts)
        listed = _list_prefix(volume, concurrency)
        files = [f for f in listed if f.path and _visible(f.path, wanted)]
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
    return volume, FileTable.of(files)
