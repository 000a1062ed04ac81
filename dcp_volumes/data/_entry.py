"""One cache entry: its data file, its record, and the lock protocol that fills it.

An entry lives below ``objects/<k2>/`` (``<key>``: 128-bit hash of source + URL)::

    <key>-<name>   the cached file; its record (the source's size, etag, mtime) in
                   its ``user.dcpv`` xattr, set before the file is renamed into place
    <key>.fill     the download in progress; created at the fill's full size (sparse)
                   when the bytes are reserved, so a killed fill's count is its size
    <key>.meta     the record as a file, only where the filesystem has no user xattrs

One inode per cached file: the record rides on the data file (xattrs; a small
value lives inside the inode on ext4/xfs/tmpfs), and the entry's lock is a
byte of the cache's one lock file (``_locks.ByteLock``). Where user xattrs are
unsupported (probed once per directory and logged) the record is a ``.meta``
file: two inodes per file. Records carry a format version; a copy without a
valid record of this version (a cache written by an earlier layout: JSON
``.meta`` files, ``.lock`` files) is never served, and is removed by the next
fill of its entry or by ``FileCache.reconcile``.

The lock protocol of a read (``FileCache.fetch_cold``): take the lock shared and
check the copy (record present, file size as recorded, size/etag as listed); on
a miss, re-take it exclusive and, if still missing, fill it. Exactly one process
fills an entry however many ask at once (DataLoader workers, ranks, other jobs
on the node): the others block on the lock and then find the finished copy.

A reader never sees a partial file: a fill lands under the temporary name and
is renamed into place with its record already on it (the entry becomes valid
in that one step; with a ``.meta`` file, when that file is renamed in after
it). A killed filler's lock is released by the kernel; the next filler,
holding the lock, deletes the leftovers first, so they are never served. An
entry knows nothing of the byte count: the cache reserves and gives back its
bytes with the store (``_store.py``), which evicts and repairs entries.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import re
import struct
import time
import uuid
from dataclasses import dataclass

from dcp_volumes._exceptions import (
    DatasetChangedError,
    VolumeError,
    VolumeNotFoundError,
)
from dcp_volumes._volume import LAG_TOTAL_S, FileInfo, Volume, despite_lag, write_all
from dcp_volumes.data._locks import ByteLock, EntryLock, byte_locks_supported

logger = logging.getLogger(__name__)

# Names below objects/<k2>/: the key, then a suffix (.meta, .fill; .lock and .resv of
# earlier layouts) or "-" and the file's sanitised name.
NAME_RE = re.compile(r"^([0-9a-f]{32})(?:(\.meta|\.lock|\.resv|\.fill)|-(.+))$")
TEMP_MARKERS = (".part-", ".tmp-", ".fill")
# Files up to this size are fetched with one GET whose length checks the listing
# (bigger ones with parallel ranged GETs).
_SINGLE_GET_BYTES = 16 * 2**20
# Hits refresh the file's mtime (the LRU clock) at most this often.
TOUCH_INTERVAL_S = 60.0
# The record: a magic that carries the format version, size, mtime (NaN: none), then
# the etag's UTF-8. Small enough to stay inside the inode as an xattr.
RECORD_XATTR = "user.dcpv"
_RECORD = struct.Struct("<4sqd")
_RECORD_MAGIC = b"dcv2"


@functools.cache
def xattrs_supported(folder: str) -> bool:
    """Whether files in ``folder`` take ``user.*`` xattrs (probed once per process)."""
    setxattr = getattr(os, "setxattr", None)
    if setxattr is None:
        logger.info("no xattrs on this platform: cache records go to .meta files")
        return False
    probe = os.path.join(folder, f".xattr-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        setxattr(probe, RECORD_XATTR, b"1")
        return True
    except OSError as exc:
        logger.info(
            "the filesystem of %s takes no user xattrs (%s): each cached file keeps its "
            "record in a .meta file beside it (two inodes per file instead of one)",
            folder,
            exc.strerror or exc,
        )
        return False
    finally:
        remove(probe)


@dataclass(frozen=True)
class Layout:
    """Where a store keeps its entries: ``objects`` dir, lock file, where records go.

    ``locks``: the cache's one lock file (``ByteLock``), or None for a lock file per
    entry (``EntryLock``, where OFD locks are missing). ``xattrs``: records are
    written as xattrs (else as ``.meta`` files; both are read).
    """

    objects: str
    locks: str | None
    xattrs: bool

    @classmethod
    def probe(cls, cache_dir: str) -> Layout:
        objects = os.path.join(cache_dir, "objects")
        locks = os.path.join(cache_dir, "entries.lock") if byte_locks_supported() else None
        return cls(objects, locks, xattrs_supported(cache_dir))


def entry_base(objects: str, key: str) -> str:
    """``objects/<k2>/<key>``: the prefix of every file of an entry."""
    # Not os.path.join: this runs once per file a worker first sees in a warm epoch.
    return f"{objects}{os.sep}{key[:2]}{os.sep}{key}"


def write_file(path: str, data: bytes | memoryview, *, truncate: bool = True) -> None:
    """Create (or truncate) ``path`` holding ``data``: raw system calls, no buffered file.

    Cache fills run on several threads that share one GIL; each system call
    hands the GIL over, and ``open()``'s extra calls (fstat, ioctl, lseek) made
    a small fill's bookkeeping cost more than its download.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
    fd = os.open(path, flags, 0o644)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def remove(path: str) -> bool:
    """Delete a file; False if it was not there."""
    try:
        os.remove(path)
        return True
    except FileNotFoundError:
        return False


