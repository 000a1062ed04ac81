"""Goodput of the user's own job: the report on records of known shape, the recorder's
journal, the manager's recording on a local directory and on the in-memory store, the
CLI, and what must never appear (a record with goodput=False, a credential, goodput/
in a checkpoint listing). The real torchrun job is in tests/test_goodput_torchrun.py."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_volumes import CheckpointManager, ConfigurationError, GoodputReport, goodput_report
from dcp_volumes._volume import Volume
from dcp_volumes.cli import main
from dcp_volumes.goodput._recorder import Recorder, note_input_wait
from dcp_volumes.goodput._records import GOODPUT_DIR, RankRecord, segment_name
from dcp_volumes.goodput._report import CATEGORIES, analyse, load_records


def _record(attempt: str, events: list[tuple[Any, ...]], *, rank: int = 0,
            source: str = "close") -> RankRecord:
    """A record from ``(kind, t, fields)`` tuples."""
    evs = tuple({"k": k, "t": t, **(extra[0] if extra else {})} for k, t, *extra in events)
    return RankRecord(attempt=attempt, rank=rank, world=2, host="h", pid=1, source=source,
                      events=evs)


def _steps(first: int, last: int, t0: float, *, step_s: float = 1.0,
           wait: float = 0.1) -> list[tuple[Any, ...]]:
    return [("step", t0 + (n - first + 1) * step_s, {"step": n, "wait": wait})
            for n in range(first, last + 1)]


def _killed_then_finished(first_source: str) -> list[RankRecord]:
    """Attempt a: start 0, up at 2, fresh restore 2-3, steps 1..8 (1 s each, 0.1 s input wait),
    a save after step 4 blocking 0.2 s, committed at 8.0, killed after step 8 (t=11).
    Attempt b: start 14, restore 15-16 of step 4, steps 5..10, exit at 22.5."""
    a = [("start", 0.0), ("ready", 2.0), ("restore0", 2.0), ("restore1", 3.0, {"step": None}),
         *_steps(1, 4, 3.0), ("save0", 7.0, {"step": 4}), ("save1", 7.2, {"step": 4}),
         ("commit", 8.0, {"step": 4}), *_steps(5, 8, 7.0)]
    if first_source == "commit":  # only the put made with the commit reached the store
        a = [e for e in a if e[1] <= 8.0]
    b = [("start", 14.0), ("ready", 15.0), ("restore0", 15.0),
         ("restore1", 16.0, {"step": 4, "sources": {"volume": 100}}), *_steps(5, 10, 16.0),
         ("exit", 22.5, {"clean": True})]
    return [_record("a", a, source=first_source), _record("a", a, rank=1,
                                                          source=first_source),
            _record("b", b)]


def test_a_killed_and_restarted_run_splits_its_wall_time_exactly() -> None:
    report = analyse(_killed_then_finished("journal"), root="r")
    assert [a.ended for a in report.attempts] == ["killed", "exit"]
    assert [a.ranks for a in report.attempts] == [(0, 1), (0,)]
    assert report.lost_steps == 4  # steps 5..8 of attempt a, computed again by b
    s = report.seconds
    assert report.wall_s == pytest.approx(22.5)
    assert s.startup == pytest.approx(2.0 + 1.0)  # 0-2 and 14-15
    assert s.restore == pytest.approx(1.0 + 1.0)
    assert s.restart_gap == pytest.approx(3.0)  # 11 -> 14
    # a's save of step 4 blocks inside step 5's span, which was lost: it made the
    # checkpoint b resumed from, so it is checkpoint blocking, not lost work
    assert s.lost_work == pytest.approx(4.0 - 0.2)
    assert s.checkpoint_blocking == pytest.approx(0.2)
    # kept steps: a's 1..4 and b's 5..10, 1 s each, 0.1 s of it input wait
    assert s.input_wait == pytest.approx(1.0)
    assert s.compute == pytest.approx(9.0)
    assert s.other == pytest.approx(0.5)  # b's close after its last step
    assert s.total == pytest.approx(report.wall_s)
    assert report.goodput == pytest.approx(9.0 / 22.5)
    assert report.estimated == ()
    assert report.attempts[1].restore_bytes == {"volume": 100}
    doc = json.loads(json.dumps(report.to_json()))
    assert set(doc["seconds"]) == set(CATEGORIES)
    assert doc["lost_steps"] == 4 and len(doc["attempts"]) == 2 and doc["restarts"] == 1
    assert doc["goodput"] == pytest.approx(0.4)


def test_a_survivor_that_fails_after_its_peer_was_killed_ends_the_attempt_at_the_kill(
) -> None:
    """Rank 1 is SIGKILLed after step 8 (its journal ends there); rank 0, the reference,
    waits on it, fails and exits at t=13: the attempt ends at the kill, and rank 0's
    wait is part of the restart, as in the run where rank 0 died itself."""
    base = _killed_then_finished("journal")
    failed = RankRecord(**{**base[0].__dict__, "source": "close", "events": (
        *base[0].events, {"k": "exit", "t": 13.0, "clean": False})})
    report = analyse([failed, base[1], base[2]], root="r")
    assert [a.ended for a in report.attempts] == ["killed", "exit"]
    assert report.attempts[0].end == pytest.approx(11.0)
    assert report.seconds == analyse(base, root="r").seconds


def test_a_tail_that_was_not_recovered_is_estimated_and_said_so() -> None:
    report = analyse(_killed_then_finished("commit"), root="r")
    first = report.attempts[0]
    assert first.estimated and report.estimated == first.estimated
    assert report.attempts[1].estimated == ()
    # the record ends at the commit (t=8); with no measured gap, the kill is put at b's start
    assert first.end == pytest.approx(14.0)
    assert report.seconds.restart_gap == pytest.approx(0.0)
    # step 5 on (but the save of step 4 in it), estimated from t=8
    assert report.seconds.lost_work == pytest.approx(14.0 - 7.0 - 0.2)
    assert report.seconds.total == pytest.approx(report.wall_s)


def test_save_interval_and_the_models_best() -> None:
    events = [("start", 0.0), ("ready", 1.0)]
    t = 1.0
    for n in range(1, 41):
        t += 1.0
        events.append(("step", t, {"step": n, "wait": 0.0}))
        if n % 10 == 0:
            events += [("save0", t, {"step": n}), ("save1", t + 0.5, {"step": n}),
                       ("commit", t + 3.0, {"step": n})]
            t += 0.5
    events.append(("exit", t + 1, {"clean": True}))
    report = analyse([_record("a", events)], root="r")
    si = report.save_interval
    assert si is not None
    assert si.interval_steps == 10 and si.interval_s == pytest.approx(10.5)
    assert si.blocking_s == pytest.approx(0.5) and si.commit_lag_s == pytest.approx(2.5)
    assert si.best_goodput >= si.model_goodput > 0
    assert report.seconds.checkpoint_blocking == pytest.approx(2.0)
    assert "save interval 10.5 s (10 steps)" in report.text()


def test_corrupt_and_foreign_files_are_named_and_the_rest_is_reported(
    memory_bucket: Any,
) -> None:
    url, _ = memory_bucket
    vol = Volume(url)
    for r in _killed_then_finished("journal"):
        # each record in two segments, as two puts leave it
        for first, end in ((0, 5), (5, len(r.events))):
            segment = replace(r, events=r.events[first:end], first=first)
            vol.publish(segment_name(r.attempt, r.rank, first, end), segment.to_json())
    vol.publish(segment_name("cut", 0, 0, 3), b'{"format": "dcp_volu')
    vol.publish(segment_name("other", 0, 0, 1), b'{"hello": 1}')
    vol.publish(f"{GOODPUT_DIR}/notes.txt", b"hi")
    report = goodput_report(url)
    assert isinstance(report, GoodputReport)
    assert len(report.attempts) == 2 and report.lost_steps == 4
    assert report.seconds == analyse(_killed_then_finished("journal"), root="r").seconds
    problems = "\n".join(report.problems)
    assert len(report.problems) == 3, problems
    assert "cut/rank00000-0000000000-0000000003.json: not JSON" in problems
    assert "other/rank00000-0000000000-0000000001.json: not a dcp_volumes goodput record" in (
        problems)
    assert "notes.txt: not a goodput record" in problems


def _train(root: str, *, steps: int = 6, **kw: Any) -> CheckpointManager:
    state = {"w": torch.zeros(4)}
    mgr = CheckpointManager(root, save_interval_steps=3, **kw)
    step = mgr.restore(state) or 0
    while step < steps:
        time.sleep(0.02)
        note_input_wait(0.01)  # what the loader reports per batch, inside the step
        step += 1
        state["w"] += 1
        if mgr.should_save(step):
            mgr.save(step, state)
    return mgr


def test_recording_on_a_local_directory_and_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    root = str(tmp_path / "run")
    staging = str(tmp_path / "staging")
    with caplog.at_level(logging.INFO, logger="dcp_volumes.goodput"):
        mgr = _train(root, staging_dir=staging)
        mgr.wait()
    # the live breakdown goes to logging (and MLflow) after each commit
    assert [r.getMessage().split(":")[0] for r in caplog.records
            if r.getMessage().startswith("goodput after")] == [
        "goodput after step 3", "goodput after step 6"]
    live = mgr.goodput()
    assert [a.ended for a in live.attempts] == ["running"] and live.attempts[0].steps == 6
    mgr.close()
    attempts = os.listdir(os.path.join(root, GOODPUT_DIR))
    # one attempt: a segment with each commit (steps 3 and 6), one at close
    assert len(attempts) == 1
    assert len(os.listdir(os.path.join(root, GOODPUT_DIR, attempts[0]))) == 3
    assert not os.listdir(os.path.join(staging, "dcp_volumes-goodput", os.listdir(
        os.path.join(staging, "dcp_volumes-goodput"))[0]))  # the journal went at close
    # a second attempt, resuming from step 6
    _train(root, steps=9, staging_dir=staging).close()
    report = goodput_report(root)
    assert [a.ended for a in report.attempts] == ["exit", "exit"]
    assert [a.resumed_from for a in report.attempts] == [0, 6]
    assert report.lost_steps == 0 and report.seconds.input_wait == pytest.approx(0.09, abs=1e-6)
    # the checkpoint side never sees goodput/: listing, ls, gc
    assert [i.step for i in CheckpointManager(root, goodput=False).list()] == [3, 6, 9]
    assert main(["ls", root, "--json"]) == 0
    assert [c["step"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == [3, 6, 9]
    assert main(["gc", root, "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert len(os.listdir(os.path.join(root, GOODPUT_DIR))) == 2
    plot = tmp_path / "timeline.png"
    assert main(["goodput", root, "--json", "--plot", str(plot)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"goodput", "wall_s", "attempts", "lost_steps", "seconds"} <= set(doc)
    assert set(doc["seconds"]) == set(CATEGORIES) and len(doc["attempts"]) == 2
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert main(["goodput", root]) == 0
    assert "goodput of" in capsys.readouterr().out
    assert main(["goodput", str(tmp_path / "nothing")]) == 1


def test_goodput_false_writes_nothing(memory_bucket: Any, tmp_path: Path) -> None:
    url, _ = memory_bucket
    staging = str(tmp_path / "staging")
    os.mkdir(staging)
    with _train(url, goodput=False, staging_dir=staging) as mgr:
        with pytest.raises(ConfigurationError, match="goodput=False"):
            mgr.goodput()
        mgr.step(7)
    vol = Volume(url)
    assert vol.list(GOODPUT_DIR) == []
    assert not os.path.exists(os.path.join(staging, "dcp_volumes-goodput"))
    with pytest.raises(ConfigurationError):
        CheckpointManager(url, goodput="yes")  # type: ignore[arg-type]


def test_a_killed_attempts_journal_is_recovered_by_the_next(
    memory_bucket: Any, tmp_path: Path,
) -> None:
    url, _ = memory_bucket
    vol = Volume(url)
    journal = str(tmp_path / "journal")
    killed = Recorder(vol, attempt="A", rank=0, world=1, journal=journal, recover=True)
    for n in range(1, 6):
        killed.step(n)
    killed.save_started(3)
    killed.put("commit")  # as with a commit; one more step, then the process dies: no close
    killed.step(6)
    assert [f.path for f in vol.list(GOODPUT_DIR)] == [segment_name("A", 0, 0, 8)]
    Recorder(vol, attempt="B", rank=0, world=1, journal=journal, recover=True)
    # the next attempt on the node puts the tail no segment held: step 6
    assert [f.path for f in vol.list(GOODPUT_DIR)] == [segment_name("A", 0, 0, 8),
                                                       segment_name("A", 0, 8, 9)]
    (recovered,), problems = load_records(vol)
    assert recovered.source == "journal" and problems == []
    assert [e["step"] for e in recovered.events if e["k"] == "step"] == [1, 2, 3, 4, 5, 6]
    assert os.listdir(journal) == ["B-rank00000.jsonl"]


def test_a_put_holds_only_the_events_since_the_last(memory_bucket: Any, tmp_path: Path) -> None:
    """10,000 steps with a save every 100: each put is one small new segment, as large at
    the end of the run as at its start, and the report joins them into every step."""
    url, _ = memory_bucket
    vol = Volume(url)
    rec = Recorder(vol, attempt="A", rank=0, world=1, journal=str(tmp_path / "j"),
                   recover=False)
    sizes: list[int] = []
    for n in range(1, 10_001):
        note_input_wait(0.0)  # no recorder installed: a no-op
        rec.wait_s += 0.001
        rec.step(n)
        if n % 100 == 0:
            rec.save_started(n)
            rec.add("save1", step=n)
            rec.add("commit", step=n)
            before = {f.path for f in vol.list(GOODPUT_DIR)}
            assert rec.put("commit")
            (new,) = {f.path for f in vol.list(GOODPUT_DIR)} - before
            sizes.append(len(vol.read_bytes(new)))
    rec.close(clean=True)
    assert len(sizes) == 100
    assert max(sizes) < 12_000, max(sizes)  # ~100 step events and a header
    assert max(sizes[-10:]) <= max(sizes[1:10]) * 1.05  # independent of the step count
    (record,), problems = load_records(vol)
    assert problems == [] and record.source == "close"
    assert [e["step"] for e in record.events if e["k"] == "step"] == list(range(1, 10_001))
    assert sum(e["wait"] for e in record.events if e["k"] == "step") == pytest.approx(10.0)
    report = analyse([record])
    assert report.attempts[0].steps == 10_000 and report.attempts[0].commits == 100
