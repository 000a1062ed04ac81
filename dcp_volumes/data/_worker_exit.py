"""DataLoader workers end with their training process, also when it is killed.

torch's workers watch ``os.getppid()``. A forkserver worker's parent is the
fork server, not the training process, and each worker holds the server's
"alive" pipe open: when the training process is killed (a crash, a preempted
rank) the server and its workers keep each other alive for good, holding
memory and shared-memory segments across every restart. Each worker waits on
the training process's sentinel (``multiprocessing.parent_process``) instead.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable


class ExitWithTrainingProcess:
    """``worker_init_fn``: watch the training process, then call the user's init."""

    def __init__(self, user_init: Callable[[int], None] | None) -> None:
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
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
