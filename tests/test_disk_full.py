"""A local disk that fills up part-way through a write: the staging disk during a save's
serialisation, the cache disk during a fill.

Each test mounts a small tmpfs (root only; skipped otherwise) and fills it from
"another job" (a filler file) at a real seam after the free-space check passed:
a DCP planner's ``finish_plan`` (after every rank's ``prepare_local_plan``, before
``write_data``), an object larger than the writer's estimate, or the proxy
seeing the download's GET. The failure must be a clear ``DiskFullError``, with
no commit marker, nothing torn left that a later run trusts, the space given
back, and the next save or fill succeeding once the filler is gone.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dcp_volumes import (
    CacheError,
    CheckpointError,
    CheckpointManager,
    DataLoader,
    DiskFullError,
    FileCache,
    StagingError,
    VolumeDataset,
    VolumeReader,
    VolumeWriter,
    storage_error,
)
from dcp_volumes._volume import Volume
from testkit.emulators import LatencyProxy, MotoServer
from testkit.states import seeded_state
from tests.test_data_support import read_id, write_samples

pytestmark = pytest.mark.timeout(60)
_SHAPES = {"w": (512, 1024)}  # 2 MiB

MiB = 2**20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount(size)``: a fresh tmpfs of ``size`` (e.g. ``"8m"``), unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill_disk(directory: Path, *, leave: int) -> Path:
    """Another job's file: it takes the free space of ``directory``'s disk but ``leave`` bytes."""
    filler = directory / "filler"
    todo = shutil.disk_usage(directory).free - leave
    chunk = b"\0" * MiB
    with open(filler, "wb") as f:
        while todo > 0:
            todo -= f.write(chunk[: min(todo, MiB)])
    return filler


def files_below(directory: Path) -> dict[str, int]:
    """``relative path -> size`` of every file below ``directory``."""
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in directory.rglob("*") if p.is_file()}


# -- the staging disk -----------------------------------------------------------------------


class _AnotherJobFillsTheDisk(DefaultSavePlanner):
    """DCP's planner, plus: the disk fills after the writer's space check, before write_data."""

    def __init__(self, disk: Path, leave: int) -> None:
        super().__init__()
        self.disk, self.leave = disk, leave

    def finish_plan(self, new_plan: Any) -> Any:
        fill_disk(self.disk, leave=self.leave)
        return super().finish_plan(new_plan)


def _quiet_save(state: dict[str, Any], writer: VolumeWriter, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns on every call
        dcp.save(state, storage_writer=writer, no_dist=True, **kwargs)


def test_a_staging_disk_that_fills_during_serialisation(
    small_disk: Callable[[str], Path], tmp_path: Path
) -> None:
    staging, ck = small_disk("8m"), tmp_path / "ck"
    writer = VolumeWriter(ck, staging_dir=staging, staging_headroom=0)
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException
        _quiet_save(seeded_state(1, _SHAPES, step=torch.tensor(1)), writer,
                    planner=_AnotherJobFillsTheDisk(staging, 256 * 2**10))
    err = storage_error(caught.value)
    # What (the disk, the bytes), why and the fix; torch's "unexpected pos" is not the message.
    assert isinstance(err, DiskFullError) and isinstance(err, StagingError), caught.value
    assert err.errno == errno.ENOSPC and err.directory == str(staging)
    assert err.needed is not None and err.needed >= 2 * MiB
    text = str(err)
    assert f"The disk holding {staging} is full" in text and "MiB" in text
    assert "staging_dir=" in text and "unexpected pos" not in text
    assert not (ck / ".metadata").exists()  # no commit marker
    assert files_below(staging) == {"filler": files_below(staging)["filler"]}  # space given back

    (staging / "filler").unlink()  # the other job is done
    _quiet_save(seeded_state(1, _SHAPES, step=torch.tensor(1)), writer)
    got = {"w": torch.zeros(512, 1024), "step": torch.tensor(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=VolumeReader(ck), no_dist=True)
    assert torch.equal(got["w"], seeded_state(1, _SHAPES)["w"]) and int(got["step"]) == 1
    assert files_below(staging) == {}


@pytest.mark.parametrize("keep_local", [False, True], ids=["staging", "local-tier"])
def test_the_manager_reports_a_full_staging_disk_at_the_next_wait(
    small_disk: Callable[[str], Path], tmp_path: Path, keep_local: bool
) -> None:
    staging, root = small_disk("4m"), tmp_path / "run"
    # An object's size is unknown until it is pickled: the up-front check counts only
    # its slack, so a 6 MiB blob passes it and fills the 4 MiB disk while being written.
    big = {"model": {"w": torch.arange(1024.0)}, "blob": os.urandom(6 * MiB)}
    with CheckpointManager(root, staging_dir=staging, keep_local=keep_local,
                           local_dir=staging / "local" if keep_local else None,
                           writer_options={"staging_headroom": 0}) as mgr:
        mgr.save(1, big)  # async: returns after staging
        with pytest.raises(CheckpointError) as caught:
            mgr.wait()
        text = str(caught.value)
        assert "step 1" in text and "DiskFullError" in text and f"{staging}" in text
        assert "free now" in text and "needing 0.0 MiB" not in text  # the blob's real size
        assert mgr.latest() is None and not (root / "step-00000001" / ".metadata").exists()
        # (the journal of the job's goodput record is the manager's, not the save's)
        assert {p for p in files_below(staging)
                if not p.startswith(("local/.", "dcp_volumes-goodput/"))} == set()

        small = {"model": {"w": torch.arange(1024.0) * 2}, "blob": b"small"}
        mgr.save(2, small)
        mgr.wait()
        latest = mgr.latest()
        assert latest is not None and latest.step == 2 and latest.complete
        restored: dict[str, Any] = {"model": {"w": torch.zeros(1024)}, "blob": b""}
        assert mgr.restore(restored) == 2
        assert torch.equal(restored["model"]["w"], small["model"]["w"])
        assert restored["blob"] == b"small"


# -- the cache disk -------------------------------------------------------------------------


@pytest.fixture
def s3_proxy(moto_server: MotoServer, s3_bucket: tuple[str, Any]
             ) -> Iterator[tuple[str, dict[str, Any], dict[str, Any], LatencyProxy]]:
    """(bucket url, direct options, options through the proxy, proxy)."""
    url, direct = s3_bucket
    with LatencyProxy.in_front_of(moto_server) as proxy:
        yield url, direct, moto_server.storage_options(proxy.endpoint), proxy


def _no_torn_entries(cache_dir: Path) -> None:
    """Nothing a later run could serve or count: only the entries' lock file, the byte
    counter and the other job's file."""
    for rel in files_below(cache_dir):
        assert rel in ("filler", "usage.lock", "entries.lock"), rel


