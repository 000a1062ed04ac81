"""CheckpointManager: lifecycle, resume, retention, local tier, errors; local and S3 (moto)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_volumes._exceptions import (
    BucketNotFoundError,
    CheckpointError,
    CheckpointExistsError,
    ConfigurationError,
    DcpVolumesError,
    VolumeAccessError,
    VolumeError,
    VolumeNotFoundError,
)
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._discovery import CheckpointInfo, parse_step, scan, step_dir
from dcp_volumes.checkpoint._layout import METADATA_NAME
from dcp_volumes.checkpoint._manager import CheckpointManager
from dcp_volumes.checkpoint._retention import retention_victims
from testkit.emulators import LatencyProxy, MotoServer
from testkit.ranks import run_ranks
from testkit.states import Progress, differences, empty_state, state_for

Location = tuple[str, dict[str, Any]]


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """A fresh run root: a local directory (not yet created) or a prefix in an object store
    (the in-memory one: these tests are about the manager, not a server)."""
    if request.param == "local":
        return str(tmp_path / "run"), {}
    bucket, options = request.getfixturevalue("memory_bucket")
    return f"{bucket}/run", options


@pytest.fixture
def slow_s3(
    moto_server: MotoServer, s3_bucket: Location
) -> Iterator[tuple[str, dict, dict, LatencyProxy]]:
    """(root, direct options, options through a 30 ms/request proxy, the proxy)."""
    bucket, options = s3_bucket
    with LatencyProxy.in_front_of(moto_server, latency_s=0.03) as proxy:
        yield f"{bucket}/run", options, moto_server.storage_options(proxy.endpoint), proxy


def restored(mgr: CheckpointManager, **kw: Any) -> tuple[int | None, dict[str, Any]]:
    state = empty_state()
    return mgr.restore(state, **kw), state


def complete_steps(url: str, options: dict[str, Any] | None) -> list[int]:
    return [i.step for i in scan(Volume(url, storage_options=options)) if i.complete]


# -- naming and retention rules ---------------------------------------------------------------


def test_step_names() -> None:
    assert step_dir(100) == "step-00000100"
    assert step_dir(123456789) == "step-123456789"
    for name, step in [("step-00000100", 100), ("step_100", 100), ("100", 100),
                       ("checkpoint-100", 100), ("ckpt_7", 7), ("global_step42", 42),
                       ("iter-3", 3), ("Step_5", 5)]:
        assert parse_step(name) == step, name
    for name in ["notes", "step-", "run-100", "100-final", "step-1a", ".metadata"]:
        assert parse_step(name) is None, name


def _info(step: int, complete: bool, name: str | None = None) -> CheckpointInfo:
    name = name or step_dir(step)
    return CheckpointInfo(step=step, url=f"/r/{name}", complete=complete, name=name)


@settings(max_examples=300, deadline=None)
@given(
    dirs=st.dictionaries(st.integers(0, 40), st.booleans(), max_size=15),
    keep_last=st.one_of(st.none(), st.integers(1, 5)),
    protect=st.one_of(st.none(), st.integers(0, 40)),
)
def test_retention_rules(dirs: dict[int, bool], keep_last: int | None, protect: int | None) -> None:
    infos = sorted((_info(s, c) for s, c in dirs.items()), key=lambda i: i.step)
    protected = [step_dir(protect)] if protect is not None else []
    victims = retention_victims(infos, keep_last=keep_last, protect=protected)
    gone = {v.step for v in victims}
    complete = [s for s, c in sorted(dirs.items()) if c]
    if not complete:
        assert victims == []  # nothing complete: nothing may go
        return
    newest = complete[-1]
    assert newest not in gone
    assert protect not in gone
    for step, is_complete in dirs.items():
        if not is_complete:
            # partial: deleted exactly when older than the newest complete (and not protected)
            assert (step in gone) == (step < newest and step != protect)
    kept_complete = [s for s in complete if s not in gone]
    if keep_last is None:
        assert kept_complete == complete
    else:
        newest_n = complete[-keep_last:]
        assert set(newest_n) <= set(kept_complete)
        assert set(kept_complete) - set(newest_n) <= ({protect} if protect is not None else set())


# -- save / restore / list --------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_save_list_latest_restore(root: Location, async_save: bool) -> None:
    url, options = root
    assert not os.path.exists(url) or url.startswith("s3://")
    with CheckpointManager(url, keep_last=2, storage_options=options,
                           async_save=async_save) as mgr:
        assert mgr.latest() is None and mgr.list() == []
        assert restored(mgr)[0] is None
        for i in (10, 20, 30):
            assert mgr.save(i, state_for(i)) == mgr.url_of(i)
            if not async_save:  # dcp.save returned: committed already
                assert Volume(mgr.url_of(i), storage_options=options).exists(METADATA_NAME)
        mgr.wait()
        infos = mgr.list()
        assert [(i.step, i.complete, i.name) for i in infos] == [
            (20, True, "step-00000020"), (30, True, "step-00000030")]
        latest = mgr.latest()
        assert latest is not None and latest.step == 30 and latest.managed
        assert latest.size and latest.num_files and latest.num_files >= 3 and latest.created
        step, state = restored(mgr)
        assert step == 30 and differences(state, state_for(30)) == []
        assert isinstance(state["progress"], Progress) and state["progress"].step == 30
        step, state = restored(mgr, step=20)
        assert step == 20 and differences(state, state_for(20)) == []
    # A new manager ("the job restarted") resumes from the same place.
    with CheckpointManager(url, storage_options=options) as again:
        step, state = restored(again)
        assert step == 30 and differences(state, state_for(30)) == []


@pytest.mark.emulator
def test_a_restore_reads_the_commit_marker_once() -> None:
    # Each request is a round trip behind a real link: the manager reads .metadata
    # (for typed errors) and DCP's load then uses it instead of reading it again.
    with MotoServer(mode="process", record_requests=True) as s3:
        url, options = f"{s3.create_bucket('restore-once')}/run", s3.storage_options()
        with CheckpointManager(url, storage_options=options) as mgr:
            mgr.save(3, state_for(3))
        s3.reset_requests()
        with CheckpointManager(url, storage_options=options) as again:
            step, state = restored(again)
        assert step == 3 and differences(state, state_for(3)) == []
        counts = s3.request_counts()
        marker = ("GET", f"/restore-once/run/step-00000003/{METADATA_NAME}")
        assert counts[marker] == 1, counts


def test_stock_dcp_checkpoints_are_listed_restored_and_retained(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, n in [("checkpoint-1", 1), ("step_2", 2)]:
            plain = {k: (v.state_dict() if isinstance(v, Progress) else v)
                     for k, v in state_for(n).items()}
            dcp.save(plain, storage_writer=dcp.FileSystemWriter(os.path.join(url, name)),
                     no_dist=True)
    mgr = CheckpointManager(url, keep_last=2)
    assert [(i.step, i.name, i.complete, i.managed) for i in mgr.list()] == [
        (1, "checkpoint-1", True, False), (2, "step_2", True, False)]
    step, state = restored(mgr)
    assert step == 2 and differences(state, state_for(2)) == []
    mgr.save(3, state_for(3))
    mgr.wait()  # keep_last=2 allows 2 and 3: the older stock one goes, step_2 stays
    assert sorted(os.listdir(url)) == ["goodput", "step-00000003", "step_2"]
    mgr.save(4, state_for(4))
    mgr.close()
    assert sorted(os.listdir(url)) == ["goodput", "step-00000003", "step-00000004"]


def test_partial_checkpoints_are_skipped_with_a_warning_and_collected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "run")
    with CheckpointManager(url, keep_last=5) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    # Step 2 was killed between its manifest and .metadata; step 3 lost a shard's tail.
    os.remove(os.path.join(url, "step-00000002", METADATA_NAME))
    shutil.copytree(os.path.join(url, "step-00000001"), os.path.join(url, "step-00000003"))
    data = next(p for p in Path(url, "step-00000003").rglob("*.distcp"))
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 1)
    mgr = CheckpointManager(url, keep_last=5)
    assert [(i.step, i.complete) for i in mgr.list()] == [(1, True), (2, False), (3, False)]
    partial3 = mgr.list()[2]
    assert any("manifest says" in p for p in partial3.problems)
    assert mgr.latest().step == 1  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="dcp_volumes"):
        step, state = restored(mgr)
    assert step == 1 and differences(state, state_for(1)) == []
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "step-00000002" in warned and "step-00000003" in warned
    for partial in ("step-00000002", "step-00000003"):  # crashed long ago, not just now
        old = time.time() - 7200
        for f in Path(url, partial).rglob("*"):
            os.utime(f, (old, old))
    mgr.save(4, state_for(4))
    mgr.close()  # partials older than the newest complete (4) are gone, complete 1 is kept
    # retention leaves the goodput records (ROOT/goodput/) alone
    assert sorted(os.listdir(url)) == ["goodput", "step-00000001", "step-00000004"]


def test_verify_skips_a_checkpoint_whose_checksum_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "run")
    with CheckpointManager(url) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    data = next(p for p in Path(url, "step-00000002").rglob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # same size: only a checksum can tell
    data.write_bytes(bytes(blob))
    with CheckpointManager(url, verify=True) as mgr, caplog.at_level(logging.WARNING):
        assert mgr.latest().step == 2  # type: ignore[union-attr]  # listing cannot tell
        step, state = restored(mgr)
    assert step == 1 and differences(state, state_for(1)) == []
    assert any("step-00000002" in r.getMessage() and "verification" in r.getMessage()
               for r in caplog.records)


def test_existing_step_is_refused_or_overwritten(root: Location) -> None:
    url, options = root
    with CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(5, state_for(5))
        mgr.wait()
        with pytest.raises(CheckpointExistsError, match="overwrite=True"):
            mgr.save(5, state_for(6))
        mgr.save(6, state_for(6))  # still usable after the refusal
    with CheckpointManager(url, storage_options=options, overwrite=True) as mgr:
        mgr.save(5, state_for(55))
        mgr.wait()
        step, state = restored(mgr, step=5)
        assert step == 5 and differences(state, state_for(55)) == []


def test_a_partial_leftover_of_the_same_step_is_replaced(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    Volume(url).publish("step-00000007/__9_9.distcp", b"left by a crashed save")
    with CheckpointManager(url) as mgr:
        mgr.save(7, state_for(7))
    assert not os.path.exists(os.path.join(url, "step-00000007", "__9_9.distcp"))
    with CheckpointManager(url) as mgr:
        step, state = restored(mgr)
    assert step == 7 and differences(state, state_for(7)) == []


def test_a_save_after_the_restore_lists_no_step_directory_while_training_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore's listing shows which step directories exist: a save into a new one
    makes no LIST in the blocking path; one into a crashed save's directory still finds
    and clears its files."""
    url = str(tmp_path / "run")
    Volume(url).publish("step-00000007/__9_9.distcp", b"left by a crashed save")
    listed: list[str] = []
    original = Volume.list

    def spy(self: Volume, prefix: str = "", **kwargs: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            listed.append(prefix)
        return original(self, prefix, **kwargs)

    monkeypatch.setattr(Volume, "list", spy)
    with CheckpointManager(url) as mgr:
        assert mgr.restore(empty_state()) is None  # nothing complete; step 7 is partial
        listed.clear()
        mgr.save(5, state_for(5))
        assert listed == []  # the save's blocking part: no request to find old files
        mgr.save(7, state_for(7))
        assert set(listed) == {"step-00000007"}  # the crashed save's: found, cleared
        mgr.wait()
    assert not os.path.exists(os.path.join(url, "step-00000007", "__9_9.distcp"))
    with CheckpointManager(url) as mgr:
        step, state = restored(mgr)
    assert step == 7 and differences(state, state_for(7)) == []


@pytest.mark.parametrize("keep_last", [0, -1, True, 2.5, "3"])
def test_keep_last_must_be_a_positive_int(tmp_path: Path, keep_last: Any) -> None:
    with pytest.raises(ConfigurationError, match="keep_last"):
        CheckpointManager(str(tmp_path), keep_last=keep_last)


def test_bad_steps_and_closed_manager(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path))
    for bad in (-1, "3", True, 1.0):
        with pytest.raises(ConfigurationError, match="step"):
            mgr.save(bad, state_for(1))  # type: ignore[arg-type]
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(1, state_for(1))


