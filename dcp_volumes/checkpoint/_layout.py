"""Where checkpoint files go and how byte ranges are fetched: names, prefixes, coalescing.

Shared by the writer and the reader so that both agree on the layout:

* data files are named like stock DCP's, with a tag of the save between rank
  and index (``__{rank}_{tag}_{i}.distcp``), so two saves of one checkpoint
  id never write the same object; optionally under a hashed sub-prefix
  (``3f/__0_9c1e07aa_1.distcp``) to spread keys over several prefixes for
  object stores that throttle per prefix; the name is the ``relative_path``
  in ``.metadata``, so stock readers find the files;
* the local copy of a checkpoint (the "local tier") lives in
  ``local_copy_dir/<checkpoint name>``;
* neighbouring byte ranges of one file are merged before fetching;
* ``CheckpointLocation``: the location-related API of the writer and the reader.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterable, Sequence
from typing import Any

import xxhash

from dcp_volumes._exceptions import CheckpointCorruptError
from dcp_volumes._volume import RetryPolicy, Volume

DATA_SUFFIX = ".distcp"

# Ranges closer than this are fetched as one request: one round trip costs
# more than reading a few hundred KiB that are then thrown away.
DEFAULT_COALESCE_GAP = 2**20


def rank_prefix(rank: int, tag: str) -> str:
    """The file-name prefix of a rank's data files in the save tagged ``tag``.

    Stock DCP names files ``__{rank}_{i}``: two jobs saving one checkpoint id at
    once would overwrite each other's shards before one of them fails to commit.
    """
    return f"{rank_name_start(rank)}{tag}_"


def rank_name_start(rank: int) -> str:
    """How the names of every data file of ``rank`` start, in any save (``__3_``)."""
    return f"__{rank}_"


def save_tag(save_id: str) -> str:
    """The short tag of a save in its file names (8 hex digits of its id)."""
    return save_id[:8]


def data_file_name(prefix: str, index: int) -> str:
    """Name of the ``index``-th data file with ``prefix`` (``__0_ab_`` -> ``__0_ab_3.distcp``)."""
    return f"{prefix}{index}{DATA_SUFFIX}"


def spread_prefix(name: str, spread: int) -> str:
    """The hashed sub-prefix for ``name`` among ``spread`` prefixes ('' when off).

    Hex digits of a hash, at least two, so keys of consecutive ranks and files
    land on different prefixes (object stores partition by key prefix).
    """
    if spread <= 1:
        return ""
    width = max(2, len(format(spread - 1, "x")))
    return format(xxhash.xxh3_64_intdigest(name.encode()) % spread, f"0{width}x")


def relative_path(name: str, spread: int) -> str:
    """Path of a data file relative to the checkpoint directory."""
    sub = spread_prefix(name, spread)
    return f"{sub}/{name}" if sub else name


def checkpoint_name(root: str) -> str:
    """The last component of a checkpoint's path: names its local copy."""
    name = root.rstrip("/").replace(os.sep, "/").rsplit("/", 1)[-1]
    return name or "checkpoint"


def local_copy_path(local_copy_dir: str | os.PathLike[str], root: str) -> str:
    """Directory holding the local copy of the checkpoint whose path is ``root``."""
    return os.path.join(os.path.abspath(os.fspath(local_copy_dir)), checkpoint_name(root))


def coalesce(
    ranges: Iterable[tuple[int, int]], *, gap: int = DEFAULT_COALESCE_GAP
) -> list[tuple[int, int]]:
    """Merge ``[start, end)`` ranges that overlap or lie within ``gap`` bytes of each other.

    Returns sorted, disjoint ranges that together cover every input range.
    Empty ranges (``start == end``) are kept covered but never widen a merge
    on their own beyond their position.
    """
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end})")
        if out and start <= out[-1][1] + gap:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def split_range(
    start: int, end: int, part_size: int, *, at_most: bool = False
) -> list[tuple[int, int]]:
    """``[start, end)`` cut into equal parts of about ``part_size`` bytes (at most 1.5x).

    Equal parts, rounded, not full parts and a remainder: a file a few KiB over
    the part size (its headers) would otherwise cost a second request for its tail.
    ``at_most``: no part above ``part_size`` (the count rounded up).
    """
    if end <= start:
        return [(start, start)]
    length = end - start
    count = max(1, -(-length // part_size) if at_most else round(length / part_size))
    cuts = [start + i * length // count for i in range(count + 1)]
    return list(itertools.pairwise(cuts))


def find_span(
    starts: Sequence[int], spans: Sequence[tuple[int, int]], start: int, end: int
) -> int:
    """Index of the span in sorted, disjoint ``spans`` that holds ``[start, end)``.

    ``starts`` are the spans' start offsets (for bisection).
    """
    i = bisect.bisect_right(starts, start) - 1
    if i < 0 or end > spans[i][1]:
        raise KeyError(f"no span contains [{start}, {end})")
    return i


class CheckpointLocation:
    """Where a ``VolumeWriter`` or ``VolumeReader`` points: its checkpoint and local copy.

    The class using it sets ``_volume``, ``_storage_options``, ``_retry`` and
    ``options`` (with ``local_copy_dir``) in its ``__init__``.
    """

    _volume: Volume
    _storage_options: dict[str, Any] | None  # None: DCP_VOLUMES_STORAGE_OPTIONS
    _retry: RetryPolicy | None
    options: Any

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's URL (credentials removed); DCP logs it."""
        return self._volume.display_url

    @property
    def volume(self) -> Volume:
        """The volume of the current checkpoint."""
        return self._volume

    @property
    def local_copy_path(self) -> str | None:
        """Directory of this checkpoint's local copy, or ``None`` without ``local_copy_dir``."""
        if self.options.local_copy_dir is None:
            return None
        return local_copy_path(self.options.local_copy_dir, self._volume.root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._volume.display_url!r})"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a URL or path this class can address."""
        try:
            Volume(checkpoint_id)
        except Exception:
            return False
        return True

    def _relocate(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """Point at ``checkpoint_id`` (a URL or path), same options; no-op when empty."""
        if checkpoint_id:
            self._volume = Volume(
                checkpoint_id, storage_options=self._storage_options, retry=self._retry
            )


def inside(rel: str, where: str) -> str:
    """``rel`` (a file name from ``.metadata`` or the manifest) if it names a file inside
    the checkpoint; ``CheckpointCorruptError`` otherwise.

    Checkpoints may come from someone else: a name with ``..``, an absolute path,
    a drive or a backslash would read (or verify, or delete) a file outside it.
    """
    parts = rel.split("/")
    if (
        not rel
        or rel.startswith("/")
        or "\\" in rel
        or ":" in parts[0]
        or any(p in ("", ".", "..") for p in parts)
        or "\x00" in rel
    ):
        raise CheckpointCorruptError(
            f"{where} names the file {rel!r}, which is not inside the checkpoint (an absolute "
            "path, '..' or an empty part). The checkpoint was tampered with or damaged; it is "
            "not loaded."
        )
    return rel
