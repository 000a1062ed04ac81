"""The commit of a save: how its files become a checkpoint, and how a committed one is replaced.

One object for both kinds of save. A save with collectives commits once, on
the coordinator: ``.dcp_volumes.manifest.json``, then ``.metadata``. A
rank-local save (``use_collectives=False``) commits each rank on its own:
``__<rank>.dcp_volumes.manifest.json``, then ``__<rank>.metadata``; the
checkpoint is complete when every rank's marker is there.

The commit, in order:

1. publish the manifest, create-only unless ``overwrite``: of two saves
   committing one location at once exactly one lands, and the manifest beside
   the marker is always the committed save's own (one of a save that crashed
   before its marker is cleared first);
2. meanwhile, on a store whose listings may lag its writes, check the listing:
   every file of the manifest is on the volume with its size. Elsewhere the
   ranks' write results vouch for their files (each upload returned success
   before its rank reported), and the commit costs no listing pages;
3. publish the marker, create-only unless ``overwrite``: the commit;
4. if another save won the commit, withdraw: remove this save's files, and
   its manifest if it is still its own.

Before a save starts, ``prepare`` refuses a committed checkpoint at the
location, or, with ``overwrite``, removes it: its marker first, so that it
turns incomplete, then its manifest and files.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dcp_volumes import _exit_safe
from dcp_volumes._exceptions import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    VolumeExistsError,
)
from dcp_volumes._volume import LAG_TOTAL_S, FileInfo, Volume, until_shown
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._layout import (
    MANIFEST_NAME,
    METADATA_NAME,
    is_commit_marker,
    manifest_rank,
    rank_manifest_name,
    rank_metadata_name,
)
from dcp_volumes.checkpoint._manifest import (
    FileRecord,
    Manifest,
    check_listing_settled,
    read_manifest,
)
from dcp_volumes.checkpoint._tiers import FileKeeper

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Commit:
    """The commit of one save at ``volume``.

    Attributes:
        volume: the checkpoint's volume.
        save_id: this save's id (in the manifest: a withdrawal removes only its own).
        overwrite: replace a committed checkpoint; otherwise every publish is create-only.
        rank: ``None`` for a save with collectives (the coordinator commits), else
            the rank whose rank-local save this is.
        world_size: the ranks of a rank-local save, recorded in its manifest so that
            a rank that died before writing anything still makes it incomplete.
        keepers: the sinks that keep this checkpoint's files on this node: each is
            told the manifest once committed.
        abandoned: looked at right before the marker goes up: set when the save's
            caller stopped waiting for it (a preemption's grace ran out), and the
            save must then never commit.
    """

    volume: Volume
    save_id: str
    overwrite: bool
    rank: int | None = None
    world_size: int | None = None
    keepers: Sequence[FileKeeper] = ()
    abandoned: threading.Event = field(default_factory=threading.Event)

    @property
    def manifest_name(self) -> str:
        return MANIFEST_NAME if self.rank is None else rank_manifest_name(self.rank)

    @property
    def marker_name(self) -> str:
        return METADATA_NAME if self.rank is None else rank_metadata_name(self.rank)

    # -- before the save ----------------------------------------------------------------------

    def prepare(self, top: set[str]) -> None:
        """Refuse, or with ``overwrite`` remove, a committed checkpoint here.

        ``top``: the names directly in the checkpoint (one listing answers all
        that a save asks before it starts).
        """
        where = self.volume.display_url
        if self.rank is None:
            # A rank-local checkpoint here (rank 0's marker is enough, as stock DCP
            # checks) counts as committed too: its markers would otherwise outlive
            # its files.
            if METADATA_NAME not in top and rank_metadata_name(0) not in top:
                return
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"A committed checkpoint already exists at {where}. Fix: save to a new "
                    "location, delete it, or pass overwrite=True to VolumeWriter to replace it."
                )
            self._remove_committed()
            return
        if METADATA_NAME in top:
            raise CheckpointExistsError(
                f"{where} holds a checkpoint saved with collectives (.metadata); a rank-local "
                "save (use_collectives=False) cannot replace it: without collectives the ranks "
                "cannot agree on who deletes it. Fix: save to a new location, or delete it "
                "first (dcp-volumes gc, or remove the directory)."
            )
        if self.marker_name not in top:
            return
        if not self.overwrite:
            raise CheckpointExistsError(
                f"Rank {self.rank} already committed a rank-local checkpoint at {where} "
                f"({self.marker_name}). Fix: save to a new location, delete it, or pass "
                "overwrite=True to VolumeWriter to replace it."
            )
        self._remove_rank_files(self.rank)

    def _remove_committed(self) -> None:
        """Delete the committed checkpoint here: ``.metadata`` first, so it turns incomplete."""
        try:
            old = read_manifest(self.volume)
        except CheckpointCorruptError:
            old = None
        self.volume.delete(METADATA_NAME)
        listing = [f.path for f in self.volume.list()]
        # A rank-local checkpoint's markers go first too, then its manifests.
        self.volume.delete_many([p for p in listing if is_commit_marker(p)])
        logger.info("overwrite: removed the commit markers of %s", self.volume.display_url)
        if old is not None:
            old_files = list(old.files)
        else:
            old_files = [
                p for p in listing if p.endswith(_layout.DATA_SUFFIX) or is_commit_marker(p)
            ]
        self.volume.delete(MANIFEST_NAME)
        self.volume.delete_many([p for p in listing if manifest_rank(p) is not None])
        self.volume.delete_many(old_files)

    def _remove_rank_files(self, rank: int) -> None:
        """Overwrite in a rank-local save: this rank's marker first, then its manifest, files."""
        try:
            old = read_manifest(self.volume, self.manifest_name)
        except CheckpointCorruptError:
            old = None
        self.volume.delete(self.marker_name)
        if old is not None:
            files = list(old.files)
        else:  # a stock rank-local save: its files carry the rank's prefix
            start = _layout.rank_name_start(rank)
            files = [
                f.path
                for f in self.volume.list()
                if f.path.rsplit("/", 1)[-1].startswith(start)
                and f.path.endswith(_layout.DATA_SUFFIX)
            ]
        self.volume.delete(self.manifest_name)
        self.volume.delete_many(files)
        logger.info("overwrite: removed rank %d's checkpoint files at %s", rank,
                    self.volume.display_url)

    # -- the commit -----------------------------------------------------------------------------

    def publish(self, files: Mapping[str, FileRecord], metadata: bytes, *, ranks: int) -> Manifest:
        """Commit: the manifest of ``files``, then the marker holding ``metadata``
        (pickled ``.metadata``). Returns the manifest.

        ``files`` come from the ranks' write results, which a rank reports only
        once each of its uploads returned success for the bytes it staged. Where
        the store's listings show every write that returned, a listing could tell
        no more, and its pages (a round trip each, one after another) grow with
        the ranks: only a store whose listings may lag (``capabilities.listing_lags``)
        is listed.

        ``ranks``: the ranks whose files these are (a save with collectives).
        Raises ``CheckpointExistsError`` when another save committed here
        meanwhile (this save's files are then removed), ``CheckpointCorruptError``
        when a listing that lags does not come to show every file whole.
        """
        extra: dict[str, Any] = {"writer": "dcp_volumes", "save_id": self.save_id}
        if self.rank is None:
            extra["ranks"] = ranks
        else:
            extra.update(rank_local=True, rank=self.rank, world_size=self.world_size)
        manifest = Manifest(files=files, extra=extra)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpv-commit") as pool:
            checked = None
            if self.volume.capabilities.listing_lags:
                # The listing runs while the manifest goes up, a round trip less per
                # save: a manifest means nothing until the marker is beside it, and a
                # failed check takes it back.
                checked = _exit_safe.submit(pool, check_listing_settled, self.volume, manifest)
            try:
                self._publish_manifest(manifest)
            except VolumeExistsError as exc:
                if checked is not None:
                    checked.exception()  # its outcome no longer matters; let it end first
                self._withdraw(manifest, published_manifest=False)
                raise self._lost() from exc
            except BaseException:
                if checked is not None:
                    checked.exception()
                raise
            try:
                if checked is not None:
                    self._check(checked)
                if self.abandoned.is_set():
                    raise CheckpointError(
                        f"The save to {self.volume.display_url} was abandoned (its caller "
                        "stopped waiting for it) and is not committed."
                    )
            except BaseException:
                # Not committed, so nothing may point at its files.
                with contextlib.suppress(Exception):
                    self.volume.delete(self.manifest_name)
                raise
        try:
            self.volume.publish(self.marker_name, metadata, exclusive=not self.overwrite)
        except VolumeExistsError as exc:
            self._withdraw(manifest, published_manifest=True)
            raise self._lost() from exc
        # Any other failure: the marker may have landed, and its manifest stays.
        for keeper in self.keepers:
            keeper.committed(self.manifest_name, manifest.to_json())
        return manifest

    def _check(self, checked: ThreadFuture[tuple[list[str], list[FileInfo]]]) -> None:
        """Raise unless the listing shows every file of the manifest whole."""
        problems, _ = checked.result()
        if problems:
            raise CheckpointCorruptError(
                f"Not committing {self.volume.display_url}: the ranks' uploads did "
                f"not land whole ({'; '.join(problems[:5])}), still so after listing "
                f"again for {LAG_TOTAL_S:.0f} s. An upload was cut short, another "
                "writer uses this location, or the store's listing lags its writes "
                "longer than that; save again (on a store known to lag, to a fresh "
                "location)."
            )

    def _lost(self) -> CheckpointExistsError:
        return CheckpointExistsError(
            f"Another save is committing or committed {self.volume.display_url} "
            "while this one ran; this save was not committed and its files were "
            "removed. Fix: give each save its own location or pass overwrite=True."
        )

    def _publish_manifest(self, manifest: Manifest) -> None:
        """Publish the manifest, create-only unless overwrite. Raises ``VolumeExistsError``
        if another save's is there (one of a save that crashed before its commit is
        cleared first)."""
        exclusive = not self.overwrite
        try:
            self.volume.publish(self.manifest_name, manifest.to_json(), exclusive=exclusive)
        except VolumeExistsError:
            if not self._clear_stale_manifest():
                raise
            self.volume.publish(self.manifest_name, manifest.to_json(), exclusive=exclusive)

    def _clear_stale_manifest(self) -> bool:
        """Remove a manifest left by a save that crashed before its commit; ``False``
        when another save committed here instead.

        A save in its commit window publishes its marker milliseconds after its
        manifest: one still without it after ``LAG_TOTAL_S`` belongs to a save
        that died (nothing loads it: without the marker it is not a checkpoint).
        Deleting it only now, not when this save starts, never takes the manifest
        of a save that is committing.
        """
        if until_shown(lambda: self.volume.exists(self.marker_name), bool,
                       what=f"{self.marker_name} beside {self.manifest_name}"):
            return False
        logger.info(
            "removing %s of a save that crashed before committing %s",
            self.manifest_name,
            self.volume.display_url,
        )
        self.volume.delete(self.manifest_name)
        return True

    def _withdraw(self, manifest: Manifest, *, published_manifest: bool) -> None:
        """Remove what this save uploaded after another save won the commit.

        Its data files have names of their own (the save tag), so the winner's
        files stay untouched; its manifest is removed only if it is still this
        save's own (the winner's commit may have landed beside it).
        """
        if published_manifest:
            try:
                current = read_manifest(self.volume, self.manifest_name)
            except CheckpointCorruptError:
                current = None  # not a manifest of this save's
            if current is not None and current.extra.get("save_id") == self.save_id:
                self.volume.delete(self.manifest_name)
        self.volume.delete_many(list(manifest.files))
