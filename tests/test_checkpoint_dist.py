"""VolumeWriter / VolumeReader on real gloo process groups: sharding, resharding, async saves."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_volumes import VolumeReader, VolumeWriter
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._layout import MANIFEST_NAME
from dcp_volumes.checkpoint._manifest import Manifest
from testkit.ranks import run_ranks
from tests.checkpoint_helpers import assert_same, blank_like, join, sample_state

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS, COLS = 10, 6  # 10 rows: shards unevenly over 3 ranks (4, 4, 2)


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


# -- rank bodies (module level: pickled into the spawned ranks) -------------------------------


def _save_and_load_plain(rank: int, world: int, url: str, opts: dict[str, Any]) -> list[str]:
    warnings.simplefilter("ignore")
    state = sample_state(seed=rank, big_mib=1)
    # Rank-local keys plus one replicated entry (DCP de-duplicates it).
    own = {f"rank{rank}": state, "shared": torch.arange(5.0)}
    dcp.save(own, storage_writer=VolumeWriter(url, storage_options=opts, file_size="512KiB"))
    out = blank_like(own)
    dcp.load(out, storage_reader=VolumeReader(url, storage_options=opts))
    assert_same(out, own)
    # Every rank's files must be in the manifest; return the names for the parent.
    manifest = Manifest.from_json(Volume(url, storage_options=opts).read_bytes(MANIFEST_NAME))
    return sorted(manifest.files)


def _dtensor_state(mesh: Any, fill: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = _full() if fill else torch.zeros(ROWS, COLS)
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "b": distribute_tensor(full[:, 0].clone(), mesh, [Shard(0)]),
        "meta": {"step": 5, "name": "run"} if fill else {"step": 0, "name": ""},
    }


def _dtensor_two_then_three(
    rank: int, world: int, url: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Ranks 0-1 save a DTensor sharded over a 2-rank group; then all 3 ranks load it."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    warnings.simplefilter("ignore")
    pair = dist.new_group([0, 1])  # collective: every rank creates it
    if rank < 2:
        mesh2 = DeviceMesh.from_group(pair, "cpu")
        dcp.save(
            _dtensor_state(mesh2, fill=True),
            storage_writer=VolumeWriter(url, prefix_spread=4),
            process_group=pair,
        )
    dist.barrier()
    mesh3 = init_device_mesh("cpu", (world,))
    state = _dtensor_state(mesh3, fill=False)
    dcp.load(state, storage_reader=VolumeReader(url))
    return (
        state["w"].to_local().clone(),
        state["b"].to_local().clone(),
        state["w"].full_tensor(),
        state["meta"]["step"],
    )


def _optimizer_roundtrip(url: str, opts: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    warnings.simplefilter("ignore")

    def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    model, optim = make(0)
    model(torch.randn(5, 8)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=VolumeWriter(url, storage_options=opts))

    model2, optim2 = make(1)
    msd2, osd2 = get_state_dict(model2, optim2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, storage_reader=VolumeReader(url, storage_options=opts))
    set_state_dict(model2, optim2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        s, t = optim.state[p], optim2.state[q]
        assert set(s) == set(t) and all(torch.equal(s[k], t[k]) for k in s)
    assert optim2.param_groups[0]["lr"] == 0.01


def _plain_then_optimizer(rank: int, world: int, url: str, opts: dict[str, Any]) -> list[str]:
    names = _save_and_load_plain(rank, world, join(url, "plain"), opts)
    _optimizer_roundtrip(join(url, "optim"), opts)
    return names


def _async_process(rank: int, world: int, url: str, opts: dict[str, Any]) -> bool:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    warnings.simplefilter("ignore")
    writer = VolumeWriter(join(url, "p1"), storage_options=opts, file_size="512KiB")
    expected = []
    for step in (1, 2):
        state = {"w": torch.full((300, 300), float(step * 10)), "step": step,
                 f"own{rank}": torch.arange(7) + rank}
        expected.append({k: (v.clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in state.items()})
        fut = dcp.async_save(
            state,
            checkpoint_id=join(url, f"p{step}"),
            storage_writer=writer,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        state["w"].add_(1000.0)  # training goes on while the daemon saves
        fut.result()
    for step in (1, 2):
        out = blank_like(expected[step - 1])
        dcp.load(out, storage_reader=VolumeReader(join(url, f"p{step}"), storage_options=opts))
        assert_same(out, expected[step - 1])
    dist.barrier()
    return True


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.emulator
def test_plain_and_optimizer_state_two_ranks_on_s3(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    """Rank-local tensors and objects, then model + Adam state via get/set_state_dict."""
    url, opts = s3_bucket
    names = run_ranks(_plain_then_optimizer, 2, url, opts, timeout=180)
    assert names[0] == names[1]
    assert any(n.startswith("__0_") for n in names[0])
    assert any(n.startswith("__1_") for n in names[0])


def test_dtensor_saved_on_two_loads_on_three_and_one(tmp_path: Path) -> None:
    ck = str(tmp_path / "dt")
    results = run_ranks(_dtensor_two_then_three, 3, ck, timeout=180)
    # Saved as (5, 5) rows on two ranks, loaded as uneven (4, 4, 2) on three.
    for (w, b, full, step), (lo, hi) in zip(results, [(0, 4), (4, 8), (8, 10)], strict=True):
        assert torch.equal(w, _full()[lo:hi])
        assert torch.equal(b, _full()[lo:hi, 0])
        assert torch.equal(full, _full())
        assert step == 5
    files = sorted(f.path for f in Volume(ck).list() if f.path.endswith(".distcp"))
    assert {p.split("/")[1][:4] for p in files} == {"__0_", "__1_"}, files

    # One process, no process group: plain tensors receive the whole DTensor.
    state = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(ROWS), "meta": {"step": 0, "name": ""}}
    dcp.load(state, storage_reader=VolumeReader(ck))
    assert torch.equal(state["w"], _full())
    assert torch.equal(state["b"], _full()[:, 0])
    assert state["meta"] == {"step": 5, "name": "run"}


@pytest.mark.emulator
def test_async_save_process_checkpointer_two_ranks(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    url, opts = s3_bucket
    assert run_ranks(_async_process, 2, url, opts, timeout=240) == [True, True]


def _local_copy_twice(rank: int, world: int, url: str, local: str) -> list[str]:
    """Both ranks of one node keep their local copy in one directory; saved twice."""
    warnings.simplefilter("ignore")
    for seed in (1, 2):
        own = {f"rank{rank}": sample_state(seed=seed + 10 * rank, big_mib=1)}
        dcp.save(own, storage_writer=VolumeWriter(
            url, local_copy_dir=local, overwrite=True, file_size="512KiB"))
    out = blank_like(own)
    dcp.load(out, storage_reader=VolumeReader(url, local_copy_dir=local, verify=True))
    assert_same(out, own)
    return sorted(Manifest.from_json(Volume(url).read_bytes(MANIFEST_NAME)).files)


def test_ranks_sharing_a_local_copy_directory_keep_each_others_files(tmp_path: Path) -> None:
    local = tmp_path / "nvme"
    names = run_ranks(_local_copy_twice, 2, str(tmp_path / "vol" / "step-3"), str(local))[0]
    # The second save replaced each rank's own files of the first and nothing else:
    # the local copy is exactly the committed checkpoint's files, of both ranks.
    kept = sorted(str(p.relative_to(local / "step-3")) for p in local.rglob("*.distcp"))
    assert kept == names and {n[:4] for n in names} == {"__0_", "__1_"}, (kept, names)
