"""Retention: which old checkpoints go, and deleting them safely.

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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._discovery import (
    CheckpointInfo,
    ManifestCache,
    newest_complete,
    scan,
    sort_key,
)
from dcp_volumes.checkpoint._layout import METADATA_NAME, is_commit_marker

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
