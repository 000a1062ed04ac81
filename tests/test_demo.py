"""The goodput demo end to end: real torchrun, real SIGKILLs, a real S3 server (moto).

The short configurations assert every correctness check of the demo (the
crashes happened where planned, bit-identical weights, the sample stream, no
partial checkpoint restored, the work lost per crash) and that the timing
checks are measured and reported. Whether blocking, input wait and goodput
meet their thresholds depends on the run being long enough to amortise one
save interval per crash (``dcp-volumes demo --help``); the default
configuration, which must PASS every check, runs in the ``soak`` test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes._volume import Volume
from dcp_volumes.demo import DemoConfig, parse_storage_options
from dcp_volumes.demo._config import plan_crashes
from dcp_volumes.demo._launcher import MARKER, busy_processes, claim, node_cpus
from dcp_volumes.demo._report import CrashOutcome, RunStats, _node_check, restart_lines
from testkit.ranks import process_running

# "library": the library's goodput records agree with the demo's own measurements.
CORRECTNESS = ("crashes", "weights", "samples", "epochs", "complete", "lost", "library")
TIMING = ("blocking", "input", "goodput")


Result = tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]


def _demo(tmp_path: Path, *args: str, timeout: float = 560) -> Result:
    cmd = [sys.executable, "-m", "dcp_volumes.cli", "demo", "--json", "--no-progress",
           "--workdir", str(tmp_path / "out"), *args]
    # torchrun's defaults: never its opt-out of the shared store, for any job.
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        doc = None
    return proc, doc


def _checks(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["key"]: c for c in doc["checks"]}


def _assert_correct(proc: subprocess.CompletedProcess[str], doc: dict[str, Any] | None) -> None:
    assert doc is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    checks = _checks(doc)
    failed = [f"{k}: {checks[k]['detail']}" for k in CORRECTNESS if not checks[k]["ok"]]
    assert not failed, failed
    for key in TIMING:  # measured and reported, whatever the verdict
        assert key in checks and checks[key]["detail"]
    for name, run in doc["runs"].items():
        parts = (run["compute"] + run["blocking"] + run["final_wait"] + run["input_wait"]
                 + run["lost"] + run["restart"] + run["startup"])
        assert run["wall"] > 0 and 0 < run["goodput"] <= run["goodput_ex_restart"] <= 1, name
        # The parts never add up to more than the wall time (other = the remainder).
        assert parts <= run["wall"] + 0.05, (name, parts, run["wall"])
    assert doc["ok"] == all(c["ok"] for c in doc["checks"])
    png = Path(doc["plot"]).read_bytes()
    assert png.startswith(b"\x89PNG")
    assert Path(doc["json"]).is_file()


def _crash_kinds(doc: dict[str, Any], run: str = "dcp_volumes") -> list[str]:
    return [c["crash"]["kind"] for c in doc["runs"][run]["crashes"]]


SHORT = ("--steps", "48", "--save-every", "8", "--files", "128")


@pytest.mark.timeout(600)
def test_sigkills_in_an_upload_the_commit_window_a_node_loss_and_a_preemption(
    tmp_path: Path
) -> None:
    # Seed 1: a preemption at step 7, an upload kill (step 16), a node loss (step 20, four
    # steps after a save) and a commit-window kill (step 32), on 2 nodes x 1 rank.
    proc, doc = _demo(tmp_path, *SHORT, "--crashes", "4", "--quick", "--seed", "1")
    _assert_correct(proc, doc)
    assert doc is not None
    assert _crash_kinds(doc) == ["preempt", "upload", "node", "commit"]
    crashed = doc["runs"]["dcp_volumes"]
    assert "naive" not in doc["runs"]  # --quick
    commit = next(c for c in crashed["crashes"] if c["crash"]["kind"] == "commit")
    # Killed with every shard on the volume and no .metadata; the restart skipped it.
    assert commit["evidence"]["ranks_with_all_shards_uploaded"] == 2
    assert commit["evidence"]["listed"] and not commit["evidence"]["complete"]
    assert commit["resumed_from"] == commit["crash"]["step"] - 8
    assert set(crashed["worlds"]) == {2}
    run_dir = Path(doc["workdir"]) / "runs" / "dcp_volumes"
    logs = {p.name: p.read_text() for p in run_dir.glob("node-*.log")}
    # The upload and commit kills were real SIGKILLs of a rank, seen by its node's agent.
    assert sum(log.count("exitcode: -9") for log in logs.values()) >= 2
    checks = _checks(doc)
    # The node loss: node 1's agent and rank SIGKILLed, its disk wiped, the job requeued
    # with a new node 1 and back on 2 ranks; the new node's shards came from node 0's
    # replica.
    node = next(c for c in crashed["crashes"] if c["crash"]["kind"] == "node")
    assert node["lost_node"] == 1 and node["replaced"]
    assert node["evidence"]["ranks_killed"] == 1
    assert checks["node"]["ok"], checks["node"]["detail"]
    assert node["resumed_from"] == 16 and node["replica_held"], node
    assert node["node_sources"]["volume"] == 0 and node["node_sources"]["peer"] > 0, node
    assert node["restore_sources"]["local"] > 0  # node 0 read its own files
    assert crashed["replicated"]
    # Every restart says how long its restore took and where it read (the preemption's
    # requeued job kept its disks: its restore is local).
    for c in crashed["crashes"]:
        got = c["restore_sources"]
        assert c["restore_s"] > 0 and sum(got.values()) > 0, c
    preempt_restore = next(c for c in crashed["crashes"]
                           if c["crash"]["kind"] == "preempt")["restore_sources"]
    assert preempt_restore["volume"] == 0, preempt_restore
    assert "node 1 replaced" in doc["table"] and "restore" in doc["table"]
    assert checks["preempt"]["ok"], checks["preempt"]["detail"]
    preempt = next(c for c in crashed["crashes"] if c["crash"]["kind"] == "preempt")
    # The ranks saved the step they stopped at; the requeued job resumed there.
    assert preempt["steps_lost"] == 0 and preempt["resumed_from"] == preempt["last_step"]
    assert preempt["stopped_cleanly"] == preempt["world"] == 2
    assert 0 < preempt["signal_to_commit_s"] < preempt["signal_to_exit_s"] < 30
    assert "SIGTERM -> commit" in doc["table"] and "preempt 0" in doc["table"]
    # A real SIGTERM to torchrun's agent, which forwarded it; a new torchrun (leg) resumed
    # after the preemption and after the node loss.
    assert "Received 15 death signal" in logs["node-0.log"]
    assert (run_dir / "spec-2.json").is_file() and not (run_dir / "spec-3.json").exists()
    # Each simulated node ran on CPUs of its own, as a real node does.
    if len(os.sched_getaffinity(0)) >= 2:
        cpus_of_node: dict[int, set[int]] = {}
        for events in run_dir.glob("events-*.jsonl"):
            start = json.loads(events.read_text().splitlines()[0])
            cpus_of_node.setdefault(start["node"], set()).update(start["cpus"])
        assert len(cpus_of_node) == 2 and not cpus_of_node[0] & cpus_of_node[1], cpus_of_node


def test_load_spins_its_processes_while_the_demo_runs_and_ends_them() -> None:
    with busy_processes(2):
        time.sleep(0.5)
        pids = [int(p) for p in subprocess.run(
            ["pgrep", "-f", "while time.monotonic"], capture_output=True, text=True
        ).stdout.split()]
        spinning = [p for p in pids if os.path.exists(f"/proc/{p}/stat")
                    and int(Path(f"/proc/{p}/stat").read_text().split()[13]) > 0]
        assert len(spinning) >= 2  # each has run on a CPU (utime ticks) already
    time.sleep(0.2)
    assert not [p for p in pids if process_running(p)]
    with pytest.raises(ConfigurationError, match="--load"):
        DemoConfig(load=-1)


def test_each_simulated_node_gets_cpus_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert node_cpus([1, 1]) == ["0,1", "2,3"]
    assert node_cpus([2, 1]) == ["0,1", "2,3"]  # by ranks, a CPU each at least
    assert node_cpus([3, 1]) == ["0,1,2", "3"]
    assert node_cpus([1, 1, 1, 1, 1]) == [""] * 5  # fewer CPUs than nodes: no pinning
    assert node_cpus([4]) == [""]  # one node has the machine
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 7})
    assert node_cpus([1, 1]) == ["4", "7"]


# soak: a longer configuration (three jobs); the short form above proves every crash kind.
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_local_directory_volume_shrinking_with_the_naive_baseline(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    # Half the default batch: three jobs train here (the naive one too), and the steps'
    # compute is most of their time; the checks are about the crashes, not the steps.
    proc, doc = _demo(tmp_path, "--volume", str(volume), *SHORT, "--crashes", "2", "--shrink",
                      "--global-batch", "16", "--load", "1")
    _assert_correct(proc, doc)
    assert doc is not None
    assert "--load 1" in doc["command"]  # on a busy machine, and the report says so
    # The node loss: every job, the reference too, comes back on fewer ranks.
    checks = _checks(doc)
    assert checks["shrink"]["ok"], checks["shrink"]
    assert "went from 2 to 1 ranks" in checks["weights"]["name"]
    crashed, ref = doc["runs"]["dcp_volumes"], doc["runs"]["reference"]
    assert crashed["worlds"][-1] == 1 and ref["worlds"][-1] == 1
    assert ref["world_change"] == crashed["world_change"]
    naive = doc["runs"]["naive"]
    assert _crash_kinds(doc, "naive") == _crash_kinds(doc) == ["commit", "node"]
    # Not replaced: the survivor restored the lost node's shards too, from the replica it
    # kept of them where it held one, and nothing replaced node 1.
    node = crashed["crashes"][-1]
    assert node["lost_node"] == 1 and not node["replaced"] and "node" not in checks
    if node["replica_held"]:
        assert node["restore_sources"]["volume"] == 0, node
    assert naive["saves"] >= 5 and naive["committed"] >= 4
    assert "naive (before)" in doc["table"] and "dcp_volumes (after)" in doc["table"]
    # Only what the demo writes, under the location it was given.
    assert sorted(p.name for p in volume.iterdir()) == ["ckpt", MARKER, "train"]
    assert sorted(p.name for p in (volume / "ckpt").iterdir()) == [
        "dcp_volumes", "naive", "reference"]
    # A second run refuses the location (it holds this run) without --fresh.
    again, _ = _demo(tmp_path / "again", "--volume", str(volume), timeout=60)
    assert again.returncode == 2 and "--fresh" in again.stderr


@pytest.mark.soak
@pytest.mark.timeout(1500)
@pytest.mark.skipif(
    os.environ.get("DCP_VOLUMES_FULL_DEMO") != "1",
    reason="the full default demo runs for many minutes: `make demo` runs it; set "
    "DCP_VOLUMES_FULL_DEMO=1 to run it here (CI keeps the shorter configurations above)",
)
def test_default_demo_passes_every_check(tmp_path: Path) -> None:
    proc, doc = _demo(tmp_path, timeout=1400)
    _assert_correct(proc, doc)
    assert doc is not None
    failed = [f"{c['key']}: {c['detail']}" for c in doc["checks"] if not c["ok"]]
    assert proc.returncode == 0 and not failed, failed


# -- bad input: clear messages, non-zero exit, nothing deleted ------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_volume(tmp_path: Path) -> None:
    started = time.monotonic()
    proc, _ = _demo(tmp_path, "--volume", "s3://demo-bucket/run", "--storage-option", "key=a",
                    "--storage-option", "secret=b", "--storage-option",
                    f"client_kwargs.endpoint_url=http://127.0.0.1:{_closed_port()}", timeout=120)
    assert proc.returncode == 1
    assert "cannot use the volume s3://demo-bucket/run" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - started < 100


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "64"], "--nproc 64"),
    (["--crashes", "9", "--steps", "40", "--save-every", "10"], "--crashes 9 does not fit"),
    (["--shrink", "--nproc", "1"], "--shrink needs --nproc 2"),
    (["--storage-option", "nonsense"], "expected KEY=VALUE"),
])
def test_bad_arguments(tmp_path: Path, args: list[str], message: str) -> None:
    proc, _ = _demo(tmp_path, *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was created


def test_a_location_with_other_files_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / "volume").mkdir()
    mine = tmp_path / "volume" / "my-data.bin"
    mine.write_bytes(b"precious")
    proc, _ = _demo(tmp_path, "--volume", str(tmp_path / "volume"), "--fresh", timeout=60)
    assert proc.returncode == 2 and "no demo run wrote" in proc.stderr
    assert mine.read_bytes() == b"precious"


@pytest.mark.timeout(300)
def test_sigterm_ends_the_ranks_it_started(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "dcp_volumes.cli", "demo", "--no-progress", "--quick",
           "--steps", "400", "--workdir", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "out" / "runs" / "dcp_volumes"
    pids: list[int] = []
    deadline = time.monotonic() + 150
    while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        pids = [json.loads(p.read_text().splitlines()[0])["pid"]
                for p in run_dir.glob("events-*.jsonl") if p.read_text().strip()]
    assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else "no rank started"
    proc.terminate()
    assert proc.wait(timeout=60) == 130
    assert "interrupted" in (proc.stderr.read() if proc.stderr else "")
    time.sleep(1)
    assert not [pid for pid in pids if process_running(pid)]


def test_claim_fresh_deletes_only_what_a_demo_created(tmp_path: Path) -> None:
    root = tmp_path / "volume"
    volume = Volume(str(root))
    volume.check_root(create=True)
    claim(volume, DemoConfig(volume=str(root)))  # empty: claimed
    for rel in ("train/sample-00000.bin", "ckpt/dcp_volumes/step-00000010/.metadata"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    with pytest.raises(ConfigurationError, match="--fresh"):
        claim(volume, DemoConfig(volume=str(root)))
    claim(volume, DemoConfig(volume=str(root), fresh=True))
    assert sorted(p.name for p in root.iterdir()) == [MARKER]
    doc = json.loads((root / MARKER).read_text())
    assert doc["tool"] == "dcp-volumes demo" and doc["prefixes"] == ["train", "ckpt"]


# -- the plan and the options ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_crash_plans(seed: int) -> None:
    cfg = DemoConfig(seed=seed)
    plan = plan_crashes(cfg)
    # The default: a node loss mid-training, so the 2 ranks run as 2 nodes x 1 rank.
    assert sorted(c.kind for c in plan) == ["commit", "node", "preempt", "upload"]
    assert cfg.nodes == [1, 1] and cfg.worlds == [2]
    steps = [c.step for c in plan]
    assert steps == sorted(set(steps)) and steps[0] > 0 and steps[-1] < cfg.steps
    for c in plan:
        on_save = c.step % cfg.save_every == 0
        assert on_save == (c.kind in ("upload", "commit"))
        assert c.rank == 0 if c.kind in ("commit", "preempt") else 0 <= c.rank < cfg.nproc
        if c.kind == "node":  # the last node, late in an interval (after a save: j >= 2)
            assert c.rank == 1 and c.step > cfg.save_every
            assert c.step % cfg.save_every >= cfg.save_every - cfg.save_every // 2
    three = plan_crashes(DemoConfig(seed=seed, crashes=3))  # --crashes 3: SIGKILLs only
    assert sorted(c.kind for c in three) == ["commit", "node", "upload"]
    one_rank = DemoConfig(seed=seed, nproc=1)  # no node to lose: a rank dies instead
    assert sorted(c.kind for c in plan_crashes(one_rank)) == [
        "commit", "preempt", "step", "upload"]
    assert one_rank.nodes == [1]
    assert DemoConfig(seed=seed, crashes=2).nodes == [2]
    shrink = plan_crashes(DemoConfig(seed=seed, shrink=True, crashes=2))
    assert [c.kind for c in shrink] == ["commit", "node"] and shrink[-1].rank == 1
    assert plan_crashes(DemoConfig(seed=seed)) == plan  # the seed decides


def test_the_node_check_fails_when_the_new_node_read_the_volume_despite_a_replica() -> None:
    def stats(node_sources: dict[str, int], *, held: bool, replicated: bool = True) -> RunStats:
        loss = CrashOutcome(
            crash={"index": 0, "kind": "node"}, t_kill=0.0, last_step=20, resumed_from=16,
            steps_lost=4, lost_s=1.0, restart_s=9.0, restart_parts={}, evidence={"node": 1},
            restore_s=0.3, restore_sources={"local": 2**20, "peer": 2**20, "volume": 0},
            lost_node=1, replaced=True, node_sources=node_sources, replica_held=held)
        return RunStats("dcp_volumes", "dcp_volumes", [2, 2], crashes=[loss],
                        replicated=replicated)

    from_peer = {"local": 0, "peer": 2**20, "volume": 0}
    from_volume = {"local": 0, "peer": 0, "volume": 2**20}
    assert _node_check(stats(from_peer, held=True)).ok
    failed = _node_check(stats(from_volume, held=True))
    assert not failed.ok and "although another node held a complete replica" in failed.detail
    # Lost while its newest checkpoint was being replicated: the volume is the right source,
    # as long as replicas are kept at all.
    assert _node_check(stats(from_volume, held=False)).ok
    assert not _node_check(stats(from_volume, held=False, replicated=False)).ok
    lines = restart_lines({"dcp_volumes": stats(from_peer, held=True)})
    assert "node 1 replaced" in lines[1] and "restore 0.30 s" in lines[1]
    assert lines[1].endswith("(node 1: local 0 B, peer 1.0 MiB, volume 0 B)")


def test_storage_options_nest_and_merge() -> None:
    got = parse_storage_options(["client_kwargs.endpoint_url=http://h:1", "anon=false", "key=k"],
                                {"client_kwargs": {"region_name": "r"}})
    assert got == {"client_kwargs": {"endpoint_url": "http://h:1", "region_name": "r"},
                   "anon": False, "key": "k"}
    with pytest.raises(ConfigurationError):
        parse_storage_options(["=x"])


def test_importing_the_demo_package_does_not_import_torch() -> None:
    code = "import sys, dcp_volumes.demo, dcp_volumes.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), check=True)
    assert out.stdout.strip() == "False"


def test_the_library_check_holds_the_issues_tolerance() -> None:
    """goodput within 1 percentage point, each category within 10% or 0.5 s (start-up,
    restore and restart gaps each on its own); a job that ran the library without records
    fails the check."""
    from dcp_volumes.demo._launcher import JobRecord
    from dcp_volumes.demo._library import ROWS, Comparison, demo_figures
    from dcp_volumes.demo._report import library_check

    labels = [label for label, _ in ROWS]
    assert [keys for _, keys in ROWS] == [
        ("compute",), ("checkpoint_blocking",), ("input_wait",), ("startup",), ("restore",),
        ("restart_gap",), ("lost_work",), ("other",)]

    def comparison(goodput: float = 0.5, **demo: float) -> Comparison:
        lib = {"compute": 30.0, "lost_work": 2.0, "startup": 4.0, "restore": 3.0,
               "restart_gap": 5.0}
        rows = []
        for label, (key,) in ROWS:
            rows.append((label, lib.get(key, 10.0), demo.get(key, lib.get(key, 10.0))))
        return Comparison("dcp_volumes", (60.0, 60.0), (0.5, goodput), tuple(rows))

    jobs = {"dcp_volumes": JobRecord("dcp_volumes", "dcp_volumes", "", []),
            "naive": JobRecord("naive", "naive", "", [])}
    # 2.9 s apart on 30 s is within 10%; 0.45 s apart on 2 s is within 0.5 s
    ok = library_check(jobs, {"dcp_volumes": comparison(0.495, compute=27.1, lost_work=2.45,
                                                        startup=4.45, restore=2.55,
                                                        restart_gap=5.45)})
    assert ok.ok, ok.detail
    # start-up and restore each 0.6 s off, the other way: their sum agrees, each does not
    for bad, what in ((comparison(0.489), "goodput"),
                      (comparison(compute=26.9), labels[0]),
                      (comparison(lost_work=2.6), labels[6]),
                      (comparison(startup=4.6, restore=2.4), labels[3]),
                      (comparison(startup=4.6, restore=2.4), labels[4]),
                      (comparison(restart_gap=5.6), labels[5])):
        check = library_check(jobs, {"dcp_volumes": bad})
        assert not check.ok and what in check.detail, check.detail
    missing = library_check(jobs, {})
    assert not missing.ok and "dcp_volumes: no goodput records" in missing.detail

    # the demo's rows: its own spans, each in its row; ``other`` the rest of the window
    figures = demo_figures(wall=100.0, loop_compute=50.0, blocking=5.0, input_wait=3.0,
                           first_batches=1.0, pre_restore=6.0, restore=4.0, gaps=8.0,
                           before_first_process=2.0, lost=7.0, lost_pre_loop=0.5,
                           preempt_tails=1.5, between_legs=2.5)
    assert figures == {"wall": 100.5, labels[0]: 50.0, labels[1]: 5.0, labels[2]: 4.0,
                       labels[3]: 6.0, labels[4]: 4.0, labels[5]: 9.0, labels[6]: 7.5,
                       labels[7]: 100.5 - 85.5}
