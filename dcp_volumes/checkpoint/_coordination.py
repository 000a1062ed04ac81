"""Rank roles and agreement for the manager's collective calls.

DCP propagates an error raised inside its own phases to every rank, but
anything a rank does *before* entering ``dcp.save`` (calling ``state_dict()``
on ``Stateful`` objects, staging, checking the target) fails on that rank
alone, and the other ranks would then wait in a collective until the process
group times out. ``Coordinator.agree`` closes that gap: every rank reports
its status in one ``all_gather_object`` and, if any rank failed, every rank
raises before anything is written.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dcp_volumes._exceptions import (
    CheckpointError,
    DcpVolumesError,
    rank_failures,
    storage_error,
)
from dcp_volumes._prompt_exit import settle_threads_at_exit
from dcp_volumes._torchrun import forget_stale_addresses
from dcp_volumes._world import World, distributed

logger = logging.getLogger(__name__)

# dcp.save/load warn on every call made without a process group, even when the
# caller asked for no_dist explicitly; for a single-process manager it is noise.
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def summary(exc: BaseException) -> str:
    """``Type: first line of the message`` (bounded), for logs and cross-rank reports."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


@contextlib.contextmanager
def typed_errors(what: str, *, refused_fix: str = "") -> Iterator[None]:
    """Raise the dcp_volumes error inside DCP's ``CheckpointException`` (a
    ``BaseException`` that ``except DcpVolumesError`` would miss); any other failure
    of DCP becomes a ``CheckpointError`` naming ``what``, the failed rank and its
    error (not DCP's bare "CheckpointException ranks:..."). ``refused_fix`` ends
    the message where DCP itself refused on some rank (its planner: a key or a
    shape the checkpoint does not match), not where storage failed."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, DcpVolumesError):
        raise
    except BaseException as exc:
        typed = storage_error(exc)
        if typed is not None:
            raise typed from exc
        failed = rank_failures(exc)
        if not failed:
            raise CheckpointError(f"Could not {what}: {summary(exc)}") from exc
        rank, first = failed[0]
        others = [str(r) for r, _ in failed[1:]]
        also = f" (rank{'s' if len(others) > 1 else ''} {', '.join(others)} too)" if others else ""
        reason = summary(first).rstrip(".")
        fix = f" {refused_fix}" if refused_fix else ""
        raise CheckpointError(
            f"Could not {what}: rank {rank} failed{also}: {reason}.{fix}"
        ) from exc


class Coordinator:
    """This process's role in checkpoint collectives.

    Args:
        process_group: the group to use; ``None`` creates a private gloo group
            over all ranks when ``torch.distributed`` is initialised (a
            collective call: every rank must construct its manager), so that
            a background save never interleaves with the training loop's
            collectives on the default group.

    Under torchrun, when it makes the group, first clears torchrun's shared store of a
    killed attempt's addresses (``_torchrun``), so that this group and those made after
    it connect.

    The library makes its process groups here: ``group`` for the saves and restores,
    and a ``side_group`` for each thread that runs collectives beside them.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.distributed = distributed()
        if self.distributed:
            settle_threads_at_exit()  # this group's threads outlive the job's last line
            if process_group is None:  # every rank is here (a group over the world follows)
                forget_stale_addresses()
            self.group: dist.ProcessGroup | None = process_group or dist.new_group(
                backend="gloo"
            )
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.local_rank = World.from_env().local_rank
        else:
            self.group = None
            self.rank, self.world_size, self.local_rank = 0, 1, 0

    def side_group(self, *, timeout_s: float | None = None) -> dist.ProcessGroup | None:
        """A further gloo group over the job's ranks (``None``: one process), for
        collectives issued from another thread than the saves': gloo pairs a group's
        collectives by their order, and two threads on one group would cross them on
        some rank. ``timeout_s``: its operations' bound (default: torch's). Collective:
        every rank makes its side groups in the same order."""
        if not self.distributed:
            return None
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        group: dist.ProcessGroup = dist.new_group(backend="gloo", timeout=timeout)
        return group

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Around the manager's ``dcp`` calls: without a process group, DCP's warning
        that it assumes one process (what the manager chose) is not shown. Only
        there: the process's other warnings filters stay as they are."""
        if self.distributed:
            yield
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING, category=UserWarning)
            yield

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 of the group: it lists, deletes and decides."""
        return self.rank == 0

    def agree(self, what: str, error: BaseException | None, *, flag: bool = False) -> bool:
        """Return on every rank if no rank failed; otherwise raise on every rank.

        A failed rank raises its own error; the others raise a ``CheckpointError``
        naming the first failed rank and its error. Returns whether any rank raised
        ``flag``: a decision one rank made, known to all in the same exchange.
        """
        if not self.distributed:
            if error is not None:
                raise error
            return flag
        mine = (None if error is None else summary(error), flag)
        statuses: list[Any] = [None] * self.world_size
        dist.all_gather_object(statuses, mine, group=self.group)
        if error is not None:
            raise error
        failed = [(rank, text) for rank, (text, _) in enumerate(statuses) if text is not None]
        if failed:
            rank, text = failed[0]
            raise CheckpointError(
                f"Could not {what}: rank {rank} failed ({text}). Every rank stopped before "
                "writing, so nothing was committed; fix that rank's error and retry."
            )
        return any(flagged for _, flagged in statuses)

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]


class Prestaged:
    """An AsyncStager handing ``dcp.async_save`` a state dict staged beforehand.

    The manager stages before the ranks agree to save, so that a staging
    failure on one rank stops the save on every rank.
    """

    _synchronize_after_execute = False

    def __init__(self, staged: dict[str, Any]) -> None:
        self._staged = staged

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._staged

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None
