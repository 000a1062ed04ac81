"""DataLoader workers hand batches over by shared-memory name ("file_system"), the user's
worker_init_fn still runs, and no segment outlives the job, even a SIGKILLed one."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from dcp_volumes import ConfigurationError, DataLoader, VolumeDataset
from tests.test_data_support import read_id, to_list, write_samples

JOB = """
import sys, time
import torch
from dcp_volumes import DataLoader, VolumeDataset

def sample(path):
    return torch.full((4096,), 1.0)  # 16 KiB: every batch is a shared-memory segment

if __name__ == "__main__":
    ds = VolumeDataset(sys.argv[1], cache_dir=sys.argv[2], transform=sample)
    it = iter(DataLoader(ds, batch_size=2, num_workers=2))
    next(it)
    next(it)
    print("ready", flush=True)  # the workers have more batches waiting in shared memory
    time.sleep(float(sys.argv[3]))
"""


def _note_strategy(folder: str, worker_id: int) -> None:
    Path(folder, f"worker-{worker_id}").write_text(torch.multiprocessing.get_sharing_strategy())


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/torch_*"))


@pytest.fixture
def samples(tmp_path: Path) -> str:
    src = str(tmp_path / "src")
    write_samples(src, None, 24, size=100)
    return src


def test_workers_share_batches_by_name_and_still_run_the_users_init(
    samples: str, tmp_path: Path
) -> None:
    for asked, expected in ((None, "file_system"), ("file_descriptor", "file_descriptor")):
        seen = tmp_path / f"seen-{asked}"
        seen.mkdir()
        ds = VolumeDataset(samples, cache_dir=tmp_path / f"cache-{asked}", transform=read_id,
                           seed=1)
        loader = DataLoader(ds, batch_size=4, num_workers=2, sharing_strategy=asked,
                            worker_init_fn=partial(_note_strategy, str(seen)))
        assert loader.sharing_strategy == expected
        got = [i for batch in loader for i in to_list(batch)]
        assert sorted(got) == list(range(24))
        # Ours ran first, then the user's init, in every worker.
        assert {p.name: p.read_text() for p in seen.iterdir()} == {
            "worker-0": expected, "worker-1": expected}
    # The training process keeps its own strategy.
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    with pytest.raises(ConfigurationError, match=r"sharing_strategy='shm'.*Fix"):
        DataLoader(VolumeDataset(samples, cache_dir=tmp_path / "c"), sharing_strategy="shm")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")
@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_no_shared_memory_outlives_the_job(samples: str, tmp_path: Path, ending: str) -> None:
    before = _segments()
    sleep_s = "0.5" if ending == "exit" else "600"
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, samples, str(tmp_path / "cache"), sleep_s],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        assert _segments() - before, "the job's waiting batches should be named segments"
        if ending == "sigkill":
            job.send_signal(signal.SIGKILL)
        assert job.wait(timeout=60) in (0, -signal.SIGKILL)
    finally:
        job.kill()
    # Orphaned workers notice within ~5 s and exit; torch_shm_manager then removes
    # every segment of its clients.
    deadline = time.monotonic() + 60
    while _segments() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _segments() - before


def test_a_worker_without_the_shm_manager_falls_back_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dcp_volumes.data import _batch_sharing

    def no_manager(*args: object, **kwargs: object) -> None:
        raise RuntimeError("could not start torch_shm_manager")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", no_manager)
    try:
        with caplog.at_level("WARNING", logger="dcp_volumes.data"):
            _batch_sharing.WorkerInit("file_system", None)(0)
        assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
        assert "torch_shm_manager" in caplog.text and "file descriptor" in caplog.text
    finally:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
