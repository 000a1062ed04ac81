"""From the records under ``ROOT/goodput/`` to where the job's wall time went.

Accounting, per attempt, on the clock of its lowest rank (the gradient
all-reduce keeps ranks in lockstep; every rank's record is kept for the timeline):

* ``startup``: process start -> training begins (the end of the restore, else the
  manager up), less the restore: the interpreter, the torch import, the group;
* ``restore``: the restore's span;
* each step, from the previous boundary (or the beginning) to its own, splits into
  ``input_wait`` (the loader's ``fetch_seconds``), ``checkpoint_blocking`` (save calls
  inside the span) and ``compute`` (the rest) when the step is kept, and counts as
  ``lost_work`` when a later attempt resumed from an earlier step (by the step
  numbers: it was computed again, or thrown away), less the blocking of a save of a
  kept step inside it (the save after the last kept step: its checkpoint is the one
  the next attempt resumed from, or could have);
* after the last boundary: the save calls there are ``checkpoint_blocking``, the rest
  ``other`` (the last commit waited on at close, a preemption's wait), or
  ``lost_work`` when the attempt was killed (the step in progress was lost);
* ``restart_gap``: an attempt's last record -> the next attempt's process start.

``other`` of the whole run is what no category holds. Where a killed attempt's
journal was not recovered (the next attempt ran on other nodes), its record ends
at its last commit: the time from there to the kill is estimated (the next start
less the restart gaps seen elsewhere) and counted as lost work, and the report
says so (``estimated``).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any

from dcp_volumes._volume import Volume
from dcp_volumes.goodput._model import DEFAULT_FAILURES_PER_DAY, DEFAULT_RESTART_S, GoodputModel
from dcp_volumes.goodput._records import (
    GOODPUT_DIR,
    RankRecord,
    RecordError,
    SegmentName,
    join_segments,
    parse_segment_name,
)

__all__ = ["AttemptReport", "Breakdown", "GoodputReport", "RecordSpans", "SaveInterval",
           "analyse", "goodput_report", "load_records", "reduce_record"]

CATEGORIES = ("compute", "checkpoint_blocking", "input_wait", "restore", "startup",
              "restart_gap", "lost_work", "other")
_READ_CONCURRENCY = 16


@dataclass(frozen=True)
class Breakdown:
    """Seconds of wall time by category (see the module docstring)."""

    compute: float = 0.0
    checkpoint_blocking: float = 0.0
    input_wait: float = 0.0
    restore: float = 0.0
    startup: float = 0.0
    restart_gap: float = 0.0
    lost_work: float = 0.0
    other: float = 0.0

    def __add__(self, other: Breakdown) -> Breakdown:
        return Breakdown(**{k: getattr(self, k) + getattr(other, k) for k in CATEGORIES})

    @property
    def total(self) -> float:
        return float(sum(getattr(self, k) for k in CATEGORIES))

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in CATEGORIES}

    def percent(self, wall: float) -> dict[str, float]:
        return {k: 100 * getattr(self, k) / wall if wall > 0 else 0.0 for k in CATEGORIES}


@dataclass(frozen=True)
class AttemptReport:
    """One attempt: one start of the job's processes.

    Attributes:
        attempt: its id (its records are under ``goodput/<attempt>/``).
        ended: ``exit`` (closed cleanly), ``failed`` (closed by an exception),
            ``preempted``, ``killed`` (no end recorded: SIGKILL, a lost node) or
            ``running`` (the attempt asking, in ``CheckpointManager.goodput()``).
        restored_step: the step its restore loaded (``None``: none loaded, or no restore).
        resumed_from: the step it went on from (0: from scratch; ``None``: unknown, no
            restore and no step); a step after it in an earlier attempt was lost.
        steps: step boundaries it recorded; ``lost_steps`` of them were lost.
        estimated: the spans of it that are estimated, in words (empty: all measured).
    """

    attempt: str
    index: int
    ranks: tuple[int, ...]
    world: int
    start: float
    end: float
    ended: str
    restored_step: int | None
    resumed_from: int | None
    first_step: int | None
    last_step: int | None
    steps: int
    lost_steps: int
    saves: int
    commits: int
    restore_bytes: Mapping[str, int]
    seconds: Breakdown
    estimated: tuple[str, ...] = ()

    @property
    def wall_s(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def goodput(self) -> float:
        return self.seconds.compute / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "index": self.index, "ranks": list(self.ranks),
                "world": self.world, "start": self.start, "end": self.end,
                "wall_s": self.wall_s, "ended": self.ended, "goodput": self.goodput,
                "restored_step": self.restored_step, "resumed_from": self.resumed_from,
                "first_step": self.first_step,
                "last_step": self.last_step, "steps": self.steps,
                "lost_steps": self.lost_steps, "saves": self.saves, "commits": self.commits,
                "restore_bytes": dict(self.restore_bytes),
                "seconds": self.seconds.to_dict(),
                "percent": self.seconds.percent(self.wall_s),
                "estimated": list(self.estimated)}


@dataclass(frozen=True)
class SaveInterval:
    """The job's save interval as measured, and what the goodput model makes of it.

    The model (``GoodputModel``: ``failures_per_day``, and ``restart_s``: this run's
    mean restart cost where it had restarts) gives the goodput at the measured interval
    and the best interval for the measured save costs.
    """

    interval_s: float
    interval_steps: float | None
    blocking_s: float
    commit_lag_s: float
    failures_per_day: float
    restart_s: float
    model_goodput: float
    best_interval_s: float
    best_goodput: float

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class GoodputReport:
    """Where the wall time of a run went, from its first process start to its last record.

    ``goodput`` is ``seconds.compute / wall_s``. ``problems`` names the files under
    ``goodput/`` that were not records (corrupt, foreign); the rest is reported anyway.
    """

    root: str
    wall_s: float
    seconds: Breakdown
    attempts: tuple[AttemptReport, ...]
    lost_steps: int
    save_interval: SaveInterval | None
    estimated: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    records: tuple[RankRecord, ...] = field(default=(), repr=False, compare=False)

    @property
    def goodput(self) -> float:
        return self.seconds.compute / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def percent(self) -> dict[str, float]:
        return self.seconds.percent(self.wall_s)

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "goodput": self.goodput, "wall_s": self.wall_s,
                "seconds": self.seconds.to_dict(), "percent": self.percent,
                "attempts": [a.to_json() for a in self.attempts],
                "restarts": max(0, len(self.attempts) - 1), "lost_steps": self.lost_steps,
                "save_interval": (self.save_interval.to_json()
                                  if self.save_interval is not None else None),
                "estimated": list(self.estimated), "problems": list(self.problems)}

    def text(self) -> str:
        """The report for people: the breakdown, the attempts, the interval advice."""
        lines = [f"goodput of {self.root}: {self.goodput:.1%} of {self.wall_s:.1f} s wall, "
                 f"{len(self.attempts)} attempt(s), {self.lost_steps} step(s) lost"]
        pct = self.percent
        for k in CATEGORIES:
            lines.append(f"  {k.replace('_', ' '):<20}{self.seconds.to_dict()[k]:>10.1f} s"
                         f"{pct[k]:>7.1f}%")
        lines.append("")
        lines.append(f"{'ATTEMPT':<28}{'ENDED':<10}{'RANKS':>6}{'STEPS':>12}{'LOST':>6}"
                     f"{'WALL s':>9}{'GOODPUT':>9}")
        for a in self.attempts:
            steps = (f"{a.first_step}-{a.last_step}" if a.first_step is not None else "-")
            lines.append(f"{a.attempt:<28}{a.ended:<10}{len(a.ranks):>6}{steps:>12}"
                         f"{a.lost_steps:>6}{a.wall_s:>9.1f}{a.goodput:>9.1%}")
        s = self.save_interval
        if s is not None:
            steps = f" ({s.interval_steps:g} steps)" if s.interval_steps is not None else ""
            lines.append("")
            lines.append(
                f"save interval {s.interval_s:.1f} s{steps}, each save blocking "
                f"{s.blocking_s:.3f} s and committing {s.commit_lag_s:.1f} s later; the "
                f"goodput model ({s.failures_per_day:g} failures/day, {s.restart_s:.0f} s per "
                f"restart) gives {s.model_goodput:.2%} at this interval and "
                f"{s.best_goodput:.2%} at the best one, {s.best_interval_s:.0f} s")
        for note in self.estimated:
            lines.append(f"estimated: {note}")
        for problem in self.problems:
            lines.append(f"problem: {problem}")
        return "\n".join(lines)


# -- reading -------------------------------------------------------------------------------


def load_records(volume: Volume) -> tuple[list[RankRecord], list[str]]:
    """Every record under ``goodput/`` of the run root (each rank's of each attempt, its
    segments joined), and the files that are not one."""
    files = volume.list(GOODPUT_DIR)
    named = [(f.path, parse_segment_name(f.path)) for f in files]
    problems = [f"{path}: not a goodput record (a foreign file; expected "
                f"{GOODPUT_DIR}/<attempt>/rank<r>-<first>-<end>.json)"
                for path, name in named if name is None]
    wanted = [(path, name) for path, name in named if name is not None]

    def read(item: tuple[str, SegmentName]) -> RankRecord | str:
        path, name = item
        try:
            segment = RankRecord.from_bytes(volume.read_bytes(path))
        except RecordError as exc:
            return f"{path}: {exc}"
        if ((segment.attempt, segment.rank, segment.first) != (name.attempt, name.rank,
                                                              name.first)
                or len(segment.events) != name.end - name.first):
            return f"{path}: its content is not the segment its name says"
        return segment

    with ThreadPoolExecutor(max_workers=max(1, min(_READ_CONCURRENCY, len(wanted)))) as pool:
        found = list(pool.map(read, wanted))
    problems += [r for r in found if isinstance(r, str)]
    segments: dict[tuple[str, int], list[RankRecord]] = {}
    for r in found:
        if isinstance(r, RankRecord):
            segments.setdefault((r.attempt, r.rank), []).append(r)
    records = []
    for key in sorted(segments):
        record, missing = join_segments(segments[key])
        records.append(record)
        problems += missing
    return records, problems


def goodput_report(
    root: str, *, storage_options: Mapping[str, Any] | None = None,
) -> GoodputReport:
    """The goodput report of the run whose checkpoints live under ``root``.

    Args:
        root: the run root given to ``CheckpointManager`` (any URL or path it takes).
        storage_options: client options (endpoint, credentials); ``None``:
            ``DCP_VOLUMES_STORAGE_OPTIONS``, if set.

    A corrupt or foreign file under ``goodput/`` is named in ``problems``; the rest is
    reported. A run with no records reports zero wall time and says so in ``problems``.
    """
    volume = Volume(root, storage_options=storage_options)
    records, problems = load_records(volume)
    if not records:
        problems.append(f"no goodput records under {volume.display_url}/{GOODPUT_DIR}/ "
                        "(CheckpointManager records them unless goodput=False, from the "
                        "first step of a job)")
    return analyse(records, root=volume.display_url, problems=problems)


# -- analysis ------------------------------------------------------------------------------


@dataclass
class RecordSpans:
    """One rank's record of one attempt, reduced to spans (an attempt's reference rank's
    for the accounting; every rank's for the timeline)."""

    attempt: str
    records: dict[int, RankRecord]
    start: float = 0.0
    end: float = 0.0
    begin: float = 0.0
    ended: str = "killed"
    restore_spans: list[tuple[float, float]] = field(default_factory=list)
    restored: int | None = None
    has_restore: bool = False
    restore_bytes: dict[str, int] = field(default_factory=dict)
    boundaries: list[tuple[int, float, float]] = field(default_factory=list)
    saves: list[tuple[int, float, float | None]] = field(default_factory=list)
    commits: dict[int, float] = field(default_factory=dict)
    journal_tail: bool = False  # its record holds every event up to the end

    @property
    def ref(self) -> RankRecord:
        return self.records[min(self.records)]

    @property
    def restore_s(self) -> float:
        return sum(t1 - t0 for t0, t1 in self.restore_spans)

    @property
    def resumed_from(self) -> int | None:
        if self.has_restore:
            return self.restored or 0
        return self.boundaries[0][0] - 1 if self.boundaries else None


