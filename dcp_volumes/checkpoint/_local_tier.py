"""The local tier: this node's copies of checkpoint files, their paths and their clean-up.

A save with ``local_copy_dir`` stages its files into the local tier and keeps
them there (``LocalCopy``, a sink of the writer); a load reads a file from
there when its size matches the manifest, checking its checksum as it reads
(``LocalCopies``, a source of the reader). Layout under the tier's directory:

* ``<local_dir>/<checkpoint name>``: this node's own copy of a checkpoint, with
  a copy of its manifest once committed;
* ``<local_dir>/replicas/node-<n>/<checkpoint name>``: the copies this node keeps
  of node n's files (``local_replicas``; the peer tier fills them).

Only the newest checkpoint is kept: older copies are dropped once a newer
checkpoint is committed (``LocalTier.keep_only``), and the replicas of a node
once the newer checkpoint's replica has arrived whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dcp_volumes import _env
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._discovery import parse_step
from dcp_volumes.checkpoint._layout import DATA_SUFFIX, checkpoint_name, rank_name_start
from dcp_volumes.checkpoint._manifest import FileRecord
from dcp_volumes.checkpoint._supply import PutBytes, Supply

logger = logging.getLogger(__name__)

#: The directory of the tier that holds other nodes' replicas.
REPLICAS_DIR = "replicas"
_REPLICA_NODE = re.compile(r"^node-(\d+)$")


# -- paths ----------------------------------------------------------------------------------


def copy_dir(local_dir: str | os.PathLike[str], root: str) -> str:
    """Directory holding this node's copy of the checkpoint whose path is ``root``."""
    return os.path.join(os.path.abspath(os.fspath(local_dir)), checkpoint_name(root))


def replica_dir(local_dir: str | os.PathLike[str], node: int) -> str:
    """Where a node keeps its replicas of node ``node``'s files (one checkpoint dir below)."""
    return os.path.join(os.path.abspath(os.fspath(local_dir)), REPLICAS_DIR, f"node-{node}")


def replica_nodes(local_dir: str | os.PathLike[str]) -> dict[int, str]:
    """The nodes whose replicas ``local_dir`` holds, with their directories."""
    base = os.path.join(os.path.abspath(os.fspath(local_dir)), REPLICAS_DIR)
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


def copy_dirs(local_dir: str | os.PathLike[str], root: str) -> list[str]:
    """Every directory of this node that may hold files of the checkpoint at ``root``:
    its own copy first, then the replicas it keeps of other nodes' files."""
    name = checkpoint_name(root)
    return [copy_dir(local_dir, root)] + [
        os.path.join(d, name) for d in replica_nodes(local_dir).values()
    ]


def data_files(directory: str) -> dict[str, int]:
    """The data files of a copy: path relative to ``directory`` (``/``-separated) -> size."""
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


def remove_data_files(directory: str, name_prefix: str) -> None:
    """Remove the data files starting with ``name_prefix`` from a copy's directory."""
    for dirpath, _, names in os.walk(directory):
        for name in names:
            if name.startswith(name_prefix) and name.endswith(DATA_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(dirpath, name))


# -- the tier as the manager sees it ----------------------------------------------------------


