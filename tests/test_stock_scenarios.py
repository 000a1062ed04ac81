"""Stock DCP's file-system checkpoint scenarios, with VolumeWriter/VolumeReader in place of
FileSystemWriter/FileSystemReader, on real gloo ranks, on a local path and on S3.

The scenarios of torch's ``test/distributed/checkpoint/test_file_system_checkpoint.py``:
ShardedTensor save and load, loading with a different sharding plan (uneven
shards, row-wise saved and column-wise loaded), bytes, switching between
sharded and plain tensors, each without an extension, with torch's Rot13
example and with ZStandard; what VolumeWriter saves also loads with the stock
reader. Then ``async_save`` with torch's ``DefaultStager`` on two ranks.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardMetadata,
)
from torch.distributed.checkpoint._extension import ZStandard
from torch.testing._internal.distributed.checkpoint_utils import (
    Rot13Example,
    get_test_extension_registry,
)

from dcp_volumes import VolumeReader, VolumeWriter
from testkit.ranks import run_ranks
from tests.checkpoint_helpers import join, stock_reader

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ROWS, COLS = 10, 8
WORLD = 2


def _full(seed: int = 0) -> torch.Tensor:
    return (torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + seed) * 0.5


def _spec(kind: str) -> Any:
    """The sharding plans of torch's tests: by rows, by columns, uneven and reordered."""
    if kind == "rows":
        return ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    if kind == "cols":
        return ChunkShardingSpec(dim=1, placements=["rank:0/cpu", "rank:1/cpu"])
    # Uneven, and rank 1 holds the first rows: a different plan from "rows".
    return EnumerableShardingSpec([
        ShardMetadata(shard_offsets=[0, 0], shard_sizes=[3, COLS], placement="rank:1/cpu"),
        ShardMetadata(shard_offsets=[3, 0], shard_sizes=[ROWS - 3, COLS], placement="rank:0/cpu"),
    ])


def _sharded(kind: str, full: torch.Tensor | None) -> Any:
    """A ShardedTensor of ``kind`` holding ``full`` (zeros when ``None``)."""
    st = sharded_tensor.zeros(_spec(kind), ROWS, COLS)
    if full is not None:
        for shard in st.local_shards():
            shard.tensor.copy_(full[_slices(shard.metadata)])
    return st


def _slices(md: ShardMetadata) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes, strict=True))


def _check_sharded(st: Any, full: torch.Tensor, what: str) -> None:
    shards = st.local_shards()
    assert shards, f"{what}: this rank holds no shard"
    for shard in shards:
        expected = full[_slices(shard.metadata)]
        assert torch.equal(shard.tensor, expected), f"{what}: shard {shard.metadata} differs"


def _extensions(name: str) -> tuple[list[Any] | None, Any]:
    if name == "none":
        return None, None
    if name == "rot13":
        return [Rot13Example()], get_test_extension_registry()
    return [ZStandard()], None


def _writer(url: str, opts: dict[str, Any], ext: str) -> VolumeWriter:
    extensions, _ = _extensions(ext)
    return VolumeWriter(url, storage_options=opts, _extensions=extensions, overwrite=True)


def _reader(url: str, opts: dict[str, Any], ext: str) -> VolumeReader:
    _, registry = _extensions(ext)
    return VolumeReader(url, storage_options=opts, _extension_registry=registry)


def _stock_reader(url: str, opts: dict[str, Any], ext: str) -> Any:
    return stock_reader(url, opts, _extensions(ext)[1])


