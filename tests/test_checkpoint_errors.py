"""Bad input to VolumeWriter / VolumeReader gets a clear error, one test each."""

from __future__ import annotations

import base64
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_volumes import (
    BackendNotInstalledError,
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigurationError,
    StagingError,
    VolumeAccessError,
    VolumeReader,
    VolumeWriter,
)
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from testkit.emulators import Azurite, MotoServer
from tests.checkpoint_helpers import blank_like, data_file, failure_of, join, sample_state

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SMALL = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(5, 5), "step": 3}


def _save_error(writer: VolumeWriter, state: dict[str, Any] | None = None) -> BaseException:
    with pytest.raises(BaseException) as excinfo:
        dcp.save(state if state is not None else SMALL, storage_writer=writer)
    return failure_of(excinfo.value)


def _load_error(reader: VolumeReader, state: dict[str, Any]) -> BaseException:
    with pytest.raises(BaseException) as excinfo:
        dcp.load(blank_like(state), storage_reader=reader)
    return failure_of(excinfo.value)


# -- URLs and backends ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [VolumeWriter, VolumeReader])
def test_unknown_protocol(cls: type) -> None:
    with pytest.raises(ConfigurationError, match="nosuchproto://"):
        cls("nosuchproto://bucket/ck")
    assert not cls.validate_checkpoint_id("nosuchproto://bucket/ck")
    assert cls.validate_checkpoint_id("/tmp/some/dir")


@pytest.mark.parametrize("cls", [VolumeWriter, VolumeReader])
def test_missing_fsspec_backend(cls: type) -> None:
    # fsspec knows oci:// but its implementation (ocifs) is not installed here.
    with pytest.raises(BackendNotInstalledError, match="install"):
        cls("oci://bucket@namespace/ck")


@pytest.mark.emulator
def test_missing_s3_bucket(moto_server: MotoServer) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ck"
    opts = moto_server.storage_options()
    err = _save_error(VolumeWriter(url, storage_options=opts))
    assert isinstance(err, BucketNotFoundError) and url.split("/")[2] in str(err)
    with pytest.raises(BucketNotFoundError):
        VolumeReader(url, storage_options=opts).read_metadata()


@pytest.mark.emulator
def test_a_bucket_deleted_under_a_running_job_is_named_as_the_bucket(
    moto_server: MotoServer, tmp_path: Path
) -> None:
    # A write's 404 is the bucket's, whether or not the answer's body says NoSuchBucket:
    # never "not found" for a file that was being created.
    bucket = f"gone-{uuid.uuid4().hex[:8]}"
    moto_server.boto3_client().create_bucket(Bucket=bucket)
    vol = Volume(f"s3://{bucket}/run", storage_options=moto_server.storage_options())
    vol.publish("first", b"x")
    moto_server.boto3_client().delete_object(Bucket=bucket, Key="run/first")
    moto_server.boto3_client().delete_bucket(Bucket=bucket)
    staged = tmp_path / "shard"
    staged.write_bytes(b"y" * 1024)
    with pytest.raises(BucketNotFoundError, match=bucket):
        vol.put_file(staged, "shard")
    with pytest.raises(BucketNotFoundError, match=bucket):
        vol.publish("marker", b"z", exclusive=True)


@pytest.mark.emulator
def test_missing_azure_container(azurite: Azurite) -> None:
    url = f"az://no-such-container-{uuid.uuid4().hex[:8]}/ck"
    err = _save_error(VolumeWriter(url, storage_options=azurite.storage_options()))
    assert isinstance(err, BucketNotFoundError) and url.split("/")[2] in str(err)


# -- credentials ------------------------------------------------------------------------------


def _assert_secret_hidden(
    secret: str, err: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    chain: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for exc in chain:
        assert secret not in str(exc) and secret not in repr(exc.args)
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "")
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        assert secret not in text, f"secret leaked in a log record of {record.name}"


