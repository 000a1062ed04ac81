"""How a process that runs a job through the library exits: promptly, and without
torch's communication threads aborting it.

At exit CPython collects every tracked object once more, the many that torch and DCP
import (DTensor, sympy) included. That pass is most of the time from a rank's last line
to its exit, which torchrun waits for before it starts a restart's new processes, and
which a preemption's grace period pays. Freezing the collector at exit (``gc.freeze``:
every object moves to the permanent generation, which no collection visits) skips it:
the other atexit handlers still run, and reference counting still frees what it frees.
Threads are joined before atexit runs, so a save in flight is unaffected.

A gloo process group's worker threads let go of a collective's tensors just after the
collective returns; where Python has dropped its own references first, that release
takes the GIL. Once the interpreter has begun to shut down, CPython before 3.14 ends a
thread that asks for the GIL by unwinding it, and unwinding through torch's C++ aborts
the process ("terminate called without an active exception", pytorch/pytorch#190489).
A group that outlives the script (the library's own; those that FSDP's modules hold
after ``destroy_process_group``) keeps its threads until then, so a job could end in
SIGABRT, which torchrun takes for a failure. ``settle_threads_at_exit`` gives those
threads a moment, with the GIL released, before the shutdown begins.

Written by hand: no library offers either.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

# The pause at exit: a thread that is about to let go of tensors needs far less; on a
# loaded machine it may first wait its turn for a core.
_SETTLE_S = 0.1

_lock = threading.Lock()
_registered: set[str] = set()


def skip_final_collection() -> None:
    """Freeze the collector when this process exits (idempotent)."""
    _register_once("freeze", gc.freeze)


def settle_threads_at_exit() -> None:
    """Before the interpreter shuts down, pause briefly with the GIL released, so that
    gloo's threads let go of the last collectives' tensors while Python can still take
    them back (idempotent). Registered early, it runs after the atexit handlers that the
    job registers later (a last collective in one of those included)."""
    if sys.version_info < (3, 14):  # from 3.14 such a thread waits instead of aborting
        _register_once("settle", time.sleep, _SETTLE_S)


def leave_now(code: int) -> None:
    """End this process at once with ``code``: the logs and standard streams flushed,
    no atexit handler, no interpreter teardown (``os._exit``). For a process with nothing
    left to do that something waits on (a requeue, a stuck worker's parent)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _register_once(name: str, handler: Callable[..., object], *args: object) -> None:
    with _lock:
        if name not in _registered:
            atexit.register(handler, *args)
            _registered.add(name)
