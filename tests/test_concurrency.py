"""Several jobs on one root or one cache at once, as real processes (spawn).

* two managers saving into one root, each running retention after every commit;
* a job saving while another deletes old checkpoints (``dcp-volumes gc``, looped);
* two datasets over different prefixes sharing one cache under a tight limit.

On a local root and on moto's S3 server. Every process must finish without an
error; what is left must be exactly what the rules keep, complete and loadable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_volumes import CheckpointManager, DataLoader, FileCache, VolumeDataset
from dcp_volumes._volume import Volume
from testkit.states import seeded_state

_SPAWN = mp.get_context("spawn")
_SHAPES = {"w": (64, 64)}  # the state's tensors, by name

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(64, 64), "step": -1}


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        (tmp_path / "root").mkdir()
        return str(tmp_path / "root"), {}
    url, opts = request.getfixturevalue("s3_bucket")
    return f"{url}/run", opts


def _run(target: Any, *args: Any) -> list[tuple[str, Any]]:
    """Start one process per args tuple; wait; return what each put on the queue."""
    out = _SPAWN.Queue()
    barrier = _SPAWN.Barrier(len(args))
    procs = [_SPAWN.Process(target=target, args=(*a, barrier, out)) for a in args]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0, f"a job died with exit code {p.exitcode}"
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    return results


# -- two managers, one root, retention at once ---------------------------------------------


def _saver(url: str, opts: dict[str, Any], staging: str, steps: list[int], keep: int,
           barrier: Any, out: Any) -> None:
    warnings.simplefilter("ignore")
    try:
        os.makedirs(staging, exist_ok=True)
        barrier.wait(timeout=60)
        with CheckpointManager(url, storage_options=opts, keep_last=keep,
                               staging_dir=staging, async_save=True) as mgr:
            for step in steps:
                mgr.save(step, seeded_state(step, _SHAPES, step=step))
        out.put(("ok", steps))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def _check_exactly(url: str, opts: dict[str, Any], staging: str, steps: list[int]) -> None:
    os.makedirs(staging, exist_ok=True)
    with CheckpointManager(url, storage_options=opts, staging_dir=staging) as mgr:
        infos = mgr.list()
        assert [(i.step, i.complete) for i in infos] == [(s, True) for s in steps], infos
        for step in steps:
            out = _blank()
            assert mgr.restore(out, step=step) == step
            assert torch.equal(out["w"], seeded_state(step, _SHAPES)["w"]) and out["step"] == step


def test_two_managers_run_retention_on_one_root_at_once(root: tuple[str, dict[str, Any]],
                                                        tmp_path: Path) -> None:
    url, opts = root
    # Interleaved steps: each job's retention runs while the other is writing or
    # deleting, and both delete the same old checkpoints.
    even, odd = list(range(0, 16, 2)), list(range(1, 16, 2))
    _run(_saver, (url, opts, str(tmp_path / "st0"), even, 3),
         (url, opts, str(tmp_path / "st1"), odd, 3))
    # Each job's last retention ran after its own last commit; the job that committed
    # last saw every older one: exactly the newest three remain (a retention that
    # raced a commit may have kept one more, never fewer).
    with CheckpointManager(url, storage_options=opts) as mgr:
        left = [i.step for i in mgr.list()]
    assert left[-3:] == [13, 14, 15] and len(left) <= 4, left
    _check_exactly(url, opts, str(tmp_path / "st2"), left)


# -- a save while another job deletes old checkpoints --------------------------------------


def _collector(url: str, opts: dict[str, Any], seconds: float, barrier: Any, out: Any) -> None:
    from tests.test_cli import run_cli

    try:
        barrier.wait(timeout=60)
        runs = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            res = run_cli("gc", url, "--keep-last", "1", "--no-progress", options=opts)
            if res.returncode != 0:
                raise RuntimeError(f"gc failed: {res.stderr.strip()}")
            runs += 1
        out.put(("ok", runs))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def test_a_save_while_another_job_deletes_old_checkpoints(root: tuple[str, dict[str, Any]],
                                                          tmp_path: Path) -> None:
    url, opts = root
    steps = list(range(1, 11))
    results = _run(
        _saver_and_collector, (url, opts, str(tmp_path / "st"), steps, 5),
        ("gc", url, opts, 20.0),
    )
    runs = next(r[1] for r in results if isinstance(r[1], int))
    assert runs >= 3, f"the collector ran only {runs} times alongside the saves"
    # gc keeps one; the job's own retention five: only the newest is certain, and it
    # is complete and loads exactly (the collector never took the one being written).
    with CheckpointManager(url, storage_options=opts) as mgr:
        infos = mgr.list()
    assert infos and infos[-1].step == 10 and all(i.complete for i in infos), infos
    _check_exactly(url, opts, str(tmp_path / "st2"), [i.step for i in infos])


def _saver_and_collector(*args: Any) -> None:
    """One spawn target for both roles (``_run`` starts one target)."""
    if args[0] == "gc":
        _collector(*args[1:])
    else:
        _saver(*args)


# -- one cache shared by two datasets --------------------------------------------------------


def _reader(url: str, opts: dict[str, Any], cache: str, limit: int, epochs: int,
            barrier: Any, out: Any) -> None:
    try:
        ds = VolumeDataset(url, storage_options=opts, cache_dir=cache, cache_limit=limit,
                           shuffle=True, seed=len(url), transform=_read)
        barrier.wait(timeout=60)
        loader = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=_as_list)
        seen = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            seen.append(sorted(s for b in loader for s in b))
        out.put(("ok", (url, seen)))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _as_list(batch: list[bytes]) -> list[bytes]:
    return batch


def _payload(prefix: str, i: int, size: int) -> bytes:
    head = f"{prefix}:{i}:".encode()
    return (head * (size // len(head) + 1))[:size]


def test_one_cache_shared_by_two_datasets(root: tuple[str, dict[str, Any]],
                                          tmp_path: Path) -> None:
    url, opts = root
    n, size = 24, 3000
    expected = {}
    for prefix in ("a", "b"):
        vol = Volume(f"{url}/{prefix}", storage_options=opts)
        if vol.capabilities.local_files:
            os.makedirs(vol.root, exist_ok=True)
        for i in range(n):
            vol.publish(f"f{i:02d}.bin", _payload(prefix, i, size))
        expected[f"{url}/{prefix}"] = sorted(_payload(prefix, i, size) for i in range(n))
    cache = str(tmp_path / "cache")
    limit = n * size  # room for one dataset's files: the two evict each other's
    results = _run(_reader, (f"{url}/a", opts, cache, limit, 2),
                   (f"{url}/b", opts, cache, limit, 2))
    for _, (which, epochs) in results:
        for got in epochs:
            assert got == expected[which]  # every file, byte-exact, each epoch
    fc = FileCache(cache, limit=limit)
    report = fc.reconcile()
    assert report.removed_temp == 0 and report.removed_broken == 0, report  # nothing torn
    if Volume(url, storage_options=opts).capabilities.local_files:
        return  # local files are read in place: the cache holds nothing
    # While both read, the cache may run over its limit by what is in use or inside
    # a prefetch window; the next fill, with nothing in use, gives that back.
    assert 0 < fc.usage() <= limit + 2 * 16 * size, (fc.usage(), limit)
    Volume(f"{url}/c", storage_options=opts).publish("extra.bin", b"x" * size)
    fc.fetch(f"{url}/c/extra.bin", storage_options=opts)
    assert fc.usage() <= limit, (fc.usage(), limit)


# -- two jobs saving the same checkpoint id at once ------------------------------------------

_RACE_MIB = 48  # per rank: saves long enough that the two jobs' saves overlap (~1 s on moto)


def _race_state(job: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * job + rank)
    n = _RACE_MIB * 2**20 // 4 // 6
    return {f"r{rank}.t{i}": torch.randn(n, generator=g) for i in range(6)}


def _race_rank(rank: int, world: int, url: str, opts: dict[str, Any], job: int,
               meeting: str, staging: str) -> tuple[str, float, float]:
    """One rank of one job: meet the other job's ranks, then save to the shared id."""
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import CheckpointExistsError, VolumeWriter, storage_error

    state = _race_state(job, rank)
    own_staging = os.path.join(staging, f"r{rank}")
    os.makedirs(own_staging, exist_ok=True)
    Path(meeting, f"job{job}-rank{rank}").touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(meeting)) < 2 * world:  # every rank of both jobs is ready
        if time.monotonic() > deadline:
            raise TimeoutError("the other job's ranks never arrived")
        time.sleep(0.005)
    started = time.time()
    try:
        dcp.save(state, storage_writer=VolumeWriter(
            url, storage_options=opts, staging_dir=own_staging))
        outcome = "committed"
    except BaseException as exc:
        if not isinstance(storage_error(exc), CheckpointExistsError):
            raise
        outcome = "exists"
    return outcome, started, time.time()


