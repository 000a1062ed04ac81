"""Errors a user can catch: DCP wraps storage errors in CheckpointException (a BaseException,
which ``except DcpVolumesError`` misses); ``storage_error`` finds ours inside, and
CheckpointManager raises the typed error itself. Messages name the real file."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    DcpVolumesError,
    VolumeReader,
    VolumeWriter,
    storage_error,
)
from testkit.states import load_into
from tests.checkpoint_helpers import data_file


def _damaged_checkpoint(ck: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(64.0)}, storage_writer=VolumeWriter(ck), no_dist=True)
    data = data_file(ck, 0)
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # same size, other bytes: only the checksum can tell
    data.write_bytes(bytes(raw))


def test_storage_error_finds_the_typed_error_inside_dcps_exception(tmp_path: Path) -> None:
    _damaged_checkpoint(tmp_path / "ck")
    with pytest.raises(BaseException) as err:
        load_into({"w": torch.zeros(64)}, str(tmp_path / "ck"))
    assert not isinstance(err.value, DcpVolumesError)  # DCP's CheckpointException
    typed = storage_error(err.value)
    assert isinstance(typed, CheckpointCorruptError)
    assert data_file(tmp_path / "ck", 0).name in str(typed)
    assert storage_error(ValueError("unrelated")) is None


def test_a_missing_marker_is_named_as_the_file_a_save_writes(tmp_path: Path) -> None:
    # DCP tries .metadata, then the rank-local __0.metadata, and keeps only both
    # messages: each must point at .metadata, not only at the fallback's name.
    (tmp_path / "empty").mkdir()
    with pytest.raises(BaseException) as err:
        load_into({"w": torch.zeros(64)}, str(tmp_path / "empty"))
    text = str(err.value)
    assert "no .metadata)" in text and "no .metadata (nor __0.metadata)" in text


def test_the_manager_raises_the_typed_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _damaged_checkpoint(root / "step-00000004")
    with CheckpointManager(root, async_save=False) as mgr, pytest.raises(
        CheckpointCorruptError, match="checksum"
    ):
        mgr.restore({"w": torch.zeros(64)})  # an ordinary except clause catches it
    with CheckpointManager(root, async_save=False) as mgr, pytest.raises(
        CheckpointError, match="restore"
    ):
        mgr.restore({"w": torch.zeros(7)})  # a shape DCP itself refuses


@pytest.mark.parametrize("where", ["local", "memory"])
def test_storage_error_finds_a_missing_checkpoint_that_dcp_swallowed(
    request: pytest.FixtureRequest, tmp_path: Path, where: str
) -> None:
    # DCP's load catches our CheckpointNotFoundError (and the rank-local fallback's)
    # and raises AssertionError("metadata is None; ...") carrying only their text.
    if where == "local":
        url, options = str(tmp_path / "never-saved"), {}
    else:
        bucket, options = request.getfixturevalue("memory_bucket")
        url = f"{bucket}/run/step-00000001"
    with pytest.raises(BaseException) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(4)}, no_dist=True,
                 storage_reader=VolumeReader(url, storage_options=options))
    assert not isinstance(err.value, DcpVolumesError)
    typed = storage_error(err.value)
    assert isinstance(typed, CheckpointNotFoundError), repr(err.value)
    assert "No checkpoint at" in str(typed) and "Fix:" in str(typed)
    with pytest.raises(CheckpointNotFoundError):  # the docstring's idiom
        raise storage_error(err.value) or err.value
    assert storage_error(err.value) is typed  # asked again: the same answer


def test_storage_error_ignores_a_swallowed_error_of_another_call() -> None:
    # Only the call that caught our error and then raised links them: an error raised
    # elsewhere while one of ours is still alive is not ours.
    kept = CheckpointNotFoundError("kept alive by this test")

    def swallow_then_fail() -> None:
        try:
            raise kept
        except CheckpointNotFoundError:
            pass
        raise AssertionError("metadata is None")

    def fail_elsewhere() -> None:
        raise AssertionError("metadata is None")

    with pytest.raises(AssertionError) as linked:
        swallow_then_fail()
    assert storage_error(linked.value) is kept
    with pytest.raises(AssertionError) as unrelated:
        fail_elsewhere()
    assert storage_error(unrelated.value) is None
