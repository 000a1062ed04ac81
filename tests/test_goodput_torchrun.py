"""A real job's goodput: torchrun, 2 gloo ranks, moto, ``VolumeDataset`` and the loader.

The job (tests/scripts/goodput_train.py) sleeps a known time per step and per sample,
saves every 4 steps, and measures itself. Launch 0: rank 0 SIGKILLs itself after
step 10 and torchrun restarts the job; that attempt is preempted (SIGTERM) at step 14
and exits 0; launch 1 (a requeue) finishes at step 20. The report from the records the
manager and the loader kept must say so: three attempts (killed, preempted, exit), the
lost steps exactly, and compute, input wait and checkpoint blocking within 10% or 0.5 s
of what the job measured; and no record holds a credential.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes import goodput_report
from dcp_volumes.goodput._records import GOODPUT_DIR, parse_segment_name
from testkit.ports import free_port
from tests.test_data_support import payload

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "goodput_train.py"
TOTAL, FILES = 20, 24
STEP_S, SAMPLE_S = 0.1, 0.02


def _launch(data: str, root: str, out: Path, opts: dict[str, Any]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GOODPUT_TEST=json.dumps(opts))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--max-restarts", "2", "--master-addr", "127.0.0.1", "--master-port",
         str(free_port()), str(SCRIPT), data, root, str(TOTAL), str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    log = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, log
    return log


def _close(measured: float, reported: float) -> bool:
    return abs(measured - reported) <= max(0.5, 0.1 * measured)


@pytest.mark.parametrize(("kill_rank", "kill_step"), [
    (0, 10),
    # more kills for the soak run: the reference rank survives its peer; a kill before
    # the second save (resumed from step 4)
    pytest.param(1, 10, marks=pytest.mark.soak),
    pytest.param(0, 7, marks=pytest.mark.soak),
])
def test_a_killed_preempted_and_requeued_jobs_goodput(
    tmp_path: Path, moto_server: Any, kill_rank: int, kill_step: int,
) -> None:
    data = moto_server.create_bucket(f"goodput-data-{random.randrange(10**9)}")
    s3 = moto_server.boto3_client()
    for i in range(FILES):
        s3.put_object(Bucket=data.removeprefix("s3://"), Key=f"{i:04d}.bin",
                      Body=payload(i, 64))
    root = moto_server.create_bucket(f"goodput-run-{random.randrange(10**9)}")
    opts = {"storage_options": moto_server.storage_options(), "step_s": STEP_S,
            "sample_s": SAMPLE_S, "interval": 4, "kill": [0, 0, kill_rank, kill_step],
            "preempt": [0, 14]}
    _launch(data, root, tmp_path, {**opts, "launch": 0})
    _launch(data, root, tmp_path, {**opts, "launch": 1})

    report = goodput_report(root, storage_options=moto_server.storage_options())
    assert report.problems == ()
    truth = [json.loads(line) for line in (tmp_path / "truth-0.jsonl").read_text().splitlines()]
    restored = [t["restored"] for t in truth if "restored" in t]
    assert [a.ended for a in report.attempts] == ["killed", "preempted", "exit"], report.text()
    assert [a.ranks for a in report.attempts] == [(0, 1)] * 3
    assert [a.resumed_from for a in report.attempts] == restored
    preempted_at = next(t["preempted"] for t in truth if "preempted" in t)
    assert restored[2] == preempted_at >= 14
    # exact: the steps of attempt 0 after the step attempt 1 resumed from
    assert report.attempts[0].lost_steps == report.lost_steps == kill_step - restored[1]
    assert report.estimated == ()  # the killed attempt's journal was recovered on this node

    # what the job measured, over the steps that were kept (rank 0: the report's clock)
    steps = [t for t in truth if "step" in t]
    last_kept = {(0, 0): restored[1], (0, 1): restored[2], (1, 0): TOTAL}
    kept = [t for t in steps if t["step"] <= last_kept[t["launch"], t["attempt"]]]
    compute = sum(t["done"] - t["got"] for t in kept)
    waited = sum(t["got"] - t["ask"] for t in kept)
    blocked = sum(t["save"][1] - t["save"][0] for t in kept if t["save"])
    s = report.seconds
    assert _close(compute, s.compute), (compute, report.text())
    assert _close(waited, s.input_wait), (waited, report.text())
    assert waited > SAMPLE_S * 2 * len(kept) * 0.9
    assert _close(blocked, s.checkpoint_blocking), (blocked, report.text())
    assert s.lost_work >= (kill_step - restored[1]) * STEP_S
    assert s.startup > 0 and s.restore > 0 and s.restart_gap > 0
    assert s.total == pytest.approx(report.wall_s)
    assert report.goodput == pytest.approx(s.compute / report.wall_s)
    assert report.save_interval is not None and report.save_interval.interval_steps == 4

    # records hold no credential and no storage option
    bucket = root.removeprefix("s3://").rstrip("/")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=GOODPUT_DIR)["Contents"]]
    segments = {parse_segment_name(k) for k in keys}
    assert None not in segments
    assert len({(n.attempt, n.rank) for n in segments if n is not None}) == 6  # 3 x 2 ranks
    for key in keys:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
        for secret in (moto_server.access_key, moto_server.secret_key, moto_server.endpoint):
            assert secret not in body, key
