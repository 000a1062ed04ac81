"""DataLoader workers belong to their training process: they end with it, and its
signals are its own.

A launcher may signal a training process's whole process group: torchrun's
agent ``killpg``s each rank with SIGTERM when the job is stopped (a
preemption), which the rank handles (``preemption_signals``) by saving and
stopping at a step boundary. A worker, or the fork server, that got it would
die, and the rank's next batch would fail before the save. So worker processes
start with SIGTERM held (``group_signals_held``) and, before anything else,
move to a process group of their own (``leave_training_group``); a SIGTERM sent
to the worker itself (torch stopping it) still ends it, and the training
process gets any that came meanwhile once the hold ends.

torch's workers watch ``os.getppid()``. A forkserver worker's parent is the
fork server, not the training process, and each worker holds the server's
"alive" pipe open: when the training process is killed (a crash, a preempted
rank) the server and its workers keep each other alive for good, holding
memory and shared-memory segments across every restart. Each worker waits on
the training process's sentinel (``multiprocessing.parent_process``) instead.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator

# Signals a launcher sends to the whole group of a training process.
_GROUP_SIGNALS = {signal.SIGTERM}


@contextlib.contextmanager
def group_signals_held() -> Iterator[None]:
    """Hold the group signals in this thread while it starts worker processes: they
    inherit the hold, so none dies of one before it has left the group."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def leave_training_group() -> None:
    """In a worker process or the fork server: a process group of its own, then the held
    group signals released (one that reached the old group meanwhile is dropped)."""
    for sig in _GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(OSError):  # already a group or session leader
        os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _GROUP_SIGNALS)
    for sig in _GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


class ExitWithTrainingProcess:
    """``worker_init_fn``: watch the training process, then call the user's init."""

    def __init__(self, user_init: Callable[[int], None] | None) -> None:
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        leave_training_group()
        parent = multiprocessing.parent_process()
        if parent is not None:
            threading.Thread(
                target=_exit_when_gone, args=(parent,), name="dcpv-parent-watch", daemon=True
            ).start()
        if self.user_init is not None:
            self.user_init(worker_id)


def _exit_when_gone(parent: multiprocessing.process.BaseProcess) -> None:
    parent.join()  # returns once the training process has ended, however it ended
    os._exit(1)  # nobody is left to take a batch; no cleanup could reach it either