@pytest.fixture
def saved_step_12(tmp_path: Path) -> str:
    root = str(tmp_path / "run")
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(12, {"model": {"w": torch.ones(16, 4)}, "step": 12})
    return root


def _restore_error(root: str, state: dict[str, Any]) -> CheckpointError:
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointError) as err:
        mgr.restore(state)
    assert isinstance(err.value.__cause__, BaseException)  # DCP's exception, chained
    return err.value


def test_a_restore_into_another_shape_names_the_key_both_shapes_and_the_fix(
    saved_step_12: str,
) -> None:
    err = _restore_error(saved_step_12, {"model": {"w": torch.zeros(8, 4)}, "step": 0})
    text = str(err)
    assert "step-00000012" in text and "rank 0 failed" in text
    assert "model.w" in text
    assert "torch.Size([16, 4])" in text and "torch.Size([8, 4])" in text
    assert "Fix:" in text and "allow_partial_load=True" in text
    assert "CheckpointException ranks" not in text  # DCP's summary says nothing


def test_a_restore_with_a_key_the_checkpoint_lacks_names_it_and_the_fix(
    saved_step_12: str,
) -> None:
    state: dict[str, Any] = {
        "model": {"w": torch.zeros(16, 4)}, "sched": {"x": torch.zeros(2)}, "step": 0}
    text = str(_restore_error(saved_step_12, state))
    assert "rank 0 failed" in text and "Missing key" in text and "sched.x" in text
    assert "Fix:" in text and "DefaultLoadPlanner(allow_partial_load=True)" in text
    # The fix the message gives works: the keys the checkpoint has are loaded.
    with CheckpointManager(saved_step_12) as mgr:
        step = mgr.restore(state, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert step == 12
    assert torch.equal(state["model"]["w"], torch.ones(16, 4)) and state["step"] == 12
    assert torch.equal(state["sched"]["x"], torch.zeros(2))  # left as it was


def test_bad_roots(tmp_path: Path) -> None:
    with pytest.raises(BucketNotFoundError, match="no-such-bucket-dcpv"):
        CheckpointManager("dcp-memory://no-such-bucket-dcpv/run")
    with pytest.raises(VolumeNotFoundError):
        CheckpointManager(str(tmp_path / "missing"), create_root=False)
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    with pytest.raises(VolumeError, match="afile"):
        CheckpointManager(str(afile / "run"))
    if os.path.isdir("/sys/kernel"):  # read-only for every user, root included
        with pytest.raises(VolumeAccessError) as err:
            CheckpointManager("/sys/kernel/dcpv-test-run")
        assert isinstance(err.value, PermissionError)
    with pytest.raises(ConfigurationError):
        CheckpointManager("")


def test_context_manager_does_not_mask_the_body_error(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="from the body"), \
            CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, state_for(1))
        raise KeyError("from the body")
    assert complete_steps(str(tmp_path / "run"), {}) == [1]  # close() still waited


