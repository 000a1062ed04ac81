"""Fewer cyclic-GC passes while a save or a load builds DCP's per-item objects.

DCP makes several objects per tensor (write and read items, plans, metadata,
results), nearly all of which live until the save ends. CPython counts them as
survivors and runs full collections that walk the whole heap of the training
process; with thousands of tensors those passes cost more than the save's own
work. Torch turns the collector off for the same reason in ``get_state_dict``.
Here only the young generation's threshold is raised, and only while some
save or load holds it: one that fails where no hook of ours runs (a peer's
error inside DCP's collectives) leaves the collector running, less often,
until its writer or reader lets go or is dropped. A hold ends when DCP drops
the save's planner, which keeps its plans and metadata: let go earlier, the
next young collection would find them all alive and promote them, and a full
collection would follow.
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

# Allocations between young collections while held: more than a save of tens of
# thousands of tensors makes, so its objects are looked at once, after it.
HELD_THRESHOLD = 1_000_000

_lock = threading.Lock()
_holders = 0
_thresholds_before: tuple[int, int, int] | None = None
_waiting: CollectorHold | None = None  # the last hold that waits for its planner to go


class CollectorHold:
    """One save's or load's hold on the collector; ``release()`` (or dropping it) lets go."""

    def __init__(self) -> None:
        _take()
        self._let_go = weakref.finalize(self, _give_back)

    def release(self) -> None:
        """Let go (once; later calls do nothing)."""
        self._let_go()

    def release_after(self, owner: object) -> None:
        """Let go once ``owner`` (a save's planner) is dropped, or at once if it cannot be
        watched. One hold waits so at most: a planner kept by the caller across saves
        holds the collector only until the next save ends."""
        global _waiting
        try:
            weakref.finalize(owner, self.release)
        except TypeError:  # not weakly referenceable
            self.release()
            return
        with _lock:
            earlier, _waiting = _waiting, self
        if earlier is not None:
            earlier.release()


def _take() -> None:
    global _holders, _thresholds_before
    with _lock:
        if _holders == 0:
            before = gc.get_threshold()
            _thresholds_before = (before[0], before[1], before[2])
            if before[0] > 0:  # 0: the user turned automatic collection off; leave it so
                gc.set_threshold(max(before[0], HELD_THRESHOLD), before[1], before[2])
        _holders += 1


def _give_back() -> None:
    global _holders, _thresholds_before
    with _lock:
        _holders -= 1
        if _holders == 0 and _thresholds_before is not None:
            gc.set_threshold(*_thresholds_before)
            _thresholds_before = None


class HoldDuringTransfer:
    """A writer's or reader's hold for the save or load in flight: taken by its first
    hook, ended by its last (once the planner goes) or by any hook that fails."""

    def __init__(self) -> None:
        self._hold: CollectorHold | None = None

    def take(self) -> None:
        if self._hold is None:
            self._hold = CollectorHold()

    def end(self, after: object = None) -> None:
        """End the hold, once ``after`` (the transfer's planner) is dropped if given."""
        hold, self._hold = self._hold, None
        if hold is None:
            return
        if after is None:
            hold.release()
        else:
            hold.release_after(after)

    def __getstate__(self) -> dict[str, Any]:
        return {"_hold": None}  # a hold is on this process's collector, not the pickle's


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def ends_hold_on_error(hook: _Hook) -> _Hook:
    """A storage hook (of an object with ``_collector``) that ends the hold when it fails:
    DCP calls no later hook of a failed transfer on this rank."""

    @functools.wraps(hook)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(self, *args, **kwargs)
        except BaseException:
            self._collector.end()
            raise

    return cast(_Hook, run)
