"""Retention: which old checkpoints go, deleting them safely, and the local tier's copies.

Rules (the manager applies them after each commit, ``dcp-volumes gc`` on demand):

* keep the newest ``keep_last`` complete checkpoints; delete older complete ones;
* delete partial checkpoints older than the newest complete one (crashed saves
  or crashed deletes); a partial one at or after it may be being written: kept;
  so is one whose files changed within the grace period (``partial_grace_s``):
  another job saving into the same root (a second manager, a restarted job whose
  predecessor is still finishing) may be writing it, whatever its step;
* never the newest complete checkpoint, never the one being written, and
  nothing at all when the listing fails (``scan`` raises, so nothing runs);
* delete ``.metadata`` first, so a crash half-way through a delete leaves a
  partial checkpoint, never one that looks complete.

The local tier keeps the staged files of the newest checkpoint on local disk
(``<local_dir>/<step dir>``); older local copies are dropped once a newer
checkpoint is committed. The replicas a node keeps of other nodes' files
(``<local_dir>/replicas/node-<n>/<step dir>``) follow the same rule, once the
newer checkpoint's replica has arrived whole.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence

from dcp_volumes import _env
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._discovery import (
    CheckpointInfo,
    ManifestCache,
    newest_complete,
    parse_step,
    scan,
    sort_key,
)
from dcp_volumes.checkpoint._layout import (
    METADATA_NAME,
    is_commit_marker,
    local_files,
    replica_nodes,
)

logger = logging.getLogger(__name__)


#: Partial checkpoints touched more recently than this are never deleted (seconds).
DEFAULT_PARTIAL_GRACE_S = 3600.0


def retention_victims(
    infos: Sequence[CheckpointInfo],
    *,
    keep_last: int | None,
    protect: Sequence[str] = (),
    partial_grace_s: float = 0.0,
    now: float | None = None,
) -> list[CheckpointInfo]:
    """Which checkpoints of a ``scan`` result retention deletes, oldest first.

    Keeps the newest ``keep_last`` complete checkpoints (all when ``None``);
    deletes older complete ones and partial ones older than the newest complete.
    Never returns the newest complete checkpoint, a partial one at or after it
    (it may be being written), a partial one whose newest file is younger than
    ``partial_grace_s`` (another job may be writing it), a directory named in
    ``protect``, or one in a newer format than this version reads (a newer
    dcp_volumes may still need it).
    """
    now = time.time() if now is None else now
    newest = newest_complete(infos)
    if newest is None:
        return []
    complete = sorted((i for i in infos if i.complete), key=sort_key)
    kept = {i.name for i in complete[-keep_last:]} if keep_last is not None else set()
    kept.add(newest.name)
    kept.update(protect)
    victims = []
    for info in infos:
        if info.name in kept or info.newer_format:
            continue
        old_complete = info.complete and keep_last is not None
        touched = info.modified if info.modified is not None else info.created
        old_partial = not info.complete and info.step < newest.step and not (
            touched is not None and now - touched < partial_grace_s
        )
        if old_complete or old_partial:
            victims.append(info)
    return sorted(victims, key=sort_key)


def delete_checkpoint(volume: Volume, name: str) -> None:
    """Delete the checkpoint directory ``name`` under ``volume``, commit markers first.

    ``.metadata``, then a rank-local checkpoint's ``__<rank>.metadata`` markers,
    then everything else.
    """
    volume.delete(f"{name}/{METADATA_NAME}")
    markers = [f.path for f in volume.list(name) if is_commit_marker(f.path.rsplit("/", 1)[-1])]
    volume.delete_many(markers)
    volume.delete_prefix(name)


def apply_retention(
    volume: Volume,
    *,
    keep_last: int | None,
    protect: Sequence[str] = (),
    manifests: ManifestCache | None = None,
    partial_grace_s: float = DEFAULT_PARTIAL_GRACE_S,
) -> list[CheckpointInfo]:
    """List the root, then delete what the rules allow; returns what was deleted."""
    infos = scan(volume, manifests=manifests)
    victims = retention_victims(infos, keep_last=keep_last, protect=protect,
                                partial_grace_s=partial_grace_s)
    for info in victims:
        logger.info("retention: deleting %s checkpoint %s",
                    "complete" if info.complete else "partial", info.url)
        delete_checkpoint(volume, info.name)
    return victims


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
            files = local_files(directory)
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
