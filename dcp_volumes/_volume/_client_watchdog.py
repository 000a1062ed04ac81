"""A watchdog on client creation, for processes that were forked from threaded ones.

A forked process inherits its parent's locks as they were at the fork. If
another thread of the parent was inside OpenSSL at that instant (an HTTPS
uploader, a client shutting down, a thread exiting), the child blocks forever
at its first TLS or hashing call, which is typically the creation of its
object-store client. Creating a client takes well under a second, so past
``DCP_VOLUMES_CLIENT_START_TIMEOUT`` seconds (default 120; 0 turns it off) the
watchdog logs what happened and how to avoid it. A DataLoader worker then
exits, so the training loop fails at once ("worker exited unexpectedly") and a
restart can resume, instead of waiting forever; other processes only log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from dcp_volumes import _env

logger = logging.getLogger(__name__)

# The exit status of a DataLoader worker the watchdog stopped.
STUCK_EXIT_CODE = 75


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
    from torch.utils.data import get_worker_info

    in_worker = get_worker_info() is not None
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
        " Stopping this DataLoader worker." if in_worker else "",
    )
    if in_worker:
        logging.shutdown()
        os._exit(STUCK_EXIT_CODE)
