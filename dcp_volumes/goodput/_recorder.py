"""The per-process recorder: events in memory, a node-local journal, segment puts.

Cost per step: one ``time.time()``, one dict appended to a list and one line
written to the journal (a local file, no fsync). Nothing goes to the store per
step: with each save after its commit (the manager's background thread), at a
preemption and at close, the events recorded since the previous put go to the
store as one new segment (``ROOT/goodput/<attempt>/rank<r>-<first>-<end>.json``,
whole-object and create-only), so a put stays as small as the span between two
saves however long the run. The journal holds the same events line by line, so
that when an attempt is SIGKILLed, the next attempt on that node (its local rank
0) puts the journal's events that no segment holds, the tail, and deletes it.

The manager installs its recorder process-wide (``install``) so that the loader,
which never imports the checkpoint side, reports its input waits through
``note_input_wait`` (a no-op when no recorder is installed).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any

from dcp_volumes import _env
from dcp_volumes._exceptions import VolumeExistsError
from dcp_volumes._volume import Volume
from dcp_volumes.goodput._records import (
    GOODPUT_DIR,
    RankRecord,
    RecordError,
    SegmentName,
    parse_journal,
    parse_segment_name,
    process_start_time,
    segment_name,
)
from dcp_volumes.goodput._report import GoodputReport, analyse, load_records

logger = logging.getLogger(__name__)

__all__ = ["LiveView", "Recorder", "current", "emit", "install", "journal_dir",
           "new_attempt_id", "note_input_wait", "uninstall"]

_current: Recorder | None = None


def install(recorder: Recorder) -> None:
    """Make ``recorder`` the one the loader reports input waits to."""
    global _current
    _current = recorder


def uninstall(recorder: Recorder) -> None:
    global _current
    if _current is recorder:
        _current = None


def current() -> Recorder | None:
    return _current


def note_input_wait(seconds: float) -> None:
    """The training loop waited ``seconds`` for a batch (the loader's ``fetch_seconds``)."""
    recorder = _current
    if recorder is not None:
        recorder.wait_s += seconds


def journal_dir(staging_dir: str | None, root_url: str) -> str:
    """``<staging dir>/dcp_volumes-goodput/<hash of the root URL>``: one per run and node."""
    base = staging_dir or _env.staging_dir() or tempfile.gettempdir()
    key = hashlib.sha256(root_url.encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(base), "dcp_volumes-goodput", key)


_managers_started = 0  # in this process: a second manager records a new attempt


def new_attempt_id() -> tuple[str, float | None]:
    """A fresh attempt id that sorts by start time (the coordinator's, broadcast), and when
    the attempt started: ``None`` for the process's first manager (each rank's own process
    start), now for a later one."""
    global _managers_started
    _managers_started += 1
    first = _managers_started == 1
    started = process_start_time() if first else time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(started))
    suffix = "" if first else f".{_managers_started}"
    return (f"{stamp}.{int(started % 1 * 1000):03d}Z-{os.getpid()}{suffix}",
            None if first else started)


