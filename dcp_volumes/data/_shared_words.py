"""``SharedWords``: int64 words in shared memory that DataLoader workers see too.

The loader's plan (``_shared_plan``) and the workers' table of verified copies
(``_hot``) are both a fixed number of 64-bit words that every process of a
dataset reads and writes. The tensor pickles as shared memory through torch's
multiprocessing (fork or spawn); each process indexes it through its own
memoryview: a tensor's ``__getitem__``/``__setitem__`` is a dispatcher call each,
many times the cost of a memoryview's.
An aligned 8-byte word is never seen torn.
"""

from __future__ import annotations

import torch


class SharedWords:
    """``n`` int64 words in shared memory, zero at first."""

    def __init__(self, n: int) -> None:
        self.tensor = torch.zeros(max(1, n), dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._view: memoryview | None = None

    def __getstate__(self) -> dict[str, torch.Tensor]:
        return {"tensor": self.tensor}  # the view is per process

    def __setstate__(self, state: dict[str, torch.Tensor]) -> None:
        self.tensor = state["tensor"]
        self._view = None

    @property
    def words(self) -> memoryview:
        view = self._view
        if view is None:
            view = self._view = memoryview(self.tensor.numpy()).cast("B").cast("q")
        return view
