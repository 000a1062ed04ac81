"""Verified cache copies: the per-process index of the hit path, and its shared twin.

A copy verified under its entry lock (sidecar present, sizes and listing
agree) stays that copy while its data file keeps the same identity (inode,
device, size, ctime): every fill publishes a new inode by rename, eviction
and repair unlink it, and a touch (``utime``) moves the ctime. So a hit
needs one ``stat`` instead of the lock and a sidecar read.

Each process keeps its own index (``_Hot`` per file). The DataLoader workers
of one dataset also share what they verified through ``SharedHot``: one
64-bit digest of the identity per listed file, in shared memory. Without it a
worker knew only the copies it had filled or checked itself, so with two
workers half of the second epoch went the slow way (pool thread, lock,
sidecar), the other worker having filled those files.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from typing import Any

import torch

from dcp_volumes._retry import redact_url
from dcp_volumes._volume import FileInfo
from dcp_volumes.data._store import Ref

_U64 = (1 << 64) - 1
_PACK = struct.Struct("<4Q")


def matches(meta: Mapping[str, Any], expected: Any) -> bool:
    """Whether a sidecar agrees with what a listing says (``Expected``/``FileInfo``/None)."""
    if expected is None:
        return True
    if expected.size is not None and expected.size != meta["size"]:
        return False
    if expected.etag:
        return bool(expected.etag == meta.get("etag"))
    if expected.mtime is not None and meta.get("mtime") is not None:
        return abs(float(meta["mtime"]) - expected.mtime) < 1e-6
    return True


def identity(st: os.stat_result) -> int:
    """A nonzero signed 64-bit digest of a file's identity (inode, device, ctime, size)."""
    raw = _PACK.pack(st.st_ino & _U64, st.st_dev & _U64, st.st_ctime_ns & _U64, st.st_size & _U64)
    value = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
    return value or 1  # 0 means "nothing verified"


class Hot:
    """A copy this process verified (sidecar and listing), and its data file's identity then."""

    __slots__ = (
        "ctime_ns",
        "data",
        "dev",
        "expected",
        "file",
        "ino",
        "key",
        "lock",
        "meta",
        "size",
        "url",
    )

    def __init__(self, ref: Ref, meta: Mapping[str, Any], st: os.stat_result) -> None:
        self.key = ref.key
        self.url = redact_url(ref.url)
        self.data = ref.data
        self.lock = ref.lock
        self.size = st.st_size
        self.meta = {"size": meta["size"], "etag": meta.get("etag"), "mtime": meta.get("mtime")}
        self.ino, self.dev, self.ctime_ns = st.st_ino, st.st_dev, st.st_ctime_ns
        # The listing entry last matched (``matches`` is skipped for the same object)
        # and the unpinned CachedFile handed out for hits (immutable, so reused).
        self.expected: Any = None
        self.file: Any = None

    def same_file(self, st: os.stat_result) -> bool:
        return (
            st.st_ino == self.ino
            and st.st_ctime_ns == self.ctime_ns
            and st.st_size == self.size
            and st.st_dev == self.dev
        )

    def listed_as(self, expected: Any) -> bool:
        """Whether the copy is the one ``expected`` (a listing entry) describes."""
        if expected is self.expected:
            return True
        if not matches(self.meta, expected):
            return False
        self.expected = expected
        return True


def listed_meta(expected: FileInfo | Any) -> dict[str, Any]:
    """The sidecar fields a copy verified against ``expected`` must have had."""
    return {"size": expected.size, "etag": expected.etag, "mtime": expected.mtime}


class SharedHot:
    """Identities of verified copies of a fixed list of files, shared by processes.

    Slot ``i`` holds ``identity()`` of the copy of file ``i`` that some process
    verified against that file's listing entry, or 0. A reader trusts a slot
    only if its own ``stat`` of the copy gives the same digest, so a stale or
    racing slot costs a slow-path check, never a wrong hit. One aligned 8-byte
    word per file: a write is never seen torn. Pickles as shared memory through
    torch's multiprocessing (DataLoader workers, fork or spawn).
    """

    def __init__(self, num_files: int) -> None:
        self.table = torch.zeros(max(1, num_files), dtype=torch.int64).share_memory_()
        self._view: memoryview | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"table": self.table}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.table = state["table"]
        self._view = None

    def _words(self) -> memoryview:
        # A memoryview of the shared words: indexing it is ~30x cheaper than a tensor's.
        view = self._view
        if view is None:
            view = self._view = memoryview(self.table.numpy()).cast("B").cast("q")
        return view

    def get(self, slot: int) -> int:
        return int(self._words()[slot])

    def put(self, slot: int, st: os.stat_result) -> None:
        self._words()[slot] = identity(st)