def reduce_record(ref: RankRecord, records: dict[int, RankRecord] | None = None) -> RecordSpans:
    """The spans of ``ref`` (``records``: every rank's record of its attempt)."""
    a = RecordSpans(ref.attempt, records or {ref.rank: ref})
    events = sorted(ref.events, key=lambda e: e["t"])
    a.start = next((e["t"] for e in events if e["k"] == "start"), events[0]["t"])
    a.end = max(e["t"] for e in events)
    ready = next((e["t"] for e in events if e["k"] == "ready"), a.start)
    a.begin = ready
    opened: float | None = None
    for e in events:
        k, t = e["k"], e["t"]
        if k == "restore0":
            opened = t
        elif k == "restore1":
            if opened is not None:
                a.restore_spans.append((opened, t))
                opened = None
            a.begin = max(a.begin, t)
            a.has_restore = True
            a.restored = e.get("step")
            for source, n in (e.get("sources") or {}).items():
                a.restore_bytes[source] = a.restore_bytes.get(source, 0) + int(n)
        elif k == "step":
            a.boundaries.append((int(e["step"]), t, float(e.get("wait") or 0.0)))
        elif k == "save0":
            a.saves.append((int(e["step"]), t, None))
        elif k == "save1" and a.saves and a.saves[-1][2] is None:
            a.saves[-1] = (a.saves[-1][0], a.saves[-1][1], t)
        elif k == "commit":
            a.commits[int(e["step"])] = t
        elif k == "preempted":
            a.ended = "preempted"
        elif k == "exit" and a.ended != "preempted":
            a.ended = "exit" if e.get("clean", True) else "failed"
    if ref.source == "live" and a.ended == "killed":
        a.ended = "running"
    a.journal_tail = ref.source in ("journal", "live") or a.ended != "killed"
    if records and a.ended in ("exit", "failed"):
        _end_at_a_peers_death(a, ref, records)
    return a


