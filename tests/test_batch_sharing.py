"""DataLoader workers hand batches over by shared-memory name ("file_system"), the user's
worker_init_fn still runs, forked workers share the training process's torch_shm_manager,
and no segment outlives the job, even a SIGKILLed one."""

from __future__ import annotations

import glob
import json
import multiprocessing
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


MANAGERS_JOB = """
import json, os, sys
from dcp_volumes import DataLoader, VolumeDataset

def processes():
    # (pid, parent) of this job's descendants, by name ("comm" is cut to 15 characters).
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        found[int(pid)] = (comm, int(rest.split()[1]))
    me = os.getpid()
    workers = sorted(pid for pid, (comm, parent) in found.items()
                     if parent == me and comm != "torch_shm_manag")
    managers = sorted((pid, parent) for pid, (comm, parent) in found.items()
                      if comm == "torch_shm_manag" and parent in (me, *workers))
    return workers, managers

if __name__ == "__main__":
    ds = VolumeDataset(sys.argv[1], cache_dir=sys.argv[2])
    loader = DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=False)
    for epoch in range(2):  # new workers every epoch
        it = iter(loader)
        next(it), next(it)  # both workers have shared batches by now
        workers, managers = processes()
        print(json.dumps([os.getpid(), workers, managers]), flush=True)
        del it
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

    # Sharing by name is where torch reaches (or starts) the manager.
    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", no_manager)
    try:
        with caplog.at_level("WARNING", logger="dcp_volumes.data"):
            _batch_sharing.WorkerInit("file_system", None)(0)
        assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
        assert "torch_shm_manager" in caplog.text and "file descriptor" in caplog.text
    finally:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")


def test_forked_workers_share_the_training_process_manager(samples: str, tmp_path: Path) -> None:
    # A manager per worker is a new process loading libtorch (~0.3 s) before each worker's
    # first download; the workers inherit the training process's one instead.
    out = subprocess.run(
        [sys.executable, "-c", MANAGERS_JOB, samples, str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.splitlines()
    seen = [json.loads(line) for line in out]  # [job pid, worker pids, [[manager, parent]]]
    assert len(seen) == 2
    (job, workers0, managers0), (_, workers1, managers1) = seen
    assert set(workers0).isdisjoint(workers1)  # the second epoch forked new workers
    assert len(workers0) == len(workers1) == 2
    # One manager, the training process's; the second epoch's workers use it too.
    assert len(managers0) == 1 and managers0[0][1] == job, managers0
    assert managers1 == managers0


def test_the_training_process_starts_a_manager_only_for_forked_workers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dcp_volumes.data import _batch_sharing

    calls: list[int] = []

    def no_manager(self: object) -> None:
        calls.append(1)
        raise RuntimeError("could not start torch_shm_manager")

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", no_manager)
    monkeypatch.setattr(_batch_sharing, "_manager_pid", None)
    spawn = multiprocessing.get_context("spawn")
    _batch_sharing.start_manager_for_workers("file_system", spawn)  # they could not inherit it
    _batch_sharing.start_manager_for_workers("file_descriptor", None)  # they need none
    assert calls == []
    with caplog.at_level("INFO", logger="dcp_volumes.data"):
        _batch_sharing.start_manager_for_workers("file_system", None)
    # It could not start: logged, not raised, and the workers try their own.
    assert calls == [1] and "workers try their own" in caplog.text
    assert _batch_sharing._manager_pid is None
