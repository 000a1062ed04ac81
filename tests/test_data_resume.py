"""Resume exactness: a job is SIGKILLed after saving its loader state with DCP, then
resumes on another number of ranks and workers and sees exactly the rest of the stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from dcp_volumes import DataLoader, VolumeDataset
from testkit.emulators import repo_root
from testkit.ranks import run_ranks
from tests.test_data_support import global_view, read_id, run_job, to_list, write_samples

# More workers than this machine's cores is deliberate here (torch warns about it).
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

GLOBAL_BATCH = 12  # splits evenly over 1, 2, 3 and 4 ranks
FILES = 48


def _loader(url: str, opts: dict[str, Any], cache: str, workers: int) -> DataLoader:
    ds = VolumeDataset(url, storage_options=opts, cache_dir=cache, transform=read_id)
    # Ranks are spawned here; torchrun's ranks would fork their workers too.
    return DataLoader(ds, global_batch_size=GLOBAL_BATCH, num_workers=workers,
                      multiprocessing_context="fork")


def _deliver_and_save(loader: DataLoader, rank: int, ck: str, out: str,
                      steps: int) -> Iterator[Any]:
    """Take ``steps`` batches, save the loader to ``ck``, then publish the batches as
    ``out/rank{rank}.json`` (atomically: the parent waits for that file). Returns the
    iterator, mid-epoch."""
    it = iter(loader)
    batches = [to_list(next(it)) for _ in range(steps)]
    dcp.save({"data": loader}, storage_writer=dcp.FileSystemWriter(ck))
    tmp = Path(out) / f".rank{rank}.json"
    tmp.write_text(json.dumps(batches))
    tmp.rename(Path(out) / f"rank{rank}.json")
    return it


def _doomed_rank(rank: int, world_size: int, url: str, opts: dict[str, Any], cache: str,
                 ck: str, out: str, steps: int) -> None:
    loader = _loader(url, opts, cache, workers=2)
    it = _deliver_and_save(loader, rank, ck, out, steps)
    next(it)  # training goes on, workers prefetch further ... until the kill
    time.sleep(600)


def doomed_job(url: str, opts: dict[str, Any], cache: str, ck: str, out: str,
               steps: int) -> None:
    """The job that gets killed: 2 ranks x 2 workers (run in a subprocess)."""
    run_ranks(_doomed_rank, 2, url, opts, cache, ck, out, steps, timeout=600)


def _resumed_rank(rank: int, world_size: int, url: str, opts: dict[str, Any], cache: str,
                  ck: str, workers: int) -> tuple[list[list[int]], dict[str, Any]]:
    loader = _loader(url, opts, cache, workers)
    dcp.load({"data": loader}, storage_reader=dcp.FileSystemReader(ck))
    return [to_list(b) for b in loader], loader.state_dict()


def _wait_for(paths: list[Path], proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            raise AssertionError(f"the job died before saving:\n{proc.stderr.read().decode()}"
                                 if proc.stderr else "the job died before saving")
        if time.monotonic() > deadline:
            raise AssertionError("the job did not save its state in time")
        time.sleep(0.1)


def test_resume_after_sigkill_on_other_ranks_and_workers(s3_bucket: tuple[str, Any],
                                                         tmp_path: Path) -> None:
    url, opts = s3_bucket
    write_samples(url, opts, FILES)
    cache, ck, out = str(tmp_path / "cache"), str(tmp_path / "ck"), tmp_path / "out"
    out.mkdir()
    reference, _ = run_job(url, opts, str(tmp_path / "ref-cache"), world=1, workers=0,
                           global_batch_size=GLOBAL_BATCH)
    assert sorted(reference) == list(range(FILES))

    code = ("import json, sys; from tests.test_data_resume import doomed_job; "
            "doomed_job(*json.loads(sys.argv[1]))")
    args = json.dumps([url, opts, cache, ck, str(out), 2])
    proc = subprocess.Popen([sys.executable, "-c", code, args], cwd=repo_root(),
                            start_new_session=True, stderr=subprocess.PIPE)
    try:
        _wait_for([out / "rank0.json", out / "rank1.json"], proc, timeout=180)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole job: ranks and their workers
        proc.wait()
    head = global_view([json.loads((out / f"rank{r}.json").read_text()) for r in range(2)])
    assert head == reference[:24]

    # Resume on 3 ranks x 3 workers (real gloo group, DCP load) ...
    results = run_ranks(_resumed_rank, 3, url, opts, cache, ck, 3, timeout=240)
    tail = global_view([batches for batches, _ in results])
    assert tail == reference[24:]
    assert all(state == results[0][1] for _, state in results)  # global state
    assert results[0][1]["epoch"] == 1 and results[0][1]["position"] == 0
    assert sorted(head + tail) == list(range(FILES))  # every file exactly once
    # ... and on 1 rank x 3 workers, from the same checkpoint.
    single, _ = _resumed_rank(0, 1, url, opts, cache, ck, 3)
    assert [i for batch in single for i in batch] == reference[24:]


def test_resume_across_the_epoch_boundary(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    write_samples(src, None, 30)  # 30 = 2.5 global batches of 12: the last one is padded
    cache = str(tmp_path / "cache")
    epoch0, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=12)
    epoch1, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=12, epoch=1)
    head, state = run_job(src, None, cache, world=2, workers=2, global_batch_size=12,
                          stop_after=3)  # the whole of epoch 0
    assert head == epoch0 and (state["epoch"], state["position"]) == (1, 0)
    part, state = run_job(src, None, cache, world=3, workers=1, global_batch_size=12,
                          state=state, stop_after=1)
    rest, state = run_job(src, None, cache, world=4, workers=3, global_batch_size=12,
                          state=state)
    assert part + rest == epoch1
    assert state["step"] == 6 and state["epoch"] == 2


def test_a_state_saved_under_the_old_key_resumes_exactly(tmp_path: Path) -> None:
    """States saved before the rename keep the file table's digest under "manifest": they
    resume exactly where they left off; new states write "file_table"."""
    src = str(tmp_path / "src")
    write_samples(src, None, 30)
    cache = str(tmp_path / "cache")
    whole, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=6)
    head, state = run_job(src, None, cache, world=2, workers=1, global_batch_size=6,
                          stop_after=2)
    assert "file_table" in state and "manifest" not in state
    old = {("manifest" if k == "file_table" else k): v for k, v in state.items()}
    rest, after = run_job(src, None, cache, world=1, workers=2, global_batch_size=6, state=old)
    assert head + rest == whole
    assert after["file_table"] == state["file_table"] and after["epoch"] == 1


@pytest.mark.soak
def test_repeated_kills_never_lose_or_repeat_samples(s3_bucket: tuple[str, Any],
                                                     tmp_path: Path) -> None:
    """Kill after each of several saves; the stitched stream is the uninterrupted one."""
    url, opts = s3_bucket
    write_samples(url, opts, FILES)
    reference, _ = run_job(url, opts, str(tmp_path / "ref"), world=1, workers=0,
                           global_batch_size=GLOBAL_BATCH)
    cache = str(tmp_path / "cache")
    stitched: list[int] = []
    for trial in range(3):
        ck = tmp_path / f"ck{trial}"
        out = tmp_path / f"out{trial}"
        out.mkdir()
        if trial:  # continue from the previous checkpoint, then save again
            prev = str(tmp_path / f"ck{trial - 1}")
            code = ("import json, sys; from tests.test_data_resume import resumed_then_doomed; "
                    "resumed_then_doomed(*json.loads(sys.argv[1]))")
            args = json.dumps([url, opts, cache, prev, str(ck), str(out), 1])
        else:
            code = ("import json, sys; from tests.test_data_resume import doomed_job; "
                    "doomed_job(*json.loads(sys.argv[1]))")
            args = json.dumps([url, opts, cache, str(ck), str(out), 1])
        proc = subprocess.Popen([sys.executable, "-c", code, args], cwd=repo_root(),
                                start_new_session=True, stderr=subprocess.PIPE)
        try:
            _wait_for([out / "rank0.json", out / "rank1.json"], proc, timeout=180)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stitched += global_view([json.loads((out / f"rank{r}.json").read_text())
                                 for r in range(2)])
    single, _ = _resumed_rank(0, 1, url, opts, cache, str(tmp_path / "ck2"), 2)
    stitched += [i for batch in single for i in batch]
    assert stitched == reference


def _resumed_doomed_rank(rank: int, world_size: int, url: str, opts: dict[str, Any],
                         cache: str, prev: str, ck: str, out: str, steps: int) -> None:
    loader = _loader(url, opts, cache, workers=2)
    dcp.load({"data": loader}, storage_reader=dcp.FileSystemReader(prev))
    _deliver_and_save(loader, rank, ck, out, steps)
    time.sleep(600)


def resumed_then_doomed(url: str, opts: dict[str, Any], cache: str, prev: str, ck: str,
                        out: str, steps: int) -> None:
    """Resume from ``prev``, deliver ``steps`` batches, save to ``ck``, wait to be killed."""
    run_ranks(_resumed_doomed_rank, 2, url, opts, cache, prev, ck, out, steps, timeout=600)
