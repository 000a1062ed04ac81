"""The global sample order of an epoch and its split over ranks and DataLoader workers.

One epoch is a *stream* of global sample positions ``0, 1, 2, ...``; position
``i`` reads file ``perm[i % N]`` where ``perm`` is a permutation of the ``N``
files drawn from ``(seed, epoch)``. The stream is cut into global batches of
``G = batch_size * world_size`` positions; global batch ``g`` gives rank ``r``
the positions ``start + g*G + r*batch_size + [0, batch_size)``, and each
rank's batches go to its DataLoader workers round-robin by batch index
(batch ``g`` to worker ``g % W``), exactly the order in which the DataLoader
asks its workers for batches. Concatenating the ranks' batches of one step
therefore always gives the same global batch, whatever the number of ranks or
workers, and a resume at position ``start`` continues the same stream.

Every rank yields the same number of batches: ``drop`` ends the epoch at the
last full global batch; ``pad`` completes the last one by wrapping around to
the start of the epoch's order (positions ``>= N`` reuse ``perm[i - N]``).

The permutation is ``argsort`` of a splitmix64 hash of the positions, so it is
the same on every machine and numpy/torch version (a library RNG's stream may
change between releases, which would break resumes across an upgrade).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dcp_volumes._exceptions import ConfigurationError

ORDER_ALGORITHM = "splitmix64-argsort-v1"

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_TAG_ORDER = 0x6F72646572  # "order"
_TAG_SAMPLE = 0x73616D706C65  # "sample"


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A 64-bit seed mixed from integers (stable across platforms and versions)."""
    h = 0x243F6A8885A308D3
    for part in parts:
        h = _splitmix64(h ^ (int(part) & _MASK))
    return h


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(_GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        mixed: np.ndarray = x ^ (x >> np.uint64(31))
        return mixed


def epoch_permutation(n: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The file order of one epoch (int64 indices into the file table)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    base = np.uint64(derive_seed(_TAG_ORDER, seed, epoch))
    with np.errstate(over="ignore"):
        keys = _splitmix64_array(np.arange(n, dtype=np.uint64) + base)
    return np.argsort(keys, kind="stable").astype(np.int64)


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The augmentation seed of one sample: fixed by (seed, epoch, global position)."""
    return derive_seed(_TAG_SAMPLE, seed, epoch, position)


def sample_seeds(seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """``sample_seed`` of many positions at once (one numpy pass instead of a loop), as
    uint64: 8 bytes a sample, where a list of Python ints would cost 40 more."""
    prefix = derive_seed(_TAG_SAMPLE, seed, epoch)
    with np.errstate(over="ignore"):
        return _splitmix64_array(np.asarray(positions).astype(np.uint64) ^ np.uint64(prefix))


class Cursor(NamedTuple):
    """Where the next iteration starts: the epoch's order (seed, shuffle) and stream position."""

    epoch: int
    start: int
    seed: int
    shuffle: bool


@dataclass(frozen=True)
class Plan:
    """What one rank reads in one (possibly resumed) epoch.

    Attributes:
        num_files: files in the file table (``N``).
        epoch, seed, shuffle: select the permutation.
        start: first global stream position to deliver (resume point).
        batch_size: samples per batch on each rank.
        world_size, rank: this rank's place in the job.
        drop: ``True``: drop the last partial global batch; ``False``: pad it.
    """

    num_files: int
    epoch: int
    seed: int
    shuffle: bool
    start: int
    batch_size: int
    world_size: int
    rank: int
    drop: bool

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigurationError(f"batch_size={self.batch_size} must be >= 1.")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigurationError(
                f"rank={self.rank} / world_size={self.world_size} is not a valid placement."
            )
        if self.start < 0 or self.epoch < 0:
            raise ConfigurationError("start and epoch must be >= 0.")

    @classmethod
    def from_cursor(
        cls, cursor: Cursor, *, num_files: int, batch_size: int, world_size: int, rank: int,
        drop: bool,
    ) -> Plan:
        """What ``rank`` reads from ``cursor`` on."""
        return cls(num_files=num_files, epoch=cursor.epoch, seed=cursor.seed,
                   shuffle=cursor.shuffle, start=cursor.start, batch_size=batch_size,
                   world_size=world_size, rank=rank, drop=drop)

    @classmethod
    def whole_epoch(
        cls, *, num_files: int, batch_size: int, world_size: int, rank: int, drop: bool
    ) -> Plan:
        """A whole epoch (its length does not depend on the order)."""
        return cls.from_cursor(Cursor(0, 0, 0, False), num_files=num_files,
                               batch_size=batch_size, world_size=world_size, rank=rank,
                               drop=drop)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def num_batches(self) -> int:
        """Batches every rank yields from ``start`` to the end of the epoch."""
        remaining = max(0, self.num_files - self.start)
        g = self.global_batch_size
        return remaining // g if self.drop else -(-remaining // g)

    @property
    def end(self) -> int:
        """The stream position after the last delivered sample of the epoch."""
        return self.start + self.num_batches * self.global_batch_size

    def worker_positions(self, worker: int, num_workers: int) -> np.ndarray:
        """Stream positions read by DataLoader worker ``worker`` of ``num_workers``, in order."""
        if not 0 <= worker < num_workers:
            raise ConfigurationError(f"worker {worker} is not in range({num_workers}).")
        batches = np.arange(worker, self.num_batches, num_workers, dtype=np.int64)
        offsets = np.arange(self.batch_size, dtype=np.int64)
        first = self.start + batches * self.global_batch_size + self.rank * self.batch_size
        return (first[:, None] + offsets[None, :]).reshape(-1)


class NextUse:
    """Distance (in stream positions) to the next use of each file by a set of ranks.

    Used for Belady eviction: the files used furthest in the future (or never
    within this epoch and the next) are evicted first; files inside the window
    ``[current - behind, current + ahead]`` are never evicted (they are being
    prefetched, or were just delivered and may still be read).
    """

    def __init__(self, plan: Plan, *, ranks: range, ahead: int, behind: int) -> None:
        n = plan.num_files
        self.ahead = ahead
        self.behind = behind
        self.current = plan.start
        self._end = plan.end
        this = epoch_permutation(n, seed=plan.seed, epoch=plan.epoch, shuffle=plan.shuffle)
        nxt = epoch_permutation(n, seed=plan.seed, epoch=plan.epoch + 1, shuffle=plan.shuffle)
        positions = np.arange(n, dtype=np.int64)
        # Position of each file in this epoch (its first use) and the next one.
        self._pos = np.empty(n, dtype=np.int64)
        self._pos[this] = positions
        self._pos_next = np.empty(n, dtype=np.int64)
        self._pos_next[nxt] = positions
        lo, hi = ranks.start, ranks.stop
        g, b = plan.global_batch_size, plan.batch_size
        rank_here = ((self._pos - plan.start) % g) // b
        self._mine = (rank_here >= lo) & (rank_here < hi) & (self._pos >= plan.start)
        self._mine &= self._pos < self._end
        rank_next = (self._pos_next % g) // b
        self._mine_next = (rank_next >= lo) & (rank_next < hi)

    def distance(self, file_index: int) -> float | None:
        """Positions until the next use of ``file_index`` here; inf if none; None if in window."""
        pos = int(self._pos[file_index])
        cur = self.current
        if cur - self.behind <= pos <= cur + self.ahead:
            return None
        if pos > cur and self._mine[file_index]:
            return float(pos - cur)
        if self._mine_next[file_index]:
            return float(self._end - cur + int(self._pos_next[file_index]))
        return float("inf")