@pytest.mark.emulator
@pytest.mark.parametrize(("size", "disk"), [(3 * MiB, "8m"), (20 * MiB, "24m")],
                         ids=["one-get", "ranged-gets"])
def test_a_cache_disk_that_fills_during_a_fill(
    small_disk: Callable[[str], Path], s3_proxy: tuple[str, Any, Any, LatencyProxy],
    size: int, disk: str,
) -> None:
    cache_dir = small_disk(disk)
    url, direct, via_proxy, proxy = s3_proxy
    data = os.urandom(size)
    Volume(url, storage_options=direct).publish("big.bin", data)
    cache = FileCache(cache_dir, limit=None, headroom=0)
    # The cache has reserved room; the download is on its way when another job fills the disk.
    proxy.call_next(lambda: fill_disk(cache_dir, leave=MiB), method="GET")
    with pytest.raises(DiskFullError) as caught:
        cache.fetch(f"{url}/big.bin", storage_options=via_proxy)
    err = caught.value
    assert isinstance(err, CacheError) and err.errno == errno.ENOSPC and err.needed == size
    text = str(err)
    assert f"The disk holding {cache_dir} is full" in text and "big.bin" in text
    assert "cache_dir=" in text and "never served" in text
    assert not cache.contains(f"{url}/big.bin", storage_options=via_proxy)
    _no_torn_entries(cache_dir)
    assert cache.usage() == 0  # the reservation was given back

    (cache_dir / "filler").unlink()
    path = cache.fetch(f"{url}/big.bin", storage_options=via_proxy)
    assert Path(path).read_bytes() == data
    assert cache.counters.misses == 1 and cache.usage() == size


