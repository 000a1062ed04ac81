"""One cache entry: its files on disk, its sidecar record, and the lock protocol that fills it.

An entry lives below ``objects/<k2>/`` as (``<key>``: 128-bit hash of source + URL)::

    <key>-<name>   the cached file
    <key>.meta     its sidecar (``Sidecar``): URL, size, etag/mtime; published last
    <key>.lock     its lock: exclusive to fill/evict, shared to pin (``_locks.py``);
                   while a fill runs it holds the bytes reserved for it (else empty)
    <key>.fill     the download in progress (renamed into place when done)

Read path (``Entry.serve``): take the lock shared and check the copy (sidecar
present, file size as recorded, size/etag as listed); on a miss, re-take it
exclusive and, if still missing, fill it. Exactly one process fills an entry
however many ask at once (DataLoader workers, ranks, other jobs on the node):
the others block on the lock and then find the finished copy.

A reader never sees a partial file: a fill lands under a temporary name and
is renamed into place, then its sidecar is published the same way (the entry
becomes valid in that one step). A killed filler's ``flock`` is released by
the kernel; the next filler, holding the lock, deletes the leftovers first, so
they are never served. The byte count and eviction are the store's
(``_store.py``); the entry only asks it to reserve and give back bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcp_volumes._exceptions import (
    CacheError,
    DatasetChangedError,
    VolumeError,
    VolumeNotFoundError,
)
from dcp_volumes._sizes import format_size
from dcp_volumes._staging import disk_full_error
from dcp_volumes._volume import LAG_TOTAL_S, FileInfo, Volume, despite_lag, write_all
from dcp_volumes.data._locks import EntryLock

if TYPE_CHECKING:
    from dcp_volumes.data._store import Store

# Names below objects/<k2>/: the key, then a suffix (.meta, .lock, .fill; .resv of
# earlier versions) or "-" and the file's sanitised name.
NAME_RE = re.compile(r"^([0-9a-f]{32})(?:(\.meta|\.lock|\.resv|\.fill)|-(.+))$")
TEMP_MARKERS = (".part-", ".tmp-", ".fill")
# Files up to this size are fetched with one GET whose length checks the listing
# (bigger ones with parallel ranged GETs).
_SINGLE_GET_BYTES = 16 * 2**20
# Hits refresh the file's mtime (the LRU clock) at most this often.
TOUCH_INTERVAL_S = 60.0
_SIDECAR_VERSION = 1


def entry_base(objects: str, key: str) -> str:
    """``objects/<k2>/<key>``: the prefix of every file of an entry."""
    # Not os.path.join: this runs once per file a worker first sees in a warm epoch.
    return f"{objects}{os.sep}{key[:2]}{os.sep}{key}"


def write_file(path: str, data: bytes | memoryview) -> None:
    """Create (or truncate) ``path`` holding ``data``: raw system calls, no buffered file.

    Cache fills run on several threads that share one GIL; each system call
    hands the GIL over, and ``open()``'s extra calls (fstat, ioctl, lseek) made
    a small fill's bookkeeping cost more than its download.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
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


@dataclass(frozen=True)
class Sidecar:
    """What the cache knows of a complete copy (the ``.meta`` file, JSON on disk).

    ``size``/``etag``/``mtime`` are the source file's as listed or asked when
    it was fetched; ``fetched`` is when (seconds since the epoch).
    """

    url: str
    size: int
    etag: str | None = None
    mtime: float | None = None
    fetched: float = 0.0

    @classmethod
    def of(cls, info: FileInfo, url: str) -> Sidecar:
        """The record of a copy of ``info`` fetched now."""
        return cls(url=url, size=info.size, etag=info.etag, mtime=info.mtime, fetched=time.time())

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "v": _SIDECAR_VERSION,
                "url": self.url,
                "size": self.size,
                "etag": self.etag,
                "mtime": self.mtime,
                "fetched": self.fetched,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Sidecar | None:
        """The record in ``raw``, or None for anything that is not one."""
        try:
            doc = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(doc, dict):
            return None
        size, etag, mtime = doc.get("size"), doc.get("etag"), doc.get("mtime")
        if isinstance(size, bool) or not isinstance(size, int):
            return None
        return cls(
            url=str(doc.get("url", "")),
            size=size,
            etag=etag if isinstance(etag, str) else None,
            mtime=float(mtime) if isinstance(mtime, (int, float)) else None,
            fetched=float(doc.get("fetched") or 0.0),
        )

    def describes(self, listed: FileInfo | None) -> bool:
        """Whether this copy is the file ``listed`` says (None: any complete copy is)."""
        if listed is None:
            return True
        if listed.size != self.size:
            return False
        if listed.etag:
            return listed.etag == self.etag
        if listed.mtime is not None and self.mtime is not None:
            return abs(self.mtime - listed.mtime) < 1e-6
        return True