# -- background work: back-pressure and errors that must not be lost --------------------------


@pytest.mark.emulator
def test_save_waits_for_the_previous_upload(slow_s3: tuple[str, dict, dict, LatencyProxy]) -> None:
    url, direct, slow, _ = slow_s3
    watcher = Volume(url, storage_options=direct)
    with CheckpointManager(url, storage_options=slow, keep_last=None) as mgr:
        started = time.monotonic()
        mgr.save(1, state_for(1))
        returned = time.monotonic() - started
        # save() returned after staging, the upload is still running...
        assert not watcher.exists(f"{step_dir(1)}/{METADATA_NAME}")
        mgr.save(2, state_for(2))
        # ...and the next save() waited for it before starting its own.
        assert watcher.exists(f"{step_dir(1)}/{METADATA_NAME}")
        assert not watcher.exists(f"{step_dir(2)}/{METADATA_NAME}")
    assert complete_steps(url, direct) == [1, 2]
    assert returned < 5.0


def _delete_bucket(moto: MotoServer, bucket: str) -> None:
    s3 = moto.boto3_client()
    for _ in range(100):  # uploads in flight may land between the listing and the delete
        for obj in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=obj["Key"])
        try:
            s3.delete_bucket(Bucket=bucket)
            return
        except s3.exceptions.ClientError:
            time.sleep(0.02)
    raise AssertionError("could not delete the bucket")


