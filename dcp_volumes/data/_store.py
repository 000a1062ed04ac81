"""The cache's on-disk store: entry layout, byte accounting, eviction and reconciliation.

Layout below ``cache_dir`` (one directory may serve many processes and jobs)::

    usage.lock                 flock'ed by writers; holds the byte count of the cache
    objects/<k2>/<key>-<name>  a cached file (<key>: 128-bit hash of source + URL)
    objects/<k2>/<key>.meta    its sidecar: URL, size, etag/mtime (written atomically)
    objects/<k2>/<key>.lock    its lock: exclusive to fill/evict, shared to pin; while a
                               fill runs it holds the bytes reserved for it (else empty)
    objects/<k2>/<key>.fill    the download in progress (renamed into place when done)

There is no shared index: an entry is its data file plus its sidecar, each
published with one atomic rename, so concurrent processes cannot lose each
other's entries (fsspec's filecache rewrites one shared index and does). The
one shared mutable value, the byte count, only changes under an exclusive
``flock`` and is recomputed from the directory at start-up and whenever it
looks wrong. Deletion never leaves ``objects/`` and never touches a name the
cache did not create.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from dcp_volumes._exceptions import CacheError
from dcp_volumes._volume import redact_url, write_all
from dcp_volumes.data._locks import CounterLock, EntryLock

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^([0-9a-f]{32})(?:(\.meta|\.lock|\.resv|\.fill)|-(.+))$")
_TEMP_MARKERS = (".part-", ".tmp-", ".fill")
# This process's view of the entries is refreshed from disk after this long.
_RESCAN_S = 30.0
_OVERSHOOT_LOG_S = 60.0


class CacheSchedule(Protocol):
    """What a dataset tells the cache about its future accesses (for eviction)."""

    def eviction_priority(self, key: str) -> float | None:
        """Higher evicts sooner (e.g. distance to next use); ``None``: never evict now."""


@dataclass
class CacheCounters:
    """Cumulative counters of one ``FileCache`` object in one process."""

    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    download_seconds: float = 0.0
    evictions: int = 0
    bytes_evicted: int = 0


class Ref(NamedTuple):
    """Where one entry lives on disk (a tuple: built once per file a process first sees)."""

    key: str
    url: str
    data: str
    meta: str
    lock: str
    fill: str


@dataclass
class _Known:
    """One entry as last seen on disk by this process."""

    data: str
    size: int
    mtime: float
    has_meta: bool


@dataclass(frozen=True)
class ReconcileReport:
    """What ``FileCache.reconcile`` found and did."""

    entries: int
    bytes: int
    removed_temp: int
    removed_broken: int
    busy: int
    foreign: int


def human(nbytes: float) -> str:
    """``1.5 MiB``-style sizes for messages."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"  # pragma: no cover


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


def read_meta(ref: Ref) -> dict[str, Any] | None:
    """The sidecar of a complete entry (data file present with the recorded size), else None."""
    try:
        with open(ref.meta, "rb") as f:
            meta = json.loads(f.read())
        st = os.stat(ref.data)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or st.st_size != meta.get("size"):
        return None
    meta["_mtime"] = st.st_mtime
    return meta


def read_reservation(lock_path: str) -> int:
    """Bytes a fill reserved, as written into its entry's lock file (0: none)."""
    try:
        if not os.stat(lock_path).st_size:
            return 0  # the usual case: one system call
        with open(lock_path, "rb") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def clear_reservation(ref: Ref) -> None:
    """The fill's bytes are on disk now (its lock file empties in place: no new inode)."""
    with contextlib.suppress(FileNotFoundError):
        os.truncate(ref.lock, 0)