def file_size(path: str) -> int | None:
    """The size of ``path``, or None if it is not there."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def encode_record(info: FileInfo) -> bytes:
    """The record of a copy of ``info`` (its size, mtime and etag), as stored."""
    mtime = math.nan if info.mtime is None else float(info.mtime)
    return _RECORD.pack(_RECORD_MAGIC, info.size, mtime) + (info.etag or "").encode()


def decode_record(raw: bytes, path: str) -> FileInfo | None:
    """The record in ``raw`` as the ``FileInfo`` of the source file ``path`` it copies, or
    None for anything that is not a record of this version."""
    if len(raw) < _RECORD.size:
        return None
    magic, size, mtime = _RECORD.unpack_from(raw)
    if magic != _RECORD_MAGIC or size < 0:
        return None
    try:
        etag = raw[_RECORD.size :].decode()
    except UnicodeDecodeError:
        return None
    return FileInfo(path, size, etag or None, None if math.isnan(mtime) else mtime)


def describes(record: FileInfo, listed: FileInfo | None) -> bool:
    """Whether the copy ``record`` is the file ``listed`` says (None: any complete copy is)."""
    if listed is None:
        return True
    if listed.size != record.size:
        return False
    if listed.etag:
        return listed.etag == record.etag
    if listed.mtime is not None and record.mtime is not None:
        return abs(record.mtime - listed.mtime) < 1e-6
    return True


class CachedFile:
    """A file in the cache: ``path`` is local; a pinned one is not evicted until released.

    Use as a context manager (or call ``release()``) to drop the pin. It is
    path-like, so ``open(cached)`` works. Not a ``FileInfo``: what a caller holds (the
    local copy, maybe its pin, how it was served), not what the source file is.
    """

    __slots__ = ("_pin", "download_seconds", "hit", "key", "path", "size", "url")

    def __init__(
        self,
        *,
        path: str,
        url: str,
        key: str,
        size: int,
        hit: bool,
        download_seconds: float,
        pin: ByteLock | EntryLock | None,
    ) -> None:
        self.path = path
        self.url = url
        self.key = key
        self.size = size
        self.hit = hit
        self.download_seconds = download_seconds
        self._pin = pin

    @property
    def pinned(self) -> bool:
        return self._pin is not None and self._pin.held

    def release(self) -> None:
        """Drop the pin (idempotent)."""
        pin, self._pin = self._pin, None
        if pin is not None:
            pin.release()

    def __fspath__(self) -> str:
        return self.path

    def __enter__(self) -> CachedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"CachedFile({self.path!r}, hit={self.hit}, pinned={self.pinned})"


class Entry:
    """One entry of the cache: paths, record, read / verify / fill / pin, the lock upgrade.

    Built once per file a process first sees (a few string operations), so it
    holds paths only; everything it knows of the copy is read from disk. ``url``
    is the file's URL as it may appear in messages (redacted), ``path`` its path
    on its volume (the records' ``FileInfo.path``); both are "" for an entry a
    scan of the directory found.
    """

    __slots__ = ("data", "fill", "key", "layout", "meta", "path", "url")

    def __init__(
        self, layout: Layout, key: str, data: str, url: str = "", path: str = ""
    ) -> None:
        base = entry_base(layout.objects, key)
        self.layout = layout
        self.key = key
        self.url = url
        self.path = path
        self.data = data
        self.meta = f"{base}.meta"
        self.fill = f"{base}.fill"

    @classmethod
    def named(cls, layout: Layout, key: str, name: str, url: str, path: str) -> Entry:
        """The entry of ``url`` (key ``key``; ``path`` on its volume), its data file ending
        in ``-name``."""
        return cls(layout, key, f"{entry_base(layout.objects, key)}-{name}", url, path)

    @property
    def lock_file(self) -> str:
        """The file whose lock (or one byte of it) is this entry's."""
        if self.layout.locks is not None:
            return self.layout.locks
        return f"{self.fill[: -len('.fill')]}.lock"

    def new_lock(self) -> ByteLock | EntryLock:
        """A lock object for this entry (not acquired)."""
        if self.layout.locks is not None:
            return ByteLock(self.layout.locks, self.key)
        return EntryLock(self.lock_file)

    # -- reading --------------------------------------------------------------------------

    def record(self) -> FileInfo | None:
        """The record on the data file (xattr) or in its ``.meta`` file, if any."""
        raw: bytes | None = None
        try:
            raw = os.getxattr(self.data, RECORD_XATTR)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None  # no data file
        except AttributeError:  # a platform without xattrs
            pass
        if raw is None:
            try:
                with open(self.meta, "rb") as f:
                    raw = f.read(4096)
            except OSError:
                return None
        return decode_record(raw, self.path)

    def read(self) -> tuple[FileInfo, os.stat_result] | None:
        """The record of a complete copy (data file present with the recorded size) and the
        data file's ``stat``, else None."""
        record = self.record()
        if record is None:
            return None
        try:
            st = os.stat(self.data)
        except OSError:
            return None
        if st.st_size != record.size:
            return None
        return record, st

    def reserved(self) -> int:
        """Bytes a fill in progress (or a killed one) holds: its ``.fill`` file's size."""
        return file_size(self.fill) or 0

    def reserve(self, size: int) -> None:
        """Create the fill's temp file at its full size (sparse): the reservation is on disk
        for whoever cleans up after a killed fill."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(self.fill, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(self.fill), exist_ok=True)
            fd = os.open(self.fill, flags, 0o644)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def pin(self) -> ByteLock | EntryLock:
        """Take the entry's lock shared: no process evicts or refills it until released."""
        lock = self.new_lock()
        lock.acquire(exclusive=False)
        return lock

    def touch(self, st: os.stat_result) -> os.stat_result | None:
        """Move the LRU clock (the data file's mtime) of a hit, at most every
        ``TOUCH_INTERVAL_S``; the data file's ``stat`` after it."""
        if time.time() - st.st_mtime <= TOUCH_INTERVAL_S:
            return st
        # Evicted meanwhile: the LRU clock does not matter then.
        with contextlib.suppress(OSError):
            os.utime(self.data)
        return stat_or_none(self.data)

    # -- filling (under the exclusive lock) -----------------------------------------------

    def clear_leftovers(self) -> int:
        """Remove what a previous (maybe killed) filler or a broken copy left behind;
        returns the bytes the store counted for them."""
        freed = 0
        reserved = file_size(self.fill)
        if reserved is not None:
            # A filler died mid-download: its reservation (the .fill at full size) is
            # still counted, and a ranged download may have left <fill>.part-* files.
            folder, prefix = os.path.split(self.fill)
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(folder):
                    if name.startswith(prefix):
                        remove(os.path.join(folder, name))
            freed += reserved
        # A killed fill's data file (renamed in before its record was published) is
        # counted by its size, as is a copy that no longer matches the listing.
        size = file_size(self.data)
        if size is not None:
            remove(self.data)
            freed += size
        remove(self.meta)
        return freed

    def fill_from(
        self, volume: Volume, relpath: str, info: FileInfo, *, listed: bool
    ) -> float:
        """Download ``info`` (``listed``: as the dataset's listing says it) into the
        reserved ``.fill`` and publish it with its record; returns the download's seconds.

        Nothing of a failed fill stays (no torn copy; the data file may be renamed in
        already); the caller gives its reservation back.
        """
        started = time.perf_counter()
        tmp = f"{self.meta}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self._download(volume, relpath, info.size, listed=listed)
            seconds = time.perf_counter() - started
            self._publish(info, tmp)
        except BaseException:
            remove(self.fill)
            remove(self.data)
            remove(tmp)
            raise
        return seconds

    def _publish(self, record: FileInfo, tmp: str) -> None:
        """Rename the complete download into place with its record: the entry becomes valid
        in one step (the rename; with a .meta file, that file's rename after it)."""
        if self.layout.xattrs:
            os.setxattr(self.fill, RECORD_XATTR, encode_record(record))
            os.replace(self.fill, self.data)
            return
        os.replace(self.fill, self.data)
        write_file(tmp, encode_record(record))
        os.replace(tmp, self.meta)

    def _download(self, volume: Volume, relpath: str, size: int, *, listed: bool) -> None:
        # A listed file that is not found may be a store that lags its writes: ask
        # again for a moment before saying it is gone.
        try:
            despite_lag(
                lambda: self._download_once(volume, relpath, size, listed=listed),
                what=self.url,
                expected=listed,
            )
        except VolumeNotFoundError as exc:
            if not listed:
                raise
            raise VolumeNotFoundError(
                f"{self.url} was listed when the dataset was built but is not "
                f"found now (also when asked again for {LAG_TOTAL_S:.0f} s): it was deleted "
                "or moved after the listing. Fix: restore the file, or re-create the dataset "
                "(it re-lists the files)."
            ) from exc

    def _download_once(self, volume: Volume, relpath: str, size: int, *, listed: bool) -> None:
        if size > _SINGLE_GET_BYTES:
            volume.get_file(relpath, self.fill, size=size)  # parallel ranged GETs
        else:
            # One GET whose length checks the listing: a file that grew or shrank
            # since then shows up here.
            data = memoryview(volume.read_whole(relpath, size))
            length = len(data)
            if length != size:
                what = "was listed" if listed else "was reported a moment ago"
                cls = DatasetChangedError if listed else VolumeError
                raise cls(
                    f"{self.url} has {length} bytes but {what} with {size}: the "
                    "file changed on the volume. Fix: re-create the dataset (it re-lists the "
                    "files) or retry."
                )
            # Into the reservation: the .fill keeps its full size all along.
            write_file(self.fill, data, truncate=False)

    # -- eviction and repair (the store's, under a non-blocking exclusive lock) -----------

    def evict(self) -> int | None:
        """Delete the entry unless it is pinned or being filled; returns the bytes freed."""
        lock = self.new_lock()
        if not lock.acquire(exclusive=True, blocking=False):
            return None  # pinned (shared lock) or being filled
        try:
            if os.path.exists(self.fill):
                return None  # a killed filler's reservation: the next fill cleans it up
            size = file_size(self.data) or 0
            remove(self.meta)  # first: a .meta entry stops being valid
            remove(self.data)  # (an xattr entry, here)
            lock.release_and_delete()
        finally:
            lock.release()
        return size

    def repair(self, temps: list[str]) -> tuple[int, int | None, bool] | None:
        """Bring the entry at rest back in line (``FileCache.reconcile``): remove ``temps``
        (temp files of killed fills found beside it, a killed fill's reservation, lock
        files of an earlier layout), then keep a complete copy or remove what is left of it.

        Returns None when a live process holds the lock (filling or pinned: left
        alone), else (temp files removed, bytes of the complete copy kept or None,
        whether a broken copy was removed).
        """
        lock = self.new_lock()
        if not lock.acquire(exclusive=True, blocking=False):
            return None
        try:
            removed = sum(remove(path) for path in temps)
            found = self.read() if self.data else None
            if found is not None:
                return removed, found[0].size, False
            broken = bool(self.data and os.path.exists(self.data)) or os.path.exists(self.meta)
            remove(self.meta)
            if self.data:
                remove(self.data)
            lock.release_and_delete()  # nothing left of this entry
            return removed, None, broken
        finally:
            lock.release()

    def held_bytes(self) -> int:
        """Bytes the entry holds on disk now: its data file and a fill's reservation."""
        held = (file_size(self.data) or 0) if self.data else 0
        return held + self.reserved()


def stat_or_none(path: str) -> os.stat_result | None:
    """``os.stat(path)``, or None where it fails (gone, evicted meanwhile)."""
    try:
        return os.stat(path)
    except OSError:
        return None
