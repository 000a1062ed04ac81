"""What the data side takes from torch beyond its stable public API.

Kept apart from ``checkpoint`` because every DataLoader worker's process
imports this side: it must not pay for importing torch.distributed.checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["pin_batch", "start_shm_manager"]


def start_shm_manager() -> None:
    """Reach (or start) this process's ``torch_shm_manager``, whatever its sharing strategy.

    A one-byte storage shared by name does it (the public ``share_memory_``
    goes by name only under the "file_system" strategy, which the training
    process must not switch to for this). Raises ``RuntimeError`` where no
    manager can start.
    """
    torch.UntypedStorage(1)._share_filename_cpu_()  # type: ignore[no-untyped-call]


def pin_batch(batch: Any) -> Any:
    """Pin the tensors of a batch (nested containers too) the way the DataLoader's
    pin-memory thread does; for batch types that wrap a batch (``pin_memory()``)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    pin: Any = pin_memory
    return pin(batch)
