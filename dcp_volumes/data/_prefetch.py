"""In-worker prefetch: fetch the next K files on a small thread pool while samples are used.

Results come back in stream order. A file that appears twice inside the
window (padding, tiny datasets) is fetched once and shared; its pin is
released when its last use is done. Closing the prefetcher (end of epoch, a
``break`` in the training loop, a worker reset) cancels what has not started
and releases the pins of what finishes later, so no pin outlives it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar, cast

K = TypeVar("K", bound=Hashable)
A = TypeVar("A")
R = TypeVar("R")


class _Slot(Generic[R]):
    """One fetch in the window: a pool future, or a value the fast path produced at once."""

    __slots__ = ("future", "taken", "uses", "value")

    def __init__(self, future: Future[R] | None, value: R | None) -> None:
        self.future = future
        self.value = value
        self.uses = 1
        self.taken = 0

    def done(self) -> bool:
        return self.future is None or self.future.done()


class Taken(Generic[K, R]):
    """One item handed to the consumer, with how long it waited and how far ahead we were.

    ``first`` is False for a repeat use of a result already handed out.
    """

    __slots__ = ("first", "key", "ready_ahead", "value", "wait_seconds")

    def __init__(
        self, key: K, value: R, wait_seconds: float, ready_ahead: int, first: bool
    ) -> None:
        self.key = key
        self.value = value
        self.wait_seconds = wait_seconds
        self.ready_ahead = ready_ahead
        self.first = first


class Prefetcher(Generic[K, A, R]):
    """Runs ``fetch(arg)`` for the next ``depth`` items of ``items`` in ``threads`` threads.

    Args:
        items: ``(key, arg)`` pairs in consumption order; equal keys share one fetch.
        fetch: called in a pool thread; its result is handed out in order.
        release: called once per fetched result after its last use (or on close).
        depth: how many items ahead to fetch.
        threads: pool size.
        fast: optional; called in the consumer's thread when an item enters the
            window, returns its result when that is cheap to get now (a cache
            hit) or None to hand the item to the pool. Cheap items then cost no
            thread handoff, and the pool threads (with the GIL) stay free for
            the slow ones.
    """

    def __init__(
        self,
        items: Iterable[tuple[K, A]],
        fetch: Callable[[A], R],
        release: Callable[[R], None],
        *,
        depth: int,
        threads: int,
        fast: Callable[[A], R | None] | None = None,
    ) -> None:
        self._items = iter(items)
        self._fetch = fetch
        self._fast = fast
        self._release = release
        self._depth = max(1, depth)
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, threads), thread_name_prefix="dcpv-prefetch"
        )
        self._window: collections.deque[K] = collections.deque()
        self._slots: dict[K, _Slot[R]] = {}
        # Keys whose future was not yet seen done (empty when every item was a hit).
        self._pending: set[K] = set()
        self._closed = False
        self._mu = threading.Lock()

    def _top_up(self) -> None:
        window, slots, items, fast = self._window, self._slots, self._items, self._fast
        while len(window) < self._depth:
            try:
                key, arg = next(items)
            except StopIteration:
                return
            slot = slots.get(key)
            if slot is None:
                value = fast(arg) if fast is not None else None
                if value is not None:
                    slots[key] = _Slot(None, value)
                else:
                    slots[key] = _Slot(self._pool.submit(self._fetch, arg), None)
                    self._pending.add(key)
            else:
                slot.uses += 1
            window.append(key)

    def _ready_ahead(self, key: K) -> int:
        """Items in the window whose result is ready (``key``: the one just taken out)."""
        waiting = 0
        if self._pending:
            slots = self._slots
            for k in list(self._pending):
                slot = slots[k]
                if slot.future.done():  # type: ignore[union-attr]
                    self._pending.discard(k)
                else:
                    # Its uses are its places in the window, plus the one taken out now.
                    waiting += slot.uses - (k == key)
        return len(self._window) - waiting

    def __iter__(self) -> Iterator[Taken[K, R]]:
        try:
            self._top_up()
            slots, window = self._slots, self._window
            while window:
                key = window.popleft()
                slot = slots[key]
                ready = self._ready_ahead(key)
                future = slot.future
                if future is None:
                    # A fast-path result: never None (None sent the item to the pool).
                    value, waited = cast(R, slot.value), 0.0
                else:
                    started = time.perf_counter()
                    value = future.result()  # re-raises the fetch error here, in order
                    waited = time.perf_counter() - started
                    self._pending.discard(key)
                self._top_up()  # keep the pool busy while the consumer works
                slot.taken += 1
                yield Taken(key, value, waited, ready, slot.taken == 1)
                slot.uses -= 1
                if slot.uses == 0:
                    del slots[key]
                    self._release(value)
        finally:
            self.close()

    def close(self) -> None:
        """Cancel pending fetches; release every result now or when it arrives."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
        slots, self._slots = list(self._slots.values()), {}
        self._window.clear()
        self._pending.clear()
        for slot in slots:
            if slot.future is None:
                self._release(slot.value)  # type: ignore[arg-type]
            elif not slot.future.cancel():
                slot.future.add_done_callback(self._release_when_done)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _release_when_done(self, future: Future[R]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._release(future.result())