class Recorder:
    """One rank's events of one attempt (see the module docstring).

    Args:
        volume: the run root.
        attempt: the attempt's id, the same on every rank.
        rank, world: this rank and the job's size.
        journal: the node's journal directory (``journal_dir``).
        recover: put and delete the journals that other attempts left here (one
            rank per node: local rank 0).
        started: when the attempt started (default: this process's start).
    """

    def __init__(self, volume: Volume, *, attempt: str, rank: int, world: int,
                 journal: str, recover: bool, started: float | None = None) -> None:
        self.volume = volume
        self.attempt, self.rank, self.world = attempt, rank, world
        self.wait_s = 0.0  # input waits since the last step boundary (the training thread)
        self._events: list[dict[str, Any]] = []
        self._stored = 0  # events [0, _stored) are in the store's segments
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()
        self._last_step: int | None = None
        self._trained = False  # a step or a save: only then is a record worth a put
        self.preempted = False  # the preemption is recorded (and put) once
        self._header: dict[str, Any] = {"attempt": attempt, "rank": rank, "world": world,
                        "host": socket.gethostname(), "pid": os.getpid(),
                        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                        "restart_count": _int_or_none(
                            os.environ.get("TORCHELASTIC_RESTART_COUNT"))}
        self._journal_path: str | None = None
        self._journal: int | None = None  # a file descriptor
        try:
            os.makedirs(journal, exist_ok=True)
            if recover:
                self._recover(journal)
            self._journal_path = os.path.join(journal, f"{attempt}-rank{rank:05d}.jsonl")
            # Unbuffered: each event reaches the kernel at once, and survives a SIGKILL.
            self._journal = os.open(self._journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                    0o644)
            doc = RankRecord(source="journal", events=(), **self._header).header()
            self._write_line(_line(doc))
        except OSError as exc:
            logger.warning("goodput: no node-local journal in %s (%s); a SIGKILLed attempt's "
                           "last steps will be estimated", journal, exc)
            self._journal = None
        self.add("start", t=started if started is not None else process_start_time())
        self.add("ready")

    # -- events ---------------------------------------------------------------------------

    def add(self, kind: str, **fields: Any) -> None:
        event = {"k": kind, "t": fields.pop("t", None) or time.time(), **fields}
        with self._lock:
            self._events.append(event)
            self._write_line(_line(event))

    def step(self, step: int) -> None:
        """A step boundary (once per step, whichever of the manager's calls marks it).

        On the training thread every step, so its journal line is formatted directly
        (the same JSON as ``add`` writes, without ``json.dumps``)."""
        if step == self._last_step:
            return
        self._last_step = step
        self._trained = True
        wait, self.wait_s = self.wait_s, 0.0
        t, wait = time.time(), round(wait, 6)
        with self._lock:
            self._events.append({"k": "step", "t": t, "step": step, "wait": wait})
            self._write_line(b'{"k":"step","t":%a,"step":%d,"wait":%a}\n' % (t, step, wait))

    def _write_line(self, line: bytes) -> None:
        if self._journal is not None:
            try:
                os.write(self._journal, line)
            except OSError:
                self._journal = None  # a full or closed disk: the store's copy is enough

    def save_started(self, step: int) -> None:
        self._trained = True
        self.add("save0", step=step)

    def record(self, source: str = "live") -> RankRecord:
        """This rank's record so far."""
        with self._lock:
            events = tuple(self._events)
        return RankRecord(source=source, events=events, **self._header)

    # -- to the store -----------------------------------------------------------------------

    def put(self, source: str) -> bool:
        """Put the events since the last put as a new segment under ``ROOT/goodput/``;
        whether the store holds every event now (never raises: the job goes on)."""
        if not self._trained:
            return True  # a manager that only listed or restored leaves nothing behind
        with self._put_lock:
            with self._lock:
                first, events = self._stored, tuple(self._events[self._stored:])
            if not events:
                return True
            segment = RankRecord(source=source, events=events, first=first, **self._header)
            if not _put_segment(self.volume, segment):
                return False  # the next put carries these events too
            self._stored = first + len(events)
        return True

    def close(self, *, clean: bool) -> None:
        """The attempt ends here: the last put, then the journal goes."""
        self.add("exit", clean=clean)
        stored = self.put("close")
        with self._lock:
            journal, self._journal = self._journal, None
        if journal is not None:
            with contextlib.suppress(OSError):
                os.close(journal)
            if stored and self._journal_path is not None:  # the store holds it all now
                with contextlib.suppress(OSError):
                    os.remove(self._journal_path)

    def _recover(self, journal: str) -> None:
        """Put the journals of other attempts (killed ones) and delete them."""
        for path in sorted(glob.glob(os.path.join(journal, "*.jsonl"))):
            if os.path.basename(path).startswith(f"{self.attempt}-"):
                continue
            try:
                with open(path) as f:
                    record = parse_journal(f.read())
            except (OSError, RecordError) as exc:
                logger.warning("goodput: skipping the journal %s: %s", path, exc)
                with contextlib.suppress(OSError):
                    os.remove(path)
                continue
            if any(e["k"] in ("step", "save0") for e in record.events):
                try:
                    stored = _stored_events(self.volume, record.attempt, record.rank)
                except Exception as exc:
                    logger.warning("goodput: could not list %s for %s: %s",
                                   self.volume.display_url, path, exc)
                    continue
                # Only the tail no segment holds (an empty segment where none is left: it
                # says that the record is whole); a journal shorter than the store's
                # segments lost lines (a full disk) and tells nothing more.
                if len(record.events) >= stored:
                    tail = replace(record, events=record.events[stored:], first=stored)
                    if not _put_segment(self.volume, tail):
                        continue
                    logger.info("goodput: recovered the last %d event(s) of attempt %s rank "
                                "%d from this node's journal", len(tail.events),
                                record.attempt, record.rank)
            with contextlib.suppress(OSError):
                os.remove(path)