@pytest.mark.emulator
@pytest.mark.parametrize("workers", [0, 1])
def test_a_dataset_epoch_on_a_cache_disk_that_fills(
    small_disk: Callable[[str], Path], s3_proxy: tuple[str, Any, Any, LatencyProxy],
    workers: int,
) -> None:
    # VolumeDataset keeps the cache's default headroom (256 MiB): the disk must be larger.
    cache_dir = small_disk("272m")
    url, direct, via_proxy, proxy = s3_proxy
    n, size = 6, 2 * MiB
    write_samples(f"{url}/data", direct, n, size=size)

    def epoch(meanwhile: Callable[[], Any] | None = None) -> list[int]:
        ds = VolumeDataset(f"{url}/data", storage_options=via_proxy, cache_dir=cache_dir,
                           transform=read_id, shuffle=False, prefetch=1, prefetch_threads=1)
        if meanwhile is not None:  # after the listing: at the first sample's download
            proxy.call_next(meanwhile, method="GET")
        loader = DataLoader(ds, batch_size=2, num_workers=workers)
        return [int(x) for batch in loader for x in batch]

    with pytest.raises(DiskFullError, match=f"The disk holding {cache_dir} is full"):
        epoch(lambda: fill_disk(cache_dir, leave=MiB))
    _no_torn_entries(cache_dir)

    (cache_dir / "filler").unlink()
    assert sorted(epoch()) == list(range(n))  # read_id checks every byte
    cached = [s for rel, s in files_below(cache_dir).items() if rel.startswith("objects/")
              and not rel.endswith((".lock", ".meta"))]
    assert cached == [size] * n


def test_staging_dirs_of_killed_processes_are_removed_by_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed mid-save (SIGKILL: no cleanup runs) leaves its private staging
    dir and the shards in it; the next process that makes one removes it. A live
    process's dir (its lock held) and a dir without an owner file stay."""
    from dcp_volumes import _staging_disk

    child = (
        "import sys, time\n"
        "from dcp_volumes._staging_disk import StagingArea\n"
        "area = StagingArea()\n"
        "shard = area.new_dir('step-00000007-r0')\n"
        "open(shard + '/__0_0.distcp', 'wb').write(b'x' * 2**20)\n"
        "print(area.path, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("DCP_VOLUMES_STAGING", None)
    procs = [subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE)
             for _ in range(2)]
    try:
        dead, alive = (p.stdout.readline().decode().strip() for p in procs)  # type: ignore[union-attr]
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        older = tmp_path / "dcp_volumes-staging-older"
        older.mkdir()
        assert os.path.isdir(dead) and os.path.isdir(alive)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        monkeypatch.delenv("DCP_VOLUMES_STAGING", raising=False)
        monkeypatch.setattr(_staging_disk, "_swept", set())
        area = _staging_disk.StagingArea()
        try:
            assert not os.path.exists(dead)
            assert os.path.isdir(alive) and os.listdir(os.path.join(alive))
            assert older.is_dir() and os.path.isdir(area.path)
            # Once a process: its next area does not look again, and the live one stays.
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            second = _staging_disk.StagingArea()
            assert os.path.isdir(alive)
            second.close()
            assert _staging_disk.sweep_abandoned(str(tmp_path)) == [alive]
            assert os.path.isdir(area.path)
        finally:
            area.close()
        assert not os.path.exists(area.path)
    finally:
        for p in procs:
            p.kill()
            p.wait()