class LocalTier:
    """The node-local copies of checkpoints: ``<directory>/<step dir>``, newest only.

    Every rank of a node may share the directory (file names carry the rank);
    only one rank per node (local rank 0) removes copies.
    """

    def __init__(self, directory: str, *, owner: bool) -> None:
        self.directory = directory
        self.owner = owner

    @staticmethod
    def default_dir(
        local_dir: str | os.PathLike[str] | None, *, staging_dir: str | None, root_url: str
    ) -> str:
        """``local_dir``, else ``<staging dir>/dcp_volumes-local/<hash of the root URL>``."""
        if local_dir is not None:
            return os.path.abspath(os.path.expanduser(os.fspath(local_dir)))
        base = staging_dir or _env.staging_dir() or tempfile.gettempdir()
        # Keyed by the root so that two runs on one node never share local copies.
        key = hashlib.sha256(root_url.encode()).hexdigest()[:16]
        return os.path.join(os.path.abspath(base), "dcp_volumes-local", key)

    def has(self, name: str) -> bool:
        """Whether a (possibly partial) local copy of checkpoint ``name`` exists."""
        return os.path.isdir(os.path.join(self.directory, name))

    def held(self, name: str) -> dict[str, tuple[int, int]]:
        """What this node holds of checkpoint ``name``: ``"own"`` (its local copy) and
        ``"node-<n>"`` (its replica of node n's files) -> (data files, bytes); only those
        that hold files."""
        dirs = {"own": os.path.join(self.directory, name)}
        dirs.update({f"node-{n}": os.path.join(d, name)
                     for n, d in replica_nodes(self.directory).items()})
        held = {}
        for what, directory in dirs.items():
            files = data_files(directory)
            if files:
                held[what] = (len(files), sum(files.values()))
        return held

    def has_replicas(self) -> bool:
        """Whether this node keeps replicas of other nodes' files (``local_replicas``)."""
        return bool(replica_nodes(self.directory))

    def drop(self, name: str) -> None:
        """Remove the local copy of ``name`` (a save of it failed)."""
        if self.owner:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def keep_only(self, name: str) -> None:
        """Remove every local copy but ``name``'s: it superseded them by committing."""
        if not self.owner or not os.path.isdir(self.directory):
            return
        for entry in os.listdir(self.directory):
            if entry != name and parse_step(entry) is not None:
                logger.debug("dropping local copy %s", entry)
                shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)


# -- write side: a save's files kept ----------------------------------------------------------


class LocalCopy:
    """A sink of the writer: this node's copy of one checkpoint, ``<local_dir>/<name>``.

    The ranks stage their files here (``staging_dir``), so keeping them costs no
    copy; ``put`` makes each closed file durable (``sync``); a failed save's
    files are removed (nothing says they are incomplete), and the commit leaves
    a copy of the manifest beside them.
    """

    def __init__(self, directory: str, *, sync: bool) -> None:
        self.directory = directory
        self.sync = sync

    def staging_dir(self, rank: int) -> str:
        """Where ``rank`` stages its files. The ranks of a node share it: an earlier save
        of this checkpoint name left this rank's files here (under other names now),
        and this save's copy replaces them; other ranks' files are theirs."""
        remove_data_files(self.directory, rank_name_start(rank))
        os.makedirs(self.directory, exist_ok=True)
        return self.directory

    def put(self, record: FileRecord, local_path: str) -> None:
        """Keep a closed file, staged here: on disk before the save may commit."""
        if self.sync:
            fd = os.open(local_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def discard(self, name_prefix: str) -> None:
        """Remove the files of a failed save (those starting with ``name_prefix``)."""
        remove_data_files(self.directory, name_prefix)

    def committed(self, manifest_name: str, manifest: bytes) -> None:
        """The checkpoint committed: keep its manifest beside the files."""
        Volume(self.directory).publish(manifest_name, manifest)


# -- read side: the files this node holds --------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """What the local tier supplies of a load's files (found on disk: nothing to wait for)."""

    supplies: Mapping[str, Supply]

    def join(self) -> None:
        """Nothing runs in the background."""


class LocalCopies:
    """A source of the reader: this node's own copy of a checkpoint, then the replicas it
    keeps of other nodes' files; a file is taken where its size matches the manifest."""

    name = "local"

    def __init__(self, local_dir: str) -> None:
        self.local_dir = local_dir

    def offer(
        self,
        checkpoint: str,
        wanted: Mapping[str, FileRecord],
        *,
        into: Callable[[str], PutBytes] | None = None,
        memory_bytes: int = 0,
    ) -> Found:
        """The files of ``wanted`` found here with the manifest's size (their checksum is
        checked when read)."""
        dirs = copy_dirs(self.local_dir, checkpoint)
        supplies = {}
        for rel, record in wanted.items():
            directory = self._holder(dirs, rel, record)
            if directory is not None:
                supplies[rel] = Supply(Volume(directory))
        return Found(supplies)

    @staticmethod
    def _holder(dirs: list[str], rel: str, record: FileRecord) -> str | None:
        wrong: list[int] = []
        for directory in dirs:
            try:
                size = os.path.getsize(os.path.join(directory, *rel.split("/")))
            except OSError:
                continue
            if size == record.size:
                return directory
            wrong.append(size)
        if wrong:
            logger.info("local copy of %s has %d bytes, manifest says %d: reading it from "
                        "elsewhere", rel, wrong[0], record.size)
        else:
            logger.debug("no local copy of %s", rel)
        return None