def _line(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


def _put_segment(volume: Volume, segment: RankRecord) -> bool:
    """One create-only put of ``segment``; whether the store holds it (never raises)."""
    name = segment_name(segment.attempt, segment.rank, segment.first,
                        segment.first + len(segment.events))
    try:
        volume.publish(name, segment.to_json(), exclusive=True)
    except VolumeExistsError:
        pass  # an earlier try reached the store: the same events
    except Exception as exc:
        logger.warning("goodput: could not write the record of rank %d to %s: %s",
                       segment.rank, volume.display_url, exc)
        return False
    return True


def _stored_events(volume: Volume, attempt: str, rank: int) -> int:
    """How many of a record's events its segments in the store hold (from their names)."""
    names = [parse_segment_name(f.path) for f in volume.list(f"{GOODPUT_DIR}/{attempt}")]
    return max((n.end for n in names if isinstance(n, SegmentName) and n.rank == rank),
               default=0)


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


class LiveView:
    """The run so far for one recorder: the earlier attempts' records from the store (read
    once, or again on ``refresh``) and this rank's own record of this attempt, in memory."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._earlier: list[RankRecord] | None = None
        self._problems: list[str] = []
        self._mu = threading.Lock()

    def report(self, *, refresh: bool = False) -> GoodputReport:
        with self._mu:
            if self._earlier is None or refresh:
                try:
                    records, self._problems = load_records(self.recorder.volume)
                except Exception as exc:  # the live view never stops a job
                    records, self._problems = [], [f"could not list the records: {exc}"]
                self._earlier = [r for r in records if r.attempt != self.recorder.attempt]
            earlier, problems = list(self._earlier), list(self._problems)
        return analyse([*earlier, self.recorder.record()],
                       root=self.recorder.volume.display_url, problems=problems)


def emit(report: GoodputReport, step: int) -> None:
    """The breakdown to ``logging`` and, where the program runs MLflow, to its active run
    (``goodput/<category>_s``), as the loader's metrics go (``data/_metrics.py``)."""
    pct = report.percent
    logger.info("goodput after step %d: %.1f%% of %.0f s (checkpoint blocking %.1f%%, input "
                "wait %.1f%%, restore %.1f%%, start-up %.1f%%, restart gaps %.1f%%, lost work "
                "%.1f%% over %d step(s), other %.1f%%)", step, report.goodput * 100,
                report.wall_s, pct["checkpoint_blocking"], pct["input_wait"], pct["restore"],
                pct["startup"], pct["restart_gap"], pct["lost_work"], report.lost_steps,
                pct["other"])
    # Only an mlflow the program imported itself: importing it here costs seconds.
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return
    values = {"goodput/goodput": report.goodput, "goodput/wall_s": report.wall_s,
              "goodput/lost_steps": float(report.lost_steps)}
    values.update({f"goodput/{k}_s": v for k, v in report.seconds.to_dict().items()})
    try:
        mlflow.log_metrics(values, step=step)
    except Exception as exc:  # a metrics sink must never stop training
        logger.warning("could not log goodput to MLflow: %s", exc)