@pytest.mark.emulator
def test_wrong_azure_key_is_reported_and_never_printed(
    azurite: Azurite, caplog: pytest.LogCaptureFixture
) -> None:
    container = f"creds-{uuid.uuid4().hex[:8]}"
    azurite.create_bucket(container)
    secret = base64.b64encode(os.urandom(64)).decode()
    good = azurite.storage_options()
    opts = {
        "account_name": good["account_name"],
        "account_key": secret,
        "connection_string": good["connection_string"].replace(good["account_key"], secret),
    }
    url = f"az://{container}/ck"
    with caplog.at_level(logging.DEBUG):
        save_err = _save_error(VolumeWriter(url, storage_options=opts))
        with pytest.raises(VolumeAccessError) as load_err:
            VolumeReader(url, storage_options=opts).read_metadata()
    assert isinstance(save_err, VolumeAccessError), save_err
    assert "credentials" in str(save_err)
    _assert_secret_hidden(secret, save_err, caplog)
    _assert_secret_hidden(secret, load_err.value, caplog)


@pytest.fixture(scope="module")
def moto_with_auth() -> Iterator[MotoServer]:
    """A moto server that checks credentials (the shared one accepts any)."""
    server = MotoServer(mode="process", auth_after=0).start()
    yield server
    server.stop()


@pytest.mark.emulator
def test_wrong_s3_secret_is_reported_and_never_printed(
    moto_with_auth: MotoServer, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "wrong-" + uuid.uuid4().hex
    opts = {
        "key": "AKIAIOSFODNN7EXAMPLE",
        "secret": secret,
        "client_kwargs": {"endpoint_url": moto_with_auth.endpoint},
    }
    with caplog.at_level(logging.DEBUG):
        err = _save_error(VolumeWriter("s3://bucket/ck", storage_options=opts))
        with pytest.raises(VolumeAccessError) as load_err:
            VolumeReader("s3://bucket/ck", storage_options=opts).read_metadata()
    assert isinstance(err, VolumeAccessError), err
    _assert_secret_hidden(secret, err, caplog)
    _assert_secret_hidden(secret, load_err.value, caplog)


@pytest.mark.emulator
def test_missing_s3_credentials(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata probe
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    opts = {"client_kwargs": {"endpoint_url": moto_server.endpoint}}
    err = _save_error(VolumeWriter("s3://bucket/ck", storage_options=opts))
    assert isinstance(err, VolumeAccessError) and "credentials" in str(err), err


# -- staging ----------------------------------------------------------------------------------


def test_staging_dir_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(StagingError, match="does not exist") as excinfo:
        VolumeWriter(tmp_path / "ck", staging_dir=missing)
    assert str(missing) in str(excinfo.value)
    # The environment variable is checked the same way.
    monkeypatch.setenv("DCP_VOLUMES_STAGING", str(missing))
    with pytest.raises(StagingError, match="DCP_VOLUMES_STAGING"):
        VolumeWriter(tmp_path / "ck")


def _construct_as_nobody(staging: str, ck: str, out: Any) -> None:
    # Root ignores directory permissions: drop to an unprivileged user first.
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    try:
        VolumeWriter(ck, staging_dir=staging)
        out.put(("no error", ""))
    except BaseException as exc:
        out.put((type(exc).__name__, str(exc)))


def test_staging_dir_read_only(tmp_path: Path) -> None:
    staging = tempfile.mkdtemp(prefix="dcpv-ro-")  # under /tmp: reachable by any user
    try:
        os.chmod(staging, 0o555)
        if os.geteuid() == 0:
            ctx = mp.get_context("fork")
            out = ctx.Queue()
            proc = ctx.Process(target=_construct_as_nobody, args=(staging, "/tmp/unused", out))
            proc.start()
            name, message = out.get(timeout=60)
            proc.join(timeout=30)
        else:
            with pytest.raises(StagingError) as excinfo:
                VolumeWriter(tmp_path / "ck", staging_dir=staging)
            name, message = type(excinfo.value).__name__, str(excinfo.value)
        assert name == "StagingError", message
        assert "not writable" in message and staging in message
    finally:
        os.chmod(staging, 0o755)
        shutil.rmtree(staging, ignore_errors=True)


def test_staging_dir_too_small(tmp_path: Path) -> None:
    # The real free-space check, with more headroom asked for than any disk has.
    writer = VolumeWriter(tmp_path / "ck", staging_dir=tmp_path, staging_headroom="1000TB")
    err = _save_error(writer)
    assert isinstance(err, StagingError) and "free" in str(err) and str(tmp_path) in str(err)
    assert not (tmp_path / "ck").exists(), "nothing may be written when staging cannot hold it"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"part_size": "1MiB"},
        {"file_size": "lots"},
        {"upload_concurrency": 0},
        {"prefix_spread": 1},
        {"staging_headroom": -1},
    ],
)
def test_invalid_writer_options(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        VolumeWriter(tmp_path / "ck", **kwargs)


def test_invalid_reader_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError):
        VolumeReader(tmp_path / "ck", read_concurrency=0)


