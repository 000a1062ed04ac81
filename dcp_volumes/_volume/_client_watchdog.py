"""A watchdog on client creation, for processes that were forked from threaded ones.

A forked process inherits its parent's locks as they were at the fork. If
another thread of the parent was inside OpenSSL at that instant (an HTTPS
uploader, a client shutting down, a thread exiting), the child blocks forever
at its first TLS or hashing call, which is typically the creation of its
object-store client. Creating a client takes well under a second, so past
``DCP_VOLUMES_CLIENT_START_TIMEOUT`` seconds (default 120; 0 turns it off) the
watchdog logs what happened and how to avoid it. A process that is better
ended than left waiting then exits with ``STUCK_EXIT_CODE``; which one that
is, the layer above says (``stop_when_stuck``: the data layer names its
DataLoader workers); other processes only log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

from dcp_volumes import _env
from dcp_volumes._prompt_exit import leave_now

logger = logging.getLogger(__name__)

# The exit status of a process the watchdog stopped.
STUCK_EXIT_CODE = 75


def _never_stopped() -> str | None:
    return None


# Names this process where it is to stop when stuck, else None (see stop_when_stuck).
_stoppable: Callable[[], str | None] = _never_stopped


def stop_when_stuck(which: Callable[[], str | None]) -> None:
    """Have the watchdog end this process (``STUCK_EXIT_CODE``) when a client creation
    is stuck and ``which()`` names the process ("DataLoader worker", for the log);
    where it returns ``None``, the watchdog only logs."""
    global _stoppable
    _stoppable = which


@contextlib.contextmanager
def watch_client_start(what: str) -> Iterator[None]:
    """Run the body (a client's creation) under the watchdog."""
    limit = _env.client_start_timeout()
    if not limit:
        yield
        return
    timer = threading.Timer(limit, _stuck, args=(what, limit))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _stuck(what: str, limit: float) -> None:
    stopping = _stoppable()
    logger.error(
        "Creating the %s client in process %d has not finished after %.0f s. This process "
        "was probably forked while another thread of its parent held an OpenSSL lock, and "
        "will never get it. Fix: start DataLoader workers with "
        "multiprocessing_context='forkserver' (or avoid TLS threads while forking); set "
        "%s=0 to wait forever instead.%s",
        what,
        os.getpid(),
        limit,
        _env.CLIENT_START_TIMEOUT,
        f" Stopping this {stopping}." if stopping else "",
    )
    if stopping:
        leave_now(STUCK_EXIT_CODE)
