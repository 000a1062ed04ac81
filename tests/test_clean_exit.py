"""A job whose gloo groups outlive its script exits 0.

Training scripts end with collectives and ``destroy_process_group()`` while something
still holds the group (FSDP's modules do), so its gloo threads live on into Python's
shutdown. A gloo thread that needs the GIL after the shutdown has begun aborts the
process on Python < 3.14 ("terminate called without an active exception"), which
torchrun takes for a failed job. On a busy machine that happens when such a thread, about
to let go of a collective's tensors, waits a moment for a core; the script below makes
the moment certain: a callback on the gloo thread sleeps 30 ms past the script's last
line. Run plainly it aborts every time. Run through ``python -m dcp_volumes.run``, or
beside a ``CheckpointManager``, which makes groups of its own, it must exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_blocks import REPO

_SCRIPT = """
import sys
import time
import types

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
if sys.argv[2] == "manager":
    from dcp_volumes import CheckpointManager

    manager = CheckpointManager(sys.argv[3])
work = dist.all_gather([torch.empty(4)], torch.ones(4), async_op=True)
work.get_future().then(lambda _: time.sleep(0.03))
# Held past the script's end, as FSDP's modules hold it.
sys.modules["held_groups"] = types.SimpleNamespace(world=dist.group.WORLD)
dist.destroy_process_group()
"""


def _exit_codes(tmp_path: Path, how: str, runs: int) -> list[tuple[int, str]]:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable]
    if how == "runner":
        launcher += ["-m", "dcp_volumes.run", "--route", f"{tmp_path}/"]
    procs = [
        subprocess.Popen(
            [*launcher, str(script), str(tmp_path / f"store-{i}"), how, str(tmp_path / f"ck-{i}")],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for i in range(runs)
    ]
    errors = [p.communicate(timeout=240)[1] for p in procs]
    return [(p.returncode, err[-2000:]) for p, err in zip(procs, errors, strict=True)]


def _assert_all_clean(results: list[tuple[int, str]]) -> None:
    failed = [(code, err) for code, err in results if code != 0]
    assert not failed, f"{len(failed)} of {len(results)} exits failed; first: {failed[0]}"


@pytest.mark.parametrize("how", ["runner", "manager"])
def test_a_job_whose_groups_outlive_its_script_exits_cleanly(tmp_path: Path, how: str) -> None:
    _assert_all_clean(_exit_codes(tmp_path, how, runs=2))


@pytest.mark.soak
@pytest.mark.parametrize("how", ["runner", "manager"])
def test_a_job_whose_groups_outlive_its_script_exits_cleanly_every_time(
    tmp_path: Path, how: str
) -> None:
    results = []
    for batch in range(5):
        work = tmp_path / str(batch)
        work.mkdir()
        results += _exit_codes(work, how, runs=4)
    _assert_all_clean(results)
