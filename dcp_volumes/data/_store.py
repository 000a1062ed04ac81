"""The cache's store: the byte count of all entries, eviction and reconciliation.

Layout below ``cache_dir`` (one directory may serve many processes and jobs)::

    usage.lock                 flock'ed by writers; holds the byte count of the cache
    entries.lock               the entries' locks, one byte each (``_locks.ByteLock``)
    objects/<k2>/<key>...      the entries (``_entry.py``: data file with its record)

There is no shared index: an entry is its data file carrying its record,
published with one atomic rename, so concurrent processes cannot lose each
other's entries (fsspec's filecache rewrites one shared index and does). The
one shared mutable value, the byte count, only changes under an exclusive
``flock`` and is recomputed from the directory at start-up and whenever it
looks wrong. Deletion never leaves ``objects/`` and never touches a name the
cache did not create. This process's counters and its view of the entries
change under the store's own lock, through its methods only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from dcp_volumes._exceptions import CacheError
from dcp_volumes._sizes import format_size
from dcp_volumes.data._entry import NAME_RE, TEMP_MARKERS, Entry, Layout
from dcp_volumes.data._locks import CounterLock
from dcp_volumes.data._metrics import Counters

logger = logging.getLogger(__name__)

# This process's view of the entries is refreshed from disk after this long.
_RESCAN_S = 30.0
_OVERSHOOT_LOG_S = 60.0


class CacheSchedule(Protocol):
    """What a dataset tells the cache about its future accesses (for eviction)."""

    def eviction_priority(self, key: str) -> float | None:
        """Higher evicts sooner (e.g. distance to next use); ``None``: never evict now."""


@dataclass
class _Known:
    """One entry as last seen on disk by this process: eviction's candidate.

    Not the entry's record (a ``FileInfo`` of the source file): local facts, the data
    file's path, its size on disk, its LRU clock, and whether it has a record at all.
    """

    data: str
    size: int
    mtime: float
    has_record: bool


@dataclass(frozen=True)
class ReconcileReport:
    """What ``FileCache.reconcile`` found and did."""

    entries: int
    bytes: int
    removed_temp: int
    removed_broken: int
    busy: int
    foreign: int


class Store:
    """The byte count and eviction of the entries below ``objects/``; see the module docstring."""

    def __init__(self, cache_dir: str, *, limit: int | None, headroom: int) -> None:
        self.cache_dir = cache_dir
        self.layout = Layout.probe(cache_dir)
        self.objects = self.layout.objects
        self.counter_path = os.path.join(cache_dir, "usage.lock")
        self.limit = limit
        self.headroom = headroom
        self.counters = Counters()
        self.schedule: CacheSchedule | None = None
        self._mu = threading.Lock()  # counters and _known
        # The entries as this process last saw them: eviction's candidates, so only kept
        # with a limit (without one it would grow by an object a file in every process).
        self._known: dict[str, _Known] = {}
        self._known_at = 0.0
        self._last_overshoot_log = 0.0

    def _at(self, key: str, data: str) -> Entry:
        """The entry ``key`` whose data file a scan found at ``data`` ("": none)."""
        return Entry(self.layout, key, data)

    # -- this process's counters and view ------------------------------------------------

    def count_fill(self, entry: Entry, size: int, seconds: float) -> None:
        """A fill published ``size`` bytes into ``entry`` after ``seconds`` of download."""
        with self._mu:
            if self.limit is not None:
                self._known[entry.key] = _Known(entry.data, size, time.time(), True)
            self.counters.misses += 1
            self.counters.bytes_fetched += size
            self.counters.download_seconds += seconds

    def count_hit(self, key: str) -> None:
        """A hit on a complete copy: count it and move this process's LRU clock."""
        with self._mu:
            self.counters.hits += 1
            known = self._known.get(key)
            if known is not None:
                known.mtime = time.time()

    def _count_eviction(self, key: str, size: int) -> None:
        with self._mu:
            self._known.pop(key, None)
            self.counters.evictions += 1
            self.counters.bytes_evicted += size

    # -- the byte count ---------------------------------------------------------------------

    def give_back(self, nbytes: int) -> None:
        """``nbytes`` are no longer on disk (a failed fill, leftovers removed)."""
        if not nbytes:
            return
        with CounterLock(self.counter_path) as counter:
            used = counter.read()
            if used is not None:
                counter.write(max(0, used - nbytes))

    def reserve(self, entry: Entry, size: int) -> None:
        """Count ``size`` bytes for a fill of ``entry``, evicting first if the cache would
        overflow; the entry's `.fill` file, made here under the count's lock, records the
        reservation until the fill ends."""
        with CounterLock(self.counter_path) as counter:
            used = counter.read()
            if used is None:
                used = self._scan_usage()
            if self.limit is not None and used + size > self.limit:
                used -= self._evict_locked(used + size - self.limit, entry.key)
                if used + size > self.limit:
                    # Maybe the count drifted (files removed behind our back): recount.
                    used = self._scan_usage()
                    if used + size > self.limit:
                        used -= self._evict_locked(used + size - self.limit, entry.key)
            free = shutil.disk_usage(self.cache_dir).free
            if free - size < self.headroom:
                used -= self._evict_locked(self.headroom + size - free, entry.key)
                free = shutil.disk_usage(self.cache_dir).free
                if free - size < self.headroom:
                    counter.write(used)
                    raise CacheError(
                        f"The disk holding the cache {self.cache_dir} has {format_size(free)} "
                        f"free; {entry.url} needs {format_size(size)} plus "
                        f"{format_size(self.headroom)} headroom, and no cached file could be "
                        "evicted (all in use). Fix: free space there, lower the cache limit, or "
                        "use a bigger disk."
                    )
            if self.limit is not None and used + size > self.limit:
                self._log_overshoot(used + size)
            counter.write(used + size)
            entry.reserve(size)

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
            format_size(total),
            format_size(self.limit or 0),
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
        with self._mu:
            items = list(self._known.items())
        for key, known in items:
            if key == exclude:
                continue
            if not known.has_record:
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
        size = self._at(key, data).evict()
        if size is not None:
            self._count_eviction(key, size)
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
        _, known = self._rescan()
        with CounterLock(self.counter_path) as counter:
            items = list(known.items())
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
                    match = NAME_RE.match(ent.name)
                    if match is None:
                        found.setdefault("", {})[ent.path] = ent.path
                        continue
                    key, suffix, rest = match.groups()
                    kinds = found.setdefault(key, {})
                    if suffix:
                        kinds[suffix] = ent.path
                    elif any(m in rest for m in TEMP_MARKERS):
                        kinds[f"temp:{ent.name}"] = ent.path
                    else:
                        kinds["data"] = ent.path
        return found

    def _rescan(self) -> tuple[dict[str, dict[str, str]], dict[str, _Known]]:
        """The entries on disk (see ``_entries_on_disk``) and the complete ones among them;
        with a limit, that is this process's view of the entries from now on."""
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
            # (An xattr record is only read when the entry is: a scan stats the files.)
            has_record = self.layout.xattrs or ".meta" in kinds
            known[key] = _Known(data, st.st_size, st.st_mtime, has_record)
        if self.limit is not None:
            with self._mu:
                self._known = known
                self._known_at = time.monotonic()
        return found, known

    def _scan_usage(self) -> int:
        """Bytes on disk now: data files plus reservations of fills in progress."""
        found, known = self._rescan()
        total = sum(k.size for k in known.values())
        for key, kinds in found.items():
            if key and ".fill" in kinds:
                total += self._at(key, "").reserved()
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
                entry = self._at(key, kinds.get("data", ""))
                # (.resv: reservation files of earlier versions; .lock: lock files of
                # earlier layouts, where the entries' locks are bytes of one file now)
                stale = (".fill", ".resv", ".lock") if self.layout.locks else (".fill", ".resv")
                temps = [
                    path
                    for kind, path in kinds.items()
                    if kind.startswith("temp:") or kind in stale
                ]
                done = entry.repair(temps)
                if done is None:
                    busy += 1  # being filled or pinned by a live process: count, don't touch
                    total += entry.held_bytes()
                    continue
                removed, kept, broken = done
                removed_temp += removed
                if kept is not None:
                    entries += 1
                    total += kept
                removed_broken += broken
            counter.write(total)
        if self.limit is not None:
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