@pytest.mark.emulator
@pytest.mark.parametrize("surfaces_in", ["save", "wait", "close"])
def test_a_background_failure_is_raised_by_the_next_call(
    moto_server: MotoServer,
    slow_s3: tuple[str, dict, dict, LatencyProxy],
    caplog: pytest.LogCaptureFixture,
    surfaces_in: str,
) -> None:
    url, _, slow, _ = slow_s3
    mgr = CheckpointManager(url, storage_options=slow)
    with caplog.at_level(logging.ERROR, logger="dcp_volumes"):
        mgr.save(1, state_for(1))
        _delete_bucket(moto_server, url.split("/")[2])  # the bucket vanishes mid-upload
        with pytest.raises(CheckpointError, match="step 1") as err:
            if surfaces_in == "save":
                mgr.save(2, state_for(2))
            elif surfaces_in == "wait":
                mgr.wait()
            else:
                mgr.close()
    chain, cur = [], err.value.__cause__
    while cur is not None:
        chain.append(type(cur).__name__ + str(cur))
        cur = cur.__cause__ or cur.__context__
    assert any("NoSuchBucket" in c or "BucketNotFound" in c or "does not exist" in c
               for c in chain), chain
    # Logged when it happened, not only when raised.
    assert any("step 1" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    mgr.wait()  # raised once, not again
    mgr.close()


# -- local tier ----------------------------------------------------------------------------


def _data_gets(proxy: LatencyProxy) -> int:
    return sum(n for (method, path), n in proxy.requests.items()
               if method == "GET" and path.endswith(".distcp"))


@pytest.mark.emulator
def test_local_tier_restores_from_local_disk_and_falls_back_per_file(
    tmp_path: Path, slow_s3: tuple[str, dict, dict, LatencyProxy]
) -> None:
    url, _, slow, proxy = slow_s3
    local = tmp_path / "nvme"
    opts: dict[str, Any] = {"keep_local": True, "local_dir": str(local), "storage_options": slow,
            "writer_options": {"file_size": 8 * 1024}}  # several data files
    with CheckpointManager(url, **opts) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    assert sorted(os.listdir(local)) == ["step-00000002"]  # only the newest copy is kept

    proxy.reset_counts()
    with CheckpointManager(url, **opts) as mgr:  # a restart on the same node
        step, state = restored(mgr)
    assert step == 2 and differences(state, state_for(2)) == []
    assert _data_gets(proxy) == 0

    files = sorted(local.joinpath("step-00000002").rglob("*.distcp"))
    assert len(files) >= 2
    blob = bytearray(files[0].read_bytes())
    blob[-1] ^= 0xFF
    files[0].write_bytes(bytes(blob))  # a damaged local copy
    proxy.reset_counts()
    with CheckpointManager(url, **opts) as mgr:
        step, state = restored(mgr)
    assert step == 2 and differences(state, state_for(2)) == []
    fetched = {p.rsplit("/", 1)[-1] for (m, p) in proxy.requests if m == "GET"
               and p.endswith(".distcp")}
    assert fetched == {files[0].name}  # only the bad file came from the volume

    proxy.reset_counts()
    with CheckpointManager(url, storage_options=slow) as mgr:  # no local tier
        step, state = restored(mgr)
    assert step == 2 and differences(state, state_for(2)) == []
    assert _data_gets(proxy) >= len(files)


# -- two real ranks ---------------------------------------------------------------------------
# One spawn of two gloo ranks runs every scenario (starting ranks costs seconds);
# the tests below check its results.


def _agree_on_restore(rank: int, url: str, options: dict | None) -> dict[str, Any]:
    mgr = CheckpointManager(url, keep_last=2, storage_options=options)
    for i in (1, 2, 3):
        mgr.save(i, state_for(i, rank=rank))
    mgr.wait()
    if rank == 0:  # a crashed newer save: every rank must still pick step 3
        Volume(url, storage_options=options).publish(f"{step_dir(9)}/__0_0.distcp", b"x")
    dist.barrier()
    state = empty_state(rank=rank)
    step = mgr.restore(state)
    diff = differences(state, state_for(3, rank=rank))
    mgr.close()
    return {"step": step, "diff": diff, "complete": complete_steps(url, options)}


class _Exploding(Progress):
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("state_dict exploded on this rank")


def _one_rank_fails(rank: int, url: str, how: str, bad_staging: str) -> dict[str, Any]:
    staging = bad_staging if (how == "staging" and rank == 1) else None
    mgr = CheckpointManager(url, staging_dir=staging, keep_last=None)
    errors = []
    state = state_for(2, rank=rank)
    if how == "stateful" and rank == 1:
        state["progress"] = _Exploding(2)
    try:
        mgr.save(2, state)
        mgr.wait()
    except (DcpVolumesError, RuntimeError) as exc:
        errors.append((type(exc).__name__, str(exc)))
    committed = os.path.exists(os.path.join(url, step_dir(2), METADATA_NAME))
    if how == "stateful":  # the manager stays usable on every rank after a failed save
        mgr.save(3, state_for(3, rank=rank))
    mgr.close()
    return {"errors": errors, "committed": committed, "complete": complete_steps(url, {})}


def _options_from_environment(rank: int, url: str) -> dict[str, Any]:
    # No storage_options anywhere: DCP_VOLUMES_STORAGE_OPTIONS (set for every rank)
    # must reach the manager, its writer and its reader (the endpoint is moto's).
    try:
        return _agree_on_restore(rank, url, None)
    except Exception as exc:  # reported, not raised: the other scenarios still run
        return {"error": f"{type(exc).__name__}: {exc}"}


def _rank_scenarios(rank: int, world: int, base: str, s3_url: str, s3_options: dict,
                    bad_staging: str, env_url: str) -> dict[str, Any]:
    return {
        "agree_local": _agree_on_restore(rank, f"{base}/agree", {}),
        "agree_s3": _agree_on_restore(rank, s3_url, s3_options),
        "agree_env": _options_from_environment(rank, env_url),
        "stateful": _one_rank_fails(rank, f"{base}/stateful", "stateful", bad_staging),
        "staging": _one_rank_fails(rank, f"{base}/staging", "staging", bad_staging),
    }


@pytest.fixture(scope="module")
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory, moto_server: MotoServer
) -> list[dict[str, Any]]:
    base = tmp_path_factory.mktemp("ranks")
    bad = base / "not-a-dir"
    bad.write_bytes(b"")  # a staging "directory" that is a file: unusable on rank 1
    bucket = moto_server.create_bucket(f"t-ranks-{os.getpid()}")
    env_bucket = moto_server.create_bucket(f"t-ranks-env-{os.getpid()}")
    # As a user sets it once for the job (the local scenarios ignore it: paths take none).
    env = {"DCP_VOLUMES_STORAGE_OPTIONS": json.dumps(moto_server.storage_options())}
    return run_ranks(_rank_scenarios, 2, str(base), f"{bucket}/run",
                     moto_server.storage_options(), str(bad), f"{env_bucket}/run",
                     timeout=240, env=env)


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.emulator)])
def test_two_ranks_save_and_agree_on_restore(two_ranks: list[dict[str, Any]], where: str) -> None:
    results = [r[f"agree_{where}"] for r in two_ranks]
    assert [r["step"] for r in results] == [3, 3]
    assert [r["diff"] for r in results] == [[], []]
    assert results[0]["complete"] == [2, 3]


