"""A process that runs a job through the library exits without the interpreter's last
full garbage collection.

At exit CPython collects every tracked object once more, the many that torch and DCP
import (DTensor, sympy) included. That pass is most of the time from a rank's last line
to its exit, which torchrun waits for before it starts a restart's new processes, and
which a preemption's grace period pays. Freezing the collector at exit (``gc.freeze``:
every object moves to the permanent generation, which no collection visits) skips it:
the other atexit handlers still run, and reference counting still frees what it frees.
Threads are joined before atexit runs, so a save in flight is unaffected. Written by
hand: no library offers it.
"""

from __future__ import annotations

import atexit
import gc
import threading

_lock = threading.Lock()
_registered = False


def skip_final_collection() -> None:
    """Freeze the collector when this process exits (idempotent)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(gc.freeze)
            _registered = True
