"""A script that returns with a save in flight leaves that checkpoint committed (or, past the
bound, cleanly abandoned): the final checkpoint of a run is the one users need most."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_volumes import CheckpointManager

SCRIPT = Path(__file__).parent / "scripts" / "last_save.py"


def _run(root: str, options: dict[str, Any], writer: dict[str, Any] | None = None,
         env: dict[str, str] | None = None, tensors: int = 1) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), root, json.dumps(options), json.dumps(writer or {}),
           str(tensors)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, **(env or {})})


def _restored(root: str, options: dict[str, Any],
              tensors: int = 1) -> tuple[int | None, torch.Tensor]:
    state: dict[str, Any] = {f"w{i}": torch.full((512, 512), -1.0) for i in range(tensors)}
    state["step"] = -1
    with CheckpointManager(root, storage_options=options) as mgr:
        step = mgr.restore(state)
    return step, torch.stack([state[f"w{i}"] for i in range(tensors)])


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.emulator)])
def test_the_last_save_of_a_script_that_just_returns_is_committed(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if where == "s3":
        url, options = request.getfixturevalue("s3_bucket")
        root = f"{url}/run"
    else:
        root, options = str(tmp_path / "run"), {}
    done = _run(root, options, {"writer_options": {"file_size": "256KiB"}})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "returning with a save in flight" in done.stdout
    assert "NOT saved" not in done.stderr
    step, w = _restored(root, options)
    assert step == 7 and torch.equal(w, torch.full((1, 512, 512), 7.0))


def test_past_the_bound_the_save_is_abandoned_cleanly(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    # 64 MiB in 1 MiB files, 1 ms allowed: the uploads still to run at exit pass the bound.
    done = _run(root, {}, {"writer_options": {"file_size": "1MiB"}},
                env={"DCP_VOLUMES_EXIT_TIMEOUT": "0.001"}, tensors=64)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "was abandoned" in done.stderr and "DCP_VOLUMES_EXIT_TIMEOUT" in done.stderr
    step, w = _restored(root, {}, 64)
    assert step == 6 and torch.equal(w, torch.full((64, 512, 512), 6.0))  # the previous one
    assert not (tmp_path / "run" / "step-00000007" / ".metadata").exists()


EXIT_PROBE = """
import atexit, gc, sys
# Registered first, so it runs last: after the library's own exit handler.
atexit.register(lambda: print("frozen objects at exit:", gc.get_freeze_count(), flush=True))
import torch
from dcp_volumes import CheckpointManager, DataLoader, VolumeDataset
if sys.argv[2] == "manager":
    CheckpointManager(sys.argv[1]).close()
elif sys.argv[2] == "loader":
    DataLoader(VolumeDataset(sys.argv[1]), global_batch_size=1)
"""


@pytest.mark.parametrize("built", ["manager", "loader", "nothing"])
def test_a_job_process_exits_without_the_final_full_collection(
    built: str, tmp_path: Path
) -> None:
    """A process that built the job's manager or loader skips the interpreter's last full
    collection at exit (what a restart waits for); importing the package alone does not."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.bin").write_bytes(b"x")
    url = str(tmp_path / ("run" if built == "manager" else "data"))
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE, url, built],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    frozen = int(done.stdout.rsplit(":", 1)[1])
    assert (frozen > 0) == (built != "nothing"), done.stdout
