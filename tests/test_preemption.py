"""Preemption: a stop signal ends a torchrun job in a committed checkpoint of the current step.

Real torchrun jobs of 2 gloo ranks (tests/scripts/preempt_train.py) on moto get
real signals: SIGTERM to the torchrun agent (which forwards it to its workers,
as Kubernetes' or SLURM's stop reaches them), to one worker only, twice, or
too late for the grace period. The checkpoints left on the store, the steps
each rank reports and a resumed run's weights are what the tests check.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_volumes import CheckpointManager, ConfigurationError
from testkit.ports import free_port
from testkit.proxy import LatencyProxy

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "preempt_train.py"


def _launch(root: str, total: int, out: Path, opts: dict[str, Any]) -> subprocess.Popen[str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "PREEMPT_TEST": json.dumps(opts)}
    log = open(out / "torchrun.log", "w")  # noqa: SIM115 - closed by _finish
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         str(SCRIPT), root, str(total), str(out)],
        env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str], out: Path, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError("the job hung:\n" + _log(out)) from None


def _log(out: Path) -> str:
    return (out / "torchrun.log").read_text()[-6000:]


def _rank(out: Path, rank: int) -> dict[str, Any]:
    try:
        return json.loads((out / f"rank-{rank}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"step": -1, "saved": []}


def _wait_for(cond: Callable[[], bool], proc: subprocess.Popen[str], out: Path,
              timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early ({proc.returncode}):\n{_log(out)}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the job:\n" + _log(out))
        time.sleep(0.02)


def _complete(root: str, options: dict[str, Any]) -> list[int]:
    with CheckpointManager(root, storage_options=options) as mgr:
        return [i.step for i in mgr.list() if i.complete]


def _weights(out: Path) -> list[list[float]]:
    return [_rank(out, r)["weights"] for r in (0, 1)]


def _reference(tmp_path: Path, moto_server: Any, total: int) -> list[list[float]]:
    """Weights of an uninterrupted run of ``total`` steps."""
    root = moto_server.create_bucket(f"preempt-ref-{random.randrange(10**9)}")
    out = tmp_path / "reference"
    proc = _launch(root, total, out, {"storage_options": moto_server.storage_options()})
    assert _finish(proc, out) == 0, _log(out)
    return _weights(out)


def test_sigterm_to_torchrun_commits_the_current_step_and_the_restart_is_exact(
    s3_bucket: tuple[str, dict[str, Any]], moto_server: Any, tmp_path: Path
) -> None:
    root, options = s3_bucket
    total = 60  # ranks compare notes about every 0.5 s: the notice lands within ~20 steps
    at = random.Random(os.getpid()).randint(3, 10)  # a step between saves, or on one
    opts = {"storage_options": options, "interval": 4}
    out = tmp_path / "preempted"
    proc = _launch(root, total, out, opts)
    _wait_for(lambda: min(_rank(out, r)["step"] for r in (0, 1)) >= at, proc, out)
    proc.send_signal(signal.SIGTERM)  # the torchrun agent: it forwards SIGTERM to its workers
    _finish(proc, out)
    ends = [_rank(out, r) for r in (0, 1)]
    assert [e["ended"] for e in ends] == ["preempted", "preempted"], _log(out)
    stopped = ends[0]["step"]
    assert ends[1]["step"] == stopped  # both ranks stopped at the same step
    assert stopped < total
    assert max(_complete(root, options)) == stopped  # 0 steps lost
    assert stopped in ends[0]["saved"]

    resumed = tmp_path / "resumed"
    proc = _launch(root, total, resumed, opts)
    assert _finish(proc, resumed) == 0, _log(resumed)
    assert _rank(resumed, 0)["restored"] == stopped
    assert _weights(resumed) == _reference(tmp_path, moto_server, total)


def test_sigterm_while_an_async_save_uploads_finishes_it_then_commits_the_current_step(
    moto_server: Any, tmp_path: Path
) -> None:
    root = moto_server.create_bucket(f"preempt-inflight-{random.randrange(10**9)}")
    with LatencyProxy.in_front_of(moto_server, latency_s=0.15, bandwidth_bps=40e6) as proxy:
        options = moto_server.storage_options(proxy.endpoint)
        # 4 MiB of state a rank behind 40 Mbit/s: each save uploads for about a second.
        opts = {"storage_options": options, "interval": 3, "state_kib": 4096, "step_s": 0.02}
        out = tmp_path / "job"
        proc = _launch(root, 400, out, opts)
        _wait_for(lambda: 3 in _rank(out, 0)["saved"], proc, out)
        proc.send_signal(signal.SIGTERM)  # step 3's upload is in flight
        _finish(proc, out)
    ends = [_rank(out, r) for r in (0, 1)]
    assert [e["ended"] for e in ends] == ["preempted", "preempted"], _log(out)
    stopped = ends[0]["step"]
    assert ends[1]["step"] == stopped
    complete = _complete(root, moto_server.storage_options())
    assert 3 in complete  # the save in flight at the signal was finished, not dropped
    assert max(complete) == stopped


def test_a_signal_that_reaches_one_rank_only_stops_every_rank_at_the_same_step(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = s3_bucket
    out = tmp_path / "job"
    proc = _launch(root, 40, out, {"storage_options": options, "interval": 5})
    _wait_for(lambda: min(_rank(out, r)["step"] for r in (0, 1)) >= 4, proc, out)
    os.kill(_rank(out, 1)["pid"], signal.SIGTERM)  # rank 1 alone, as on another node
    assert _finish(proc, out) == 0, _log(out)  # the workers exit 0: torchrun ends cleanly
    ends = [_rank(out, r) for r in (0, 1)]
    assert [e["ended"] for e in ends] == ["preempted", "preempted"]
    assert ends[0]["step"] == ends[1]["step"]
    assert max(_complete(root, options)) == ends[0]["step"]


@contextlib.contextmanager
def _slow_save_job(
    moto_server: Any, tmp_path: Path, grace_s: float
) -> Iterator[tuple[str, Path, subprocess.Popen[str]]]:
    """A job saving every 2 steps, 8 MiB a rank behind 16 Mbit/s: a save takes about 4 s."""
    with LatencyProxy.in_front_of(moto_server, latency_s=0.05, bandwidth_bps=16e6) as proxy:
        root = moto_server.create_bucket(f"preempt-slow-{random.randrange(10**9)}")
        options = moto_server.storage_options(proxy.endpoint)
        opts = {"storage_options": options, "interval": 2, "state_kib": 8192, "step_s": 0.02,
                "grace_s": grace_s}
        out = tmp_path / "job"
        yield root, out, _launch(root, 400, out, opts)


def test_a_second_signal_ends_the_job_without_a_partial_checkpoint_taken_for_complete(
    moto_server: Any, tmp_path: Path
) -> None:
    with _slow_save_job(moto_server, tmp_path, grace_s=60) as (root, out, proc):
        _wait_for(lambda: 4 in _rank(out, 0)["saved"], proc, out)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.5)  # the preemption save is uploading now
        for r in (0, 1):
            os.kill(_rank(out, r)["pid"], signal.SIGTERM)
        code = _finish(proc, out)
    assert code != 0  # stopped, not a clean preemption
    assert all(_rank(out, r)["ended"] == "running" for r in (0, 1))
    log = _log(out)
    assert "Preempted: stopped waiting for the save in flight (a second signal came)" in log
    options = moto_server.storage_options()
    with CheckpointManager(root, storage_options=options) as mgr:
        infos = mgr.list()
    complete = [i.step for i in infos if i.complete]
    # Whatever committed stays; what did not is never listed as complete.
    assert complete and max(complete) < _rank(out, 0)["step"]
    for info in infos:
        if not info.complete:
            with pytest.raises(Exception):  # noqa: B017 - any refusal; it must not load
                CheckpointManager(root, storage_options=options).restore({}, step=info.step)


def test_the_grace_period_running_out_leaves_the_previous_checkpoint_intact(
    moto_server: Any, tmp_path: Path
) -> None:
    with _slow_save_job(moto_server, tmp_path, grace_s=1.0) as (root, out, proc):
        _wait_for(lambda: 4 in _rank(out, 0)["saved"], proc, out)
        proc.send_signal(signal.SIGTERM)
        code = _finish(proc, out)
    assert code != 0
    log = _log(out)
    assert "the 1 s of preemption_grace_s ran out" in log
    complete = _complete(root, moto_server.storage_options())
    stopped = max(_rank(out, r)["step"] for r in (0, 1))
    assert complete and max(complete) < stopped
    assert 2 in complete  # the checkpoint before the preemption is intact


def test_without_preemption_signals_sigterm_keeps_its_default_action(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = s3_bucket
    out = tmp_path / "job"
    proc = _launch(root, 400, out, {"storage_options": options, "signals": []})
    _wait_for(lambda: _rank(out, 1)["step"] >= 3, proc, out)
    os.kill(_rank(out, 1)["pid"], signal.SIGTERM)
    assert _finish(proc, out) != 0  # the worker died of the signal; torchrun says so
    assert _rank(out, 1)["ended"] == "running"
    assert "exitcode  : -15" in _log(out) or "Signal 15" in _log(out)


# -- in one process -----------------------------------------------------------------------


def test_the_handler_chains_to_the_one_before_it_and_close_puts_it_back(
    tmp_path: Path,
) -> None:
    seen: list[int] = []

    def before(signum: int, frame: Any) -> None:
        seen.append(signum)

    old = signal.signal(signal.SIGUSR1, before)
    try:
        mgr = CheckpointManager(tmp_path / "ckpt", save_interval_steps=3,
                                preemption_signals=(signal.SIGUSR1,))
        assert signal.getsignal(signal.SIGUSR1) is not before
        assert [mgr.should_save(s) for s in (1, 2, 3)] == [False, False, True]
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # chained at once
        assert mgr.should_save(4)  # the step at which the preemption is agreed
        mgr.save(4, {"x": torch.ones(3)})
        assert mgr.reached_preemption(4)
        assert mgr.latest() is not None and mgr.latest().step == 4  # type: ignore[union-attr]
        mgr.close()
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_no_preemption_signals_means_no_handler_and_a_plain_interval(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(tmp_path / "ckpt", save_interval_steps=5) as mgr:
        assert signal.getsignal(signal.SIGTERM) is before
        assert [s for s in range(1, 16) if mgr.should_save(s)] == [5, 10, 15]
        assert not mgr.reached_preemption(5)
    with CheckpointManager(tmp_path / "ckpt2") as mgr:
        assert not any(mgr.should_save(s) for s in range(1, 50))


@pytest.mark.parametrize("bad", [(signal.SIGKILL,), ("TERM",), (999,)])
def test_an_uncatchable_or_unknown_signal_is_refused(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="preemption_signals"):
        CheckpointManager(tmp_path / "ckpt", preemption_signals=bad)


def test_a_manager_with_signals_must_be_made_on_the_main_thread(tmp_path: Path) -> None:
    caught: list[BaseException] = []

    def make() -> None:
        try:
            CheckpointManager(tmp_path / "ckpt", preemption_signals=(signal.SIGTERM,))
        except BaseException as exc:
            caught.append(exc)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert caught and isinstance(caught[0], ConfigurationError)
    assert "main thread" in str(caught[0])
