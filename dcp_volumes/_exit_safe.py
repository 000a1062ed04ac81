"""Work handed to a thread pool that still finishes while the interpreter exits.

A script whose last step is ``CheckpointManager.save()`` returns while the save
uploads in a background thread. Python then joins that thread, but first makes
every ``ThreadPoolExecutor`` refuse new work, so the save's next upload would
fail and its checkpoint be lost. ``submit`` runs such work on the calling thread
instead, within ``DCP_VOLUMES_EXIT_TIMEOUT`` seconds of the first refusal; past
that the save fails cleanly (no ``.metadata``), with a message that says so.
Written by hand: concurrent.futures has no "run here when refused".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TypeVar

from dcp_volumes import _env
from dcp_volumes._exceptions import CheckpointError

logger = logging.getLogger(__name__)

T = TypeVar("T")
S = TypeVar("S")
_lock = threading.Lock()
_refused_at: float | None = None  # monotonic time of the first refusal


def submit(pool: Executor, fn: Callable[..., T], *args: object) -> Future[T]:
    """``pool.submit(fn, *args)``, or ``fn(*args)`` here when the pool refuses new work."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:  # what submit raises at interpreter exit (or on a shut-down pool)
        pass
    _check_deadline()
    done: Future[T] = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as exc:  # handed to the caller through the future, as a pool would
        done.set_exception(exc)
    return done


def start(name: str, fn: Callable[..., T], *args: object) -> Future[T]:
    """``fn(*args)`` started now in a thread of its own, collected later from the future
    (a request that can run beside other work); the thread ends when ``fn`` returns."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    try:
        return submit(pool, fn, *args)
    finally:
        pool.shutdown(wait=False)


def map_all(pool: Executor, fn: Callable[[S], T], items: Iterable[S]) -> list[T]:
    """``list(pool.map(fn, items))`` that also completes while the interpreter exits."""
    return [f.result() for f in [submit(pool, fn, item) for item in items]]


def _check_deadline() -> None:
    global _refused_at
    limit = _env.exit_timeout()
    with _lock:
        first = _refused_at is None
        if first:
            _refused_at = time.monotonic()
        started = _refused_at
    if first:
        logger.warning(
            "the interpreter is exiting while a checkpoint save is in flight: finishing it on "
            "its own thread (at most %.0f s, %s)",
            limit,
            _env.EXIT_TIMEOUT,
        )
    assert started is not None
    if limit and time.monotonic() - started > limit:
        raise CheckpointError(
            f"The interpreter is exiting and the save in flight did not finish within "
            f"{limit:.0f} s ({_env.EXIT_TIMEOUT}); it was abandoned, so no .metadata was "
            "written and the previous checkpoint stays the latest. Fix: call "
            "CheckpointManager.close() (or wait()) at the end of training, or raise the bound."
        )
