"""Jobs as users run them: torchrun restarts a killed job with its own defaults, and it goes on.

Real torchrun jobs of 2 gloo ranks (tests/scripts/restart_train.py: the manager, the
dataset and the loader on moto, nothing else) lose a rank to SIGKILL twice and are
restarted by torchrun's elastic agent with the rendezvous store it shares across
attempts (no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``): with ``--standalone``, with a
c10d rendezvous, and with the static rendezvous of ``--master-addr``. Each finishes,
and every step after a restart sees the samples and ends in the weights of a job that
never crashed. The survivors of a kill exit as soon as torchrun's SIGTERM reaches them.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from testkit.ports import free_port
from tests.test_data_support import payload

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "restart_train.py"
TOTAL = 14
FILES = 24

# How each launch style names its rendezvous; all keep torchrun's shared store.
LAUNCH = {
    "standalone": lambda port: ["--standalone"],
    "c10d": lambda port: ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-id", "restart-test"],
    "static": lambda port: ["--master-addr", "127.0.0.1", "--master-port", str(port)],
}


def _obstore_names(moto: Any) -> dict[str, Any]:
    return {"access_key_id": moto.access_key, "secret_access_key": moto.secret_key,
            "endpoint": moto.endpoint, "region": moto.region}


def _run(style: str, data: str, root: str, out: Path, opts: dict[str, Any]) -> tuple[int, str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RESTART_TEST=json.dumps(opts))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--max-restarts", "3", *LAUNCH[style](free_port()),
         str(SCRIPT), data, root, str(TOTAL), str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    return proc.returncode, (proc.stdout + proc.stderr)[-8000:]


def _records(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"rank-{rank}.jsonl").read_text().splitlines()]


def _final(out: Path, rank: int) -> tuple[dict[int, list[int]], list[Any], list[int]]:
    """The samples each step trained on in the attempt that finished, its weights, and the
    step each attempt restored."""
    records = _records(out, rank)
    last = max(r["attempt"] for r in records)
    steps = {r["step"]: r["ids"] for r in records if r["attempt"] == last and "ids" in r}
    weights = next(r["weights"] for r in records if "weights" in r)
    restored = [r["restored"] for r in records if "restored" in r]
    return steps, weights, restored


@pytest.fixture(scope="module")
def training_data(moto_server: Any) -> str:
    url = moto_server.create_bucket(f"restart-data-{random.randrange(10**9)}")
    s3 = moto_server.boto3_client()
    bucket = url.removeprefix("s3://").rstrip("/")
    for i in range(FILES):
        s3.put_object(Bucket=bucket, Key=f"{i:04d}.bin", Body=payload(i, 64))
    return url


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, moto_server: Any,
              training_data: str) -> tuple[list[dict[int, list[int]]], list[Any]]:
    """Every rank's samples per step and the weights of the same job without a crash."""
    out = tmp_path_factory.mktemp("reference")
    root = moto_server.create_bucket(f"restart-ref-{random.randrange(10**9)}")
    code, log = _run("standalone", training_data, root, out,
                     {"storage_options": moto_server.storage_options()})
    assert code == 0, log
    finals = [_final(out, rank) for rank in (0, 1)]
    return [f[0] for f in finals], finals[0][1]


@pytest.mark.parametrize(("style", "names", "one_cpu"), [
    ("standalone", "obstore", True),
    ("c10d", "s3fs", True),
    ("static", "s3fs", False),
])
def test_a_job_torchrun_restarts_twice_finishes_and_resumes_exactly(
    tmp_path: Path, moto_server: Any, training_data: str, reference: Any,
    style: str, names: str, one_cpu: bool,
) -> None:
    ref_steps, ref_weights = reference
    options = _obstore_names(moto_server) if names == "obstore" else moto_server.storage_options()
    root = moto_server.create_bucket(f"restart-{style}-{random.randrange(10**9)}")
    # Rank 1 dies after starting the save of step 4 (async: it uploads), rank 0 after 10's.
    opts = {"storage_options": options, "one_cpu": one_cpu,
            "kills": {"0": [1, 4], "1": [0, 10]}}
    code, log = _run(style, training_data, root, tmp_path, opts)
    assert code == 0, log
    assert "connectFullMesh failed" not in log, log
    for rank in (0, 1):
        steps, weights, restored = _final(tmp_path, rank)
        attempts = {r["attempt"] for r in _records(tmp_path, rank)}
        assert attempts == {0, 1, 2}, log  # two restarts, each through torchrun's store
        assert restored[0] == 0 and restored[1] in (0, 3) and restored[2] in (6, 9), restored
        assert min(steps) == restored[-1] + 1 and max(steps) == TOTAL
        for step, ids in steps.items():
            assert ids == ref_steps[rank][step], (rank, step)  # the same samples
        assert weights == ref_weights  # bit for bit


def _sigterm_times(log: str) -> dict[int, float]:
    """pid -> when torchrun's agent sent it SIGTERM (its log's wall clock)."""
    times = {}
    for match in re.finditer(
        r"^W(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*Sending process (\d+) closing signal SIGTERM",
        log, re.MULTILINE,
    ):
        stamp = datetime.strptime(f"{datetime.now().year}{match[1]} {match[2]}",
                                  "%Y%m%d %H:%M:%S.%f")
        times[int(match[3])] = stamp.timestamp()
    return times


@pytest.mark.serial  # exits within a second of SIGTERM: not beside another worker's load
@pytest.mark.parametrize("signals", [[], ["SIGTERM"]], ids=["no-signals", "sigterm-preempts"])
def test_survivors_exit_at_once_on_torchruns_sigterm(
    tmp_path: Path, moto_server: Any, training_data: str, signals: list[str],
) -> None:
    """torchrun's SIGTERM after a peer died ends a survivor within a second, a save in
    flight or not; also where SIGTERM announces a preemption (the survivor's loop
    failed on the dead peer: the save in flight is abandoned, not waited on)."""
    root = moto_server.create_bucket(f"restart-exit-{random.randrange(10**9)}")
    opts = {"storage_options": moto_server.storage_options(), "kills": {"0": [1, 7]},
            "signals": signals}
    exits: dict[int, float] = {}
    stop = threading.Event()

    def watch() -> None:  # when each rank's process ends, from its pid's disappearance
        seen: dict[int, int] = {}
        while not stop.is_set():
            for rank in (0, 1):
                path = tmp_path / f"rank-{rank}.pid"
                if path.exists() and rank not in seen:
                    seen[rank] = int(path.read_text())
            for pid in seen.values():
                if pid not in exits and not os.path.exists(f"/proc/{pid}"):
                    exits[pid] = time.time()
            time.sleep(0.005)

    opts["pid_dir"] = str(tmp_path)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code, log = _run("standalone", training_data, root, tmp_path, opts)
    finally:
        stop.set()
        watcher.join()
    assert code == 0, log
    terms = _sigterm_times(log)
    survivors = [pid for pid in terms if pid in exits]
    assert survivors, log
    for pid in survivors:
        assert exits[pid] - terms[pid] < 1.0, (exits[pid] - terms[pid], log)
