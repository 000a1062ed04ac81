"""Every name in a checkpoint: its markers, manifests and data files.

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
* ``checkpoint_name``: the last component of a checkpoint's path, which also
  names its copies on local disk.
"""

from __future__ import annotations

import os
import re

import xxhash

from dcp_volumes._exceptions import CheckpointCorruptError

DATA_SUFFIX = ".distcp"
METADATA_NAME = ".metadata"
MANIFEST_NAME = ".dcp_volumes.manifest.json"
_RANK_MARKER = re.compile(r"^__(\d+)" + re.escape(METADATA_NAME) + "$")
_RANK_MANIFEST = re.compile(r"^__(\d+)" + re.escape(MANIFEST_NAME) + "$")


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
    """The last component of a checkpoint's path: names its copies on local disk."""
    name = root.rstrip("/").replace(os.sep, "/").rsplit("/", 1)[-1]
    return name or "checkpoint"


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
