"""FileCache: a node-local cache of remote files (read-through, atomic, bounded, shared).

Read path: take the entry's lock shared and check the copy (sidecar present,
file size as recorded, size/etag as listed); on a miss, re-take it exclusive
and, if still missing, fill it. Exactly one process fills an entry however
many ask at once (DataLoader workers, ranks, other jobs on the node): the
others block on the lock and then find the finished copy.

A reader never sees a partial file: a fill lands under a temporary name and
is renamed into place, then its sidecar is published the same way (the entry
becomes valid in that one step). A killed filler's ``flock`` is released by
the kernel; the next filler, holding the lock, deletes the leftovers first, so
they are never served. See ``_store.py`` for the layout, the byte accounting
and eviction, ``_locks.py`` for the lock protocol, ``_hot.py`` for the hit
path (copies already verified, served after one ``stat``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fsspec.core import split_protocol

from dcp_volumes import _env
from dcp_volumes._exceptions import (
    CacheError,
    ConfigurationError,
    DatasetChangedError,
    VolumeError,
    VolumeNotFoundError,
)
from dcp_volumes._sizes import parse_size
from dcp_volumes._staging import disk_full_error, probe_writable
from dcp_volumes._volume import (
    LAG_DELAYS_S,
    LAG_TOTAL_S,
    LOCAL_PROTOCOLS,
    FileInfo,
    Volume,
    redact_url,
    refuse_url_credentials,
)
from dcp_volumes.data._files import CachedFile, Expected
from dcp_volumes.data._hot import TOUCH_INTERVAL_S, HotIndex, SharedHot, matches
from dcp_volumes.data._locks import EntryLock
from dcp_volumes.data._store import (
    CacheCounters,
    CacheSchedule,
    ReconcileReport,
    Ref,
    Store,
    clear_reservation,
    human,
    read_meta,
    remove,
    write_file,
)

logger = logging.getLogger(__name__)

_KEY_CHARS = 32
# Files up to this size are fetched with one GET whose length checks the listing
# (bigger ones with parallel ranged GETs).
_SINGLE_GET_BYTES = 16 * 2**20

__all__ = [
    "CacheCounters",
    "CacheSchedule",
    "CachedFile",
    "Expected",
    "FileCache",
    "ReconcileReport",
    "default_cache_dir",
]


def default_cache_dir() -> str:
    """``DCP_VOLUMES_CACHE`` if set, else ``~/.cache/dcp_volumes``."""
    return _env.cache_dir() or os.path.join(os.path.expanduser("~"), ".cache", "dcp_volumes")


_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def _sanitize(name: str) -> str:
    safe = _UNSAFE_CHARS.sub("_", name)[-80:].lstrip(".")
    return safe or "data"


def _source_identity(volume: Volume) -> str:
    """Protocol + endpoint: the same bucket name on two endpoints is two sources."""
    opts = volume.storage_options
    client = opts.get("client_kwargs") or {}
    endpoint = str(
        opts.get("endpoint_url") or client.get("endpoint_url") or opts.get("account_name") or ""
    )
    conn = opts.get("connection_string")
    if conn:  # hashed: it holds a secret
        endpoint += "#" + hashlib.sha256(str(conn).encode()).hexdigest()[:16]
    return f"{volume.protocol}|{endpoint}"


def _key(volume: Volume, url: str) -> str:
    digest = hashlib.sha256(f"{_source_identity(volume)}\n{url}".encode()).hexdigest()
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
        limit: int | str | None = "100GB",
        headroom: int | str = "256MiB",
        reconcile: bool = True,
    ) -> None:
        chosen = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_dir = os.path.abspath(os.path.expanduser(chosen))
        self.limit = parse_size(limit, what="limit")
        self.headroom = parse_size(headroom, what="headroom") or 0
        if self.limit == 0:
            raise ConfigurationError("limit=0 leaves no room for any file; use None for no limit.")
        self._check_dir()
        self._init_process_state()
        if reconcile:
            self.reconcile()

    def _init_process_state(self) -> None:
        self._store = Store(self.cache_dir, limit=self.limit, headroom=self.headroom)
        self._volumes: dict[tuple[str, str], Volume] = {}
        # id(volume) -> (volume, relpath -> Hot); holding the volume keeps its id unique.
        self._hot = HotIndex()

    def __getstate__(self) -> dict[str, Any]:
        # Locks, clients and the in-memory view are per process.
        return {"cache_dir": self.cache_dir, "limit": self.limit, "headroom": self.headroom}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    def __repr__(self) -> str:
        return f"FileCache({self.cache_dir!r}, limit={self.limit})"

    @property
    def counters(self) -> CacheCounters:
        """Hits, misses, bytes fetched and evictions of this object in this process."""
        return self._store.counters

    def _check_dir(self) -> None:
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
                logger.warning(
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
        protocol, path = split_protocol(url)
        protocol = (protocol or "file").lower()
        refuse_url_credentials(protocol, url)  # the file's key would carry them
        # None stays None: the Volume then takes DCP_VOLUMES_STORAGE_OPTIONS.
        opts = None if storage_options is None else dict(storage_options)
        if protocol in LOCAL_PROTOCOLS:
            root, rel = os.sep, os.path.abspath(os.path.expanduser(path)).lstrip(os.sep)
        else:
            bucket, _, rel = path.strip("/").partition("/")
            root = f"{protocol}://{bucket}"
        if not rel:
            raise ConfigurationError(
                f"{redact_url(url)!r} names no file; pass the URL of one file, such as "
                "'s3://bucket/train/x.jpg'."
            )
        vkey = (root, json.dumps(opts, sort_keys=True, default=repr))
        with self._store.mu:
            volume = self._volumes.get(vkey)
            if volume is None:
                volume = self._volumes[vkey] = Volume(root, storage_options=opts)
        return volume, rel.replace(os.sep, "/")

    def key_of(self, volume: Volume, relpath: str) -> str:
        """The entry key of ``relpath`` on ``volume``: a hash of source identity and URL."""
        return _key(volume, volume.url_of(relpath))

    def _ref(self, volume: Volume, relpath: str) -> Ref:
        url = volume.url_of(relpath)
        name = _sanitize(relpath.rstrip("/").rsplit("/", 1)[-1])
        return self._store.ref(_key(volume, url), name, url)

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
        return self.fetch_from(volume, rel, expected=self._expect(size, etag)).path

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
        return self.fetch_from(volume, rel, expected=self._expect(size, etag), pin=True)

    @staticmethod
    def _expect(size: int | None, etag: str | None) -> Expected | None:
        return Expected(size=size, etag=etag) if size is not None or etag else None

    def contains(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> bool:
        """Whether a complete copy of ``url`` is in the cache now."""
        volume, rel = self._volume_for(url, storage_options)
        return read_meta(self._ref(volume, rel)) is not None

    def path_of(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> str:
        """Where the copy of ``url`` lives (or would live) in the cache."""
        volume, rel = self._volume_for(url, storage_options)
        return self._ref(volume, rel).data

    def evict(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> bool:
        """Remove the cached copy of ``url`` unless it is in use; True if removed."""
        volume, rel = self._volume_for(url, storage_options)
        ref = self._ref(volume, rel)
        return self._store.evict_key(ref.key, ref.data)

    def clear(self) -> int:
        """Remove every entry that is not in use; returns the bytes freed."""
        return self._store.clear()

    def usage(self) -> int:
        """Bytes held (files plus fills in progress) as all processes see it."""
        return self._store.usage()

    def reconcile(self) -> ReconcileReport:
        """Bring the directory and the byte count back in line (run at start-up).

        Removes temp files of killed fills, entries whose sidecar or file is
        missing or inconsistent (a file without its sidecar cannot be trusted
        and is removed), and lock files of gone entries. Entries in use by
        live processes are left alone; files the cache did not create are
        never touched.
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
        expected: Expected | FileInfo | None = None,
        pin: bool = False,
        shared: SharedHot | None = None,
        slot: int = -1,
    ) -> CachedFile | None:
        """The fast path of ``fetch_from``: a copy already verified, or None.

        Costs one ``stat`` (plus the pin's shared lock): no sidecar read, no
        hashing, no thread. None means "take the full path" (never seen here,
        listed differently now, or the file was replaced, evicted or repaired).
        With ``shared`` (a dataset's ``SharedHot``) and ``slot`` (the file's
        index in it), a copy that another process verified against the same
        listing entry counts too.
        """
        return self._hot.lookup(
            volume, relpath, expected=expected, pin=pin, shared=shared, slot=slot,
            ref_of=self._ref, note_hit=self._store.note_hit,
        )

    def fetch_from(
        self,
        volume: Volume,
        relpath: str,
        *,
        expected: Expected | FileInfo | None = None,
        pin: bool = False,
        shared: SharedHot | None = None,
        slot: int = -1,
    ) -> CachedFile:
        """Serve ``relpath`` of ``volume`` from the cache, filling it first if needed.

        With ``pin`` the returned file holds a shared lock that keeps it from
        being evicted (by any process) until ``release()``. ``expected`` may be
        an ``Expected`` or the listing's ``FileInfo`` itself. ``shared``/``slot``:
        see ``fetch_hot``.
        """
        found = self.fetch_hot(
            volume, relpath, expected=expected, pin=pin, shared=shared, slot=slot
        )
        if found is not None:
            return found
        ref = self._ref(volume, relpath)
        lock = EntryLock(ref.lock)
        filled_size = -1
        seconds = 0.0
        while True:
            lock.acquire(exclusive=False)
            meta = read_meta(ref)
            if meta is None or not matches(meta, expected):
                # Upgrade by release + exclusive acquire: the first to get it fills,
                # the others then find a valid entry.
                lock.release()
                lock.acquire(exclusive=True)
                try:
                    meta = read_meta(ref)
                    if meta is None or not matches(meta, expected):
                        filled_size, seconds = self._fill(volume, relpath, ref, expected)
                finally:
                    lock.release()
                if not pin and filled_size >= 0:
                    return self._done(ref, filled_size, True, seconds, None)
                continue  # re-take it shared and re-check: an evictor may have slipped in
            filled = filled_size >= 0
            if not filled:
                self._touch(ref, meta)
            self._hot.remember(volume, relpath, ref, meta, expected, shared, slot)
            result = self._done(ref, int(meta["size"]), filled, seconds, lock if pin else None)
            if not pin:
                lock.release()
            return result

    def _done(
        self, ref: Ref, size: int, filled: bool, seconds: float, pin: EntryLock | None
    ) -> CachedFile:
        counters = self._store.counters
        with self._store.mu:
            if filled:
                counters.misses += 1
                counters.bytes_fetched += size
                counters.download_seconds += seconds
            else:
                counters.hits += 1
        return CachedFile(
            path=ref.data,
            url=redact_url(ref.url),
            key=ref.key,
            size=size,
            hit=not filled,
            download_seconds=seconds,
            pin=pin,
        )

    def _touch(self, ref: Ref, meta: Mapping[str, Any]) -> None:
        if time.time() - float(meta.get("_mtime", 0.0)) > TOUCH_INTERVAL_S:
            # Evicted meanwhile: the LRU clock does not matter then.
            with contextlib.suppress(OSError):
                os.utime(ref.data)
        self._store.note_used(ref.key)

    def _fill(
        self, volume: Volume, relpath: str, ref: Ref, expected: Expected | FileInfo | None
    ) -> tuple[int, float]:
        """Download into the entry; the caller holds its exclusive lock."""
        self._store.clear_entry(ref)
        if expected is not None and expected.size is not None:
            size, etag, mtime = expected.size, expected.etag, expected.mtime
        else:
            info = volume.info(relpath)
            size, etag, mtime = info.size, info.etag, info.mtime
        if self.limit is not None and size > self.limit:
            raise CacheError(
                f"{redact_url(ref.url)} is {human(size)}, larger than the cache limit of "
                f"{human(self.limit)}. Fix: raise the cache limit (cache_limit= / limit=) or "
                "cache on a bigger disk."
            )
        try:
            self._store.reserve(ref, size)
        except OSError as exc:
            self._raise_if_disk_full(exc, ref, size)
            raise
        started = time.perf_counter()
        tmp = f"{ref.meta}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self._download(volume, relpath, ref, size, listed=expected is not None)
            seconds = time.perf_counter() - started
            meta = {
                "v": 1,
                "url": redact_url(ref.url),
                "size": size,
                "etag": etag,
                "mtime": mtime,
                "fetched": time.time(),
            }
            write_file(tmp, json.dumps(meta).encode())
        except BaseException as exc:
            # Nothing of a failed fill stays: no torn copy, and its space and
            # reservation are given back (the data file may be renamed in already).
            remove(ref.fill)
            remove(ref.data)
            remove(tmp)
            self._store.unreserve(ref, size)
            self._raise_if_disk_full(exc, ref, size)
            raise
        try:
            clear_reservation(ref)  # the reservation is now the file itself
            os.replace(tmp, ref.meta)  # the entry becomes valid here, in one step
        except BaseException:
            remove(tmp)
            raise
        self._store.note_filled(ref, size)
        return size, seconds

    def _raise_if_disk_full(self, exc: BaseException, ref: Ref, size: int) -> None:
        """Raise ``exc`` as a ``DiskFullError`` if the cache's disk ran out of space."""
        full = disk_full_error(
            exc,
            self.cache_dir,
            doing=f"caching {redact_url(ref.url)}",
            needed=size,
            fix="The partial copy was removed and is never served. Fix: free space there, "
            "lower the cache limit (cache_limit= / limit=), or move the cache (cache_dir= / "
            "DCP_VOLUMES_CACHE) to a larger local disk; the next read fills it again.",
        )
        if full is not None:
            raise full from exc

    @staticmethod
    def _download(volume: Volume, relpath: str, ref: Ref, size: int, *, listed: bool) -> None:
        # A listed file that is not found may be a store that lags its writes: ask
        # again for a moment (LAG_DELAYS_S) before saying it is gone.
        delays = list(LAG_DELAYS_S) if listed else []
        while True:
            try:
                FileCache._download_once(volume, relpath, ref, size, listed=listed)
                return
            except VolumeNotFoundError as exc:
                if not listed:
                    raise
                if not delays:
                    raise VolumeNotFoundError(
                        f"{redact_url(ref.url)} was listed when the dataset was built but is "
                        f"not found now (also when asked again for {LAG_TOTAL_S:.0f} s): it "
                        "was deleted or moved after the listing. Fix: restore the file, or "
                        "re-create the dataset (it re-lists the files)."
                    ) from exc
                time.sleep(delays.pop(0))

    @staticmethod
    def _download_once(
        volume: Volume, relpath: str, ref: Ref, size: int, *, listed: bool
    ) -> None:
        if size > _SINGLE_GET_BYTES:
            volume.get_file(relpath, ref.fill, size=size)  # parallel ranged GETs
        else:
            # One GET whose length checks the listing: a file that grew or shrank
            # since then shows up here.
            data = memoryview(volume.read_whole(relpath, size))
            length = len(data)
            if length != size:
                what = "was listed" if listed else "was reported a moment ago"
                cls = DatasetChangedError if listed else VolumeError
                raise cls(
                    f"{redact_url(ref.url)} has {length} bytes but {what} with {size}: the "
                    "file changed on the volume. Fix: re-create the dataset (it re-lists the "
                    "files) or retry."
                )
            write_file(ref.fill, data)
        os.replace(ref.fill, ref.data)
