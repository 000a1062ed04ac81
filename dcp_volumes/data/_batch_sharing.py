"""How DataLoader workers hand their batches to the training process.

A batch leaves a worker as tensors in shared memory. torch's default
strategy on Linux, "file_descriptor", sends each one as a file descriptor:
for every batch the training process opens a new connection to the worker's
resource-sharer thread, both sides run an HMAC handshake, and the descriptor
crosses over. With small samples that handshake is most of what the training
process does in ``next()``, and the worker's thread answers each connection.
"file_system" passes the segment's name instead; torch's
``torch_shm_manager`` tracks the segments and removes them when the last
process using them exits, killed or not. (The data benchmark's warm epochs
show the difference: benchmarks/HISTORY.md, ``warm_side_by_side``.)

So ``DataLoader`` switches its *workers* to "file_system" (the strategy is
per process: what the training process itself shares keeps the user's
setting; it only maps what arrives). A worker where the manager cannot start
falls back to torch's default and logs why.

Each process that shares by name talks to a ``torch_shm_manager``, and one
that has none starts its own: a new process that loads libtorch, before the
worker's first download. Forked workers inherit the training process's
manager, so the training process starts one before they fork: once per
job, not once per worker and epoch. They then share its connection (a
request is one small write answered by an identical "OK"); the manager
removes what a client left behind once the last process on that connection
is gone, so a worker killed on its own leaves its waiting batches until the
training process exits.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes._torch.data import start_shm_manager
from dcp_volumes.data._worker_exit import keep_connections_from_children

logger = logging.getLogger(__name__)

FAST = "file_system"
_TORCH_DEFAULT = "file_descriptor"
# The process whose torch_shm_manager forked workers inherit (see start_manager_for_workers).
_manager_pid: int | None = None


def resolve(strategy: str | None) -> str | None:
    """The strategy for the workers: ``strategy`` checked, or the fast one where there is one."""
    available = sorted(torch.multiprocessing.get_all_sharing_strategies())  # type: ignore[no-untyped-call]
    if strategy is None:
        return FAST if FAST in available else None
    if strategy not in available:
        raise ConfigurationError(
            f"sharing_strategy={strategy!r} is not one of this platform's {available}. Fix: "
            f"pass one of them, or leave it unset ({FAST!r} where available)."
        )
    return strategy


class WorkerInit:
    """``worker_init_fn``: set the worker's sharing strategy, then call the user's init."""

    def __init__(self, strategy: str, user_init: Callable[[int], None] | None) -> None:
        self.strategy = strategy
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        use(self.strategy)
        if self.user_init is not None:
            self.user_init(worker_id)


def use(strategy: str) -> None:
    """Switch this process to ``strategy``; for "file_system", make sure it works here."""
    torch.multiprocessing.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]
    if strategy != FAST:
        return
    try:
        # Reaches (or starts) torch_shm_manager now rather than at the first batch: the
        # strategy is "file_system" now, so sharing goes by name.
        torch.UntypedStorage(1).share_memory_()  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        torch.multiprocessing.set_sharing_strategy(_TORCH_DEFAULT)  # type: ignore[no-untyped-call]
        logger.warning(
            "DataLoader worker: shared memory by name is unavailable here (%s); batches go by "
            "file descriptor, which costs the training process more CPU per batch.",
            exc,
        )


def start_manager_for_workers(strategy: str | None, context: Any) -> None:
    """Start this process's torch_shm_manager now, so the workers it forks share it.

    ``context``: the DataLoader's multiprocessing context (None: torch's
    default). Only for forked "file_system" workers; forkserver workers share
    the one their server started (``_forkserver_preload``); spawned ones
    cannot inherit it. If it cannot start, each worker tries its own (``use``).
    """
    if strategy != FAST:
        return
    if (context or torch.multiprocessing).get_start_method() != "fork":
        return
    start_manager_here()


def start_manager_here() -> None:
    """Reach (or start) this process's torch_shm_manager, once per process."""
    global _manager_pid
    if _manager_pid == os.getpid():
        return
    keep_connections_from_children()  # the manager is exec'd, and outlives a killed rank
    try:
        # What the process itself shares keeps its own strategy (see start_shm_manager).
        start_shm_manager()
    except (AttributeError, RuntimeError) as exc:
        logger.info("DataLoader: no shared-memory manager here (%s); workers try their own", exc)
        return
    _manager_pid = os.getpid()
