"""A real model's shape: 10,240 small tensors through ``dcp.async_save`` and a resharded load."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_volumes import VolumeReader, VolumeWriter
from testkit.ranks import run_ranks
from tests.checkpoint_helpers import assert_same, blank_like

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SMALL = 10_240  # tensors in the whole state, over both saving ranks
SHARDED = 4  # of them DTensors sharded over the saving ranks (the rest each rank's own)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float64)


def _small(i: int) -> torch.Tensor:
    """The ``i``-th small tensor: a few bytes to a few KiB, of several dtypes and shapes."""
    g = torch.Generator().manual_seed(i)
    dtype = _DTYPES[i % len(_DTYPES)]
    shape: tuple[int, ...] = [(), (0,), (7,), (3, 5), (16, 16), (2, 3, 4), (257,)][i % 7]
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _sharded_full(j: int) -> torch.Tensor:
    return torch.randn(6, 33, generator=torch.Generator().manual_seed(10**6 + j))


def _expected() -> dict[str, Any]:
    """The state the two ranks save together, as one process loads it."""
    state: dict[str, Any] = {f"layers.{i}.p": _small(i) for i in range(SMALL - SHARDED)}
    state.update({f"sharded.{j}": _sharded_full(j) for j in range(SHARDED)})
    state["step"] = 42
    return state


def _async_save_two_ranks(rank: int, world: int, url: str, opts: dict[str, Any]) -> bool:
    """Each rank owns every other small tensor; the DTensors are split between both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {
        f"layers.{i}.p": _small(i) for i in range(rank, SMALL - SHARDED, world)
    }
    state.update({f"sharded.{j}": distribute_tensor(_sharded_full(j), mesh, [Shard(0)])
                  for j in range(SHARDED)})
    state["step"] = 42
    fut = dcp.async_save(state, storage_writer=VolumeWriter(url, storage_options=opts))
    for key, value in state.items():  # training goes on: the save holds its own copy
        if key.startswith("layers.") and value.numel() and value.dtype != torch.bool:
            value.add_(1)
    fut.result()
    dist.barrier()
    return True


def _check_roundtrip(url: str, opts: dict[str, Any]) -> None:
    assert run_ranks(_async_save_two_ranks, 2, url, opts, timeout=300) == [True, True]
    # Loaded by one process without a process group: another rank count and sharding.
    expected = _expected()
    out = blank_like(expected)
    out["step"] = 0
    dcp.load(out, storage_reader=VolumeReader(url, storage_options=opts))
    assert_same(out, expected)  # bit-equal tensors, equal objects


def test_ten_thousand_small_tensors_async_save_resharded_load_local(tmp_path: Path) -> None:
    _check_roundtrip(str(tmp_path / "ck"), {})


@pytest.mark.emulator
def test_ten_thousand_small_tensors_async_save_resharded_load_s3(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    url, opts = s3_bucket
    _check_roundtrip(url + "/ck", opts)


def test_a_tensor_item_is_torch_saves_bytes_without_running_it(tmp_path: Path) -> None:
    """Small tensors skip torch.save's calls: the same bytes (its records carry no CRC-32 and
    the serialisation id is the frame's), torch.load reads them, their data is located."""
    import io

    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from dcp_volumes.checkpoint._byte_format import HashingFile, without_zip_crc32, write_item

    buffer = torch.arange(1000, dtype=torch.float32)
    tensors = [_small(i) for i in range(14)] + [
        buffer[100:400].view(30, 10),  # a view into a larger buffer: only its own bytes
        torch.rand(3, 2**17),  # 1.5 MiB: written without gathering
        torch.arange(6.0).view(2, 3).t(),  # not contiguous: torch.save itself
    ]
    item = WriteItem(index=None, type=WriteItemType.TENSOR)  # type: ignore[arg-type]
    f = HashingFile(str(tmp_path / "data"))
    spans = []
    with without_zip_crc32():
        for t in tensors:
            start = f.tell()
            assert write_item(f, t, item, None) is None
            spans.append((start, f.tell()))
        record = f.close(fsync=False)
        stock = []
        for t in tensors:
            out = io.BytesIO()
            torch.save(t.clone(), out)
            stock.append(out.getvalue())
    data = (tmp_path / "data").read_bytes()
    for (start, end), t, theirs in zip(spans, tensors, stock, strict=True):
        ours = data[start:end]
        assert len(ours) == len(theirs)
        assert_same(torch.load(io.BytesIO(ours), weights_only=True), t)
        if t.numel() and t.is_contiguous():
            at, nbytes = record.tensors[start]
            assert data[at : at + nbytes] == t.reshape(-1).view(torch.uint8).numpy().tobytes()
            # Up to the data, torch.save's bytes; after it only its serialisation id
            # (derived from the values) may differ.
            head = at - start
            assert ours[: head + nbytes] == theirs[: head + nbytes]


def test_small_tensors_are_staged_as_views_of_one_buffer_reused_across_saves() -> None:
    from dcp_volumes.checkpoint._state_copy import CpuStager, free_pooled_buffers

    free_pooled_buffers()
    weight = torch.nn.Parameter(torch.randn(4, 4))  # copied, not recorded by autograd
    state: dict[str, Any] = {
        "model": {f"p{i}": _small(i) for i in range(2, 30)},
        "big": torch.randn(2**19),  # 2 MiB: a buffer of its own
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "list": [torch.arange(3), "x", weight],
    }
    expected = {k: v for k, v in state.items() if k != "list"}
    stager = CpuStager(cache=True)
    staged = stager.stage(state)
    assert isinstance(staged, dict)
    assert_same({k: v for k, v in staged.items() if k != "list"}, expected)
    for ours, theirs in zip(staged["list"], state["list"], strict=True):
        assert torch.equal(ours, theirs) if isinstance(theirs, torch.Tensor) else ours == theirs
    assert not staged["list"][2].requires_grad
    small = [t for t in staged["model"].values() if t.numel()] + [staged["list"][0]]
    storages = {t.untyped_storage().data_ptr() for t in small}
    assert len(storages) == 1, "small tensors share one staging buffer"
    assert staged["big"].untyped_storage().data_ptr() not in storages
    pointers = [t.data_ptr() for t in small]
    state["model"]["p2"].add_(1)  # training goes on: the staged copy stays
    assert not torch.equal(staged["model"]["p2"], state["model"]["p2"])
    stager.release()
    again = CpuStager(cache=True).stage(state)  # a new writer: the pooled buffer, refreshed
    assert isinstance(again, dict)
    assert [t.data_ptr() for t in [t for t in again["model"].values() if t.numel()]
            + [again["list"][0]]] == pointers
    assert torch.equal(again["model"]["p2"], state["model"]["p2"])
    free_pooled_buffers()
