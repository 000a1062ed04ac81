"""What a save holds in memory: pooled staging buffers and the upload's in-flight bytes."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import VolumeReader, VolumeWriter
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._rank_save import InFlightBytes
from dcp_volumes.checkpoint._state_copy import CpuStager, free_pooled_buffers
from testkit.states import seeded_state
from tests.checkpoint_helpers import assert_same, blank_like, join

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
_SHAPES = {"w": (256, 256), "b": (256,)}  # the state's tensors, by name


def _pointers(staged: dict[str, Any]) -> set[int]:
    return {v.data_ptr() for v in staged.values() if isinstance(v, torch.Tensor)}


def test_a_new_stager_reuses_the_buffers_a_finished_save_gave_back() -> None:
    free_pooled_buffers()
    first = CpuStager(cache=True)
    staged = first.stage(seeded_state(1, _SHAPES, step=1))
    used = _pointers(staged)
    first.release()

    second = CpuStager(cache=True)  # a new writer, as most training code makes per save
    fresh = seeded_state(2, _SHAPES, step=2)
    restaged = second.stage(fresh)
    assert _pointers(restaged) == used
    assert_same(restaged, fresh)  # refreshed in place, not the first save's values

    # While `second` holds them (its save is in flight), another stager gets its own.
    other = CpuStager(cache=True).stage(seeded_state(3, _SHAPES, step=3))
    assert _pointers(other).isdisjoint(used)

    # Another shape never receives them.
    second.release()
    bigger = CpuStager(cache=True).stage({"w": torch.zeros(512, 512), "b": torch.zeros(256)})
    assert _pointers(bigger).isdisjoint(used)
    free_pooled_buffers()


def test_fresh_writers_per_async_save_load_back_each_saves_own_values(
    memory_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Pooled buffers shared by successive writers never leak one save's values into another."""
    url, opts = memory_bucket
    free_pooled_buffers()
    for step in range(3):
        writer = VolumeWriter(join(url, f"step-{step}"), storage_options=opts)
        dcp.async_save(seeded_state(step, _SHAPES, step=step), storage_writer=writer).result()
    for step in range(3):
        expected = seeded_state(step, _SHAPES, step=step)
        target = blank_like(expected)
        reader = VolumeReader(join(url, f"step-{step}"), storage_options=opts)
        dcp.load(target, storage_reader=reader)
        assert_same(target, expected)
    free_pooled_buffers()


def test_data_files_stay_within_file_size_unless_one_tensor_is_larger(
    memory_bucket: tuple[str, dict[str, Any]],
) -> None:
    url, opts = memory_bucket
    ck = join(url, "sized")
    # 384 KiB tensors: two fit in 1 MiB; a third would overshoot it by a third.
    state = {f"t{i}": torch.randn(96 * 2**10) for i in range(9)}
    state["big"] = torch.randn(2**19)  # 2 MiB: above file_size, alone in its file
    dcp.save(state, storage_writer=VolumeWriter(ck, storage_options=opts, file_size="1MiB"))

    sizes = [f.size for f in Volume(ck, storage_options=opts).list() if f.path.endswith(".distcp")]
    headers = 4096  # torch.save's zip headers per tensor, about 1.6 KiB
    big = [s for s in sizes if s > 2**20 + 4 * headers]
    assert len(big) == 1 and big[0] < 2**21 + headers, sizes
    assert sum(sizes) > 5 * 2**20 and len(sizes) >= 6, sizes  # 5 pairs of tensors + the big one
    target = blank_like(state)
    dcp.load(target, storage_reader=VolumeReader(ck, storage_options=opts))
    assert_same(target, state)


def test_in_flight_bytes_never_exceed_the_budget() -> None:
    budget = InFlightBytes(10)
    held = 0
    most = 0
    lock = threading.Lock()

    def upload(nbytes: int) -> None:
        nonlocal held, most
        with budget.hold(nbytes):
            with lock:
                held += min(nbytes, 10)
                most = max(most, held)
            time.sleep(0.02)
            with lock:
                held -= min(nbytes, 10)

    # 4-byte files, and one file larger than the whole budget: it runs alone.
    threads = [threading.Thread(target=upload, args=(n,)) for n in [4] * 8 + [25] + [4] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert most <= 10
    assert most >= 8  # two 4-byte files did run at once: the budget is not a lock
