"""Deterministic training states: a function of the step, so a test can recompute them.

Every tensor of ``state_for(step)`` is derived from ``step`` alone (and the
rank for per-rank entries), so a test that only knows which step was restored
can check the restored bytes exactly. ``seeded_state`` builds a flat state of
given shapes the same way; ``load_into`` restores a checkpoint in one process.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import VolumeReader


class Progress:
    """A ``Stateful`` (state_dict/load_state_dict) loaded in place by DCP."""

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.history = torch.zeros(8, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.history = state["history"].clone()


def progress_for(step: int) -> Progress:
    p = Progress(step)
    p.history = torch.arange(step, step + 8, dtype=torch.int64)
    return p


def state_for(step: int, *, rank: int | None = None, size: int = 64) -> dict[str, Any]:
    """The state a job has at ``step`` (``rank``: add a per-rank entry)."""
    g = torch.Generator().manual_seed(1000 + step)
    state: dict[str, Any] = {
        "model": {
            "w": torch.randn(size, size, generator=g),
            "b": torch.randn(size, generator=g).to(torch.bfloat16),
        },
        "optim": {"m": torch.randn(size, size, generator=g), "lr": 0.1 * step},
        "progress": progress_for(step),
    }
    if rank is not None:
        gr = torch.Generator().manual_seed(10_000 * (rank + 1) + step)
        state[f"rank{rank}"] = torch.randint(0, 1 << 30, (size,), generator=gr)
    return state


def seeded_state(seed: int, shapes: Mapping[str, tuple[int, ...]], **extra: Any) -> dict[str, Any]:
    """Float32 tensors of ``shapes`` drawn in order from ``seed``, then the ``extra`` entries."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {name: torch.randn(*shape, generator=g)
                             for name, shape in shapes.items()}
    state.update(extra)
    return state


def load_into(
    target: dict[str, Any], url: str, storage_options: Mapping[str, Any] | None = None,
    **reader_options: Any,
) -> dict[str, Any]:
    """``dcp.load`` the checkpoint at ``url`` into ``target`` in this process alone; returns it."""
    reader = VolumeReader(url, storage_options=dict(storage_options or {}), **reader_options)
    with warnings.catch_warnings():
        # Without a process group DCP warns that it loads in a single process: intended here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=reader, no_dist=True)
    return target


def empty_state(*, rank: int | None = None, size: int = 64) -> dict[str, Any]:
    """A state of the same structure with wrong values, to restore into."""
    state: dict[str, Any] = {
        "model": {"w": torch.full((size, size), -1.0),
                  "b": torch.full((size,), -1.0, dtype=torch.bfloat16)},
        "optim": {"m": torch.full((size, size), -1.0), "lr": -1.0},
        "progress": Progress(-1),
    }
    if rank is not None:
        state[f"rank{rank}"] = torch.full((size,), -1, dtype=torch.int64)
    return state


def _plain(value: Any) -> Any:
    if isinstance(value, Progress):
        return value.state_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def differences(got: dict[str, Any], want: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys whose values are not bit-equal (tensors: same dtype, shape and bytes)."""
    got, want = _plain(got), _plain(want)
    out: list[str] = []
    for key in sorted(set(got) | set(want)):
        name = f"{prefix}{key}"
        if key not in got or key not in want:
            out.append(f"{name}: missing")
            continue
        a, b = got[key], want[key]
        if isinstance(b, dict) and isinstance(a, dict):
            out.extend(differences(a, b, prefix=f"{name}."))
        elif isinstance(b, torch.Tensor):
            same = (
                isinstance(a, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.dim() else a,
                                b.view(torch.uint8) if b.dim() else b)
            )
            if not same:
                out.append(f"{name}: tensor differs")
        elif a != b:
            out.append(f"{name}: {a!r} != {b!r}")
    return out
