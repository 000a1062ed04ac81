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

A forked worker also inherits the training process's network connections: its
process groups' sockets, its store's, its HTTP clients'. While a worker holds one,
the connection outlives a killed training process, and its peers, blocked in a
collective with it, fail only once that worker has noticed and exited. Each worker
lets go of them first thing (``release_inherited_connections``), and the training
process keeps them from what it execs (``keep_connections_from_children``): torch's
shared-memory manager is one such helper.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import stat
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


@contextlib.contextmanager
def starting_workers() -> Iterator[None]:
    """Around whatever may start worker processes or the fork server: the group signals
    held, and the training process's connections kept from what it execs."""
    keep_connections_from_children()
    with group_signals_held():
        yield


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
        release_inherited_connections()
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


def keep_connections_from_children() -> None:
    """In the training process, before it starts workers: its TCP sockets (process
    groups, store, HTTP clients) are closed across exec, so a helper that torch execs
    (``torch_shm_manager``, which outlives a killed rank for seconds) holds none."""
    for fd in _network_sockets():
        # Closed since it was listed (a client's idle connection, on another thread):
        # nothing of it to keep.
        with contextlib.suppress(OSError):
            os.set_inheritable(fd, False)


def release_inherited_connections() -> None:
    """In a forked worker, before it opens any of its own: every TCP socket it holds was
    the training process's; each fd is pointed at /dev/null instead, so the connection
    closes with the training process. The fd number stays taken: whatever object still
    names it later closes /dev/null, never a reused fd."""
    fds = _network_sockets()
    if not fds:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            os.dup2(null, fd)
    finally:
        os.close(null)


def _network_sockets() -> list[int]:
    """This process's open TCP/UDP sockets by fd (none where /proc is absent)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc (not Linux): nothing to find by this route
        return []
    return [fd for fd in fds if _is_network_socket(fd)]


def _is_network_socket(fd: int) -> bool:
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        with socket.socket(fileno=os.dup(fd)) as sock:
            return sock.family in (socket.AF_INET, socket.AF_INET6)
    except OSError:  # closed meanwhile (the listing's own fd), or not a socket we can ask
        return False