# -- missing or damaged checkpoints -----------------------------------------------------------


def _assert_not_found(
    where: Path | str, match: str, storage_options: dict[str, Any] | None = None
) -> str:
    """The reader's message for ``where`` (also through ``dcp.load``); returns it."""
    with pytest.raises(CheckpointNotFoundError, match=match) as excinfo:
        VolumeReader(where, storage_options=storage_options).read_metadata()
    assert str(where) in str(excinfo.value)
    # Through dcp.load the message survives DCP's wrapping.
    with pytest.raises(BaseException, match=match):
        dcp.load(blank_like(SMALL),
                 storage_reader=VolumeReader(where, storage_options=storage_options))
    return str(excinfo.value)


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    _assert_not_found(tmp_path / "nothing", "No checkpoint")


def test_incomplete_checkpoint_without_metadata(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(SMALL, storage_writer=VolumeWriter(ck))
    (ck / METADATA_NAME).unlink()  # as after a crash before the commit
    _assert_not_found(ck, "incomplete")


def test_incomplete_checkpoint_with_spread_prefixes_only(tmp_path: Path) -> None:
    # A save that crashed before its manifest and .metadata: only data files, below
    # hashed prefixes (3f/__0_<tag>_1.distcp). Not mistaken for a run root.
    ck = tmp_path / "ck"
    dcp.save(sample_state(big_mib=1), storage_writer=VolumeWriter(
        ck, prefix_spread=16, file_size="256KiB"))
    (ck / METADATA_NAME).unlink()
    (ck / MANIFEST_NAME).unlink()
    assert not any(p.suffix == ".distcp" for p in ck.iterdir())
    _assert_not_found(ck, "incomplete")


def test_run_root_is_named_with_its_checkpoints(tmp_path: Path) -> None:
    # Issue 30: a run root of three complete checkpoints was called "incomplete: 9 files
    # are there but not .metadata ... A save crashed or is still running".
    root = tmp_path / "run"
    for step in (1, 2, 3):
        dcp.save(SMALL, storage_writer=VolumeWriter(root / f"step-{step:08d}"))
    message = _assert_not_found(root, "is a run root, not a checkpoint")
    assert "incomplete" not in message and "crashed" not in message
    assert "3 checkpoint(s)" in message and "all complete" in message
    assert "step-00000001, step-00000002, step-00000003" in message
    assert f"e.g. {root / 'step-00000003'} (the newest complete one)" in message
    assert "CheckpointManager" in message and "Fix:" in message


def test_run_root_of_partial_and_unnumbered_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "run"
    dcp.save(SMALL, storage_writer=VolumeWriter(root / "step-00000001"))
    (root / "step-00000001" / METADATA_NAME).unlink()
    message = _assert_not_found(root, "run root")
    assert "step-00000001 (partial)" in message and "None of them is complete" in message
    # A checkpoint whose directory name carries no step is one too (no manager hint:
    # CheckpointManager restores step-named checkpoints only).
    dcp.save(SMALL, storage_writer=VolumeWriter(root / "final"))
    message = _assert_not_found(root, "run root")
    assert f"e.g. {root / 'final'}." in message and "CheckpointManager" not in message


def test_directory_that_is_no_checkpoint(tmp_path: Path) -> None:
    # Issue 30: a directory holding only notes.txt was an "incomplete" checkpoint too.
    where = tmp_path / "notes"
    where.mkdir()
    (where / "notes.txt").write_text("not a checkpoint")
    message = _assert_not_found(where, "is not a checkpoint")
    assert "notes.txt" in message and "incomplete" not in message and "Fix:" in message


@pytest.mark.emulator
def test_run_root_on_s3(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    for step in (10, 20):
        dcp.save(SMALL, storage_writer=VolumeWriter(f"{bucket}/run/step-{step:08d}",
                                                    storage_options=opts))
    message = _assert_not_found(f"{bucket}/run", "run root", opts)
    assert f"e.g. {bucket}/run/step-00000020 (the newest complete one)" in message
    assert opts["secret"] not in message
    Volume(f"{bucket}/notes", storage_options=opts).publish("notes.txt", b"x")
    _assert_not_found(f"{bucket}/notes", "is not a checkpoint", opts)


def _truncate(shard: Path) -> None:
    shard.write_bytes(shard.read_bytes()[:-10])


def _flip_a_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01  # inside tensor data: torch.load alone would not notice
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("index", "damage", "expected"),
    [
        pytest.param(1, Path.unlink, "missing", id="missing_shard"),
        pytest.param(0, _truncate, "manifest says", id="shorter_than_manifest"),
        pytest.param(1, _flip_a_byte, "checksum", id="flipped_byte_fails_checksum"),
    ],
)
def test_damaged_shard(tmp_path: Path, index: int, damage: Any, expected: str) -> None:
    ck = tmp_path / "ck"
    state = sample_state(big_mib=1)
    dcp.save(state, storage_writer=VolumeWriter(ck, file_size="512KiB"))
    shard = data_file(ck, index)
    damage(shard)
    err = _load_error(VolumeReader(ck), state)
    assert isinstance(err, CheckpointCorruptError) and shard.name in str(err)
    assert expected in str(err)


def test_verify_checks_files_a_partial_load_only_ranges(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    state = sample_state(big_mib=1)
    # One file: big1 and f32 share it (files are cut before an item would overflow them).
    dcp.save(state, storage_writer=VolumeWriter(ck, file_size="64MiB"))
    md = VolumeReader(ck).read_metadata()
    big1 = next(v for k, v in md.storage_data.items() if k.fqn == "big1")
    f32 = next(v for k, v in md.storage_data.items() if k.fqn == "f32")
    assert big1.relative_path == f32.relative_path
    shard = ck / big1.relative_path
    data = bytearray(shard.read_bytes())
    data[big1.offset + big1.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    part = {"f32": torch.zeros(17, 5)}
    # Without verify only the needed range is fetched: the damage is elsewhere, f32 loads.
    dcp.load(part, storage_reader=VolumeReader(ck, coalesce_gap=0))
    assert torch.equal(part["f32"], state["f32"])
    err = _load_error(VolumeReader(ck, coalesce_gap=0, verify=True), {"f32": state["f32"]})
    assert isinstance(err, CheckpointCorruptError) and big1.relative_path in str(err)
    assert "checksum" in str(err)


def test_truncated_stock_shard_without_manifest(tmp_path: Path) -> None:
    ck = tmp_path / "stock"
    state = sample_state(big_mib=1)
    dcp.save(state, storage_writer=FileSystemWriter(ck))
    assert not (ck / MANIFEST_NAME).exists()
    shard = next(ck.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    err = _load_error(VolumeReader(ck), state)
    assert isinstance(err, CheckpointCorruptError) and shard.name in str(err)
    shard.unlink()
    err = _load_error(VolumeReader(ck), state)
    assert isinstance(err, CheckpointCorruptError) and "missing" in str(err)


def test_corrupt_metadata(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(SMALL, storage_writer=VolumeWriter(ck))
    (ck / METADATA_NAME).write_bytes(b"not a pickle")
    with pytest.raises(CheckpointCorruptError, match="unpickled"):
        VolumeReader(ck).read_metadata()


def test_error_classes_are_builtin_compatible(tmp_path: Path) -> None:
    # Callers that handle built-ins keep working.
    with pytest.raises(FileNotFoundError):
        VolumeReader(tmp_path / "none").read_metadata()
    with pytest.raises(FileExistsError):
        ck = tmp_path / "twice"
        dcp.save(SMALL, storage_writer=VolumeWriter(ck))
        try:
            dcp.save(SMALL, storage_writer=VolumeWriter(ck))
        except BaseException as exc:
            raise failure_of(exc) from None
    assert join("s3://b", "x") == "s3://b/x"
