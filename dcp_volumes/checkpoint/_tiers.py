"""Where a checkpoint file's bytes live: the checkpoint's volume, this node's local copy,
another node's replica; and where a ``VolumeWriter`` or ``VolumeReader`` points.

Two small protocols. The write side: a save hands each closed file to its
sinks (``FileSink.put``): the upload to the volume (``_rank_save``), and with
``local_copy_dir`` the local tier, which also keeps the files (``FileKeeper``:
the ranks stage into it). The read side: a load asks an ordered list of
sources (``FileSource.offer``) for the files it needs, each for those no
earlier one had; a supplied file is read whole and checked against the
manifest's checksum, and whatever no source has, or a copy that fails its
check, comes from the checkpoint's volume, the source of truth. The reader
counts bytes by the source's name and never asks which one answered.

The implementations: the local tier (``_local_tier``: sink and source) and the
peer tier (``_peers``: a source; it replicates a checkpoint once committed,
when the manager asks, never a file of a save that may not commit).
``CheckpointManager`` builds the lists; a writer or reader made alone gets the
local tier at its ``local_copy_dir``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from dcp_volumes._volume import RetryPolicy, Volume
from dcp_volumes.checkpoint._local_tier import LocalCopies, LocalCopy, copy_dir
from dcp_volumes.checkpoint._manifest import FileRecord
from dcp_volumes.checkpoint._supply import PutBytes, Supply

#: Where a load's bytes came from (``VolumeReader.sources``): the sources' names.
SOURCE_NAMES = ("local", "peer", "volume")


class FileSink(Protocol):
    """Takes each closed file of a rank's save (on the rank's upload threads)."""

    def put(self, record: FileRecord, local_path: str) -> None:
        """Take the file ``record`` describes, staged at ``local_path``."""


class FileKeeper(FileSink, Protocol):
    """A sink that keeps the files on this node: the ranks stage into it."""

    def staging_dir(self, rank: int) -> str:
        """Where ``rank`` stages its files (made ready for them)."""

    def discard(self, name_prefix: str) -> None:
        """Remove the files of a failed save (those starting with ``name_prefix``)."""

    def committed(self, manifest_name: str, manifest: bytes) -> None:
        """The checkpoint committed with ``manifest`` (on the committing rank)."""


class Offer(Protocol):
    """A source's answer to a load: ``supplies`` maps each file it has to its ``Supply``;
    ``join`` waits for what it runs in the background (a transfer)."""

    @property
    def supplies(self) -> Mapping[str, Supply]:
        """Path in the checkpoint -> where the source has the file."""

    def join(self) -> None:
        """Until the source's background work for this load has ended."""


class FileSource(Protocol):
    """A place a load may read a checkpoint's files from, instead of its volume."""

    #: What ``VolumeReader.sources`` counts its bytes under (one of ``SOURCE_NAMES``).
    name: str

    def offer(
        self,
        checkpoint: str,
        wanted: Mapping[str, FileRecord],
        *,
        into: Callable[[str], PutBytes] | None = None,
        memory_bytes: int = 0,
    ) -> Offer:
        """Which of ``wanted`` (path -> the manifest's record) of checkpoint ``checkpoint``
        this source supplies. Called on every rank of a load, with nothing wanted too (a
        source may be collective). ``into(path)`` lays out a read's buffers for a file
        whose bytes arrive in pieces, for up to ``memory_bytes`` of them."""


class Location:
    """Where a ``VolumeWriter`` or ``VolumeReader`` points: the checkpoint's volume, and
    the directory of the local tier when a ``local_copy_dir`` is given.

    DCP's ``reset(checkpoint_id)`` moves it (``move_to``); the volume is then
    made with the same ``storage_options`` and retry policy.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None,
        retry: RetryPolicy | None,
        local_copy_dir: str | None,
    ) -> None:
        # None stays None: the Volume then takes DCP_VOLUMES_STORAGE_OPTIONS.
        self._storage_options = None if storage_options is None else dict(storage_options)
        self._retry = retry
        self.local_copy_dir = local_copy_dir
        self.volume = Volume(path, storage_options=self._storage_options, retry=retry)

    @property
    def local_copy_path(self) -> str | None:
        """Directory of this checkpoint's local copy, or ``None`` without ``local_copy_dir``."""
        if self.local_copy_dir is None:
            return None
        return copy_dir(self.local_copy_dir, self.volume.root)

    def keepers(self, *, sync: bool) -> list[FileKeeper]:
        """The sinks that keep this checkpoint's files on this node (``sync``: durably)."""
        path = self.local_copy_path
        return [] if path is None else [LocalCopy(path, sync=sync)]

    def sources(self) -> list[FileSource]:
        """The sources a reader made alone asks: the local tier, if any."""
        return [] if self.local_copy_dir is None else [LocalCopies(self.local_copy_dir)]

    def move_to(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """Point at ``checkpoint_id`` (a URL or path), same options; no-op when empty."""
        if checkpoint_id:
            self.volume = Volume(
                checkpoint_id, storage_options=self._storage_options, retry=self._retry
            )

    @staticmethod
    def addressable(checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a URL or path a volume can be made for."""
        try:
            Volume(checkpoint_id)
        except Exception:
            return False
        return True


class AtLocation:
    """What a ``VolumeWriter`` and a ``VolumeReader`` say about where they point.

    The one attribute it needs is declared: ``_location``, set by the subclass.
    """

    _location: Location

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's URL (credentials removed); DCP logs it."""
        return self.volume.display_url

    @property
    def volume(self) -> Volume:
        """The volume of the current checkpoint."""
        return self._location.volume

    @property
    def local_copy_path(self) -> str | None:
        """Directory of this checkpoint's local copy, or ``None`` without ``local_copy_dir``."""
        return self._location.local_copy_path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.volume.display_url!r})"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a URL or path this class can address."""
        return Location.addressable(checkpoint_id)