def _end_at_a_peers_death(a: RecordSpans, ref: RankRecord,
                          records: dict[int, RankRecord]) -> None:
    """Where another rank of the attempt died (no exit recorded), the attempt ended then:
    what the reference rank did after (waiting on the dead peer, failing, exiting) is the
    restart's, not the attempt's. The death is the dead rank's last journaled event, or,
    without its journal, the reference rank's last step boundary."""
    dead = [r for r in records.values() if r is not ref and r.events
            and not any(e["k"] in ("exit", "preempted") for e in r.events)]
    if not dead:
        return
    known = [max(e["t"] for e in r.events) for r in dead if r.source == "journal"]
    last = a.boundaries[-1][1] if a.boundaries else a.begin
    a.end = max(last, min([a.end, *known]) if known else last)
    a.ended = "killed"


def _overlap(spans: Iterable[tuple[float, float]], t0: float, t1: float) -> float:
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)


def analyse(
    records: Sequence[RankRecord], *, root: str = "", problems: Sequence[str] = (),
    failures_per_day: float = DEFAULT_FAILURES_PER_DAY,
) -> GoodputReport:
    """The report of a run from its records (see the module docstring)."""
    by_attempt: dict[str, dict[int, RankRecord]] = {}
    for r in records:
        if not r.events:
            continue
        held = by_attempt.setdefault(r.attempt, {})
        if r.rank not in held or len(r.events) > len(held[r.rank].events):
            held[r.rank] = r
    attempts = sorted((reduce_record(v[min(v)], v) for v in by_attempt.values()),
                      key=lambda a: a.start)
    notes: list[str] = []
    # A killed attempt whose tail is not in its record: the kill came some time before the
    # next start; the gap is taken as long as the gaps measured elsewhere (0 if none).
    known_gaps = [nxt.start - a.end for a, nxt in itertools.pairwise(attempts)
                  if a.journal_tail]
    typical_gap = statistics.median(known_gaps) if known_gaps else 0.0
    estimated_end: dict[int, float] = {}
    for i, (a, nxt) in enumerate(itertools.pairwise(attempts)):
        if not a.journal_tail and nxt.start - typical_gap > a.end:
            estimated_end[i] = nxt.start - typical_gap
    step_times = [b[1] - p[1] for a in attempts
                  for p, b in zip(a.boundaries, a.boundaries[1:], strict=False)]
    step_s = statistics.median(step_times) if step_times else 0.0

    reports: list[AttemptReport] = []
    total_lost = 0
    for i, a in enumerate(attempts):
        later = [n.resumed_from for n in attempts[i + 1:] if n.resumed_from is not None]
        cutoff = min(later) if later else None
        save_spans = [(t0, t1 if t1 is not None else a.end) for _, t0, t1 in a.saves]
        # A save of a step that was kept made a checkpoint that was used (or could have
        # been): its blocking is checkpoint blocking, also inside a step that was lost.
        kept_saves = [(t0, t1 if t1 is not None else a.end) for n, t0, t1 in a.saves
                      if cutoff is None or n <= cutoff]
        s = dict.fromkeys(CATEGORIES, 0.0)
        s["restore"] = a.restore_s
        s["startup"] = max(0.0, a.begin - a.start - a.restore_s)
        prev, lost = a.begin, 0
        for step, t, wait in a.boundaries:
            span = max(0.0, t - prev)
            if cutoff is not None and step > cutoff:
                blocking = min(span, _overlap(kept_saves, prev, t))
                s["checkpoint_blocking"] += blocking
                s["lost_work"] += span - blocking
                lost += 1
            else:
                blocking = min(span, _overlap(save_spans, prev, t))
                waited = min(max(0.0, span - blocking), wait)
                s["checkpoint_blocking"] += blocking
                s["input_wait"] += waited
                s["compute"] += span - blocking - waited
            prev = max(prev, t)
        tail = max(0.0, a.end - prev)
        estimated: list[str] = []
        end = a.end
        if a.ended == "killed":
            # The step in progress when the process died was lost, but for a save in it.
            blocking = min(tail, _overlap(kept_saves, prev, a.end))
            s["checkpoint_blocking"] += blocking
            s["lost_work"] += tail - blocking
            if i in estimated_end:
                extra = estimated_end[i] - a.end
                s["lost_work"] += extra
                guessed = round(extra / step_s) if step_s > 0 else 0
                lost += guessed
                end = estimated_end[i]
                estimated.append(
                    f"attempt {a.attempt}: {extra:.1f} s after its last record "
                    f"({time.strftime('%H:%M:%S', time.gmtime(a.end))} UTC) to the kill, "
                    f"about {guessed} step(s), counted as lost work: the node-local journal "
                    "of its last steps was not recovered (the next attempt ran elsewhere)")
        else:
            blocking = min(tail, _overlap(save_spans, prev, a.end))
            s["checkpoint_blocking"] += blocking
            s["other"] += tail - blocking
        total_lost += lost
        notes += estimated
        first = a.boundaries[0][0] if a.boundaries else None
        last = a.boundaries[-1][0] if a.boundaries else None
        reports.append(AttemptReport(
            attempt=a.attempt, index=i, ranks=tuple(sorted(a.records)), world=a.ref.world,
            start=a.start, end=end, ended=a.ended,
            restored_step=a.restored if a.has_restore else None,
            resumed_from=a.resumed_from, first_step=first,
            last_step=last, steps=len(a.boundaries), lost_steps=lost, saves=len(a.saves),
            commits=len(a.commits), restore_bytes=dict(a.restore_bytes),
            seconds=Breakdown(**s), estimated=tuple(estimated)))

    total = Breakdown()
    for done in reports:
        total = total + done.seconds
    gaps = [max(0.0, nxt.start - done.end) for done, nxt in itertools.pairwise(reports)]
    total = replace(total, restart_gap=sum(gaps))
    wall = (reports[-1].end - reports[0].start) if reports else 0.0
    total = replace(total, other=total.other + max(0.0, wall - total.total))
    return GoodputReport(
        root=root, wall_s=wall, seconds=total, attempts=tuple(reports), lost_steps=total_lost,
        save_interval=_save_interval(attempts, reports, gaps, failures_per_day),
        estimated=tuple(notes), problems=tuple(problems), records=tuple(records))