def _scenarios(rank: int, world: int, url: str, opts: dict[str, Any], ext: str) -> list[str]:
    """Every scenario, one after the other, on this rank; returns the ones that ran."""
    warnings.simplefilter("ignore")
    done = []

    # Only tensors, replicated on every rank (test_read_write_only_tensor).
    ck = join(url, "only-tensor")
    state = {"replicated": _full(1), "step": torch.tensor(7)}
    dcp.save(state, storage_writer=_writer(ck, opts, ext))
    out = {"replicated": torch.zeros(ROWS, COLS), "step": torch.tensor(0)}
    dcp.load(out, storage_reader=_reader(ck, opts, ext))
    assert torch.equal(out["replicated"], state["replicated"]) and out["step"].item() == 7
    done.append("only_tensor")

    # ShardedTensor save and load, same plan (test_read_write_shard_tensor); stock loads it too.
    ck = join(url, "sharded")
    dcp.save({"sharded": _sharded("rows", _full(2))}, storage_writer=_writer(ck, opts, ext))
    for reader in (_reader(ck, opts, ext), _stock_reader(ck, opts, ext)):
        out = {"sharded": _sharded("rows", None)}
        dcp.load(out, storage_reader=reader)
        _check_sharded(out["sharded"], _full(2), f"same plan via {type(reader).__name__}")
    done.append("sharded")

    # A different plan: uneven and reordered (test_load_with_different_shard_plan) ...
    out = {"sharded": _sharded("uneven", None)}
    dcp.load(out, storage_reader=_reader(ck, opts, ext))
    _check_sharded(out["sharded"], _full(2), "uneven plan")
    # ... and saved by rows, loaded by columns (test_load_rowwise_to_colwise).
    out = {"sharded": _sharded("cols", None)}
    dcp.load(out, storage_reader=_reader(ck, opts, ext))
    _check_sharded(out["sharded"], _full(2), "rows to cols")
    done.append("reshard")

    # Bytes: objects that are not tensors (test_save_load_bytes).
    ck = join(url, "bytes")
    state = {"bytes0": [1], "bytes1": "string", "blob": b"\x00\x01" * 500}
    dcp.save(state, storage_writer=_writer(ck, opts, ext))
    out = {"bytes0": [2], "bytes1": "other", "blob": b""}
    dcp.load(out, storage_reader=_reader(ck, opts, ext))
    assert out == state, out
    done.append("bytes")

    # Sharded saved, plain loaded; plain saved, sharded loaded
    # (test_switch_between_sharded_tensor_to_tensor).
    ck = join(url, "switch-a")
    dcp.save({"t": _sharded("cols", _full(3))}, storage_writer=_writer(ck, opts, ext))
    out = {"t": torch.zeros(ROWS, COLS)}
    dcp.load(out, storage_reader=_reader(ck, opts, ext))
    assert torch.equal(out["t"], _full(3))
    ck = join(url, "switch-b")
    dcp.save({"t": _full(4)}, storage_writer=_writer(ck, opts, ext))
    out = {"t": _sharded("uneven", None)}
    dcp.load(out, storage_reader=_reader(ck, opts, ext))
    _check_sharded(out["t"], _full(4), "plain to sharded")
    done.append("switch")

    dist.barrier()
    return done


_ALL = ["only_tensor", "sharded", "reshard", "bytes", "switch"]


@pytest.mark.parametrize("ext", ["none", "rot13", "zstd"])
def test_stock_scenarios_local(tmp_path: Path, ext: str) -> None:
    ck = str(tmp_path / "ck")
    assert run_ranks(_scenarios, WORLD, ck, {}, ext, timeout=240) == [_ALL] * WORLD


@pytest.mark.emulator
@pytest.mark.parametrize("ext", ["none", "zstd"])
def test_stock_scenarios_s3(s3_bucket: tuple[str, dict[str, Any]], ext: str) -> None:
    url, opts = s3_bucket
    assert run_ranks(_scenarios, WORLD, join(url, "ck"), opts, ext, timeout=240) == [_ALL] * WORLD


def _async_default_stager(rank: int, world: int, url: str, opts: dict[str, Any]) -> bool:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    warnings.simplefilter("ignore")
    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True,
                                          use_async_staging=True, use_non_blocking_copy=False))
    # (DefaultStager copies plain tensors and DTensors; ShardedTensor it cannot stage.)
    try:
        state = {"w": _full(5), f"own{rank}": torch.arange(9.0) + rank, "step": 11}
        response = dcp.async_save(
            state,
            storage_writer=VolumeWriter(url, storage_options=opts, compression="zstd"),
            async_stager=stager,
        )
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result(timeout=60)
        state["w"].add_(1000.0)  # the next step changes the state once staged
        state[f"own{rank}"].add_(1000.0)
        response.upload_completion.result(timeout=120)
    finally:
        stager.close()
    out = {"w": _sharded("uneven", None), f"own{rank}": torch.zeros(9), "step": 0}
    dcp.load(out, storage_reader=VolumeReader(url, storage_options=opts))
    _check_sharded(out["w"], _full(5), "async save")
    assert torch.equal(out[f"own{rank}"], torch.arange(9.0) + rank) and out["step"] == 11
    dist.barrier()
    return True


@pytest.mark.emulator
def test_async_save_with_default_stager_two_ranks_on_s3(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    url, opts = s3_bucket
    assert run_ranks(_async_default_stager, WORLD, join(url, "ck"), opts, timeout=240) == [
        True
    ] * WORLD
