"""What a demo run is: its validated settings and the crashes it injects.

Everything here is plain data (no torch): the launcher validates it before
anything touches a volume, and the ranks read the same plan from a JSON file,
so every process agrees on which rank dies where.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes._world import available_cpus

#: Crash kinds. ``upload``: the victim dies while its shards of an async save are
#: uploading; ``commit``: the coordinator dies after every shard of a save is on the
#: volume and before ``.metadata`` (the commit marker) is written; ``step``: a rank
#: dies in the middle of training; ``node``: a node is lost in the middle of training:
#: its torchrun agent and its ranks are SIGKILLed and its local directory (the
#: checkpoints' local tier, staging, the input cache) is removed; the scheduler requeues
#: the job on the same world, the lost node replaced by one with an empty disk (with
#: ``--shrink`` nothing replaces it: torchrun brings the job back on fewer ranks);
#: ``preempt``: the job is told to
#: stop, as Kubernetes, SLURM or a spot notice tell it: SIGTERM to every torchrun agent,
#: which forwards it to its ranks and SIGKILLs them after its grace period
#: (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default); the scheduler then requeues
#: the job (the launcher starts torchrun again).
CRASH_KINDS = ("upload", "commit", "step", "node", "preempt")

#: The two setups compared: the library's, and the naive one it replaces.
SETUPS = ("dcp_volumes", "naive")


@dataclass(frozen=True)
class Crash:
    """One injected failure.

    Attributes:
        index: the crash's number; it fires in the attempt that follows
            ``index`` earlier crashes, so it fires once even though steps are redone.
        step: for ``upload``/``commit`` the step whose save is hit, otherwise
            the step after whose computation the rank dies.
        kind: one of ``CRASH_KINDS``.
        rank: the victim's rank in the world of that attempt.
    """

    index: int
    step: int
    kind: str
    rank: int

    @property
    def hits_save(self) -> bool:
        """Whether the crash lands inside a save (so that save is lost too)."""
        return self.kind in ("upload", "commit")

    def victim(self, setup: str) -> int:
        """The rank that dies: the naive job saves on rank 0 only, so a save is hit on rank 0."""
        return 0 if setup == "naive" and self.hits_save else self.rank

    def describe(self, setup: str = "dcp_volumes") -> str:
        """``SIGKILL rank 1 while the save of step 40 uploads``."""
        if setup == "naive" and self.hits_save:
            when = "halfway through" if self.kind == "upload" else "at the end of"
            return f"SIGKILL rank 0 {when} the upload of step {self.step} (naive save)"
        if self.kind == "upload":
            return f"SIGKILL rank {self.rank} while the save of step {self.step} uploads"
        if self.kind == "commit":
            return (f"SIGKILL rank {self.rank} after every shard of step {self.step} is on the "
                    "volume, before .metadata")
        if self.kind == "node":
            return (f"node loss after step {self.step}: the last node's torchrun agent and "
                    f"rank(s) (rank {self.rank}) SIGKILLed, its local disk wiped")
        if self.kind == "preempt":
            reaction = ("the ranks have no handler and die" if setup == "naive" else
                        "the ranks save the step they are at and exit")
            return (f"preemption after step {self.step}: SIGTERM to the torchrun agent(s), "
                    f"{reaction}; the job is requeued")
        return f"SIGKILL rank {self.rank} after step {self.step}"


@dataclass(frozen=True)
class DemoConfig:
    """The settings of one ``dcp-volumes demo`` run (see ``add_arguments`` for meanings)."""

    nproc: int = 2
    steps: int = 420
    save_every: int = 6
    crashes: int = 4
    seed: int = 0
    shrink: bool = False
    quick: bool = False
    files: int = 512
    global_batch: int = 32
    hidden: int = 128
    keep_last: int = 2
    volume: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    fresh: bool = False
    workdir: str | None = None
    failures_per_day: float = 8.6
    load: int = 0

    def __post_init__(self) -> None:
        for name in ("nproc", "steps", "save_every", "files", "global_batch", "hidden",
                     "keep_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"--{name.replace('_', '-')} {value!r}: must be >= 1.")
        if self.crashes < 0:
            raise ConfigurationError(f"--crashes {self.crashes}: must be >= 0.")
        if isinstance(self.load, bool) or not isinstance(self.load, int) or self.load < 0:
            raise ConfigurationError(f"--load {self.load!r}: must be a count >= 0.")
        cpus = available_cpus()
        if self.nproc > cpus:
            raise ConfigurationError(
                f"--nproc {self.nproc}: this machine lets the demo use {cpus} CPU(s), and each "
                f"rank needs one (ranks that share a CPU measure each other, not the storage). "
                f"Fix: --nproc {cpus} or fewer."
            )
        if self.shrink and self.nproc < 2:
            raise ConfigurationError("--shrink needs --nproc 2 or more (it loses a node).")
        if self.shrink and self.crashes < 1:
            raise ConfigurationError("--shrink needs at least one crash (--crashes 1 or more).")
        for world in self.worlds:
            if self.global_batch % world:
                raise ConfigurationError(
                    f"--global-batch {self.global_batch} does not split over {world} ranks; the "
                    f"global batch stays fixed when the world changes. Fix: a multiple of "
                    f"{world}."
                )
        if self.save_every < 2:
            raise ConfigurationError("--save-every must be >= 2 (crashes land between saves).")
        if self.files < self.global_batch or self.files % self.global_batch:
            raise ConfigurationError(
                f"--files {self.files} must be a multiple of --global-batch {self.global_batch}"
                " (every epoch is whole global batches, so each sample is seen once per epoch)."
            )
        if self.crashes > self.max_crashes:
            raise ConfigurationError(
                f"--crashes {self.crashes} does not fit in {self.steps} steps: with "
                f"--save-every {self.save_every} there are {self.saves} saves before the end and "
                f"each crash needs a save interval of its own, so at most {self.max_crashes}. "
                "Fix: fewer --crashes, more --steps or a smaller --save-every."
            )
        if self.failures_per_day <= 0:
            raise ConfigurationError("--failures-per-day must be > 0.")

    @property
    def saves(self) -> int:
        """Saves strictly before the last step."""
        return (self.steps - 1) // self.save_every

    @property
    def max_crashes(self) -> int:
        """The most crashes that each get a save interval of their own."""
        return self.saves

    @property
    def loses_node(self) -> bool:
        """Whether a crash loses a node: with ``shrink`` the last one (not replaced),
        otherwise, from three crashes on 2 ranks or more, one replaced by a new node."""
        return self.nproc >= 2 and (self.shrink or self.crashes >= 3)

    @property
    def nodes(self) -> list[int]:
        """Ranks per torchrun agent ("node"); two nodes when one is to be lost."""
        if not self.loses_node:
            return [self.nproc]
        first = (self.nproc + 1) // 2
        return [first, self.nproc - first]

    @property
    def worlds(self) -> list[int]:
        """The world sizes the run goes through."""
        return [self.nproc, self.nodes[0]] if self.shrink else [self.nproc]

    def to_json(self) -> dict[str, Any]:
        """The settings as a JSON document, without storage options (they may hold secrets)."""
        doc = asdict(self)
        doc.pop("storage_options")
        return doc


def _kinds(n: int, node: bool) -> list[str]:
    if n <= 1:
        return ["commit"] * n
    kinds = ["upload", "commit", "node" if node else "step", "preempt"]
    while len(kinds) < n:
        kinds.append("upload" if len(kinds) % 2 else "step")
    return kinds[:n]


def plan_crashes(cfg: DemoConfig) -> list[Crash]:
    """The crashes of a run, drawn from ``cfg.seed``.

    Kinds: with one crash it lands in the commit window; with two, one in an
    upload and one in the commit window; a third lands mid-training: a node loss
    (the node replaced, the world unchanged) on 2 ranks or more, else a rank's
    death; a fourth is a preemption (SIGTERM, then a requeue); more alternate
    between uploads and training (a rank's death). With ``shrink`` the last one
    is a node loss that nothing replaces, and the others are as without it with
    a rank's death mid-training instead of a node loss. Crash ``i``
    falls in the ``i``-th of ``crashes`` equal blocks of save intervals, so
    crashes are spread over the run and each is preceded by at least one save
    the job can come back to (except possibly the first).
    """
    n = cfg.crashes
    if n == 0:
        return []
    rng = random.Random(cfg.seed)
    kinds = _kinds(n - 1, node=False) if cfg.shrink else _kinds(n, node=cfg.loses_node)
    rng.shuffle(kinds)
    if cfg.shrink:
        kinds.append("node")
    # Save indices 1..saves (all before the last step), split into n blocks.
    usable = cfg.saves
    crashes: list[Crash] = []
    for i, kind in enumerate(kinds):
        lo = 1 + (i * usable) // n
        hi = max(lo, ((i + 1) * usable) // n)
        if kind in ("upload", "commit"):
            # The first save has nothing before it to fall back to; prefer a later one.
            j = rng.randint(max(lo, 2) if hi >= 2 else lo, hi)
            step = j * cfg.save_every
        else:
            # A node loss, too, preferably after a save that was replicated.
            j = rng.randint(max(lo, 2) if hi >= 2 and kind == "node" else lo, hi)
            # A node loss lands in the second half of an interval: the save before it has
            # had the time to commit and be replicated, as usually between saves.
            late = cfg.save_every // 2 if kind == "node" else cfg.save_every - 1
            step = j * cfg.save_every - rng.randint(1, max(1, late))
        if kind in ("commit", "preempt"):
            # commit: the coordinator writes .metadata, only its death stops the commit;
            # preempt: the signal goes to the agents, so every rank gets it (rank: none).
            rank = 0
        elif kind == "node":
            rank = cfg.nproc - 1  # a rank of the last node (that node's agent and ranks die)
        else:
            rank = rng.randrange(cfg.nproc)
        crashes.append(Crash(index=i, step=step, kind=kind, rank=rank))
    return crashes
