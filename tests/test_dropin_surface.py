"""The rest of stock DCP's StorageWriter surface: storage_meta, reset, set-up forms, async staging.

``dcp.async_save`` answers an ``AsyncSaveResponse`` (staging done apart from
upload done) when the stager returns a future: torch's ``DefaultStager`` with
``StagingOptions``, or ``VolumeWriter(async_staging=True)``.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_volumes import VolumeReader, VolumeWriter
from dcp_volumes.checkpoint import _writer
from tests.checkpoint_helpers import assert_same, blank_like, sample_state

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    return state


def _scribble(state: dict[str, Any]) -> None:
    """What the next training step does to the state: change every float tensor in place."""
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.add_(1000.0)


def test_storage_meta_and_reset_give_each_save_its_id(tmp_path: Path) -> None:
    writer = VolumeWriter(tmp_path / "a")
    meta = writer.storage_meta()
    assert isinstance(meta, StorageMeta)
    assert meta.checkpoint_id == writer.checkpoint_id == str(tmp_path / "a")
    first = meta.save_id
    writer.reset(str(tmp_path / "b"))
    meta = writer.storage_meta()
    assert meta.checkpoint_id == str(tmp_path / "b") and meta.save_id != first
    # The id stamped into .metadata is this save's own (stock readers see it too).
    dcp.save({"t": torch.arange(3.0)}, storage_writer=writer)
    saved = FileSystemReader(tmp_path / "b").read_metadata().storage_meta
    assert saved.checkpoint_id == str(tmp_path / "b")
    assert saved.save_id == writer.storage_meta().save_id != first


def test_set_up_forms_of_older_and_newer_torch(tmp_path: Path) -> None:
    writer = VolumeWriter(tmp_path / "ck")
    writer.set_up_storage_writer(True)  # torch < 2.7: no keywords at all
    writer.set_up_storage_writer(False, rank=3, use_collectives=True, future_kwarg=1)
    assert writer.checkpoint_id == str(tmp_path / "ck")
    dcp.save({"t": torch.arange(3.0)}, storage_writer=writer)
    reader = VolumeReader(tmp_path / "ck")
    md = reader.read_metadata(rank=None, future_kwarg=1)
    reader.set_up_storage_reader(md, True, rank=0, use_collectives=True, future_kwarg=1)
    out = {"t": torch.zeros(3)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["t"], torch.arange(3.0))


@pytest.mark.parametrize(
    "options",
    [
        # Pinned memory is ignored (with a warning) where there is no CUDA.
        StagingOptions(use_pinned_memory=True, use_shared_memory=True, use_async_staging=True,
                       use_non_blocking_copy=False),
        StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                       use_non_blocking_copy=False),
    ],
    ids=["pinned+shared", "plain"],
)
def test_async_save_with_torch_default_stager(tmp_path: Path, options: StagingOptions) -> None:
    state = sample_state(big_mib=1)
    expected = _clone(state)
    stager = DefaultStager(options)
    try:
        response = dcp.async_save(
            state,
            storage_writer=VolumeWriter(tmp_path / "ck", compression="zstd"),
            async_stager=stager,
        )
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result(timeout=60)
        _scribble(state)  # allowed once staging is complete
        response.upload_completion.result(timeout=120)
    finally:
        stager.close()
    out = blank_like(expected)
    dcp.load(out, storage_reader=VolumeReader(tmp_path / "ck"))
    assert_same(out, expected)


def test_volume_writer_async_staging_returns_staging_and_upload_futures(tmp_path: Path) -> None:
    writer = VolumeWriter(tmp_path / "unused", async_staging=True)
    for step in (1, 2):  # the cached buffers are reused by the second save
        state = sample_state(seed=step, big_mib=1)
        expected = _clone(state)
        ck = tmp_path / f"step-{step}"
        response = dcp.async_save(state, checkpoint_id=str(ck), storage_writer=writer)
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result(timeout=60)
        _scribble(state)
        response.upload_completion.result(timeout=120)
        out = blank_like(expected)
        dcp.load(out, storage_reader=FileSystemReader(ck))
        assert_same(out, expected)
    writer.close()


def test_async_staging_copies_in_the_background(tmp_path: Path) -> None:
    """``stage`` returns before the copy: a state whose copy is held back still returns."""
    gate = threading.Event()

    class Held:
        """An object whose deep copy (part of staging) waits for ``gate``."""

        def __deepcopy__(self, memo: dict[int, Any]) -> Held:
            if not gate.wait(timeout=60):
                raise TimeoutError("gate never opened")
            return Held()

    writer = VolumeWriter(tmp_path / "ck", async_staging=True)
    staged = writer.stage({"t": torch.arange(4.0), "held": Held()})
    assert not staged.done()  # type: ignore[union-attr]
    gate.set()
    result = staged.result(timeout=60)  # type: ignore[union-attr]
    assert torch.equal(result["t"], torch.arange(4.0)) and isinstance(result["held"], Held)
    writer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_staging_of_cuda_tensors_sees_the_state_as_of_the_call(tmp_path: Path) -> None:
    state = {"w": torch.randn(4096, 4096, device="cuda"), "step": 3}
    expected = {"w": state["w"].cpu(), "step": 3}
    writer = VolumeWriter(tmp_path / "ck", async_staging=True)
    response = dcp.async_save(state, storage_writer=writer)
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result(timeout=60)
    state["w"].mul_(0)
    response.upload_completion.result(timeout=120)
    out = {"w": torch.zeros(4096, 4096), "step": 0}
    dcp.load(out, storage_reader=VolumeReader(tmp_path / "ck"))
    assert torch.equal(out["w"], expected["w"]) and out["step"] == 3
    writer.close()


def test_file_system_writer_call_runs_unchanged(tmp_path: Path) -> None:
    """The keywords of a FileSystemWriter call, as a user wrote them, work with VolumeWriter."""
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    state = sample_state(big_mib=1)
    ck = tmp_path / "ck"
    writer = VolumeWriter(
        ck,
        single_file_per_rank=False,
        sync_files=False,
        thread_count=4,
        per_thread_copy_ahead=10_000_000,
        cache_staged_state_dict=False,
        overwrite=True,
        _extensions=[ZStandard()],
        serialization_format=SerializationFormat.TORCH_SAVE,
    )
    dcp.save(state, storage_writer=writer)
    md = FileSystemReader(ck).read_metadata()
    # single_file_per_rank=False: one file per item, as FileSystemWriter writes them.
    paths = [info.relative_path for info in md.storage_data.values()]
    assert len(set(paths)) == len(paths) == len(md.storage_data)
    out = blank_like(state)
    dcp.load(out, storage_reader=FileSystemReader(ck))
    assert_same(out, state)
    dcp.save(state, storage_writer=writer)  # overwrite=True, as the stock default


def test_stock_keywords_without_effect_are_named_once_with_what_to_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """thread_count/per_thread_copy_ahead are accepted and ignored: a WARNING says so,
    naming upload_concurrency, once per process (writers are often made per save)."""
    monkeypatch.setattr(_writer, "_IGNORED_KEYWORDS_WARNED", set())  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger="dcp_volumes"):
        VolumeWriter(tmp_path / "a", thread_count=4, per_thread_copy_ahead=10_000_000)
        VolumeWriter(tmp_path / "b", thread_count=4, per_thread_copy_ahead=10_000_000)
        VolumeWriter(tmp_path / "c")
    warned = [r for r in caplog.records if "ignores" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    message = warned[0].getMessage()
    assert "thread_count=4" in message and "per_thread_copy_ahead" in message
    assert "upload_concurrency" in message
