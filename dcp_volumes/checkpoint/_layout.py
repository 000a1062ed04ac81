"""Where a checkpoint's files go: every name in a checkpoint, and its location.

Shared by the writer, the reader, discovery and the CLI so that all agree on the layout:

* ``.metadata`` is the commit marker (stock DCP's), written last; beside it
  ``.dcp_volumes.manifest.json`` holds every data file's size and checksum;
  a rank-local save (``use_collectives=False``) commits each rank on its own
  with ``__<rank>.dcp_volumes.manifest.json`` and then ``__<rank>.metadata``
  (stock DCP's name for a rank's marker);

* data files are named like stock DCP's, with a tag of the save between rank
  and index (``__{rank}_{tag}_{i}.distcp``), so two saves of one checkpoint
  id never write the same object; optionally under a hashed sub-prefix
  (``3f/__0_9c1e07aa_1.distcp``) to spread keys over several prefixes for
  object stores that throttle per prefix; the name is the ``relative_path``
  in ``.metadata``, so stock readers find the files;
* the local copy of a checkpoint (the "local tier") lives in
  ``local_copy_dir/<checkpoint name>``; the copies a node keeps of another
  node's files (``local_replicas``) in
  ``local_copy_dir/replicas/node-<its node>/<checkpoint name>``;
* ``Location``: the checkpoint's volume and local copy, held by the writer
  and the reader.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import xxhash

from dcp_volumes._exceptions import CheckpointCorruptError
from dcp_volumes._volume import RetryPolicy, Volume

DATA_SUFFIX = ".distcp"
METADATA_NAME = ".metadata"
MANIFEST_NAME = ".dcp_volumes.manifest.json"
_RANK_MARKER = re.compile(r"^__(\d+)" + re.escape(METADATA_NAME) + "$")
_RANK_MANIFEST = re.compile(r"^__(\d+)" + re.escape(MANIFEST_NAME) + "$")
_REPLICA_NODE = re.compile(r"^node-(\d+)$")


def rank_metadata_name(rank: int) -> str:
    """The commit marker of ``rank`` in a rank-local checkpoint (``__3.metadata``)."""
    return f"__{rank}{METADATA_NAME}"


def rank_manifest_name(rank: int) -> str:
    """The manifest of ``rank`` in a rank-local checkpoint."""
    return f"__{rank}{MANIFEST_NAME}"


def marker_rank(name: str) -> int | None:
    """The rank whose commit marker ``name`` is (``__3.metadata`` -> 3), else ``None``."""
    match = _RANK_MARKER.match(name)
    return int(match.group(1)) if match else None


def manifest_rank(name: str) -> int | None:
    """The rank whose manifest ``name`` is, else ``None``."""
    match = _RANK_MANIFEST.match(name)
    return int(match.group(1)) if match else None


def is_commit_marker(name: str) -> bool:
    """``.metadata`` or a rank's ``__r.metadata``: the files a delete removes first."""
    return name == METADATA_NAME or marker_rank(name) is not None


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


#: The directory of ``local_copy_dir`` that holds other nodes' replicas.
REPLICAS_DIR = "replicas"


def replica_dir(local_copy_dir: str | os.PathLike[str], node: int) -> str:
    """Where a node keeps its replicas of node ``node``'s files (one checkpoint dir below)."""
    return os.path.join(os.path.abspath(os.fspath(local_copy_dir)), REPLICAS_DIR, f"node-{node}")


def replica_nodes(local_copy_dir: str | os.PathLike[str]) -> dict[int, str]:
    """The nodes whose replicas ``local_copy_dir`` holds, with their directories."""
    base = os.path.join(os.path.abspath(os.fspath(local_copy_dir)), REPLICAS_DIR)
    try:
        entries = os.listdir(base)
    except OSError:
        return {}
    found = {}
    for entry in entries:
        match = _REPLICA_NODE.match(entry)
        if match:
            found[int(match.group(1))] = os.path.join(base, entry)
    return dict(sorted(found.items()))


def local_files(directory: str) -> dict[str, int]:
    """The data files of a local copy: path relative to ``directory`` (``/``-separated) -> size."""
    found: dict[str, int] = {}
    for dirpath, _, names in os.walk(directory):
        for name in names:
            if not name.endswith(DATA_SUFFIX):
                continue
            path = os.path.join(dirpath, name)
            try:
                found[os.path.relpath(path, directory).replace(os.sep, "/")] = os.path.getsize(path)
            except OSError:  # removed meanwhile (retention)
                continue
    return found


def local_copy_paths(local_copy_dir: str | os.PathLike[str], root: str) -> list[str]:
    """Every directory of this node that may hold files of the checkpoint at ``root``:
    its own local copy first, then the replicas it keeps of other nodes' files."""
    name = checkpoint_name(root)
    return [local_copy_path(local_copy_dir, root)] + [
        os.path.join(d, name) for d in replica_nodes(local_copy_dir).values()
    ]


class Location:
    """Where a ``VolumeWriter`` or ``VolumeReader`` points: the checkpoint's volume, and
    the directory of its local copy when a ``local_copy_dir`` is given.

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
        return local_copy_path(self.local_copy_dir, self.volume.root)

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
