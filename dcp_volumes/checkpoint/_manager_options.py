"""``ManagerOptions``: a ``CheckpointManager``'s settings, checked once at construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dcp_volumes._exceptions import ConfigurationError

__all__ = ["ManagerOptions"]


@dataclass(frozen=True)
class ManagerOptions:
    """Validated settings of a ``CheckpointManager`` (see its docstring)."""

    keep_last: int | None = 3
    async_save: bool = True
    keep_local: bool = False
    local_replicas: int = 0
    verify: bool = False
    overwrite: bool = False
    create_root: bool = True
    partial_grace_s: float = 3600.0
    save_interval_steps: int | None = None
    preemption_grace_s: float = 25.0
    goodput: bool = True
    writer_options: Mapping[str, Any] = field(default_factory=dict)
    reader_options: Mapping[str, Any] = field(default_factory=dict)
    encryption: Any = None  # an Encryption: the writer's and the reader's keys

    def __post_init__(self) -> None:
        _count_or_none("keep_last", self.keep_last, "(the newest complete checkpoint is "
                       "always kept), or None to keep every checkpoint.")
        if (isinstance(self.local_replicas, bool) or not isinstance(self.local_replicas, int)
                or self.local_replicas < 0):
            raise ConfigurationError(
                f"local_replicas={self.local_replicas!r} must be an integer >= 0: how many "
                "other nodes keep a copy of each node's local tier (1 survives a node loss)."
            )
        if self.local_replicas and not self.keep_local:
            raise ConfigurationError(
                f"local_replicas={self.local_replicas} copies the local tier to other nodes, "
                "and there is no local tier. Fix: pass keep_local=True as well."
            )
        if not isinstance(self.partial_grace_s, (int, float)) or self.partial_grace_s < 0:
            raise ConfigurationError(
                f"partial_grace={self.partial_grace_s!r} must be a number of seconds >= 0."
            )
        _count_or_none("save_interval_steps", self.save_interval_steps,
                       "(should_save(step) is then true every that many steps), or None.")
        if (isinstance(self.preemption_grace_s, bool)
                or not isinstance(self.preemption_grace_s, (int, float))
                or self.preemption_grace_s <= 0):
            raise ConfigurationError(
                f"preemption_grace_s={self.preemption_grace_s!r} must be a number of seconds "
                "> 0: how long after the signal the preemption save may take (keep it below "
                "the time the platform waits before SIGKILL, e.g. 25 for Kubernetes' 30)."
            )
        if not isinstance(self.goodput, bool):
            raise ConfigurationError(
                f"goodput={self.goodput!r} must be True (record where the job's time goes, "
                "under <root>/goodput/) or False (record nothing)."
            )
        reserved = {"path", "storage_options", "staging_dir", "local_copy_dir", "retry"}
        for what, opts in (("writer_options", self.writer_options),
                           ("reader_options", self.reader_options)):
            clash = sorted(reserved & set(opts))
            if clash:
                raise ConfigurationError(
                    f"{what} may not set {clash}: the manager sets them. Pass them as "
                    "CheckpointManager arguments instead."
                )


def _count_or_none(name: str, value: object, meaning: str) -> None:
    """Refuse ``value`` unless it is ``None`` or an integer >= 1 (``meaning`` ends the message)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigurationError(f"{name}={value!r} must be an integer >= 1 {meaning}")
