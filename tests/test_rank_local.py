"""Rank-local saves (``use_collectives=False``): each rank commits its own ``__<rank>.metadata``.

The commit rule is the collective one, per rank: a rank's manifest, then its
marker last, create-only. A checkpoint is complete only when every rank's
marker is there; the manager, retention, the CLI and ``restore`` understand
that, and refuse what cannot apply (a rank-local checkpoint on another number
of ranks). Crashes are real: a rank is SIGKILLed mid-save.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_volumes import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    CheckpointNotFoundError,
    VolumeReader,
    VolumeWriter,
)
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._layout import (
    MANIFEST_NAME,
    METADATA_NAME,
    rank_manifest_name,
    rank_metadata_name,
)
from dcp_volumes.checkpoint._manifest import Manifest
from dcp_volumes.cli import main as cli_main
from testkit.ports import free_port
from testkit.ranks import run_ranks
from tests.checkpoint_helpers import assert_same, blank_like, failure_of
from tests.scripts import rank_local_child
from tests.scripts.rank_local_child import rank_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _names(volume: Volume, under: str = "") -> set[str]:
    prefix = f"{under}/" if under else ""
    return {f.path[len(prefix):] for f in volume.list(under)}


# -- one process ------------------------------------------------------------------------------


def test_single_process_rank_local_save_commits_rank_marker_last(tmp_path: Path) -> None:
    state = rank_state(1, 0)
    ckpt = tmp_path / "ck"
    dcp.save(state, storage_writer=VolumeWriter(ckpt), use_collectives=False)
    names = _names(Volume(ckpt))
    assert {rank_metadata_name(0), rank_manifest_name(0)} <= names
    assert METADATA_NAME not in names and MANIFEST_NAME not in names
    manifest = json.loads((ckpt / rank_manifest_name(0)).read_text())
    assert manifest["extra"]["rank_local"] is True and manifest["extra"]["rank"] == 0
    assert set(manifest["files"]) == {n for n in names if n.endswith(".distcp")}
    # The marker is written after the manifest (the commit rule).
    assert os.stat(ckpt / rank_metadata_name(0)).st_mtime_ns >= os.stat(
        ckpt / rank_manifest_name(0)).st_mtime_ns
    for reader in (VolumeReader(ckpt, verify=True), dcp.FileSystemReader(str(ckpt))):
        target = blank_like(state)
        dcp.load(target, storage_reader=reader)
        assert_same(target, state)


def test_stock_rank_local_checkpoint_loads_with_volume_reader(tmp_path: Path) -> None:
    state = rank_state(2, 0)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ck")),
             use_collectives=False)
    assert (tmp_path / "ck" / rank_metadata_name(0)).exists()
    target = blank_like(state)
    dcp.load(target, storage_reader=VolumeReader(tmp_path / "ck"))
    assert_same(target, state)


def test_rank_local_save_refuses_existing_unless_overwrite(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    dcp.save(rank_state(1, 0), storage_writer=VolumeWriter(ckpt), use_collectives=False)
    with pytest.raises(BaseException) as info:
        dcp.save(rank_state(2, 0), storage_writer=VolumeWriter(ckpt), use_collectives=False)
    error = failure_of(info.value)
    assert isinstance(error, CheckpointExistsError) and "Rank 0 already committed" in str(error)
    dcp.save(rank_state(2, 0), storage_writer=VolumeWriter(ckpt, overwrite=True),
             use_collectives=False)
    target = blank_like(rank_state(2, 0))
    dcp.load(target, storage_reader=VolumeReader(ckpt, verify=True))
    assert_same(target, rank_state(2, 0))
    # A collective save over a rank-local checkpoint counts it as committed...
    with pytest.raises(BaseException) as info:
        dcp.save(rank_state(3, 0), storage_writer=VolumeWriter(ckpt))
    assert isinstance(failure_of(info.value), CheckpointExistsError)
    # ...and with overwrite replaces it whole, rank markers and manifests included.
    dcp.save(rank_state(3, 0), storage_writer=VolumeWriter(ckpt, overwrite=True))
    names = _names(Volume(ckpt))
    assert METADATA_NAME in names and rank_metadata_name(0) not in names
    assert rank_manifest_name(0) not in names
    # A rank-local save cannot replace a collective checkpoint: the ranks cannot agree.
    with pytest.raises(BaseException) as info:
        dcp.save(rank_state(4, 0), storage_writer=VolumeWriter(ckpt, overwrite=True),
                 use_collectives=False)
    error = failure_of(info.value)
    assert isinstance(error, CheckpointExistsError) and "saved with collectives" in str(error)


def test_rank_local_save_clears_the_manifest_of_a_crashed_save(tmp_path: Path) -> None:
    # What a rank killed in its commit window leaves: its manifest, no marker.
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    stale = Manifest(files={}, extra={"save_id": "crashed", "rank_local": True, "rank": 0})
    (ckpt / rank_manifest_name(0)).write_bytes(stale.to_json())
    dcp.save(rank_state(1, 0), storage_writer=VolumeWriter(ckpt), use_collectives=False)
    doc = json.loads((ckpt / rank_manifest_name(0)).read_text())
    assert doc["extra"]["save_id"] != "crashed" and doc["files"]
    target = blank_like(rank_state(1, 0))
    dcp.load(target, storage_reader=VolumeReader(ckpt, verify=True))
    assert_same(target, rank_state(1, 0))


def test_rank_local_async_save_and_routed_save(tmp_path: Path) -> None:
    import dcp_volumes

    state = rank_state(5, 0)
    response = dcp.async_save(state, storage_writer=VolumeWriter(tmp_path / "a"),
                              use_collectives=False)
    getattr(response, "upload_completion", response).result(timeout=60)
    assert (tmp_path / "a" / rank_metadata_name(0)).exists()
    with dcp_volumes.route([str(tmp_path / "routed")]):
        dcp.save(state, checkpoint_id=str(tmp_path / "routed" / "s"), use_collectives=False)
        target = blank_like(state)
        dcp.load(target, checkpoint_id=str(tmp_path / "routed" / "s"))
    assert_same(target, state)
    names = _names(Volume(tmp_path / "routed" / "s"))
    assert {rank_metadata_name(0), rank_manifest_name(0)} <= names


# -- several ranks ----------------------------------------------------------------------------


def _save_ranks(rank: int, world: int, root: str, options: dict[str, Any]) -> None:
    for step in (1, 2):
        dcp.save(rank_state(step, rank), storage_writer=VolumeWriter(
            f"{root}/step-{step}", storage_options=options), use_collectives=False)


def _restore_ranks(rank: int, world: int, root: str, options: dict[str, Any]) -> int | None:
    target = blank_like(rank_state(2, rank))
    with CheckpointManager(root, storage_options=options) as mgr:
        step = mgr.restore(target)
    assert_same(target, rank_state(2, rank))  # each rank got its own state back
    return step


def _check_two_rank_checkpoints(root: str, options: dict[str, Any], tmp_path: Path) -> None:
    run_ranks(_save_ranks, 2, root, options)
    volume = Volume(root, storage_options=options)
    names = _names(volume, "step-2")
    assert {rank_metadata_name(0), rank_metadata_name(1)} <= names
    assert METADATA_NAME not in names
    reader = VolumeReader(f"{root}/step-2", storage_options=options)
    with pytest.raises(CheckpointNotFoundError, match=r"rank-local checkpoint .*ranks 0-1 each"):
        reader.read_metadata()
    with pytest.raises(CheckpointNotFoundError, match=r"ranks 0-1, not __2\.metadata"):
        reader.read_metadata(rank=2)
    mgr = CheckpointManager(root, storage_options=options)
    infos = mgr.list()
    assert [(i.step, i.complete, i.rank_local, i.ranks) for i in infos] == [
        (1, True, True, 2), (2, True, True, 2)]
    # Each rank loads its own state on two ranks again...
    assert run_ranks(_restore_ranks, 2, root, options) == [2, 2]
    # ...and a job of another size is told why it cannot.
    with pytest.raises(CheckpointError, match=r"rank-local.*2 ranks.*this job has 1 ranks"):
        mgr.restore(blank_like(rank_state(2, 0)))
    mgr.close()
    # The CLI: ls marks it, verify checks every rank's files, inspect shows one rank.
    opts = ["--storage-options", json.dumps(options)] if options else []
    out = tmp_path / "out.json"
    assert _cli(["ls", root, "--json", *opts], out) == 0
    doc = json.loads(out.read_text())
    assert [(c["rank_local"], c["ranks"], c["complete"]) for c in doc["checkpoints"]] == [
        (True, 2, True), (True, 2, True)]
    assert _cli(["verify", f"{root}/step-2", "--json", *opts], out) == 0
    assert json.loads(out.read_text())["checkpoints"][0]["checksums"] is True
    assert _cli(["inspect", f"{root}/step-2", "--rank", "1", "--json", *opts], out) == 0
    doc = json.loads(out.read_text())
    assert doc["rank"] == 1 and doc["ranks"] == 2
    assert {e["name"] for e in doc["entries"]} == {"w", "b", "step"}
    assert _cli(["inspect", f"{root}/step-2", "--rank", "2", *opts], out) == 2
    # Retention deletes rank-local checkpoints like any other.
    with CheckpointManager(root, storage_options=options, keep_last=1) as mgr:
        mgr.save(3, {"x": torch.ones(3)})
    assert [i.step for i in CheckpointManager(root, storage_options=options).list()] == [3]


def _cli(argv: list[str], out: Path) -> int:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_main(argv)
    out.write_text(buf.getvalue())
    return code


def test_two_rank_rank_local_checkpoints_local(tmp_path: Path) -> None:
    _check_two_rank_checkpoints(str(tmp_path / "run"), {}, tmp_path)


@pytest.mark.emulator
def test_two_rank_rank_local_checkpoints_s3(s3_bucket: tuple[str, dict[str, Any]],
                                            tmp_path: Path) -> None:
    url, options = s3_bucket
    _check_two_rank_checkpoints(f"{url}/run", options, tmp_path)


# -- crashes ----------------------------------------------------------------------------------


def _crash(root: str, options: dict[str, Any], phase: str, tmp_path: Path) -> None:
    """Two ranks save step 1, then rank 1 is SIGKILLed at ``phase`` of step 2."""
    signals = tmp_path / f"signals-{phase}"
    signals.mkdir()
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_local_child.main,
                         args=(r, 2, port, root, options, phase, 1, str(signals)))
             for r in range(2)]
    for p in procs:
        p.start()
    volume = Volume(root, storage_options=options)
    try:
        deadline = time.monotonic() + 120
        # Rank 1 holds at the phase; rank 0 commits its own marker meanwhile.
        while not ((signals / "rank1.held").exists()
                   and volume.exists(f"step-2/{rank_metadata_name(0)}")):
            assert time.monotonic() < deadline, "the ranks never reached the crash point"
            assert all(p.is_alive() for p in procs), [p.exitcode for p in procs]
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)  # kill -9 the rank mid-save
        procs[1].join(10)
        assert procs[1].exitcode == -signal.SIGKILL
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # rank 0 waits in DCP's closing barrier for the dead rank
            p.join(10)


@pytest.mark.parametrize("phase", rank_local_child.PHASES)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_rank_killed_mid_save_leaves_the_checkpoint_incomplete(
    where: str, phase: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if where == "s3":
        url, options = request.getfixturevalue("s3_bucket")
        root = f"{url}/run"
    else:
        root, options = str(tmp_path / "run"), {}
    _crash(root, options, phase, tmp_path)
    volume = Volume(root, storage_options=options)
    names = _names(volume, "step-2")
    assert rank_metadata_name(0) in names and rank_metadata_name(1) not in names
    if phase == "before_commit":  # rank 1's files and manifest made it, its marker did not
        assert rank_manifest_name(1) in names and any(n.startswith("__1_") for n in names)
    else:
        assert not any(n.startswith("__1") for n in names)
    mgr = CheckpointManager(root, storage_options=options)
    step2 = next(i for i in mgr.list() if i.step == 2)
    assert not step2.complete and step2.rank_local and step2.ranks == 2
    assert any(rank_metadata_name(1) in p for p in step2.problems), step2.problems
    latest = mgr.latest()
    assert latest is not None and latest.step == 1
    mgr.close()
    out = tmp_path / "out.json"
    opts = ["--storage-options", json.dumps(options)] if options else []
    assert _cli(["verify", f"{root}/step-2", "--json", *opts], out) == 1
    problems = json.loads(out.read_text())["checkpoints"][0]["problems"]
    assert any(rank_metadata_name(1) in p for p in problems), problems
    # Loading the dead rank's part fails with a message naming its marker.
    with pytest.raises(BaseException) as info:
        VolumeReader(f"{root}/step-2", storage_options=options).read_metadata(rank=1)
    assert rank_metadata_name(1) in str(failure_of(info.value))
    assert not dist.is_initialized()
