"""The GPU path: async saves of CUDA tensors, loads into CUDA tensors, pinned batches.

Run with ``make test-gpu`` (``pytest -m gpu``) on a machine with a CUDA device;
everywhere else every test here is skipped, with the reason. Sizes: 1 GiB, and
8 GiB (marked ``soak`` as well) of state on one device.

The bound on an async save: training is blocked only for the copy of the
state from the device to host memory. That copy's floor is measured here,
into pinned memory (the fastest a device-to-host copy goes); the second save
reuses the writer's pinned staging buffers, so it must block for little more
than that floor.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import DataLoader, VolumeDataset, VolumeReader, VolumeWriter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False)"),
    pytest.mark.timeout(900),
]

GiB = 2**30
SIZES = [pytest.param(1, id="1GiB"), pytest.param(8, id="8GiB", marks=pytest.mark.soak)]


def _state(gib: int) -> dict[str, Any]:
    """``gib`` GiB of float32 on the device in 256 MiB tensors, plus a step."""
    gen = torch.Generator(device="cuda").manual_seed(gib)
    n = 256 * 2**20 // 4
    return {"model": {f"w{i}": torch.randn(n, device="cuda", generator=gen)
                      for i in range(gib * 4)}, "step": 7}


def _copy_floor_s(state: dict[str, Any]) -> float:
    """Seconds to copy the state's tensors from the device into pinned host memory."""
    tensors = list(state["model"].values())
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    best = float("inf")
    for _ in range(2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for host, t in zip(hosts, tensors, strict=True):
            host.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


@pytest.mark.parametrize("gib", SIZES)
def test_async_save_of_cuda_tensors_blocks_about_a_device_to_host_copy(
    tmp_path: Path, gib: int
) -> None:
    state = _state(gib)
    floor = _copy_floor_s(state)
    writer = VolumeWriter(tmp_path / "ck", staging_dir=tmp_path / "staging")
    blocked = []
    for i in range(2):  # the second save reuses the pinned staging buffers
        torch.cuda.synchronize()
        started = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / f"ck{i}")
        blocked.append(time.perf_counter() - started)
        fut.result()
    writer.close()
    assert blocked[1] < 2 * floor + 0.5, f"blocked {blocked}, device-to-host floor {floor:.2f}s"

    got = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    dcp.load(got, storage_reader=VolumeReader(tmp_path / "ck1"))
    assert got["step"] == 7
    for k, v in state["model"].items():
        assert got["model"][k].is_cuda and torch.equal(got["model"][k], v), k


@pytest.mark.parametrize("gib", SIZES)
def test_load_into_cuda_tensors_is_exact(tmp_path: Path, gib: int) -> None:
    state = _state(gib)
    dcp.save(state, storage_writer=VolumeWriter(tmp_path / "ck"))
    got = {"model": {k: torch.empty_like(v).fill_(float("nan"))
                     for k, v in state["model"].items()}, "step": 0}
    torch.cuda.synchronize()
    started = time.perf_counter()
    dcp.load(got, storage_reader=VolumeReader(tmp_path / "ck"))
    torch.cuda.synchronize()
    took = time.perf_counter() - started
    for k, v in state["model"].items():
        assert got["model"][k].device == v.device and torch.equal(got["model"][k], v), k
    assert took < 60 * gib, f"loading {gib} GiB into the device took {took:.1f}s"


def _as_tensor(path: str) -> torch.Tensor:
    """A sample: the cached file's bytes (the transform gets its local path)."""
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)


def test_the_dataloader_pins_batches_for_the_device(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(16):
        (src / f"{i:03d}.bin").write_bytes(bytes([i]) * 2**20)
    loader = DataLoader(VolumeDataset(str(src), cache_dir=str(tmp_path / "cache"),
                                      transform=_as_tensor, shuffle=False),
                        batch_size=4, num_workers=2)
    assert loader.pin_memory  # the tuned default where CUDA is present
    seen = []
    for batch in loader:
        assert batch.is_pinned()
        on_device = batch.to("cuda", non_blocking=True)
        seen.extend(int(row[0]) for row in on_device.cpu())
    assert sorted(seen) == list(range(16))
