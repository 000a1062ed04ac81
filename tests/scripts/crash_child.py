"""A training job that saves through CheckpointManager in a loop until it is SIGKILLed.

Run by tests/test_crash_injection.py in a forked child. It reports what it is
doing through a pipe, from the library's own log records (the manager and the
writer log each phase), so the parent can tell in which phase the kill landed:

    ("restored", step | None, differences)   after resuming, before the loop
    ("staging", step)    save(step) waited for the previous save, now stages
    ("uploading", step)  staged; the upload runs in the background
    ("committed", step)  .metadata is written
    ("deleting", name)   retention deletes an old checkpoint
    ("finished", step)   retention and local-tier cleanup are done
"""

from __future__ import annotations

import logging
import random
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from dcp_volumes.checkpoint._encryption import Encryption
from dcp_volumes.checkpoint._manager import CheckpointManager
from testkit.states import differences, empty_state, state_for

# (message prefix, event): the manager's log lines for each phase.
_PHASES = (
    ("step %d: staging", "staging"),
    ("checkpoint step %d staged", "uploading"),
    ("checkpoint step %d committed", "committed"),
    ("retention: deleting", "deleting"),
    ("step %d: save finished", "finished"),
)


class _Reporter(logging.Handler):
    def __init__(self, conn: Connection) -> None:
        super().__init__(logging.DEBUG)
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, event: tuple[Any, ...]) -> None:
        with self._lock:  # the manager's background thread logs too
            self._conn.send(event)

    def emit(self, record: logging.LogRecord) -> None:
        for prefix, event in _PHASES:
            if record.msg.startswith(prefix):
                arg = record.args[-1] if event == "deleting" else record.args[0]  # type: ignore[index]
                self.send((event, arg))
                return


def run(root: str, options: dict[str, Any], keep_last: int, seed: int, conn: Connection,
        size: int, key: bytes | None = None) -> None:
    """Resume from the newest complete checkpoint, then save every step until killed
    (``key``: encrypted with it, key id ``crash``)."""
    reporter = _Reporter(conn)
    log = logging.getLogger("dcp_volumes")
    log.setLevel(logging.DEBUG)
    log.addHandler(reporter)
    mgr = CheckpointManager(root, keep_last=keep_last, storage_options=options,
                            encryption=Encryption(key=key, key_id="crash") if key else None)
    state = empty_state(size=size)
    step = mgr.restore(state)
    diff = differences(state, state_for(step, size=size)) if step is not None else []
    reporter.send(("restored", step, diff))
    rng = random.Random(seed)
    step = (step or 0) + 1
    while True:
        mgr.save(step, state_for(step, size=size))
        time.sleep(rng.uniform(0.0, 0.01))  # "training" between saves
        step += 1
