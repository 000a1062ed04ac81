"""FileCache: a node-local cache of remote files (read-through, atomic, bounded, shared).

The cache is this one object: it owns its entries, its byte count and its memo,
and a read passes them once, in one direction. ``fetch_hot`` asks the memo of
copies this process (or a sibling worker) verified (``_hot.py``: one ``stat``);
``fetch_cold`` takes the entry's lock (``_entry.py``, ``_locks.py``), checks the
copy and, on a miss, fills it: bytes reserved with the store (``_store.py``:
the byte count and eviction), downloaded and published by the entry, counted
by the store; the copy served then goes into the memo. Neither the entry nor
the store calls back into this object; the store calls entries (to reserve,
evict and repair them), never the other way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Mapping
from typing import Any

from dcp_volumes._exceptions import CacheError
from dcp_volumes._sizes import format_size, parse_size
from dcp_volumes._staging_disk import disk_full_error, probe_writable
from dcp_volumes._volume import (
    FileInfo,
    Volume,
    file_location,
    redact_url,
    refuse_url_credentials,
    split_url,
)
from dcp_volumes.data._cache_options import (
    DEFAULT_CACHE_LIMIT,
    CacheOptions,
    default_cache_dir,
    resolve_cache_dir,
)
from dcp_volumes.data._entry import CachedFile, Entry, describes, stat_or_none
from dcp_volumes.data._hot import HotIndex, SharedHot
from dcp_volumes.data._metrics import Counters
from dcp_volumes.data._store import CacheSchedule, ReconcileReport, Store

logger = logging.getLogger(__name__)

_KEY_CHARS = 32

__all__ = [
    "DEFAULT_CACHE_LIMIT",
    "CacheOptions",
    "CacheSchedule",
    "CachedFile",
    "Counters",
    "FileCache",
    "ReconcileReport",
    "default_cache_dir",
    "resolve_cache_dir",
]


_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def _sanitize(name: str) -> str:
    safe = _UNSAFE_CHARS.sub("_", name)[-80:].lstrip(".")
    return safe or "data"


def _key(volume: Volume, url: str) -> str:
    digest = hashlib.sha256(f"{volume.identity}\n{url}".encode()).hexdigest()
    return digest[:_KEY_CHARS]


class FileCache:
    """A local (NVMe) cache of remote files, shared safely by all processes on a node.

    Args:
        cache_dir: the cache directory; default ``DCP_VOLUMES_CACHE`` or
            ``~/.cache/dcp_volumes``. Several processes and jobs may share it.
        limit: maximum bytes of cached files (``"100GB"``, an int, or ``None``
            for no limit beyond the disk's free space).
        headroom: free space always left on the disk holding the cache.
        reconcile: check the directory at start-up: remove leftovers of killed
            processes and broken entries, recount the bytes.

    Example::

        cache = FileCache("/nvme/cache", limit="100GB")
        path = cache.fetch("s3://bucket/train/x.jpg", storage_options=opts)
        with cache.pin("s3://bucket/train/y.jpg", storage_options=opts) as f:
            data = open(f, "rb").read()      # cannot be evicted while pinned

    ``fetch`` returns a path that stays valid until the file is evicted (an
    evicted file that is already open stays readable: POSIX unlink). Hold a
    ``pin`` to keep a file while reading it under cache pressure.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        limit: int | str | None = DEFAULT_CACHE_LIMIT,
        headroom: int | str = "256MiB",
        reconcile: bool = True,
    ) -> None:
        self.options = CacheOptions(
            cache_dir=resolve_cache_dir(cache_dir),
            limit=parse_size(limit, what="limit"),
            headroom=parse_size(headroom, what="headroom") or 0,
            reconcile=bool(reconcile),
            limit_chosen=limit is not DEFAULT_CACHE_LIMIT,
        )
        self._check_dir()
        self._init_process_state()
        if self.options.reconcile:
            self.reconcile()

    def _init_process_state(self) -> None:
        self._store = Store(self.cache_dir, limit=self.limit, headroom=self.headroom)
        self._volumes: dict[tuple[str, str], Volume] = {}
        self._volumes_mu = threading.Lock()
        self._hot = HotIndex()

    def __getstate__(self) -> dict[str, Any]:
        # Locks, clients and the in-memory view are per process.
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._init_process_state()

    @property
    def cache_dir(self) -> str:
        """The cache directory (absolute)."""
        return self.options.cache_dir

    @property
    def limit(self) -> int | None:
        """Most bytes of cached files (None: the disk's free space)."""
        return self.options.limit

    @property
    def headroom(self) -> int:
        """Free space always left on the disk holding the cache."""
        return self.options.headroom

    def __repr__(self) -> str:
        return f"FileCache({self.cache_dir!r}, limit={self.limit})"

    @property
    def counters(self) -> Counters:
        """Hits, misses, bytes fetched and evictions of this object in this process."""
        return self._store.counters

    def _check_dir(self) -> None:
        """Make the directory; say so if the limit is more than the disk holds."""
        try:
            os.makedirs(os.path.join(self.cache_dir, "objects"), exist_ok=True)
            probe_writable(self.cache_dir)
        except OSError as exc:
            raise CacheError(
                f"The cache directory {self.cache_dir} cannot be used ({exc.strerror or exc}). "
                "Fix: make it writable by this process, or pass another cache_dir= (ideally on "
                "local NVMe) or set DCP_VOLUMES_CACHE."
            ) from exc
        if self.limit is not None:
            total = shutil.disk_usage(self.cache_dir).total
            if self.limit > total:
                logger.log(
                    logging.WARNING if self.options.limit_chosen else logging.INFO,
                    "cache limit %.1f GiB exceeds the size of the disk holding %s (%.1f GiB); the "
                    "disk's free space will be the real limit",
                    self.limit / 2**30,
                    self.cache_dir,
                    total / 2**30,
                )

    # -- naming ---------------------------------------------------------------------------

    def _volume_for(
        self, url: str, storage_options: Mapping[str, Any] | None
    ) -> tuple[Volume, str]:
        refuse_url_credentials(split_url(url)[0], url)  # the file's key would carry them
        top, rel = file_location(url)
        # None stays None: the Volume then takes DCP_VOLUMES_STORAGE_OPTIONS.
        opts = None if storage_options is None else dict(storage_options)
        vkey = (top, json.dumps(opts, sort_keys=True, default=repr))
        with self._volumes_mu:
            volume = self._volumes.get(vkey)
            if volume is None:
                volume = self._volumes[vkey] = Volume(top, storage_options=opts)
        return volume, rel

    def key_of(self, volume: Volume, relpath: str) -> str:
        """The entry key of ``relpath`` on ``volume``: a hash of source identity and URL."""
        return _key(volume, volume.url_of(relpath))

    def _entry(self, volume: Volume, relpath: str) -> Entry:
        url = volume.url_of(relpath)
        name = _sanitize(relpath.rstrip("/").rsplit("/", 1)[-1])
        return Entry.named(self._store.layout, _key(volume, url), name, redact_url(url), relpath)

    # -- public API -----------------------------------------------------------------------

    def fetch(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        size: int | None = None,
        etag: str | None = None,
    ) -> str:
        """The local path of ``url``: downloaded on first use, then served locally.

        ``size``/``etag`` (from a listing) are checked against the cached copy
        and a mismatch refetches; without them a complete copy is trusted.
        """
        volume, rel = self._volume_for(url, storage_options)
        return self.fetch_from(volume, rel, expected=self._listed(volume, rel, size, etag)).path

    def pin(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        size: int | None = None,
        etag: str | None = None,
    ) -> CachedFile:
        """Like ``fetch``, but the returned ``CachedFile`` is pinned until released."""
        volume, rel = self._volume_for(url, storage_options)
        listed = self._listed(volume, rel, size, etag)
        return self.fetch_from(volume, rel, expected=listed, pin=True)

    def _listed(
        self, volume: Volume, rel: str, size: int | None, etag: str | None
    ) -> FileInfo | None:
        """What the caller says of the file, as a listing entry (None: nothing)."""
        if size is not None:
            return FileInfo(rel, size, etag)
        if not etag:
            return None
        # An etag alone: a copy with that etag is the file; else the store says what is.
        found = self._entry(volume, rel).read()
        if found is not None and found[0].etag == etag:
            return FileInfo(rel, found[0].size, etag)
        return volume.info(rel)

    def contains(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> bool:
        """Whether a complete copy of ``url`` is in the cache now."""
        volume, rel = self._volume_for(url, storage_options)
        return self._entry(volume, rel).read() is not None

    def path_of(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> str:
        """Where the copy of ``url`` lives (or would live) in the cache."""
        volume, rel = self._volume_for(url, storage_options)
        return self._entry(volume, rel).data

    def evict(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> bool:
        """Remove the cached copy of ``url`` unless it is in use; True if removed."""
        volume, rel = self._volume_for(url, storage_options)
        entry = self._entry(volume, rel)
        return self._store.evict_key(entry.key, entry.data)

    def clear(self) -> int:
        """Remove every entry that is not in use; returns the bytes freed."""
        return self._store.clear()

    def usage(self) -> int:
        """Bytes held (files plus fills in progress) as all processes see it."""
        return self._store.usage()

    def reconcile(self) -> ReconcileReport:
        """Bring the directory and the byte count back in line (run at start-up).

        Removes temp files of killed fills, entries whose record or file is
        missing or inconsistent (a file without its record cannot be trusted
        and is removed, as are entries of an earlier layout), and lock files of
        gone entries. Entries in use by live processes are left alone; files
        the cache did not create are never touched.
        """
        return self._store.reconcile()

    def set_schedule(self, schedule: CacheSchedule | None) -> None:
        """Tell this process's cache the future access order (Belady eviction); None: LRU."""
        self._store.schedule = schedule

    # -- the read path --------------------------------------------------------------------

    def fetch_hot(
        self,
        volume: Volume,
        relpath: str,
        *,
        expected: FileInfo | None = None,
        pin: bool = False,
        shared: SharedHot | None = None,
        slot: int = -1,
    ) -> CachedFile | None:
        """The fast path of ``fetch_from``: a copy already verified, or None.

        Costs one ``stat`` (plus the pin's shared lock): no record read, no
        hashing, no thread. None means "take the full path" (never seen here,
        listed differently now, or the file was replaced, evicted or repaired).
        With ``shared`` (a dataset's ``SharedHot``) and ``slot`` (the file's
        index in it), a copy that another process verified against the same
        listing entry counts too.
        """
        copy = self._hot.get(volume, relpath)
        if copy is None:
            if shared is None or expected is None or not shared.get(slot):
                return None
            entry = self._entry(volume, relpath)
            copy = self._hot.adopt(volume, relpath, entry, expected, shared, slot)
            if copy is None:
                return None
        found = self._hot.serve(
            volume, relpath, copy, expected, pin=pin, shared=shared, slot=slot
        )
        if found is not None:
            self._store.count_hit(found.key)
        return found

    def fetch_from(
        self,
        volume: Volume,
        relpath: str,
        *,
        expected: FileInfo | None = None,
        pin: bool = False,
        shared: SharedHot | None = None,
        slot: int = -1,
    ) -> CachedFile:
        """Serve ``relpath`` of ``volume`` from the cache, filling it first if needed.

        With ``pin`` the returned file holds a shared lock that keeps it from
        being evicted (by any process) until ``release()``. ``expected`` is the
        listing's ``FileInfo`` of the file (checked against the copy; None: any
        complete copy). ``shared``/``slot``: see ``fetch_hot``. The memo first
        (``fetch_hot``), then the entry under its lock (``fetch_cold``).
        """
        found = self.fetch_hot(
            volume, relpath, expected=expected, pin=pin, shared=shared, slot=slot
        )
        if found is not None:
            return found
        return self.fetch_cold(
            volume, relpath, expected=expected, pin=pin, shared=shared, slot=slot
        )

    def fetch_cold(
        self,
        volume: Volume,
        relpath: str,
        *,
        expected: FileInfo | None = None,
        pin: bool = False,
        shared: SharedHot | None = None,
        slot: int = -1,
    ) -> CachedFile:
        """``fetch_from`` without the memo, for a caller whose ``fetch_hot`` said None.

        The entry's lock protocol (``_entry.py``): shared, and the copy checked; on a
        miss exclusive, and the entry filled. The copy served goes into the memo.
        """
        entry = self._entry(volume, relpath)
        lock = entry.new_lock()
        mine: FileInfo | None = None  # the record this call published, if it filled
        seconds = 0.0
        st: os.stat_result | None
        while True:
            lock.acquire(exclusive=False)
            found = entry.read()
            if found is not None and (found[0] == mine or describes(found[0], expected)):
                record, st = found
                if mine is None:
                    st = entry.touch(st)
                if not pin:
                    lock.release()
                break
            # Upgrade by release + exclusive acquire: the first to get it fills, the
            # others then find a valid entry.
            lock.release()
            lock.acquire(exclusive=True)
            pinned = False
            try:
                found = entry.read()
                if found is None or not describes(found[0], expected):
                    mine, seconds = self._fill(entry, volume, relpath, expected)
                    # Served as published: under the exclusive lock, or pinned by the
                    # shared lock it turned into in one step.
                    pinned = pin and lock.downgrade()
                    if pinned or not pin:
                        record, st = mine, stat_or_none(entry.data)
                        break
            finally:
                if not pinned:
                    lock.release()
            # Re-take it shared and re-check: an evictor may have slipped in.
        if mine is None:
            self._store.count_hit(entry.key)
        if st is not None:
            self._hot.remember(volume, relpath, entry, record, st, expected, shared, slot)
        return CachedFile(
            path=entry.data,
            url=entry.url,
            key=entry.key,
            size=record.size,
            hit=mine is None,
            download_seconds=seconds,
            pin=lock if pin else None,
        )

    def _fill(
        self, entry: Entry, volume: Volume, relpath: str, listed: FileInfo | None
    ) -> tuple[FileInfo, float]:
        """Fill ``entry`` (the caller holds its exclusive lock): its bytes reserved with the
        store first, given back if the fill fails. Returns its record and download time."""
        store = self._store
        store.give_back(entry.clear_leftovers())
        info = listed if listed is not None else volume.info(relpath)
        record = FileInfo(entry.path, info.size, info.etag, info.mtime)
        size = record.size
        if store.limit is not None and size > store.limit:
            raise CacheError(
                f"{entry.url} is {format_size(size)}, larger than the cache limit "
                f"of {format_size(store.limit)}. Fix: raise the cache limit (cache_limit= / "
                "limit=) or cache on a bigger disk."
            )
        try:
            store.reserve(entry, size)
        except OSError as exc:
            self._raise_if_disk_full(exc, entry, size)
            raise
        try:
            seconds = entry.fill_from(volume, relpath, record, listed=listed is not None)
        except BaseException as exc:
            store.give_back(size)
            self._raise_if_disk_full(exc, entry, size)
            raise
        store.count_fill(entry, size, seconds)
        return record, seconds

    def _raise_if_disk_full(self, exc: BaseException, entry: Entry, size: int) -> None:
        """Raise ``exc`` as a ``DiskFullError`` if the cache's disk ran out of space."""
        full = disk_full_error(
            exc,
            self.cache_dir,
            doing=f"caching {entry.url}",
            needed=size,
            fix="The partial copy was removed and is never served. Fix: free space there, "
            "lower the cache limit (cache_limit= / limit=), or move the cache (cache_dir= / "
            "DCP_VOLUMES_CACHE) to a larger local disk; the next read fills it again.",
        )
        if full is not None:
            raise full from exc
