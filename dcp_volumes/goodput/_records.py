"""What one rank of one attempt recorded, and its JSON form in ``ROOT/goodput/``.

An *attempt* is one start of the job's processes (torchrun starts a new one at
each restart; a requeued job is a new one too). Each rank of an attempt keeps
one record: a header (attempt id, rank, world, host, pid, torchrun's run id and
restart count) and a list of events, each ``{"k": kind, "t": unix seconds, ...}``.

In the store a record is a series of *segments*, each put once and never
rewritten: ``goodput/<attempt>/rank<r>-<first>-<end>.json`` holds the header,
``first`` and the events ``[first, end)`` of the record, the ones recorded since
the previous put. A put's size is bounded by what happens between two saves,
not by the length of the run; the reader joins the segments in order.
Times are wall-clock so that the events of different processes, attempts and
nodes line up on one axis.

Event kinds (fields beyond ``k`` and ``t``):

* ``start``: the process started (from ``/proc``: the interpreter start, so the
  torch import and the process group set-up count as start-up)
* ``ready``: the ``CheckpointManager`` is up (process group formed, root checked)
* ``restore0`` / ``restore1``: a restore began / ended (``step``: the step
  loaded or ``None``; ``sources``: bytes read from ``local``, ``peer``, ``volume``)
* ``step``: a step boundary (``step``; ``wait``: seconds the steps since the
  previous boundary waited for input, from the loader's ``fetch_seconds``)
* ``save0`` / ``save1``: a save call began / returned to the loop (``step``)
* ``commit``: a save's ``.metadata`` is written (``step``)
* ``preempted``: every rank agreed on a preemption and its save is committed (``step``)
* ``exit``: the manager closed (``clean``: without an exception)

The record's ``source`` says which moment wrote it: ``commit`` (with a save),
``preempt``, ``close``, ``journal`` (the next attempt on the node uploaded the
node-local journal of an attempt that was killed), ``live`` (in memory).
A record never holds storage options or credentials: only the fields above.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "FORMAT",
    "GOODPUT_DIR",
    "RankRecord",
    "RecordError",
    "SegmentName",
    "join_segments",
    "parse_journal",
    "parse_segment_name",
    "process_start_time",
    "segment_name",
]

#: The directory under a run root that holds the records (checkpoint discovery skips it).
GOODPUT_DIR = "goodput"
FORMAT = "dcp_volumes.goodput"
VERSION = 1
KINDS = frozenset({"start", "ready", "restore0", "restore1", "step", "save0", "save1",
                   "commit", "preempted", "exit"})
SOURCES = frozenset({"commit", "preempt", "close", "journal", "live"})


class RecordError(ValueError):
    """A file under ``goodput/`` that is not a record of this format (said in the report)."""


_SEGMENT = re.compile(rf"{GOODPUT_DIR}/([^/]+)/rank(\d+)-(\d+)-(\d+)\.json")


@dataclass(frozen=True)
class SegmentName:
    """What a segment's path says: whose events and which of them (``[first, end)``)."""

    attempt: str
    rank: int
    first: int
    end: int


def segment_name(attempt: str, rank: int, first: int, end: int) -> str:
    """The path below the run root of the segment holding events ``[first, end)``."""
    return f"{GOODPUT_DIR}/{attempt}/rank{rank:05d}-{first:010d}-{end:010d}.json"


def parse_segment_name(path: str) -> SegmentName | None:
    """``path``'s segment (``None``: not a segment's name)."""
    m = _SEGMENT.fullmatch(path)
    if m is None or int(m[3]) > int(m[4]):
        return None
    return SegmentName(m[1], int(m[2]), int(m[3]), int(m[4]))


@dataclass(frozen=True)
class RankRecord:
    """One rank's record of one attempt (see the module docstring)."""

    attempt: str
    rank: int
    world: int
    host: str
    pid: int
    source: str
    events: tuple[dict[str, Any], ...]
    run_id: str | None = None
    restart_count: int | None = None
    first: int = 0  # the index of ``events[0]`` in the whole record (a segment's)

    def header(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "attempt": self.attempt,
                "rank": self.rank, "world": self.world, "host": self.host, "pid": self.pid,
                "run_id": self.run_id, "restart_count": self.restart_count,
                "source": self.source}

    def to_json(self) -> bytes:
        return json.dumps({**self.header(), "first": self.first, "events": list(self.events)},
                          separators=(",", ":")).encode()

    @classmethod
    def from_doc(cls, doc: Any, events: list[Any] | None = None) -> RankRecord:
        """A record from its parsed JSON (``events``: given apart, as a journal holds them)."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise RecordError("not a dcp_volumes goodput record (no \"format\": "
                              f"\"{FORMAT}\")")
        if doc.get("version") != VERSION:
            raise RecordError(f"record version {doc.get('version')!r}, this reader knows "
                              f"{VERSION}")
        raw = doc.get("events") if events is None else events
        try:
            attempt, rank, world = str(doc["attempt"]), int(doc["rank"]), int(doc["world"])
            if not isinstance(raw, list):
                raise TypeError("events is not a list")
            checked = tuple(_event(e) for e in raw)
            restarts = doc.get("restart_count")
            first = int(doc.get("first", 0))
            if first < 0:
                raise ValueError(f"first {first} < 0")
            return cls(attempt=attempt, rank=rank, world=world, host=str(doc.get("host", "")),
                       pid=int(doc.get("pid", 0)), source=str(doc.get("source", "")),
                       events=checked, run_id=doc.get("run_id"),
                       restart_count=None if restarts is None else int(restarts),
                       first=first)
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"a malformed record: {exc}") from None

    @classmethod
    def from_bytes(cls, data: bytes) -> RankRecord:
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RecordError(f"not JSON ({exc})") from None
        return cls.from_doc(doc)


def _event(e: Any) -> dict[str, Any]:
    if not isinstance(e, dict) or e.get("k") not in KINDS or not isinstance(
            e.get("t"), (int, float)):
        raise ValueError(f"an event that is not one: {str(e)[:80]}")
    return e


def join_segments(segments: list[RankRecord]) -> tuple[RankRecord, list[str]]:
    """One rank's record of one attempt from its segments, and what is missing from it.

    Segments are joined by their ``first``; where two overlap (a put that reached the
    store although its writer saw it fail, then a wider one), the events are the same
    and each is taken once. The header, ``source`` included, is the last segment's.
    """
    ordered = sorted(segments, key=lambda g: (g.first, g.first + len(g.events)))
    events: list[dict[str, Any]] = []
    problems: list[str] = []
    for g in ordered:
        if g.first > len(events):
            problems.append(f"{GOODPUT_DIR}/{g.attempt}/ rank {g.rank}: events "
                            f"{len(events)}-{g.first} are missing (a segment was deleted); "
                            "the report joins the rest")
            events.extend(g.events)
        else:
            events.extend(g.events[len(events) - g.first:])
    last = ordered[-1]
    return replace(last, events=tuple(events), first=0), problems


def parse_journal(text: str) -> RankRecord:
    """A record from a node-local journal: a header line, then one event per line.

    A SIGKILL may cut the last line short: it is skipped.
    """
    lines = text.splitlines()
    if not lines:
        raise RecordError("an empty journal")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise RecordError(f"a journal whose header is not JSON ({exc})") from None
    events = []
    for line in lines[1:]:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return RankRecord.from_doc({**header, "source": "journal"}, events)


def process_start_time() -> float:
    """When this process started (wall clock, ~10 ms resolution on Linux; now elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime) in clock ticks since boot; the name (field 2) may hold spaces.
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()