def _save_interval(attempts: Sequence[RecordSpans], reports: Sequence[AttemptReport],
                   gaps: Sequence[float], failures_per_day: float) -> SaveInterval | None:
    """The measured interval and save costs, and the model's view of them."""
    intervals, step_intervals, blocking, lags = [], [], [], []
    for a in attempts:
        done = [(step, t0, t1) for step, t0, t1 in a.saves if t1 is not None]
        blocking += [t1 - t0 for _, t0, t1 in done]
        lags += [a.commits[step] - t0 for step, t0, _ in done if step in a.commits]
        for (s0, t0, _), (s1, t1, _) in zip(a.saves, a.saves[1:], strict=False):
            intervals.append(t1 - t0)
            step_intervals.append(s1 - s0)
    if not intervals or not blocking:
        return None
    # A restart's cost: the gap, then the next attempt's start-up and restore.
    restarts = [gap + r.seconds.startup + r.seconds.restore
                for gap, r in zip(gaps, reports[1:], strict=False)]
    restart_s = statistics.mean(restarts) if restarts else DEFAULT_RESTART_S
    model = GoodputModel(failures_per_day=failures_per_day, restart_s=restart_s)
    interval = statistics.median(intervals)
    block = statistics.mean(blocking)
    e2e = block + max(0.0, statistics.mean(lags) - block) if lags else block
    best = model.best(block, e2e)
    return SaveInterval(
        interval_s=interval,
        interval_steps=statistics.median(step_intervals) if step_intervals else None,
        blocking_s=block, commit_lag_s=max(0.0, e2e - block),
        failures_per_day=failures_per_day, restart_s=restart_s,
        model_goodput=model.goodput(interval, block, e2e),
        best_interval_s=best["best_interval_s"], best_goodput=best["best_goodput"])

