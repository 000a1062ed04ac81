"""The hit path: a memo of the cache copies this process verified, and its shared twin.

A copy verified under its entry lock (record present, sizes and listing
agree) stays that copy while its data file keeps the same identity (inode,
device, size, ctime): every fill publishes a new inode by rename, eviction
and repair unlink it, and a touch (``utime``) moves the ctime. So a hit
needs one ``stat`` instead of the lock and a record read.

Each process keeps its own memo (``HotCopy`` per file). The DataLoader
workers of one dataset also share what they verified through ``SharedHot``:
one 64-bit digest of the identity per listed file, in shared memory. Without
it a worker knew only the copies it had filled or checked itself, so with two
workers half of the second epoch went the slow way (pool thread, lock,
record), the other worker having filled those files. The memo never decides
alone: what it does not know, or no longer matches, goes the full way
(``FileCache.fetch_cold``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time

from dcp_volumes._volume import FileInfo, Volume
from dcp_volumes.data._entry import TOUCH_INTERVAL_S, CachedFile, Entry, describes
from dcp_volumes.data._locks import ByteLock, EntryLock
from dcp_volumes.data._shared_words import SharedWords

_U64 = (1 << 64) - 1
_PACK = struct.Struct("<4Q")
# Copies in one process's memo (a copy is a handful of objects and paths); past this it
# starts over (it only saves work, it is never the source of truth). Small, so that a
# worker's memory does not grow with the dataset: a dataset's copies past it are hits
# through ``SharedHot`` (8 bytes a file, shared), at the cost of an entry's name a hit.
_HOT_MAX = 1 << 12


def identity(st: os.stat_result) -> int:
    """A nonzero signed 64-bit digest of a file's identity (inode, device, ctime, size)."""
    raw = _PACK.pack(st.st_ino & _U64, st.st_dev & _U64, st.st_ctime_ns & _U64, st.st_size & _U64)
    value = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
    return value or 1  # 0 means "nothing verified"


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


class HotCopy:
    """A copy this process verified: its entry, its record, its data file's identity then.

    Not a ``CachedFile``: it is this process's memo of a data file's identity (moved as
    touches change the ctime), from which it hands out ``CachedFile`` objects.
    """

    __slots__ = ("ctime_ns", "dev", "entry", "file", "ino", "listed", "record", "size")

    def __init__(self, entry: Entry, record: FileInfo, st: os.stat_result) -> None:
        self.entry = entry
        self.record = record
        self.size = st.st_size
        self.ino, self.dev, self.ctime_ns = st.st_ino, st.st_dev, st.st_ctime_ns
        # The listing entry last matched (``describes`` is skipped for the same object)
        # and the unpinned CachedFile handed out for hits (immutable, so reused).
        self.listed: FileInfo | None = None
        self.file: CachedFile | None = None

    def same_file(self, st: os.stat_result) -> bool:
        return (
            st.st_ino == self.ino
            and st.st_ctime_ns == self.ctime_ns
            and st.st_size == self.size
            and st.st_dev == self.dev
        )

    def listed_as(self, listed: FileInfo | None) -> bool:
        """Whether the copy is the one ``listed`` (a listing entry, or None) describes."""
        if listed is self.listed:
            return True
        if not describes(self.record, listed):
            return False
        self.listed = listed
        return True

    def hit(self, pin: ByteLock | EntryLock | None) -> CachedFile:
        if pin is None and self.file is not None:
            return self.file  # unpinned hits hand out one immutable object per copy
        found = CachedFile(
            path=self.entry.data,
            url=self.entry.url,
            key=self.entry.key,
            size=self.size,
            hit=True,
            download_seconds=0.0,
            pin=pin,
        )
        if pin is None:
            self.file = found
        return found


class HotIndex:
    """One process's memo of verified copies, per volume object and path."""

    def __init__(self) -> None:
        # id(volume) -> (volume, relpath -> HotCopy); holding the volume keeps its id unique.
        self._by_volume: dict[int, tuple[Volume, dict[str, HotCopy]]] = {}

    def get(self, volume: Volume, relpath: str) -> HotCopy | None:
        entry = self._by_volume.get(id(volume))
        return entry[1].get(relpath) if entry is not None else None

    def serve(
        self,
        volume: Volume,
        relpath: str,
        copy: HotCopy,
        listed: FileInfo | None,
        *,
        pin: bool,
        shared: SharedHot | None,
        slot: int,
    ) -> CachedFile | None:
        """``copy`` if it is still the one verified and ``listed`` describes it, else None
        (and the memo forgets it)."""
        if not copy.listed_as(listed):
            return None
        lock = copy.entry.pin() if pin else None
        try:
            st: os.stat_result | None = os.stat(copy.entry.data)
        except OSError:
            st = None
        if st is None or not copy.same_file(st):
            # Replaced, evicted, repaired or touched: still good if a process sharing
            # the table verified exactly this copy (another worker's touch or refill).
            if (
                st is None
                or shared is None
                or listed is None
                or st.st_size != copy.size
                or shared.get(slot) != identity(st)
            ):
                if lock is not None:
                    lock.release()
                self._index(volume).pop(relpath, None)
                return None
            copy.ino, copy.dev, copy.ctime_ns = st.st_ino, st.st_dev, st.st_ctime_ns
        if time.time() - st.st_mtime > TOUCH_INTERVAL_S:
            self._touch(copy, shared, slot)
        if lock is None and copy.file is not None:
            return copy.file  # the common case, without a call
        return copy.hit(lock)

    @staticmethod
    def _touch(copy: HotCopy, shared: SharedHot | None, slot: int) -> None:
        data = copy.entry.data
        with contextlib.suppress(OSError):
            os.utime(data)  # the LRU clock of other processes
            st = os.stat(data)
            # utime moved the ctime; adopt it only if it is still the same file.
            if st.st_ino == copy.ino and st.st_dev == copy.dev and st.st_size == copy.size:
                copy.ctime_ns = st.st_ctime_ns
                if shared is not None:
                    shared.put(slot, st)

    def _index(self, volume: Volume) -> dict[str, HotCopy]:
        entry = self._by_volume.get(id(volume))
        if entry is None or entry[0] is not volume:
            entry = self._by_volume[id(volume)] = (volume, {})
        index = entry[1]
        if len(index) >= _HOT_MAX:
            index.clear()
        return index

    def adopt(
        self,
        volume: Volume,
        relpath: str,
        entry: Entry,
        listed: FileInfo,
        shared: SharedHot,
        slot: int,
    ) -> HotCopy | None:
        """The copy of ``entry`` that another process verified against ``listed`` (its
        identity is in ``shared``), if the data file is still that copy."""
        digest = shared.get(slot)
        if not digest:
            return None
        try:
            st = os.stat(entry.data)
        except OSError:
            return None
        if identity(st) != digest:
            return None
        copy = HotCopy(entry, listed, st)  # the record of a copy verified against listed
        copy.listed = listed
        self._index(volume)[relpath] = copy
        return copy

    def remember(
        self,
        volume: Volume,
        relpath: str,
        entry: Entry,
        record: FileInfo,
        st: os.stat_result,
        listed: FileInfo | None,
        shared: SharedHot | None,
        slot: int,
    ) -> None:
        """Memo a copy just verified under its lock (``st``: its data file then)."""
        self._index(volume)[relpath] = HotCopy(entry, record, st)
        if shared is not None and listed is not None:
            shared.put(slot, st)
