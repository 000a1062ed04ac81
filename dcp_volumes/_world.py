"""The world this process trains in: its rank, the job's size, its node, and its CPUs.

The one place that asks: the default process group where one is up, else the
variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``); a plain process is rank 0 of 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """Where this process stands in the job.

    Attributes:
        rank: this process's global rank.
        size: the number of ranks.
        local_rank: its rank on its node.
        local_size: ranks on its node (never more than ``size``).
        node: its node's index (torchrun's ``GROUP_RANK``).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node: int = 0

    @classmethod
    def from_env(cls) -> World:
        """The world as torchrun's environment describes it (rank 0 of 1 outside torchrun)."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            size=size,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_size=max(1, min(local_size, size)),
            node=int(os.environ.get("GROUP_RANK", "0")),
        )

    @classmethod
    def current(cls) -> World:
        """The default process group's rank and size where one is up, else ``from_env``."""
        env = cls.from_env()
        if not distributed():
            return env
        import torch.distributed as dist

        size = dist.get_world_size()
        return cls(
            rank=dist.get_rank(),
            size=size,
            local_rank=env.local_rank,
            local_size=max(1, min(env.local_size, size)),
            node=env.node,
        )


def distributed() -> bool:
    """Whether a default process group is up in this process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def cpu_ids() -> list[int] | None:
    """The CPUs this process may run on, by id (its affinity); None where the system
    does not say (not Linux)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None


def available_cpus() -> int:
    """How many CPUs this process may run on (its affinity where the system tells it)."""
    ids = cpu_ids()
    return len(ids) if ids is not None else os.cpu_count() or 1
