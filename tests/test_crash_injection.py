"""Crash injection: SIGKILL a job saving through CheckpointManager at random instants.

Each trial forks a child (from a forkserver that has torch and dcp_volumes
imported, so a trial costs milliseconds, not an interpreter start) that
resumes from the newest complete checkpoint and then saves every step until
it is killed with SIGKILL at a random instant. After every kill the parent
checks, against the volume itself:

* every checkpoint reported complete loads and is bit-equal to the state of
  its step (states are a function of the step), so no partial checkpoint is
  ever taken for complete;
* ``latest()`` is complete and ``restore()`` brings back exactly its state;
* the newest complete step never goes backwards (a crash never costs the
  last good checkpoint, not even during retention deletes);
* the next child's own restore is bit-equal too.

Kills are attributed to a phase from the child's log events and the volume:
staging, upload, commit window (manifest written, ``.metadata`` not yet),
retention deletes, or between saves.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._discovery import newest_complete, scan, step_dir
from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from dcp_volumes.checkpoint._manager import CheckpointManager
from testkit.emulators import MotoServer
from testkit.ranks import forkserver_context
from testkit.states import differences, empty_state, load_into, state_for
from tests.conftest import unique_bucket_name
from tests.scripts import crash_child

_SIZE = 48  # tensors of 48x48: a few tens of KiB per checkpoint, so trials stay cheap


def _context() -> Any:
    # The server run_ranks forks from (torch, dcp_volumes, s3fs), plus the child's module
    # where this test starts the server first.
    return forkserver_context("tests.scripts.crash_child")


@dataclass
class Tally:
    """What the trials saw; printed at the end and asserted on."""

    trials: int = 0
    phases: collections.Counter[str] = field(default_factory=collections.Counter)
    partial_dirs_seen: int = 0
    complete_checked: int = 0
    partial_reported_complete: int = 0
    wrong_restores: int = 0
    went_backwards: int = 0
    saves_committed: int = 0
    failures: list[str] = field(default_factory=list)

    def line(self, label: str) -> str:
        phases = ", ".join(f"{k}={v}" for k, v in sorted(self.phases.items()))
        return (
            f"[crash-injection {label}] trials={self.trials} kills by phase: {phases}; "
            f"partial dirs seen={self.partial_dirs_seen}, complete checkpoints checked="
            f"{self.complete_checked}, commits observed={self.saves_committed}, "
            f"partial reported complete={self.partial_reported_complete}, "
            f"wrong restores={self.wrong_restores}, newest went backwards={self.went_backwards}"
        )


def _drain(conn: Connection) -> list[tuple[Any, ...]]:
    events: list[tuple[Any, ...]] = []
    while True:
        try:
            if not conn.poll(0.5):
                return events
            events.append(conn.recv())
        except (EOFError, OSError):
            return events


def _phase(events: list[tuple[Any, ...]], volume: Volume) -> str:
    """Which phase the kill landed in, from the last event and the volume."""
    last = next((e for e in reversed(events) if e[0] != "restored"), None)
    if last is None:
        return "before first save"
    kind = last[0]
    if kind == "staging":
        return "staging"
    if kind == "uploading":
        name = step_dir(int(last[1]))
        if volume.exists(f"{name}/{MANIFEST_NAME}") and not volume.exists(
            f"{name}/{METADATA_NAME}"
        ):
            return "commit window (manifest, no .metadata)"
        return "upload"
    if kind == "committed":
        return "after commit (retention listing)"
    if kind == "deleting":
        return "retention deletes"
    return "between saves"


def _check(root: str, options: dict[str, Any], keep_last: int, tally: Tally,
           newest_before: int | None) -> int | None:
    volume = Volume(root, storage_options=options)
    infos = scan(volume)
    tally.partial_dirs_seen += sum(not i.complete for i in infos)
    for info in infos:
        if not info.complete:
            continue
        tally.complete_checked += 1
        try:
            got = load_into(empty_state(size=_SIZE), info.url, options)
            diff = differences(got, state_for(info.step, size=_SIZE))
        except BaseException as exc:  # a "complete" checkpoint that cannot load is partial
            # (DCP raises CheckpointException, a BaseException)
            if isinstance(exc, KeyboardInterrupt):
                raise
            diff = [f"load failed: {type(exc).__name__}: {exc}"]
        if diff:
            tally.partial_reported_complete += 1
            tally.failures.append(f"{info.name} reported complete but {diff[:3]}")
    newest = newest_complete(infos)
    with CheckpointManager(root, keep_last=keep_last, storage_options=options) as mgr:
        latest = mgr.latest()
        state = empty_state(size=_SIZE)
        step = mgr.restore(state)
    if (latest.step if latest else None) != (newest.step if newest else None) or (
        step != (latest.step if latest else None)
    ):
        tally.wrong_restores += 1
        tally.failures.append(f"latest={latest} restore={step} newest={newest}")
    elif step is not None:
        diff = differences(state, state_for(step, size=_SIZE))
        if diff:
            tally.wrong_restores += 1
            tally.failures.append(f"restore of step {step} differs: {diff[:3]}")
    if newest_before is not None and (step is None or step < newest_before):
        tally.went_backwards += 1
        tally.failures.append(f"newest complete went from {newest_before} to {step}")
    return step


def _settle(volume: Volume, timeout_s: float = 10.0) -> None:
    """Wait until the store stops changing: requests the killed child had already sent
    (a batch delete of retention, an upload's last part) are still carried out by the
    server after the kill, and a check must not race them."""
    deadline = time.monotonic() + timeout_s
    before = volume.list()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = volume.list()
        if now == before:
            return
        before = now


def run_trials(
    root: str,
    child_options: dict[str, Any],
    check_options: dict[str, Any],
    *,
    trials: int,
    keep_last: int,
    max_delay_s: float,
    seed: int,
    encryption_key: bytes | None = None,
) -> Tally:
    ctx = _context()
    rng = random.Random(seed)
    tally = Tally()
    newest: int | None = None
    volume = Volume(root, storage_options=check_options)
    for trial in range(trials):
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(
            target=crash_child.run,
            args=(root, child_options, keep_last, seed * 1000 + trial, send, _SIZE,
                  encryption_key),
            daemon=True,
        )
        child.start()
        send.close()
        deadline = time.monotonic() + 60
        first: tuple[Any, ...] | None = None
        while first is None and time.monotonic() < deadline and child.is_alive():
            if recv.poll(0.05):
                first = recv.recv()
        if first is None:
            child.kill()
            child.join()
            pytest.fail(f"trial {trial}: the child never resumed (exit code {child.exitcode})")
        _, restored_step, diff = first
        if restored_step != newest or diff:
            tally.wrong_restores += 1
            tally.failures.append(f"child restored {restored_step} (newest {newest}): {diff[:3]}")
        time.sleep(rng.uniform(0.0, max_delay_s))
        if not child.is_alive():
            child.join()
            pytest.fail(f"trial {trial}: the child failed by itself (exit code "
                        f"{child.exitcode}) before it was killed; see its stderr")
        child.kill()  # SIGKILL: no handler, no cleanup, no flush
        child.join()
        _settle(volume)
        events = [first, *_drain(recv)]
        recv.close()
        tally.trials += 1
        tally.saves_committed += sum(e[0] == "committed" for e in events)
        tally.phases[_phase(events, volume)] += 1
        newest = _check(root, check_options, keep_last, tally, newest)
    return tally


def _report(tally: Tally, label: str, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print("\n" + tally.line(label))
    assert tally.failures == [], "\n".join(tally.failures[:10])
    assert tally.partial_reported_complete == 0 and tally.wrong_restores == 0
    assert tally.went_backwards == 0
    assert tally.saves_committed > 0


@pytest.fixture(scope="module")
def moto_process() -> Iterator[MotoServer]:
    """moto in its own process: the parent's checks must not slow the server down."""
    with MotoServer(mode="process") as server:
        yield server


@pytest.fixture
def bucket(moto_process: MotoServer, request: pytest.FixtureRequest) -> Iterator[
    tuple[str, dict[str, Any]]
]:
    name = unique_bucket_name(request)
    url = moto_process.create_bucket(name)
    try:
        yield f"{url}/run", moto_process.storage_options()
    finally:
        moto_process.reset()


@pytest.mark.parametrize(
    ("trials", "seed"),
    [pytest.param(25, 1, id="quick"), pytest.param(200, 3, marks=pytest.mark.soak, id="many")],
)
def test_sigkill_at_random_instants_local(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trials: int, seed: int
) -> None:
    tally = run_trials(str(tmp_path / "run"), {}, {}, trials=trials, keep_last=2,
                       max_delay_s=0.5, seed=seed)
    _report(tally, f"local, {trials} trials", capsys)


@pytest.mark.emulator
@pytest.mark.parametrize(
    ("trials", "seed"),
    # 100 kills in all on S3, each checked against the store; the local volume's 225 search
    # the orders of a save more widely (the commit protocol is the same).
    [pytest.param(25, 2, id="quick"), pytest.param(75, 4, marks=pytest.mark.soak, id="many")],
)
def test_sigkill_at_random_instants_s3(
    bucket: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str], trials: int,
    seed: int
) -> None:
    root, options = bucket
    tally = run_trials(root, options, options, trials=trials, keep_last=1,
                       max_delay_s=1.2, seed=seed)
    _report(tally, f"s3 (moto), {trials} trials", capsys)
