"""The plan a loader publishes to its DataLoader workers, in shared memory.

Workers are separate processes that outlive epochs (persistent workers), so
what they must read at each epoch start (order, position, batch layout) lives
in one small int64 tensor in shared memory rather than in pickled state. The
published plan is written only before an iteration starts (workers may read
it late: a slow worker starts after the first batches were delivered); the
``cur_*`` cursor moves with every delivered batch and serves stock DataLoaders,
which publish nothing.
"""

from __future__ import annotations

from typing import NamedTuple

from dcp_volumes.data._order import Cursor, Plan
from dcp_volumes.data._shared_words import SharedWords

_FIELDS = (
    "valid",
    "epoch",
    "seed",
    "shuffle",
    "start",
    "batch_size",
    "world_size",
    "rank",
    "drop",
    "num_workers",
    "prefetch_factor",
    "local_world_size",
    "cur_epoch",
    "cur_start",
    "cur_seed",
    "cur_shuffle",
)
_AT = {name: i for i, name in enumerate(_FIELDS)}
_CUR_EPOCH, _CUR_START, _CUR_SEED, _CUR_SHUFFLE = (
    _AT[n] for n in ("cur_epoch", "cur_start", "cur_seed", "cur_shuffle")
)


class Published(NamedTuple):
    plan: Plan
    prefetch_factor: int
    local_world_size: int


class SharedPlan(SharedWords):
    """The published plan and the cursor (picklable; shares its memory with workers)."""

    def __init__(self) -> None:
        super().__init__(len(_FIELDS))

    def publish(
        self, plan: Plan, *, num_workers: int, prefetch_factor: int, local_world_size: int
    ) -> None:
        values = {
            "valid": 1,
            "epoch": plan.epoch,
            "seed": plan.seed,
            "shuffle": int(plan.shuffle),
            "start": plan.start,
            "batch_size": plan.batch_size,
            "world_size": plan.world_size,
            "rank": plan.rank,
            "drop": int(plan.drop),
            "num_workers": num_workers,
            "prefetch_factor": prefetch_factor,
            "local_world_size": local_world_size,
        }
        for name, value in values.items():
            self.words[_AT[name]] = value

    def set_cursor(self, cursor: Cursor) -> None:
        view = self.words  # it moves with every batch
        view[_CUR_EPOCH] = cursor.epoch
        view[_CUR_START] = cursor.start
        view[_CUR_SEED] = cursor.seed
        view[_CUR_SHUFFLE] = int(cursor.shuffle)

    def read(self, num_files: int) -> tuple[Published | None, Cursor]:
        """The published plan (None if nothing was published) and the cursor."""
        raw = dict(zip(_FIELDS, self.words.tolist(), strict=True))
        cursor = Cursor(
            raw["cur_epoch"], raw["cur_start"], raw["cur_seed"], bool(raw["cur_shuffle"])
        )
        if not raw["valid"]:
            return None, cursor
        plan = Plan(
            num_files=num_files,
            epoch=raw["epoch"],
            seed=raw["seed"],
            shuffle=bool(raw["shuffle"]),
            start=raw["start"],
            batch_size=raw["batch_size"],
            world_size=raw["world_size"],
            rank=raw["rank"],
            drop=bool(raw["drop"]),
        )
        return Published(plan, raw["prefetch_factor"], raw["local_world_size"]), cursor