def _race_job(url: str, opts: dict[str, Any], job: int, meeting: str, staging: str,
              barrier: Any, out: Any) -> None:
    from testkit.ranks import run_ranks

    try:
        barrier.wait(timeout=60)
        out.put(("ok", (job, run_ranks(_race_rank, 2, url, opts, job, meeting, staging,
                                        timeout=180))))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def test_two_jobs_saving_the_same_checkpoint_id_at_once(
        root: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """Exactly one job commits; the other gets CheckpointExistsError on every rank and
    leaves nothing behind; the checkpoint holds the winner's bytes, verified."""
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeReader
    from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
    from dcp_volumes.checkpoint._manifest import read_manifest

    url, opts = root
    ck = f"{url}/step-1"
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    results = _run(_race_job, *[(ck, opts, job, str(meeting), str(tmp_path / f"st{job}"))
                                for job in (0, 1)])
    by_job = dict(r[1] for r in results)
    outcomes = {job: {o for o, _, _ in ranks} for job, ranks in by_job.items()}
    assert sorted(map(sorted, outcomes.values())) == [["committed"], ["exists"]], outcomes
    winner = next(job for job, o in outcomes.items() if o == {"committed"})
    # The saves ran at the same time (else this would test nothing).
    spans = [(s, e) for ranks in by_job.values() for _, s, e in ranks]
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans

    volume = Volume(ck, storage_options=opts)
    manifest = read_manifest(volume)
    assert manifest is not None
    listed = {f.path for f in volume.list()}
    assert listed == set(manifest.files) | {MANIFEST_NAME, METADATA_NAME}, (
        "the losing job's files must be gone, the winner's all there")
    expected = {k: v for rank in (0, 1) for k, v in _race_state(winner, rank).items()}
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(out, storage_reader=VolumeReader(ck, storage_options=opts, verify=True),
             no_dist=True)
    assert all(torch.equal(out[k], expected[k]) for k in expected)
