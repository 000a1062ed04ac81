"""What the ranks measured: one JSON-lines file per process, read back by the report.

Each rank process appends events (``{"ev": ..., "t": unix seconds, ...}``) to
``<run dir>/events-<pid>.jsonl``, one ``write`` per line, so a SIGKILL loses
at most the event being written: the kernel keeps what was written. Times
are wall-clock (``time.time()``) so that events of different processes and
attempts line up on one axis.

Event kinds (fields beyond ``ev`` and ``t``):

* ``start``: ``t_proc`` (process start), ``t_import`` (torch imported),
  ``t_group`` (process group up), ``rank``, ``world``, ``node``, ``attempt``
  (crashes before this attempt), ``leg``, ``setup``, ``pid``
* ``restored``: ``step`` (None: fresh), ``t0``, ``t1``, ``sources`` (bytes the
  restore read from ``local`` files, ``peer`` nodes and the ``volume``)
* ``step``: ``step``, ``t0`` (asks for the batch), ``tf`` (has it), ``tc``
  (optimizer step done), ``t1`` (save returned), ``fetch`` (the loader's
  fetch_seconds), ``cpu`` (the training thread's CPU seconds from ``tf`` to
  ``tc``), ``save`` ([t0, t1] of the blocking save call or None),
  ``samples``, ``loss``
* ``staged`` / ``committed``: ``step`` (a save left the training loop / its
  ``.metadata`` is written), from the library's log records
* ``replicated``: ``name`` (a checkpoint directory), ``kept``, ``of`` (files of
  peers this rank kept as replicas), from the library's log records
* ``kill``: ``crash`` (the plan entry), ``step``, ``evidence`` (for a node loss:
  ``node``, ``agent_pid``, ``ranks_killed``)
* ``preempted``: ``step`` (``reached_preemption`` said the save of ``step`` is
  committed; the rank leaves the loop), then ``exit`` once the rank is done
  (the launcher records the SIGTERM it sent in ``kill-<index>.json``)
* ``end``: ``digest`` (rank 0), ``final_wait`` ([t0, t1] of the last ``wait``)
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
from typing import Any

from dcp_volumes.goodput._records import process_start_time

__all__ = ["EventLog", "process_start_time", "read_events"]


class EventLog:
    """Appends events of one process; safe to call from several threads."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, f"events-{os.getpid()}.jsonl")
        # Line-buffered: every event reaches the kernel before the next line of code.
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (lives with the process)
        self._lock = threading.Lock()

    def write(self, ev: str, **fields: Any) -> None:
        """Append one event stamped with the current time (unless ``t`` is given)."""
        doc = {"ev": ev, "t": fields.pop("t", time.time()), **fields}
        line = json.dumps(doc, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        """Close the file (further writes raise)."""
        with self._lock:
            self._file.close()


def read_events(run_dir: str) -> list[list[dict[str, Any]]]:
    """The events of every process of a run, one list per process, oldest process first.

    A process's file may end in a half-written line (SIGKILL mid-write); it is skipped.
    """
    procs = []
    for path in glob.glob(os.path.join(run_dir, "events-*.jsonl")):
        events = []
        with open(path) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        if events and events[0].get("ev") == "start":
            procs.append(events)
    procs.sort(key=lambda evs: (evs[0]["leg"], evs[0]["attempt"], evs[0]["rank"]))
    return procs
