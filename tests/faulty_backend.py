"""A ``Backend`` wrapper that makes the faults a proxy cannot: stale listings, vanishing files.

A proxy in front of a server (``testkit/emulators.py``) can fail, delay or cut
requests, but it cannot make a store *eventually consistent*: answer a
listing without the objects written just before it, or say "not found" for an
object that exists. This wrapper does that, at the backend protocol, on any
real backend (local directory, moto S3), seeded, and counts what it did.

Install it with ``install(monkeypatch, ...)``: it wraps what
``Volume.backend`` gets from ``backend_for`` (``_volume.py`` imports the name,
so that module's reference is the seam). Nothing of ours is mocked: every call
goes to the real backend, the wrapper only hides or withholds answers.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from dcp_volumes._volume import _volume
from dcp_volumes._volume._backend import Backend, Data, FileInfo, Listing


@dataclass
class Faults:
    """What to inject, and (``calls``, ``faults``) what was done.

    stale_lists: the next this many ``list()`` calls leave out the objects
        (those whose location contains ``stale_match``, if given) put after the
        wrapper's ``stale_since`` (default: in the last ``stale_window_s`` seconds).
    stale_p: besides, each listing is stale with this probability.
    vanish: location substrings; ``head``/``read*`` of a matching location
        raise the backend's own not-found error for its next ``vanish_calls``
        calls, then it is back.
    short: location substrings whose reads come back ``short_by`` bytes short
        (the listing and ``head`` still say the full size).
    refuse_uploads_after: after this many ``upload()`` calls, every later one
        is refused with ``PermissionError`` naming the location (a store that
        starts refusing writes part-way through a save).
    meet: two ``(operation, location substring)`` pairs, e.g. ``[("list", ""),
        ("put", MANIFEST_NAME)]``: the first call matching each waits (up to
        5 s) until the other has started; ``faults["no meeting"]`` counts the
        waits that ran out (the two calls were not in flight at once).
    """

    stale_lists: int = 0
    stale_p: float = 0.0
    stale_window_s: float = 5.0
    stale_match: str | None = None
    vanish: Sequence[str] = ()
    vanish_calls: int = 1
    short: Sequence[str] = ()
    short_by: int = 1
    refuse_uploads_after: int | None = None
    meet: Sequence[tuple[str, str]] = ()
    seed: int = 0
    # Counters: calls by method, faults by kind; each upload's (size, concurrency).
    calls: Counter[str] = field(default_factory=Counter)
    uploads: list[tuple[int, int]] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)


class FaultyBackend:
    """Delegates every ``Backend`` call to ``inner``, injecting ``faults`` per call."""

    def __init__(self, inner: Backend, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults
        self.capabilities = inner.capabilities
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()
        # When each location was last written through this wrapper (put, upload, copy).
        self._written: dict[str, float] = {}
        self._vanished: Counter[str] = Counter()
        self.stale_since: float | None = None
        self._meeting = threading.Barrier(2, timeout=5)
        self._met: set[int] = set()

    # -- faults ---------------------------------------------------------------------------

    def _stale_cutoff(self) -> float | None:
        f = self.faults
        with self._lock:
            if f.stale_lists > 0:
                f.stale_lists -= 1
            elif not (f.stale_p and self._rng.random() < f.stale_p):
                return None
        return self.stale_since if self.stale_since is not None else (
            time.time() - f.stale_window_s)

    def _not_found(self, path: str) -> Exception:
        """The error the real backend raises for a missing object (asked of it, so it is
        exactly its type: ``FileNotFoundError`` locally, obstore's ``NotFoundError``)."""
        try:
            self.inner.head(f"{path}.vanished-{uuid.uuid4().hex[:8]}")
        except Exception as exc:
            return exc
        raise AssertionError("a made-up name exists")  # pragma: no cover

    def _maybe_vanish(self, path: str, op: str) -> None:
        f = self.faults
        hit = next((m for m in f.vanish if m in path), None)
        if hit is None:
            return
        with self._lock:
            if self._vanished[path] >= f.vanish_calls:
                return
            self._vanished[path] += 1
            f.faults[f"vanished {op}"] += 1
        raise self._not_found(path)

    def _short(self, path: str) -> bool:
        if any(m in path for m in self.faults.short):
            with self._lock:
                self.faults.faults["short read"] += 1
            return True
        return False

    def _wrote(self, path: str) -> None:
        with self._lock:
            self._written[path] = time.time()

    def _meet(self, op: str, path: str) -> None:
        party = next((i for i, (want, match) in enumerate(self.faults.meet)
                      if want == op and match in path), None)
        if party is None:
            return
        with self._lock:
            if party in self._met:
                return
            self._met.add(party)
        try:
            self._meeting.wait()
        except threading.BrokenBarrierError:
            with self._lock:
                self.faults.faults["no meeting"] += 1

    def arrive(self, op: str, path: str = "") -> None:
        """A step outside the backend (a planner, say) takes part in ``meet`` as ``op``."""
        self._meet(op, path)

    def _count(self, op: str) -> None:
        with self._lock:
            self.faults.calls[op] += 1

    # -- the protocol ---------------------------------------------------------------------

    def check_root(self, root: str, *, create: bool) -> Listing:
        self._count("check_root")
        self._meet("check_root", root)
        return self._maybe_stale(self.inner.check_root(root, create=create))

    def head(self, path: str) -> FileInfo:
        self._count("head")
        self._maybe_vanish(path, "head")
        return self.inner.head(path)

    def list(self, prefix: str, *, recursive: bool) -> Listing:
        self._count("list")
        self._meet("list", prefix)
        return self._maybe_stale(self.inner.list(prefix, recursive=recursive))

    def _maybe_stale(self, listing: Listing) -> Listing:
        cutoff = self._stale_cutoff()
        if cutoff is None:
            return listing
        with self._lock:
            hidden = {p for p, t in self._written.items() if t >= cutoff
                      and (self.faults.stale_match is None or self.faults.stale_match in p)}
        files = [f for f in listing.files if f.path not in hidden]

        def shown(d: str) -> bool:
            # A prefix holding nothing but hidden objects is not listed either (it has
            # no older objects: a prefix exists only through what is below it).
            d = d.rstrip("/") + "/"
            return not any(p.startswith(d) for p in hidden) or any(
                p.startswith(d) for p in self._written if p not in hidden)

        dirs = [d for d in listing.dirs if shown(d)]
        with self._lock:
            self.faults.faults["stale list"] += 1
            self.faults.faults["objects hidden"] += len(listing.files) - len(files)
            self.faults.faults["prefixes hidden"] += len(listing.dirs) - len(dirs)
        return Listing(files, dirs)

    def read(self, path: str, start: int, end: int | None) -> Data:
        self._count("read")
        self._meet("read", path)
        self._maybe_vanish(path, "read")
        data = self.inner.read(path, start, end)
        return memoryview(data)[: max(0, len(memoryview(data)) - self.faults.short_by)] \
            if self._short(path) else data

    def read_whole(self, path: str, expect: int) -> Data:
        self._count("read_whole")
        self._maybe_vanish(path, "read_whole")
        data = self.inner.read_whole(path, expect)
        return memoryview(data)[: max(0, len(memoryview(data)) - self.faults.short_by)] \
            if self._short(path) else data

    def read_into(self, path: str, start: int, outs: Sequence[memoryview]) -> int:
        self._count("read_into")
        self._maybe_vanish(path, "read_into")
        got = self.inner.read_into(path, start, outs)
        return max(0, got - self.faults.short_by) if self._short(path) else got

    def upload(self, local_path: str, path: str, *, size: int, part_size: int,
               concurrency: int, move: bool) -> None:
        self._count("upload")
        f = self.faults
        with self._lock:
            f.uploads.append((size, concurrency))
        if f.refuse_uploads_after is not None and f.calls["upload"] > f.refuse_uploads_after:
            with self._lock:
                f.faults["refused upload"] += 1
            raise PermissionError(f"upload of {path} refused (injected)")
        self.inner.upload(local_path, path, size=size, part_size=part_size,
                          concurrency=concurrency, move=move)
        self._wrote(path)

    def put(self, path: str, data: Data, *, create_only: bool) -> None:
        self._count("put")
        self._meet("put", path)
        self.inner.put(path, data, create_only=create_only)
        self._wrote(path)

    def delete(self, paths: Sequence[str]) -> None:
        self._count("delete")
        self.inner.delete(paths)

    def copy(self, src: str, dst: str) -> None:
        self._count("copy")
        self.inner.copy(src, dst)
        self._wrote(dst)

    def __getattr__(self, name: str) -> Any:
        # Backend-specific extras (LocalBackend.delete_tree ...) pass straight through.
        return getattr(self.inner, name)


def install(monkeypatch: pytest.MonkeyPatch, faults: Faults) -> dict[int, FaultyBackend]:
    """Wrap every backend ``Volume`` gets in this process from now on (one wrapper per
    backend, so state is shared like the backend is); returns them by ``id(inner)``."""
    wrappers: dict[int, FaultyBackend] = {}
    real: Callable[..., Backend] = _volume.backend_for

    def wrapped(protocol: str, storage_options: Any, retry: Any) -> Backend:
        inner = real(protocol, storage_options, retry)
        if id(inner) not in wrappers:
            wrappers[id(inner)] = FaultyBackend(inner, faults)
        return wrappers[id(inner)]  # type: ignore[return-value]

    monkeypatch.setattr(_volume, "backend_for", wrapped)
    return wrappers
