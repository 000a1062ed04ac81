"""Crash injection inside a rank: SIGKILL at the planned step or save phase.

Every rank builds a ``CrashInjector`` from the shared plan; the crash of
attempt ``a`` is the plan entry with ``index == a``, where ``a`` counts the
kill markers (``kill-<index>.json``) earlier attempts left in the run
directory, so a crash fires once although its steps are trained again.

Where a kill lands inside a save is seen from the library's own log records
(``SavePhases``), the only public signal of those phases:

* ``uploaded %s (%d bytes)`` (debug, an upload thread): one shard file of
  this rank is on the volume, others are still uploading -> ``upload`` kills;
* ``rank %d wrote %d files`` (debug, the save thread): all of this rank's
  shards are on the volume (verified on object stores) and the save is about
  to hand its results to the coordinator, which then writes the manifest and
  ``.metadata``. For a ``commit`` kill every rank leaves a marker file at this
  point, and rank 0 dies once all markers are there: every shard is on the
  volume and ``.metadata`` is not;
* ``checkpoint step %d committed`` (info, the manager's thread): the save
  is complete; recorded as a ``committed`` event;
* ``peer tier: %s replicated: ... kept %d of %d files ...`` (info, the
  replication thread, ``local_replicas``): this rank holds its peers' files of
  that checkpoint; recorded as a ``replicated`` event.

A ``node`` crash is a node loss: the first rank of the node named to die
SIGKILLs its torchrun agent, the node's other ranks and itself, each rank with
its process group (its loader workers); the launcher then wipes the node's
local directory and, unless the job is to shrink, requeues the job with a
replacement node (``_launcher``).

If the library's messages change, the kills do not fire and the report says
so (a planned crash that never happened fails the demo).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from dcp_volumes.demo._config import Crash
from dcp_volumes.demo._events import EventLog

logger = logging.getLogger(__name__)

_FILE_UPLOADED = "uploaded %s"
_RANK_WROTE = "rank %d wrote"
_COMMITTED = "checkpoint step %d committed"
_REPLICATED = re.compile(r"peer tier: (\S+) replicated: .* kept (\d+) of (\d+) files")

#: How long the coordinator waits for the other ranks' shards before a commit kill.
_SHARDS_TIMEOUT_S = 60.0


def kill_marker(run_dir: str, index: int) -> str:
    """The file that records that crash ``index`` fired."""
    return os.path.join(run_dir, f"kill-{index}.json")


def kills_so_far(run_dir: str) -> int:
    """How many planned crashes have fired in this run (the attempt's index)."""
    return sum(1 for n in os.listdir(run_dir) if n.startswith("kill-") and n.endswith(".json"))


class CrashInjector:
    """Fires this rank's planned crash, if any, and records the save phases it sees.

    Args:
        crashes: the run's plan.
        attempt: crashes fired before this attempt.
        rank, world: this process in this attempt's world.
        setup: ``dcp_volumes`` or ``naive`` (the naive job saves on rank 0 only, so a
            crash inside a save hits rank 0).
        events: this process's event log.
        run_dir: where kill and shard markers go.
        node: this rank's node (the launcher's number of its torchrun agent).
        node_victim: this rank takes its node down in a ``node`` crash (the first rank
            of the last node: never the node that hosts the rendezvous).
    """

    def __init__(self, crashes: list[Crash], *, attempt: int, rank: int, world: int,
                 setup: str, events: EventLog, run_dir: str, node: int = 0,
                 node_victim: bool = False) -> None:
        self.attempt, self.rank, self.world = attempt, rank, world
        self.events, self.run_dir = events, run_dir
        self.crash = next((c for c in crashes if c.index == attempt), None)
        self.setup, self.node = setup, node
        if self.crash is not None and self.crash.kind == "node":
            self.mine = node_victim
        else:
            self.mine = self.crash is not None and self.crash.victim(setup) == rank
        self.inflight: int | None = None
        self.evidence: Callable[[int], dict[str, Any]] | None = None
        self._fired = threading.Event()

    # -- the training loop's hooks --------------------------------------------------------

    def before_save(self, step: int) -> None:
        """The loop is about to save ``step`` (one save is in flight at a time)."""
        self.inflight = step

    def after_compute(self, step: int) -> None:
        """Step ``step`` is computed: ``step`` and ``node`` crashes fire here."""
        c = self.crash
        if self.mine and c is not None and c.kind in ("step", "node") and c.step == step:
            self.kill(step)

    def in_naive_upload(self, step: int, done: int, total: int) -> None:
        """The naive save of ``step`` has written ``done`` of ``total`` chunks to the volume.

        ``upload`` crashes fire halfway, ``commit`` crashes once every chunk is written
        (before the file is closed, which is when an object store makes it visible).
        """
        c = self.crash
        if not (self.mine and c is not None and c.hits_save and c.step == step):
            return
        if done >= (total if c.kind == "commit" else max(1, total // 2)):
            self.kill(step, {"naive_chunks_written": done, "naive_chunks": total})

    # -- the library's save phases (from its log records) ---------------------------------

    def on_file_uploaded(self) -> None:
        c = self.crash
        if self.mine and c is not None and c.kind == "upload" and self.inflight == c.step:
            self.kill(c.step, {"phase": "one shard file of this rank uploaded, others not"})

    def on_rank_wrote(self) -> None:
        c = self.crash
        if c is None or c.kind != "commit" or self.inflight != c.step:
            return
        marker = os.path.join(self.run_dir, f"shards-{self.attempt}-{self.rank}")
        with open(marker, "w") as f:
            f.write(str(time.time()))
        if not self.mine:
            return
        deadline = time.monotonic() + _SHARDS_TIMEOUT_S
        missing = list(range(self.world))
        while time.monotonic() < deadline:
            missing = [r for r in range(self.world) if not os.path.exists(
                os.path.join(self.run_dir, f"shards-{self.attempt}-{r}"))]
            if not missing:
                break
            time.sleep(0.002)
        evidence: dict[str, Any] = {"ranks_with_all_shards_uploaded": self.world - len(missing)}
        if self.evidence is not None:
            try:
                evidence.update(self.evidence(c.step))
            except Exception as exc:  # evidence is a nicety; the kill must still happen
                evidence["evidence_error"] = repr(exc)
        self.kill(c.step, evidence)

    def on_committed(self, step: int) -> None:
        self.events.write("committed", step=step)

    def on_replicated(self, name: str, kept: int, of: int) -> None:
        self.events.write("replicated", name=name, kept=kept, of=of)

    # -- the kill -------------------------------------------------------------------------

    def kill(self, step: int, evidence: dict[str, Any] | None = None) -> None:
        """Record the crash, then SIGKILL this process (for ``node``: its agent, the
        node's other ranks and this one, each with its process group)."""
        c = self.crash
        if c is None or self._fired.is_set():
            return
        self._fired.set()
        ranks: list[int] = []
        if c.kind == "node":
            ranks = [pid for pid in _children(os.getppid()) if pid != os.getpid()]
            evidence = {**(evidence or {}), "node": self.node, "agent_pid": os.getppid(),
                        "ranks_killed": 1 + len(ranks)}
        doc = {"crash": c.__dict__, "step": step, "t": time.time(), "pid": os.getpid(),
               "node": self.node, "evidence": evidence or {}}
        self.events.write("kill", crash=c.__dict__, step=step, evidence=evidence or {},
                          what=c.describe(self.setup))
        path = kill_marker(self.run_dir, c.index)
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)
        logger.warning("injected crash %d: %s", c.index + 1, c.describe(self.setup))
        if c.kind == "node":
            os.kill(os.getppid(), signal.SIGKILL)  # torchrun's agent of this node
            for pid in ranks:
                _kill_group(pid)
            _kill_group(os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a torchrun agent's: its ranks)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # Field 4 is the parent; the name (field 2) may hold spaces and parentheses.
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _kill_group(pid: int) -> None:
    """SIGKILL ``pid`` and, where it leads one (torchrun starts each rank in a session of
    its own), its process group: the rank's loader workers and their fork server."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class SavePhases(logging.Handler):
    """Turns the library's save-phase log records into ``CrashInjector`` calls."""

    def __init__(self, injector: CrashInjector) -> None:
        super().__init__(logging.DEBUG)
        self.injector = injector

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not isinstance(msg, str):
            return
        if msg.startswith(_FILE_UPLOADED):
            self.injector.on_file_uploaded()
        elif msg.startswith(_RANK_WROTE):
            self.injector.on_rank_wrote()
        elif msg.startswith(_COMMITTED) and isinstance(record.args, tuple) and record.args:
            step = record.args[0]
            if isinstance(step, int):
                self.injector.on_committed(step)
        elif msg.startswith("peer tier: ") and (m := _REPLICATED.match(record.getMessage())):
            self.injector.on_replicated(m.group(1), int(m.group(2)), int(m.group(3)))

    @classmethod
    def install(cls, injector: CrashInjector) -> SavePhases:
        """Attach to the library's checkpoint loggers (at debug level, which they need)."""
        handler = cls(injector)
        log = logging.getLogger("dcp_volumes.checkpoint")
        log.setLevel(logging.DEBUG)
        log.addHandler(handler)
        return handler
