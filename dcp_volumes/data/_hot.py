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

import contextlib
import hashlib
import os
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

from dcp_volumes._volume import FileInfo, Volume, redact_url
from dcp_volumes.data._files import CachedFile
from dcp_volumes.data._locks import EntryLock
from dcp_volumes.data._shared_words import SharedWords
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


class SharedHot(SharedWords):
    """Identities of verified copies of a fixed list of files, shared by processes.

    Slot ``i`` holds ``identity()`` of the copy of file ``i`` that some process
    verified against that file's listing entry, or 0. A reader trusts a slot
    only if its own ``stat`` of the copy gives the same digest, so a stale or
    racing slot costs a slow-path check, never a wrong hit.
    """

    def get(self, slot: int) -> int:
        return int(self.words[slot])

    def put(self, slot: int, st: os.stat_result) -> None:
        self.words[slot] = identity(st)


# Hits refresh the file's mtime (the LRU clock) at most this often.
TOUCH_INTERVAL_S = 60.0
# Entries of one process's index; past this it starts over (it only saves
# work, it is never the source of truth).
_HOT_MAX = 1 << 20


class HotIndex:
    """One process's index of verified copies, per volume object: the cache's hit path."""

    def __init__(self) -> None:
        self._by_volume: dict[int, tuple[Volume, dict[str, Hot]]] = {}

    def lookup(
        self,
        volume: Volume,
        relpath: str,
        *,
        expected: Any,
        pin: bool,
        shared: SharedHot | None,
        slot: int,
        ref_of: Callable[[Volume, str], Ref],
        note_hit: Callable[[str], None],
    ) -> CachedFile | None:
        """A verified copy of ``relpath``, or None: ``FileCache.fetch_hot`` does this."""
        entry = self._by_volume.get(id(volume))
        hot = entry[1].get(relpath) if entry is not None else None
        st: os.stat_result | None = None
        if hot is None:
            adopted = self._adopt(volume, relpath, expected, shared, slot, ref_of)
            if adopted is None:
                return None
            hot, st = adopted
        elif not hot.listed_as(expected):
            return None
        lock = None
        if pin:
            lock = EntryLock(hot.lock)
            lock.acquire(exclusive=False)
            st = None  # stat again under the pin
        if st is None:
            try:
                st = os.stat(hot.data)
            except OSError:
                st = None
        if st is None or not hot.same_file(st):
            # Replaced, evicted, repaired or touched: still good if a process sharing
            # the table verified exactly this copy (another worker's touch or refill).
            if (
                st is None
                or shared is None
                or expected is None
                or st.st_size != hot.size
                or shared.get(slot) != identity(st)
            ):
                if lock is not None:
                    lock.release()
                self._index(volume).pop(relpath, None)
                return None
            hot.ino, hot.dev, hot.ctime_ns = st.st_ino, st.st_dev, st.st_ctime_ns
        if time.time() - st.st_mtime > TOUCH_INTERVAL_S:
            self._touch_hot(hot, shared, slot)
        note_hit(hot.key)
        if lock is not None:
            return _hit(hot, lock)
        found = hot.file  # unpinned hits hand out one immutable object per copy
        if found is None:
            found = hot.file = _hit(hot, None)
        return found  # type: ignore[no-any-return]

    def _touch_hot(self, hot: Hot, shared: SharedHot | None, slot: int) -> None:
        with contextlib.suppress(OSError):
            os.utime(hot.data)  # the LRU clock of other processes
            st = os.stat(hot.data)
            # utime moved the ctime; adopt it only if it is still the same file.
            if st.st_ino == hot.ino and st.st_dev == hot.dev and st.st_size == hot.size:
                hot.ctime_ns = st.st_ctime_ns
                if shared is not None:
                    shared.put(slot, st)

    def _index(self, volume: Volume) -> dict[str, Hot]:
        entry = self._by_volume.get(id(volume))
        if entry is None or entry[0] is not volume:
            entry = self._by_volume[id(volume)] = (volume, {})
        return entry[1]

    def _adopt(
        self,
        volume: Volume,
        relpath: str,
        expected: Any,
        shared: SharedHot | None,
        slot: int,
        ref_of: Callable[[Volume, str], Ref],
    ) -> tuple[Hot, os.stat_result] | None:
        """A copy another process verified against ``expected`` (see ``SharedHot``),
        with the ``stat`` that matched."""
        if shared is None or expected is None:
            return None
        digest = shared.get(slot)
        if not digest:
            return None
        ref = ref_of(volume, relpath)
        try:
            st = os.stat(ref.data)
        except OSError:
            return None
        if identity(st) != digest:
            return None
        hot = Hot(ref, listed_meta(expected), st)
        hot.expected = expected
        index = self._index(volume)
        if len(index) >= _HOT_MAX:
            index.clear()
        index[relpath] = hot
        return hot, st

    def remember(
        self,
        volume: Volume,
        relpath: str,
        ref: Ref,
        meta: Mapping[str, Any],
        expected: Any,
        shared: SharedHot | None,
        slot: int,
    ) -> None:
        """Index a copy just verified under its lock (see ``fetch_hot``)."""
        try:
            st = os.stat(ref.data)
        except OSError:
            return
        index = self._index(volume)
        if len(index) >= _HOT_MAX:
            index.clear()
        index[relpath] = Hot(ref, meta, st)
        if shared is not None and expected is not None:
            shared.put(slot, st)


def _hit(hot: Hot, pin: EntryLock | None) -> CachedFile:
    return CachedFile(
        path=hot.data,
        url=hot.url,
        key=hot.key,
        size=hot.size,
        hit=True,
        download_seconds=0.0,
        pin=pin,
    )