class CachedFile:
    """A file in the cache: ``path`` is local; a pinned one is not evicted until released.

    Use as a context manager (or call ``release()``) to drop the pin. It is
    path-like, so ``open(cached)`` works.
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
        pin: EntryLock | None,
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


@dataclass(frozen=True)
class Served:
    """What ``Entry.serve`` did: the file, its record, and its data file's ``stat`` then."""

    file: CachedFile
    sidecar: Sidecar
    stat: os.stat_result | None
    filled: bool


class Entry:
    """One entry of the cache: paths, sidecar, read / verify / fill / pin, the lock upgrade.

    Built once per file a process first sees (a few string operations), so it
    holds paths only; everything it knows of the copy is read from disk. ``url``
    is the file's URL as it may appear in messages (redacted).
    """

    __slots__ = ("data", "fill", "key", "lock", "meta", "url")

    def __init__(self, base: str, key: str, data: str, url: str = "") -> None:
        self.key = key
        self.url = url
        self.data = data
        self.meta = f"{base}.meta"
        self.lock = f"{base}.lock"
        self.fill = f"{base}.fill"

    @classmethod
    def named(cls, objects: str, key: str, name: str, url: str) -> Entry:
        """The entry of ``url`` (key ``key``), its data file ending in ``-name``."""
        base = entry_base(objects, key)
        return cls(base, key, f"{base}-{name}", url)

    # -- reading --------------------------------------------------------------------------

    def read(self) -> tuple[Sidecar, os.stat_result] | None:
        """The sidecar of a complete copy (data file present with the recorded size) and the
        data file's ``stat``, else None."""
        try:
            with open(self.meta, "rb") as f:
                raw = f.read()
            st = os.stat(self.data)
        except OSError:
            return None
        sidecar = Sidecar.from_json(raw)
        if sidecar is None or st.st_size != sidecar.size:
            return None
        return sidecar, st

    def reserved(self) -> int:
        """Bytes a fill reserved, as written into the lock file (0: none)."""
        try:
            if not os.stat(self.lock).st_size:
                return 0  # the usual case: one system call
            with open(self.lock, "rb") as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0

    def reserve(self, size: int) -> None:
        """Record a fill's reservation in the lock file the filler holds (no new inode:
        creating and deleting one per fill is what ext4's allocator is slowest at)."""
        write_file(self.lock, str(size).encode())

    def clear_reservation(self) -> None:
        """The fill's bytes are on disk now (or given back): the lock file empties in place."""
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self.lock, 0)

    # -- the read path --------------------------------------------------------------------

    def pin(self) -> EntryLock:
        """Take the entry's lock shared: no process evicts or refills it until released."""
        lock = EntryLock(self.lock)
        lock.acquire(exclusive=False)
        return lock

    def serve(
        self, volume: Volume, relpath: str, listed: FileInfo | None, *, pin: bool, store: Store
    ) -> Served:
        """The copy of ``relpath`` that ``listed`` describes, filled first if needed.

        With ``pin`` the returned file holds the shared lock until released.
        """
        lock = EntryLock(self.lock)
        mine: Sidecar | None = None  # the sidecar this call published, if it filled
        seconds = 0.0
        while True:
            lock.acquire(exclusive=False)
            found = self.read()
            if found is None or (found[0] != mine and not found[0].describes(listed)):
                # Upgrade by release + exclusive acquire: the first to get it fills,
                # the others then find a valid entry.
                lock.release()
                lock.acquire(exclusive=True)
                try:
                    found = self.read()
                    if found is None or not found[0].describes(listed):
                        mine, seconds = self._fill(volume, relpath, listed, store)
                        if not pin:  # served as published, still under the exclusive lock
                            st = _stat(self.data)
                            return Served(self._file(mine, mine, seconds, None), mine, st, True)
                finally:
                    lock.release()
                continue  # re-take it shared and re-check: an evictor may have slipped in
            sidecar, st = found
            if mine is None:
                st = self._touch(st)
            served = Served(
                self._file(sidecar, mine, seconds, lock if pin else None),
                sidecar,
                st,
                mine is not None,
            )
            if not pin:
                lock.release()
            return served

    def _file(
        self, sidecar: Sidecar, mine: Sidecar | None, seconds: float, pin: EntryLock | None
    ) -> CachedFile:
        return CachedFile(
            path=self.data,
            url=self.url,
            key=self.key,
            size=sidecar.size,
            hit=mine is None,
            download_seconds=seconds,
            pin=pin,
        )

    def _touch(self, st: os.stat_result) -> os.stat_result | None:
        """Move the LRU clock (the data file's mtime) of a hit, at most every
        ``TOUCH_INTERVAL_S``; the data file's ``stat`` after it."""
        if time.time() - st.st_mtime <= TOUCH_INTERVAL_S:
            return st
        # Evicted meanwhile: the LRU clock does not matter then.
        with contextlib.suppress(OSError):
            os.utime(self.data)
        return _stat(self.data)

    # -- filling (under the exclusive lock) -----------------------------------------------

    def clear_leftovers(self) -> int:
        """Remove what a previous (maybe killed) filler or a broken copy left behind;
        returns the bytes the store counted for them."""
        reserved = self.reserved()
        if reserved:
            # A filler died mid-download: its reservation is still counted, and a
            # ranged download may have left <fill>.part-* files.
            self.clear_reservation()
            folder, prefix = os.path.split(self.fill)
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(folder):
                    if name.startswith(prefix):
                        remove(os.path.join(folder, name))
        remove(self.fill)
        size = 0
        try:
            size = os.stat(self.data).st_size
            remove(self.data)
        except FileNotFoundError:
            pass
        remove(self.meta)
        # A killed fill's data file (renamed in before its death) is counted by its
        # reservation only.
        return reserved or size

    def _fill(
        self, volume: Volume, relpath: str, listed: FileInfo | None, store: Store
    ) -> tuple[Sidecar, float]:
        """Download into the entry; the caller holds its exclusive lock."""
        store.give_back(self.clear_leftovers())
        info = listed if listed is not None else volume.info(relpath)
        size = info.size
        if store.limit is not None and size > store.limit:
            raise CacheError(
                f"{self.url} is {format_size(size)}, larger than the cache limit "
                f"of {format_size(store.limit)}. Fix: raise the cache limit (cache_limit= / "
                "limit=) or cache on a bigger disk."
            )
        try:
            store.reserve(self, size)
        except OSError as exc:
            self._raise_if_disk_full(exc, store, size)
            raise
        started = time.perf_counter()
        tmp = f"{self.meta}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self._download(volume, relpath, size, listed=listed is not None)
            seconds = time.perf_counter() - started
            sidecar = Sidecar.of(info, self.url)
            write_file(tmp, sidecar.to_json())
        except BaseException as exc:
            # Nothing of a failed fill stays: no torn copy, and its space and
            # reservation are given back (the data file may be renamed in already).
            remove(self.fill)
            remove(self.data)
            remove(tmp)
            self.clear_reservation()
            store.give_back(size)
            self._raise_if_disk_full(exc, store, size)
            raise
        try:
            self.clear_reservation()  # the reservation is now the file itself
            os.replace(tmp, self.meta)  # the entry becomes valid here, in one step
        except BaseException:
            remove(tmp)
            raise
        store.count_fill(self, size, seconds)
        return sidecar, seconds

    def _raise_if_disk_full(self, exc: BaseException, store: Store, size: int) -> None:
        """Raise ``exc`` as a ``DiskFullError`` if the cache's disk ran out of space."""
        full = disk_full_error(
            exc,
            store.cache_dir,
            doing=f"caching {self.url}",
            needed=size,
            fix="The partial copy was removed and is never served. Fix: free space there, "
            "lower the cache limit (cache_limit= / limit=), or move the cache (cache_dir= / "
            "DCP_VOLUMES_CACHE) to a larger local disk; the next read fills it again.",
        )
        if full is not None:
            raise full from exc

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
            write_file(self.fill, data)
        os.replace(self.fill, self.data)

    # -- eviction and repair (the store's, under a non-blocking exclusive lock) -----------

    def evict(self) -> int | None:
        """Delete the entry unless it is pinned or being filled; returns the bytes freed."""
        lock = EntryLock(self.lock)
        if not lock.acquire(exclusive=True, blocking=False):
            return None  # pinned (shared lock) or being filled
        try:
            if lock.fd is not None and os.fstat(lock.fd).st_size:
                return None  # a killed filler's reservation: the next fill cleans it up
            try:
                size = os.stat(self.data).st_size
            except FileNotFoundError:
                size = 0
            remove(self.meta)  # first: the entry stops being valid
            remove(self.data)
            lock.release_and_delete()
        finally:
            lock.release()
        return size

    def repair(self, temps: list[str]) -> tuple[int, int | None, bool] | None:
        """Bring the entry at rest back in line (``FileCache.reconcile``): remove ``temps``
        (temp files of killed fills found beside it) and a killed fill's reservation,
        then keep a complete copy or remove what is left of it.

        Returns None when a live process holds the lock (filling or pinned: left
        alone), else (temp files removed, bytes of the complete copy kept or None,
        whether a broken copy was removed).
        """
        lock = EntryLock(self.lock)
        if not lock.acquire(exclusive=True, blocking=False):
            return None
        try:
            removed = sum(remove(path) for path in temps)
            if self.reserved():
                removed += 1  # a killed fill's reservation
                self.clear_reservation()
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
        """Bytes the entry holds on disk now: its data file, or a fill's reservation."""
        try:
            return os.stat(self.data).st_size if self.data else self.reserved()
        except FileNotFoundError:
            return 0


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None
