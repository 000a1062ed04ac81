"""Helpers shared by the data-side tests (test_cache, test_dataset, test_loader, test_data_resume).

Every sample file starts with its 4-byte little-endian id followed by filler
bytes derived from the id, so a reader can tell which file it got and that
the bytes are intact.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dcp_volumes._volume import Volume


def payload(file_id: int, size: int = 64) -> bytes:
    """The content of sample file ``file_id``: its id, then id-derived filler."""
    head = file_id.to_bytes(4, "little")
    filler = hashlib.sha256(head).digest() * (size // 32 + 1)
    return (head + filler)[:size]


def name_of(file_id: int) -> str:
    return f"part-{file_id // 10}/sample-{file_id:05d}.bin"


def write_samples(url: str, storage_options: Mapping[str, Any] | None, n: int, *,
                  size: int = 64) -> dict[str, bytes]:
    """Create ``n`` sample files below ``url``; returns ``{relpath: bytes}``."""
    volume = Volume(url, storage_options=storage_options)
    if volume.capabilities.local_files:
        os.makedirs(volume.root, exist_ok=True)
    files = {name_of(i): payload(i, size) for i in range(n)}
    for rel, data in files.items():
        volume.publish(rel, data)
    return files


def read_id(path: str) -> int:
    """Transform: the id of a sample file, checking its bytes are intact."""
    with open(path, "rb") as f:
        data = f.read()
    file_id = int.from_bytes(data[:4], "little")
    if data != payload(file_id, len(data)):
        raise AssertionError(f"torn or corrupt sample file {path}")
    return file_id


def augment(path: str, rng: torch.Generator) -> tuple[int, float, float]:
    """A random transform: (id, a draw from rng, a draw from the global torch RNG)."""
    return read_id(path), float(torch.rand(1, generator=rng)), float(torch.rand(1))


def global_view(per_rank: Sequence[Sequence[Sequence[Any]]]) -> list[Any]:
    """Concatenate the ranks' batches step by step: the global sample stream."""
    steps = {len(batches) for batches in per_rank}
    if len(steps) != 1:
        raise AssertionError(f"ranks yielded different numbers of batches: {steps}")
    out: list[Any] = []
    for step in range(steps.pop()):
        for batches in per_rank:
            out.extend(batches[step])
    return out


def to_list(batch: Any) -> list[Any]:
    """A collated batch as a plain list of samples."""
    if isinstance(batch, torch.Tensor):
        return [int(v) for v in batch.tolist()]
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        # default_collate of tuples: one tensor per field
        return [tuple(float(f[i]) for f in batch) for i in range(len(batch[0]))]
    return list(batch)


def disk_bytes(cache_dir: str) -> int:
    """Bytes of every data file below cache_dir/objects (what the limit bounds).

    Locks and sidecars (also a sidecar's temp file, there for a moment while a
    fill publishes it) are bookkeeping, not cached bytes.
    """
    total = 0
    for root, _, names in os.walk(os.path.join(cache_dir, "objects")):
        for name in names:
            if name.endswith((".lock", ".meta")) or ".meta.tmp-" in name:
                continue
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                total += os.path.getsize(os.path.join(root, name))
    return total


def run_job(
    source: Any,
    storage_options: Mapping[str, Any] | None,
    cache_dir: str,
    *,
    world: int,
    workers: int,
    global_batch_size: int,
    state: Mapping[str, Any] | None = None,
    stop_after: int | None = None,
    epoch: int | None = None,
    **dataset_kwargs: Any,
) -> tuple[list[Any], dict[str, Any]]:
    """Run one epoch (or ``stop_after`` batches) as ``world`` ranks, one after the other.

    Each rank has its own dataset and loader (explicit rank/world_size), as in
    a real job. Returns the global sample stream and the loader state, which
    must be the same on every rank.
    """
    from dcp_volumes import DataLoader, VolumeDataset

    dataset_kwargs.setdefault("transform", read_id)
    per_rank: list[list[list[Any]]] = []
    states: list[dict[str, Any]] = []
    for rank in range(world):
        ds = VolumeDataset(source, storage_options=storage_options, cache_dir=cache_dir,
                           **dataset_kwargs)
        loader = DataLoader(ds, global_batch_size=global_batch_size, num_workers=workers,
                            rank=rank, world_size=world, persistent_workers=False)
        if state is not None:
            loader.load_state_dict(state)
        if epoch is not None:
            loader.set_epoch(epoch)
        batches = []
        for batch in loader:
            batches.append(to_list(batch))
            if stop_after is not None and len(batches) == stop_after:
                break
        per_rank.append(batches)
        states.append(loader.state_dict())
    if any(s != states[0] for s in states):
        raise AssertionError(f"loader states differ between ranks: {states}")
    return global_view(per_rank), states[0]
