"""The backend protocol: the few operations every kind of volume implements.

``Volume`` (``_volume.py``) is the only thing the rest of the package speaks to;
behind it one ``Backend`` per kind of store (``_local.py``, ``_obstore.py``,
``_fsspec.py``). A backend works on *locations*: what ``Volume.full_path``
gives (an absolute OS path on local volumes, ``bucket/key`` elsewhere). It
maps its client's exceptions to the neutral kinds of ``_errors.py`` at its
boundary; ``Volume`` retries (``_retry.py``) and translates (``_errors.py``) those, so no
backend and no caller handles another client's errors.

What a caller may need to know about a store is a ``Capabilities`` flag,
never a type check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Bytes of any kind that has the buffer protocol (bytes, memoryview, obstore's Bytes).
Data = Any


@dataclass(frozen=True)
class FileInfo:
    """One file on a volume; ``path`` is relative to the volume's root, ``/``-separated."""

    path: str
    size: int
    etag: str | None = None
    mtime: float | None = None


@dataclass(frozen=True)
class Listing:
    """What one listing call found: files (full locations) and, one level deep, prefixes."""

    files: list[FileInfo]
    dirs: list[str]


@dataclass(frozen=True)
class Capabilities:
    """What a store does, for the callers that must adapt to it.

    Attributes:
        local_files: locations are files on this machine: they can be opened,
            renamed into place and read in place (local disks and mounts).
        atomic_create: ``put(create_only=True)`` is decided by the server in
            one step, so of two writers racing for one name exactly one wins.
            Without it the volume checks first, which leaves a short window.
        buffers_uploads: an upload holds each part (a whole small file) in
            memory while it is in flight; uploads are then shaped to a memory
            budget. False for obstore: it sends maps of the staged files whose
            sent pages are dropped as they go (``_mapped.py``).
        survives_fork: a process forked after this backend did I/O can still use
            it (in a new client). False for obstore: its runtime's threads do
            not exist in the child, which then hangs on its first call.
        ranged_reads_cost_whole_object: the server reads the whole object to
            answer a ranged read (moto does; real stores do not). Readers then
            cut a file into as few ranges as the part size allows, not into one
            per idle stream. Set by the storage option of the same name.
        listing_lags: a listing may leave out, for a while, objects whose
            writes already returned (NFS attribute caches, some S3-compatible
            servers and caching gateways). A commit then checks every file of
            its save in a listing; where listings show every returned write (S3,
            Azure, GCS), the ranks' write results vouch for their files. Set by
            the storage option of the same name.
    """

    local_files: bool
    atomic_create: bool
    buffers_uploads: bool
    survives_fork: bool = True
    ranged_reads_cost_whole_object: bool = False
    listing_lags: bool = False


class Backend(Protocol):
    """The operations of one kind of store, on locations (see the module docstring)."""

    capabilities: Capabilities

    def check_root(self, root: str, *, create: bool) -> Listing:
        """Raise unless ``root`` can be used (``create``: make a missing directory);
        returns what is directly in it (one request where the check is a listing)."""

    def head(self, path: str) -> FileInfo:
        """Size, etag and mtime of one object (``FileInfo.path`` is the location)."""

    def list(self, prefix: str, *, recursive: bool) -> Listing:
        """Objects below ``prefix`` (all levels, or one level with its sub-prefixes)."""

    def read(self, path: str, start: int, end: int | None) -> Data:
        """Bytes ``[start, end)`` of an object (``end=None``: to its end; clipped at its end)."""

    def read_whole(self, path: str, expect: int) -> Data:
        """The whole object in one request; its real length may differ from ``expect``."""

    def read_into(self, path: str, start: int, outs: Sequence[memoryview]) -> int:
        """Read from ``start`` into ``outs`` in turn; returns how many bytes arrived."""

    def upload(
        self, local_path: str, path: str, *, size: int, part_size: int, concurrency: int,
        move: bool,
    ) -> None:
        """Store a local file (multipart from the file where the store has it)."""

    def put(self, path: str, data: Data, *, create_only: bool) -> None:
        """Store a small object in one step; ``create_only`` refuses to replace one."""

    def delete(self, paths: Sequence[str]) -> None:
        """Delete objects (batched where the store can); missing ones are no error."""

    def copy(self, src: str, dst: str) -> None:
        """Copy an object on the store itself (no bytes through this process)."""


def scatter(data: memoryview, outs: Sequence[memoryview]) -> int:
    """Copy ``data`` into ``outs`` in turn; returns how many bytes were placed."""
    got = 0
    for out in outs:
        n = min(len(out), len(data) - got)
        if n <= 0:
            break
        out[:n] = data[got : got + n]
        got += n
    return got



def keys_by_bucket(paths: Sequence[str]) -> dict[str, list[str]]:
    """``bucket/key`` paths grouped by bucket, in order: one batch request per bucket."""
    grouped: dict[str, list[str]] = {}
    for path in paths:
        bucket, _, key = path.partition("/")
        grouped.setdefault(bucket, []).append(key)
    return grouped
