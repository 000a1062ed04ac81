"""Preemption: a stop signal becomes a committed checkpoint of the current step on every rank.

Kubernetes, spot VMs and torchrun's agent send SIGTERM some seconds before
SIGKILL; SLURM sends the signal ``--signal`` names. The handler here only
notes the signal (and chains to a handler installed before it); the work
happens on the training thread at the next step boundary.

Ranks must agree on the step at which they save, though the signal reaches
them at different moments or reaches one node only. Every rank calls ``poll``
once per step; on check steps it collects the MAX all-reduce of every rank's
"signal seen" flag (and longest step time) that the previous check started (it
ran on gloo's thread meanwhile) and starts the next one. Check steps come
every ``k`` polls, ``k`` chosen from the reduced step time so that a check
runs about every ``CHECK_EVERY_S`` of training: every rank derives the same
``k`` from the same reduced values, so every rank checks, and sees a
preemption, at the same step, at most about two checks after the first rank
noticed it; the steps between checks cost a counter. It runs on a process
group of its own: the manager's background saves use theirs at any moment.

A second signal (a second later or more), or the grace period running out, ends the waiting: the
watch says so (``gave_up``) and the manager stops waiting for the save in
flight. Nothing partial is taken for complete (``.metadata`` is written last).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from dcp_volumes._exceptions import ConfigurationError

logger = logging.getLogger(__name__)

# Signals this close together are one notice: a job's processes often get the
# same signal twice (SLURM or a container runtime signals them all, and
# torchrun's agent forwards its own).
_ONE_NOTICE_S = 1.0
# How often ranks compare notes: the collective's cost spread over this much
# training, against a notice that arrives within about twice this.
CHECK_EVERY_S = 0.5
_MAX_POLLS_PER_CHECK = 1000

Handler = Callable[[int, FrameType | None], Any] | int | None


def signals_of(value: Sequence[int | signal.Signals] | int | None) -> tuple[signal.Signals, ...]:
    """The signals of ``preemption_signals`` (``None`` or empty: none), validated."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, int) else tuple(value)
    chosen = []
    for item in items:
        try:
            sig = signal.Signals(item)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"preemption_signals holds {item!r}, which is not a signal. Fix: pass signal "
                "numbers such as (signal.SIGTERM,) or (signal.SIGUSR1,) for SLURM's --signal."
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigurationError(
                f"preemption_signals holds {sig.name}, which no process can catch. Fix: use "
                "the signal that comes before it (SIGTERM; SLURM: --signal=USR1@120)."
            )
        chosen.append(sig)
    return tuple(dict.fromkeys(chosen))


class PreemptionWatch:
    """Notices a preemption signal on any rank; every rank answers ``poll`` alike.

    Args:
        signals: the signals that announce a preemption.
        grace_s: seconds from the first signal within which the preemption save
            must commit; past it the manager stops waiting.
        group: a process group of its own for the agreement (``None``: one process).
    """

    def __init__(
        self, signals: Sequence[signal.Signals], *, grace_s: float,
        group: dist.ProcessGroup | None,
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigurationError(
                "preemption_signals needs the CheckpointManager to be created on the main "
                "thread: Python runs signal handlers there only. Fix: create the manager in "
                "the training process's main thread, or pass preemption_signals=()."
            )
        self.signals = tuple(signals)
        self.grace_s = float(grace_s)
        self._group = group
        self._received = 0
        self._first_at: float | None = None  # monotonic time of the first signal
        self._previous: dict[signal.Signals, Handler] = {}
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._polled: tuple[int, bool] | None = None  # (step, answer) of the last poll
        self._polls = 0  # polls made: the same count on every rank
        self._next_check = 1  # the poll count of the next check step
        self._every = 1  # polls between checks, from the reduced step time
        self._last_poll_at: float | None = None
        self._slowest_step_s = 0.0  # this rank's longest step since the last check
        self.agreed_step: int | None = None
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    # -- the handler: note, chain, nothing else -------------------------------------------

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
            self._received = 1
        elif now - self._first_at >= _ONE_NOTICE_S:
            self._received += 1
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)

    # -- state ------------------------------------------------------------------------------

    @property
    def noticed(self) -> bool:
        """Whether this process received one of the signals."""
        return self._received > 0

    @property
    def agreed(self) -> bool:
        """Whether every rank has agreed that the job is being preempted."""
        return self.agreed_step is not None

    def remaining_s(self) -> float:
        """Seconds of the grace period left (the whole period before any signal here)."""
        if self._first_at is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self._first_at))

    @property
    def gave_up(self) -> bool:
        """A second signal came, or the grace period ran out: stop waiting."""
        return self._received >= 2 or (self._first_at is not None and self.remaining_s() <= 0)

    # -- agreement ----------------------------------------------------------------------------

    def poll(self, step: int, *, now: bool = False) -> bool:
        """Whether the job is being preempted, the same on every rank at the same ``step``.

        Collective when there is a group: every rank calls it once per step
        (a repeated call for the same step answers again without a collective).
        ``now``: every rank checks at this step (a save step: every rank knows it
        is one), waiting for the answer, so a notice never waits for the
        schedule across saves that slow the steps down.
        """
        if self._polled is not None and self._polled[0] == step:
            return self._polled[1]
        if self.agreed_step is None:
            seen = self.noticed if self._group is None else self._check(now)
            if seen:
                self.agreed_step = step
                logger.warning("preemption noticed (%s): saving step %d, %.1f s of grace left",
                               "/".join(s.name for s in self.signals), step, self.remaining_s())
        answer = self.agreed_step is not None
        self._polled = (step, answer)
        return answer

    def _check(self, now: bool) -> bool:
        """On a check step: the previous check's answer, and the next check started
        (``now``: and its answer waited for)."""
        at = time.monotonic()
        if self._last_poll_at is not None:
            self._slowest_step_s = max(self._slowest_step_s, at - self._last_poll_at)
        self._last_poll_at = at
        self._polls += 1
        if self._polls < self._next_check and not now:
            return False
        seen = self._collect()
        values = torch.tensor([1.0 if self.noticed else 0.0, self._slowest_step_s],
                              dtype=torch.float64)
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if work is not None:
            self._pending = (work, values)
        self._slowest_step_s = 0.0
        self._next_check = self._polls + self._every
        if now:
            seen = self._collect() or seen
        return seen

    def _collect(self) -> bool:
        """The answer of the check in flight (started a check ago: done by now, mostly)."""
        if self._pending is None:
            return False
        work, values = self._pending
        self._pending = None
        work.wait()
        slowest = float(values[1].item())
        if slowest > 0:
            self._every = min(_MAX_POLLS_PER_CHECK, max(1, math.ceil(CHECK_EVERY_S / slowest)))
        return bool(values[0].item())

    # -- end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Put back the handlers that were installed before (collects a pending agreement)."""
        if self._pending is not None:
            try:
                self._pending[0].wait()
            except Exception:  # a rank that is gone; nothing to agree on any more
                logger.debug("preemption agreement abandoned at close", exc_info=True)
            self._pending = None
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