class Store:
    """Entries below ``objects/`` and the shared byte count; see the module docstring."""

    def __init__(self, cache_dir: str, *, limit: int | None, headroom: int) -> None:
        self.cache_dir = cache_dir
        self.objects = os.path.join(cache_dir, "objects")
        self.counter_path = os.path.join(cache_dir, "usage.lock")
        self.limit = limit
        self.headroom = headroom
        self.mu = threading.Lock()
        self.counters = CacheCounters()
        self.schedule: CacheSchedule | None = None
        self._known: dict[str, _Known] = {}
        self._known_at = 0.0
        self._last_overshoot_log = 0.0

    def ref(self, key: str, name: str, url: str = "") -> Ref:
        base = self._base(key)
        return Ref(
            key=key,
            url=url,
            data=f"{base}-{name}",
            meta=f"{base}.meta",
            lock=f"{base}.lock",
            fill=f"{base}.fill",
        )

    def _base(self, key: str) -> str:
        # Not os.path.join: this runs once per file a worker first sees in a warm epoch.
        return f"{self.objects}{os.sep}{key[:2]}{os.sep}{key}"

    def note_filled(self, ref: Ref, size: int) -> None:
        with self.mu:
            self._known[ref.key] = _Known(ref.data, size, time.time(), True)

    def note_hit(self, key: str) -> None:
        """A hit on a verified copy: count it and move this process's LRU clock."""
        with self.mu:
            self.counters.hits += 1
            known = self._known.get(key)
            if known is not None:
                known.mtime = time.time()

    def note_used(self, key: str) -> None:
        with self.mu:
            known = self._known.get(key)
            if known is not None:
                known.mtime = time.time()

    def _adjust(self, delta: int) -> None:
        with CounterLock(self.counter_path) as counter:
            used = counter.read()
            if used is not None:
                counter.write(max(0, used + delta))

    # -- one entry, under its exclusive lock ----------------------------------------------

    def clear_entry(self, ref: Ref) -> None:
        """Remove what a previous (maybe killed) filler or a broken copy left behind."""
        reserved = read_reservation(ref.lock)
        if reserved:
            # A filler died mid-download: its reservation is still counted, and a
            # ranged download may have left <fill>.part-* files.
            clear_reservation(ref)
            folder, prefix = os.path.split(ref.fill)
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(folder):
                    if name.startswith(prefix):
                        remove(os.path.join(folder, name))
        remove(ref.fill)
        size = 0
        try:
            size = os.stat(ref.data).st_size
            remove(ref.data)
        except FileNotFoundError:
            pass
        remove(ref.meta)
        # A killed fill's data file (renamed in before its death) is counted by its
        # reservation only.
        freed = reserved or size
        if freed:
            self._adjust(-freed)

    def reserve(self, ref: Ref, size: int) -> None:
        """Count ``size`` bytes for a fill, evicting first if the cache would overflow."""
        with CounterLock(self.counter_path) as counter:
            used = counter.read()
            if used is None:
                used = self._scan_usage()
            if self.limit is not None and used + size > self.limit:
                used -= self._evict_locked(used + size - self.limit, ref.key)
                if used + size > self.limit:
                    # Maybe the count drifted (files removed behind our back): recount.
                    used = self._scan_usage()
                    if used + size > self.limit:
                        used -= self._evict_locked(used + size - self.limit, ref.key)
            free = shutil.disk_usage(self.cache_dir).free
            if free - size < self.headroom:
                used -= self._evict_locked(self.headroom + size - free, ref.key)
                free = shutil.disk_usage(self.cache_dir).free
                if free - size < self.headroom:
                    counter.write(used)
                    raise CacheError(
                        f"The disk holding the cache {self.cache_dir} has {human(free)} free; "
                        f"{redact_url(ref.url)} needs {human(size)} plus {human(self.headroom)} "
                        "headroom, and no cached file could be "
                        "evicted (all in use). Fix: free space there, lower the cache limit, or "
                        "use a bigger disk."
                    )
            if self.limit is not None and used + size > self.limit:
                self._log_overshoot(used + size)
            counter.write(used + size)
            # Into the lock file the filler holds, not a file of its own: creating and
            # deleting an inode per fill is what ext4's allocator is slowest at.
            write_file(ref.lock, str(size).encode())

    def unreserve(self, ref: Ref, size: int) -> None:
        clear_reservation(ref)
        self._adjust(-size)

    def _log_overshoot(self, total: int) -> None:
        now = time.monotonic()
        if now - self._last_overshoot_log < _OVERSHOOT_LOG_S:
            return
        self._last_overshoot_log = now
        logger.warning(
            "file cache %s holds %s, over its limit of %s: every other file is in use or "
            "inside the prefetch window. Fix: raise the cache limit, or lower the prefetch "
            "depth / number of workers.",
            self.cache_dir,
            human(total),
            human(self.limit or 0),
        )

    # -- eviction -------------------------------------------------------------------------

    def _evict_locked(self, need: int, exclude: str) -> int:
        """Evict the best victims until ``need`` bytes are freed; caller holds the counter."""
        if time.monotonic() - self._known_at > _RESCAN_S:
            self._rescan()
        freed = 0
        for attempt in range(2):
            for key, known in self._victims(exclude):
                if freed >= need:
                    return freed
                freed += self.evict_one(key, known.data) or 0
            if freed >= need or attempt:
                break
            self._rescan()  # other processes filled entries we have not seen yet
        return freed

    def _victims(self, exclude: str) -> list[tuple[str, _Known]]:
        now = time.time()
        schedule = self.schedule
        ranked: list[tuple[float, str, _Known]] = []
        with self.mu:
            items = list(self._known.items())
        for key, known in items:
            if key == exclude:
                continue
            if not known.has_meta:
                ranked.append((float("inf"), key, known))  # broken or half-done: first to go
                continue
            # Without a schedule: least recently used first.
            priority = now - known.mtime if schedule is None else schedule.eviction_priority(key)
            if priority is None:
                continue  # inside the prefetch window: never evicted
            ranked.append((priority, key, known))
        ranked.sort(key=lambda r: r[0], reverse=True)
        return [(key, known) for _, key, known in ranked]

    def evict_one(self, key: str, data: str) -> int | None:
        """Delete one entry unless it is pinned or being filled; returns bytes freed."""
        base = self._base(key)
        lock = EntryLock(f"{base}.lock")
        if not lock.acquire(exclusive=True, blocking=False):
            return None  # pinned (shared lock) or being filled
        try:
            if lock.fd is not None and os.fstat(lock.fd).st_size:
                return None  # a killed filler's reservation: the next fill cleans it up
            try:
                size = os.stat(data).st_size
            except FileNotFoundError:
                size = 0
            remove(f"{base}.meta")  # first: the entry stops being valid
            remove(data)
            lock.release_and_delete()
        finally:
            lock.release()
        with self.mu:
            self._known.pop(key, None)
            self.counters.evictions += 1
            self.counters.bytes_evicted += size
        return size

    def evict_key(self, key: str, data: str) -> bool:
        """Evict one entry now (public ``evict``)."""
        with CounterLock(self.counter_path) as counter:
            freed = self.evict_one(key, data)
            if freed is None:
                return False
            used = counter.read()
            if used is not None:
                counter.write(max(0, used - freed))
        return True

    def clear(self) -> int:
        """Evict every entry not in use; returns the bytes freed."""
        self._rescan()
        with CounterLock(self.counter_path) as counter:
            with self.mu:
                items = list(self._known.items())
            freed = sum(self.evict_one(key, known.data) or 0 for key, known in items)
            used = counter.read()
            if used is not None:
                counter.write(max(0, used - freed))
        return freed

    def usage(self) -> int:
        with CounterLock(self.counter_path) as counter:
            used = counter.read()
            if used is None:
                used = self._scan_usage()
                counter.write(used)
            return used

    # -- the directory as the source of truth ---------------------------------------------

    def _entries_on_disk(self) -> dict[str, dict[str, str]]:
        """``key -> {kind: path}`` for every file below objects/; foreign files under ''."""
        found: dict[str, dict[str, str]] = {}
        with contextlib.suppress(FileNotFoundError):
            for sub in os.scandir(self.objects):
                if not sub.is_dir(follow_symlinks=False):
                    found.setdefault("", {})[sub.path] = sub.path
                    continue
                for ent in os.scandir(sub.path):
                    match = _NAME_RE.match(ent.name)
                    if match is None:
                        found.setdefault("", {})[ent.path] = ent.path
                        continue
                    key, suffix, rest = match.groups()
                    kinds = found.setdefault(key, {})
                    if suffix:
                        kinds[suffix] = ent.path
                    elif any(m in rest for m in _TEMP_MARKERS):
                        kinds[f"temp:{ent.name}"] = ent.path
                    else:
                        kinds["data"] = ent.path
        return found

    def _rescan(self) -> dict[str, dict[str, str]]:
        """Refresh this process's view of the entries from the directory."""
        found = self._entries_on_disk()
        known: dict[str, _Known] = {}
        for key, kinds in found.items():
            data = kinds.get("data")
            if not key or data is None:
                continue
            try:
                st = os.stat(data)
            except FileNotFoundError:
                continue
            known[key] = _Known(data, st.st_size, st.st_mtime, ".meta" in kinds)
        with self.mu:
            self._known = known
            self._known_at = time.monotonic()
        return found

    def _scan_usage(self) -> int:
        """Bytes on disk now: data files plus reservations of fills in progress."""
        found = self._rescan()
        with self.mu:
            total = sum(k.size for k in self._known.values())
        for key, kinds in found.items():
            if key and ".lock" in kinds and "data" not in kinds:
                total += read_reservation(kinds[".lock"])
        return total

    def reconcile(self) -> ReconcileReport:
        """Bring the directory and the byte count back in line (see ``FileCache.reconcile``)."""
        removed_temp = removed_broken = busy = entries = total = 0
        with CounterLock(self.counter_path) as counter:
            found = self._entries_on_disk()
            foreign = len(found.pop("", {}))
            if foreign:
                logger.warning(
                    "cache %s: %d files not created by the cache are left alone",
                    self.objects,
                    foreign,
                )
            for key, kinds in found.items():
                base = self._base(key)
                lock = EntryLock(f"{base}.lock")
                if not lock.acquire(exclusive=True, blocking=False):
                    busy += 1  # being filled or pinned by a live process: count, don't touch
                    data = kinds.get("data")
                    with contextlib.suppress(FileNotFoundError):
                        total += os.stat(data).st_size if data else read_reservation(f"{base}.lock")
                    continue
                try:
                    for kind, path in kinds.items():
                        # (.resv: reservation files of earlier versions)
                        if kind.startswith("temp:") or kind in (".fill", ".resv"):
                            removed_temp += remove(path)
                    ref = self.ref(key, "")
                    if read_reservation(ref.lock):
                        removed_temp += 1  # a killed fill's reservation
                        clear_reservation(ref)
                    data = kinds.get("data")
                    meta = read_meta(ref._replace(data=data)) if data else None
                    if meta is not None:
                        entries += 1
                        total += int(meta["size"])
                        continue
                    if data or ".meta" in kinds:
                        removed_broken += 1
                    remove(f"{base}.meta")
                    if data:
                        remove(data)
                    lock.release_and_delete()  # nothing left of this entry
                finally:
                    lock.release()
            counter.write(total)
        self._rescan()
        report = ReconcileReport(
            entries=entries,
            bytes=total,
            removed_temp=removed_temp,
            removed_broken=removed_broken,
            busy=busy,
            foreign=foreign,
        )
        if removed_temp or removed_broken:
            logger.info("cache %s reconciled: %s", self.cache_dir, report)
        return report