@pytest.mark.emulator
def test_two_ranks_take_storage_options_from_the_environment(
    two_ranks: list[dict[str, Any]],
) -> None:
    # DCP_VOLUMES_STORAGE_OPTIONS is every entry point's default, the manager's too
    # (it used to go to AWS's endpoint with no credentials).
    results = [r["agree_env"] for r in two_ranks]
    assert [r.get("error") for r in results] == [None, None]
    assert [r["step"] for r in results] == [3, 3]
    assert [r["diff"] for r in results] == [[], []]
    assert results[0]["complete"] == [2, 3]


@pytest.mark.parametrize("how", ["stateful", "staging"])
def test_a_rank_failing_fails_the_save_on_every_rank(
    two_ranks: list[dict[str, Any]], how: str
) -> None:
    r0, r1 = (r[how] for r in two_ranks)
    assert not r0["committed"] and not r1["committed"]
    assert len(r0["errors"]) == 1 and len(r1["errors"]) == 1
    assert r0["errors"][0][0] == "CheckpointError" and "rank 1" in r0["errors"][0][1]
    if how == "stateful":
        assert r1["errors"][0] == ("RuntimeError", "state_dict exploded on this rank")
        assert "state_dict exploded" in r0["errors"][0][1]
    else:
        assert r1["errors"][0][0] == "StagingError"
        assert "StagingError" in r0["errors"][0][1]
    assert r0["complete"] == ([3] if how == "stateful" else [])


def test_a_manager_leaves_the_process_warning_filters_alone(tmp_path: Path) -> None:
    """A single-process manager hides DCP's "no process group" warning around its own
    dcp calls only; constructing one once added a process-wide filter, which hid the
    warning from the user's own dcp calls too."""
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shown = list(warnings.filters)
        with CheckpointManager(str(tmp_path / "ck"), async_save=False) as mgr:
            assert warnings.filters == shown
            mgr.save(1, {"w": torch.ones(4)})
            mgr.wait()
            assert warnings.filters == shown
            assert mgr.restore({"w": torch.zeros(4)}) == 1
        assert not [w for w in seen if "torch.distributed is disabled" in str(w.message)]
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "own"), no_dist=True)
        assert [w for w in seen if "torch.distributed is disabled" in str(w.message)]
    assert warnings.filters == before
