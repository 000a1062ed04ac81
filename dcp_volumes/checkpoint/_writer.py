"""VolumeWriter: a DCP ``StorageWriter`` that stages on local disk and uploads in parallel.

Each rank serialises its write items into files in a local staging directory,
hashing every byte as it is written, and hands each file to an upload pool
the moment it is closed, so serialisation of later files overlaps the upload
of earlier ones. The coordinator commits: it checks that every file is on the
volume with the right size, publishes the manifest (sizes and checksums) and
then ``.metadata`` *last*. A checkpoint without ``.metadata`` is incomplete,
never wrong.

The files are standard DCP: stock ``FileSystemReader``/``FsspecReader`` load
them, because ``.metadata`` holds only stock types.

This module is the DCP adapter: DCP's calls, in DCP's order (see the class).
A rank's serialisation and upload are a ``RankSave`` (``_rank_save.py``), the
commit and the replacement of a committed checkpoint a ``Commit``
(``_commit.py``); every name in a checkpoint is ``_layout``'s; where the files
go besides the volume (``local_copy_dir``), and the ``Location``, ``_tiers``'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future as ThreadFuture
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_volumes import _exit_safe
from dcp_volumes._exceptions import (
    CheckpointCorruptError,
    ConfigurationError,
)
from dcp_volumes._sizes import parse_size
from dcp_volumes._staging_disk import DEFAULT_HEADROOM_BYTES, StagingArea
from dcp_volumes._torch.checkpoint import DCP_VERSION, STAGING_FUTURES, StorageInfo
from dcp_volumes._volume import FileInfo, RetryPolicy
from dcp_volumes._world import World, distributed
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._byte_format import estimate_bytes
from dcp_volumes.checkpoint._collector_hold import HoldDuringTransfer, ends_hold_on_error
from dcp_volumes.checkpoint._commit import Commit
from dcp_volumes.checkpoint._compression import ZstdCompression
from dcp_volumes.checkpoint._encryption import Encryption
from dcp_volumes.checkpoint._extensions import check_serialization_format, writer_transforms
from dcp_volumes.checkpoint._manifest import FileRecord
from dcp_volumes.checkpoint._rank_save import RankSave, WrittenItem
from dcp_volumes.checkpoint._state_copy import CpuStager
from dcp_volumes.checkpoint._tiers import AtLocation, Location
from dcp_volumes.checkpoint._writer_options import WriterOptions

logger = logging.getLogger(__name__)


class VolumeWriter(AtLocation, StorageWriter, AsyncStager):
    """DCP storage writer for any volume: object store, fsspec URL or mount path.

    Pass it to ``dcp.save`` or ``dcp.async_save``. With ``async_save`` it also
    acts as the stager: training blocks only for a copy of the state dict into
    CPU buffers that are allocated once and reused by every later save (pinned
    when CUDA is present), then serialisation and upload run in the background.
    With ``cache_staged_state_dict`` wait for one save to finish before the
    next ``async_save`` (the buffers are reused).

    DCP calls, in this order (see ``torch.distributed.checkpoint.storage``):

    0. (all ranks) ``reset(checkpoint_id)`` when ``dcp.save`` gets a checkpoint_id:
       the id (a URL or path) replaces ``path``.
    1. (all ranks) ``set_up_storage_writer(is_coordinator, rank=..., use_collectives=...)``.
    2. (all ranks) ``prepare_local_plan``: the staging directory is checked for
       write access and room for this rank's bytes.
    3. (coordinator) ``prepare_global_plan``: the volume is checked (bucket,
       directory); a committed checkpoint there raises ``CheckpointExistsError``
       unless ``overwrite=True``, which deletes its ``.metadata`` first and then
       its files, before any rank uploads (a manifest without ``.metadata``, of
       a save that crashed, is cleared at commit time); each rank gets its file prefix, which
       carries a new tag per save, so no two saves write the same object.
    4. (all ranks) ``write_data``: serialise to staging files of about
       ``file_size`` bytes (each item through the stream transforms, i.e.
       compressed, when ``compression``/``_extensions`` are given; in
       ``dcp.async_save`` this is the background part), upload each as soon
       as it is closed; the future is
       complete when every file of this rank is on the volume with its size
       verified.
    5. (coordinator) ``finish``: verify all files are listed with their sizes,
       publish the manifest, then ``.metadata`` (the commit marker).

    ``stage`` (``dcp.async_save`` only) runs on every rank before step 0.

    Rank-local saves (``dcp.save(..., use_collectives=False)``): DCP runs steps
    3 and 5 on *every* rank, for that rank's plan alone, with no collective.
    Each rank then checks and clears only its own files, names them with its
    own prefix (``__3_0.distcp``) and commits itself: its manifest
    (``__3.dcp_volumes.manifest.json``), then ``__3.metadata`` last, create-only
    unless ``overwrite``. The checkpoint is complete when every rank's marker
    is there; ``dcp.load`` then reads each rank's own ``__<rank>.metadata``. A
    location holding a checkpoint saved with collectives is refused (ranks
    cannot agree, without collectives, on who deletes it).

    Args:
        path: ``s3://bucket/run/step-100``, ``gs://...``, ``az://...``, ``file://...``,
            a local or mounted directory, or any fsspec URL.
        staging_dir: local (NVMe) directory to serialise into; default: the
            ``DCP_VOLUMES_STAGING`` environment variable, else a temp dir.
        storage_options: client options (endpoint, credentials...); ``None``:
            ``DCP_VOLUMES_STORAGE_OPTIONS``, if set.
        overwrite: replace a committed checkpoint at ``path``; without it a
            save to a committed checkpoint raises ``CheckpointExistsError``.
        keep_staging: keep the staged files after the upload (debugging).
        local_copy_dir: keep a local copy ("local tier"): files are staged
            into ``local_copy_dir/<checkpoint name>`` and kept there, with a
            copy of the manifest; ``VolumeReader(local_copy_dir=...)`` reads
            from it when the files match the manifest.
        upload_concurrency: streams in flight for this rank. On an object
            store each stream carries two files, one PUT each (every request
            costs a round trip): a large one, three quarters of its share of
            the rank's bytes, then a small one, so that little is left to send
            once serialisation ends (files of at least 2 MiB, at most
            ``file_size`` and ``part_size``); a tensor larger than that is a
            file of its own, sent in parallel parts. fsspec clients, which hold
            each upload in memory, get files within a quarter of the rank's
            bytes.
        part_size: multipart part size (bytes or e.g. ``"32MiB"``, >= 5 MiB).
        file_size: largest size of one data file (bytes or e.g. ``"256MiB"``).
        prefix_spread: ``N >= 2`` spreads the files over ``N`` hashed
            sub-prefixes (``3f/__0_9c1e07aa_1.distcp``) for stores that throttle per
            prefix; stock readers still find them via ``.metadata``.
        cache_staged_state_dict: reuse the CPU staging buffers across saves.
        staging_headroom: free space to leave on the staging disk beyond what
            a save needs (bytes or e.g. ``"1GiB"``).
        retry: retry policy for transient volume errors.
        compression: ``"zstd"`` or ``ZstdCompression(level=..., threads=...)``
            compresses every item as stock DCP's ``ZStandard`` extension does
            (stock readers load it); the compression runs while serialising,
            in the background part of ``dcp.async_save``.
        async_staging: with ``dcp.async_save``, copy the state in a background
            thread: ``async_save`` returns at once with an ``AsyncSaveResponse``
            whose ``staging_completion`` says when training may change the
            state again (torch >= 2.9).
        _extensions: stock DCP's stream transforms (e.g. torch's ``ZStandard()``
            or any ``StreamTransformExtension``), as ``FileSystemWriter`` takes
            them; the item descriptors in ``.metadata`` are stock's. At most one.
        serialization_format: stock's ``SerializationFormat.TORCH_SAVE`` (the
            only format stock readers load item by item); ``SAFETENSORS`` is
            refused with a pointer to torch's ``HuggingFaceStorageWriter``.
        single_file_per_rank: stock's keyword: ``False`` writes every item to a
            file of its own (as ``FileSystemWriter`` does); ``True`` (default)
            cuts a rank's files at ``file_size``.
        sync_files: stock's keyword: ``False`` skips the fsync of files on a
            mount volume or in the local tier (faster, not crash-safe there).
        thread_count: stock's keyword, accepted so that code written for
            ``FileSystemWriter`` runs unchanged; it has no effect (a warning,
            once per process, says so): this writer serialises in one thread
            and uploads ``upload_concurrency`` streams at once. It is not
            taken as ``upload_concurrency``: stock counts threads writing
            whole files (1 by default), which as upload streams would make a
            copied call's saves serial.
        per_thread_copy_ahead: stock's keyword for its GPU copy-ahead,
            accepted likewise without effect (``stage`` makes the host copy).
        encryption: ``Encryption(key=..., key_id=...)``: every item is encrypted
            (AES-256-GCM in frames, after compression if ``compression`` is
            given) before it reaches the staging disk; ``.metadata`` records
            the key id. Readers need the key (``VolumeReader(encryption=...)``).

    Unlike stock writers, ``overwrite`` defaults to ``False`` (stock announces
    the same change): a committed checkpoint is never replaced by accident.
    """

    options: WriterOptions

    # Staging is a blocking copy: nothing to synchronise after async_save returns.
    _synchronize_after_execute: bool = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        keep_staging: bool = False,
        local_copy_dir: str | os.PathLike[str] | None = None,
        upload_concurrency: int = 8,
        part_size: int | str = "32MiB",
        file_size: int | str = "256MiB",
        prefix_spread: int = 0,
        cache_staged_state_dict: bool = True,
        staging_headroom: int | str = DEFAULT_HEADROOM_BYTES,
        retry: RetryPolicy | None = None,
        compression: str | ZstdCompression | None = None,
        async_staging: bool = False,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int | None = None,
        per_thread_copy_ahead: int | None = None,
        encryption: Encryption | None = None,
    ) -> None:
        super().__init__()
        check_serialization_format(serialization_format)
        if async_staging and not STAGING_FUTURES:  # pragma: no cover - torch < 2.9
            raise ConfigurationError(
                "async_staging=True needs torch >= 2.9, whose dcp.async_save takes a staging "
                "future and returns AsyncSaveResponse. Upgrade torch, or drop async_staging "
                "(staging then blocks for the host copy only)."
            )
        self._transforms = writer_transforms(_extensions, compression, encryption)
        self.options = WriterOptions(
            staging_dir=os.fspath(staging_dir) if staging_dir is not None else None,
            overwrite=overwrite,
            keep_staging=keep_staging,
            local_copy_dir=os.fspath(local_copy_dir) if local_copy_dir is not None else None,
            upload_concurrency=upload_concurrency,
            part_size=int(parse_size(part_size, what="part_size") or 0),
            # One item per file (stock's single_file_per_rank=False): any item overflows 1 byte.
            file_size=(
                int(parse_size(file_size, what="file_size") or 0) if single_file_per_rank else 1
            ),
            prefix_spread=prefix_spread,
            cache_staged_state_dict=cache_staged_state_dict,
            staging_headroom=int(parse_size(staging_headroom, what="staging_headroom") or 0),
            async_staging=bool(async_staging),
            sync_files=bool(sync_files),
        )
        _warn_ignored(thread_count=thread_count, per_thread_copy_ahead=per_thread_copy_ahead)
        self._location = Location(
            path,
            storage_options=storage_options,
            retry=retry,
            local_copy_dir=self.options.local_copy_dir,
        )
        if self.options.local_copy_dir is not None:
            os.makedirs(self.options.local_copy_dir, exist_ok=True)
            staging_root: str | None = self.options.local_copy_dir
        else:
            staging_root = self.options.staging_dir
        self._staging_disk = StagingArea(staging_root, headroom_bytes=self.options.staging_headroom)
        # Remove a temp staging dir we created when this writer goes away.
        self._finalizer: weakref.finalize[[], VolumeWriter] | None = weakref.finalize(
            self, self._staging_disk.close
        )
        self._save_id = uuid.uuid4().hex
        self._abandoned = threading.Event()  # abandon(): the save in flight must not commit
        self._is_coordinator = False
        self._rank = 0
        self._rank_local = False
        self._world_size: int | None = None
        # The listing of the checkpoint's top level, started at set-up (see there).
        self._root_listing: ThreadFuture[list[FileInfo]] | None = None
        self._state_copy = CpuStager(
            cache=self.options.cache_staged_state_dict, background=self.options.async_staging
        )
        # Held from staging (or set-up) to this rank's last hook of the save.
        self._collector = HoldDuringTransfer()
        self._planner: SavePlanner | None = None  # of the save in flight, for the hold's end

    # -- identity ---------------------------------------------------------------------------


    @property
    def staging_dir(self) -> str:
        """The local staging directory (the local tier root when ``local_copy_dir`` is set)."""
        return self._staging_disk.path

    def __getstate__(self) -> dict[str, Any]:
        # The PROCESS async checkpointer pickles the writer on every save: the
        # staging buffers (the stager pickles empty) and the finalizer stay here.
        state = self.__dict__.copy()
        state["_finalizer"] = None
        state["_root_listing"] = None
        state["_planner"] = None
        state["_abandoned"] = self._abandoned.is_set()  # an Event does not pickle
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        abandoned = threading.Event()
        if state.pop("_abandoned"):
            abandoned.set()
        self.__dict__.update(state, _abandoned=abandoned)

    def storage_meta(self) -> StorageMeta:
        """``StorageMeta`` stored in ``.metadata``: the checkpoint URL and this save's id."""
        return StorageMeta(checkpoint_id=self.volume.display_url, save_id=self._save_id)

    # -- AsyncStager ------------------------------------------------------------------------

    def stage(
        self, state_dict: dict[str, Any]
    ) -> dict[str, Any] | ThreadFuture[dict[str, Any]]:
        """Copy ``state_dict`` to CPU buffers that later training steps cannot change.

        With ``cache_staged_state_dict`` the buffers are allocated on the first
        save (pinned when CUDA is present) and refreshed in place afterwards;
        they are reallocated only when the structure, a shape or a dtype changes.
        With ``async_staging`` the copy runs in a background thread and a
        future of the staged copy is returned at once.
        """
        self._collector.take()
        return self._state_copy.stage(state_dict)

    def synchronize_staging(self) -> None:
        """No-op: ``stage`` returns only once the copy is complete."""

    def close(self) -> None:
        """Give the staging buffers to the next save and remove a temporary staging directory.

        The buffers of the last two state-dict shapes are kept for later
        writers in this process; ``CheckpointManager.close`` frees them.
        """
        self._state_copy.close()
        if self._finalizer is not None:
            self._finalizer()

    def abandon(self) -> None:
        """Give up the save in flight in this process: it never commits (no ``.metadata``).

        For a caller that stops waiting (a preemption's grace ran out); the save
        fails at its commit, so nothing partial is ever taken for complete.
        """
        self._abandoned.set()

    # -- StorageWriter ----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; ``checkpoint_id`` (a URL or path) replaces the location."""
        self._location.move_to(checkpoint_id)
        self._end_hold()  # of a save that ended where no hook of ours ran
        self._abandoned.clear()
        self._root_listing = None  # of the old location, if a save stopped before planning
        self._save_id = uuid.uuid4().hex

    @ends_hold_on_error
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record this rank's role (all ranks)."""
        self._collector.take()
        self._is_coordinator = is_coordinator
        world = World.current() if distributed() else None
        rank = kwargs.get("rank")
        self._rank = int(rank if rank is not None else world.rank if world else 0)
        self._rank_local = not kwargs.get("use_collectives", True)
        # Recorded in a rank-local manifest so that a rank that died before writing
        # anything still makes the checkpoint incomplete (see _discovery).
        self._world_size = world.size if world else None
        if (is_coordinator or self._rank_local) and not self.volume.capabilities.local_files:
            self._start_root_listing()

    def _start_root_listing(self) -> None:
        """List the store's checkpoint prefix while DCP plans: ``prepare_global_plan``
        needs it, and asked there it was a round trip on the save's path. (A local
        directory is only made there, once staging is known to hold the save.)"""
        self._root_listing = _exit_safe.start(
            "dcpv-root", functools.partial(self.volume.check_root, create=True)
        )

    def _root_files(self) -> set[str]:
        """What is directly in the checkpoint (the listing started at set-up, if any)."""
        started, self._root_listing = self._root_listing, None
        listing = started.result() if started is not None else self.volume.check_root(create=True)
        return {f.path for f in listing}

    @ends_hold_on_error
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Check the staging directory can take this rank's bytes (all ranks)."""
        self._staging_disk.check()
        self._staging_disk.ensure_space(estimate_bytes(plan.items))
        return plan

    @ends_hold_on_error
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Check the volume, refuse or clear an existing checkpoint, name files (coordinator).

        In a rank-local save every rank calls it with its own plan alone, and
        checks and clears only its own files.
        """
        # One listing of the checkpoint's top level answers all that a save asks before
        # it starts (a missing bucket and refused credentials are errors of their own):
        # one round trip where a HEAD per question cost three.
        self._commit().prepare(self._root_files())
        # A new id per save, also for a writer reused without reset(): its tag
        # makes this save's file names its own (in a rank-local save each rank's).
        self._save_id = uuid.uuid4().hex
        tag = _layout.save_tag(self._save_id)
        ranks = [self._rank] * len(plans) if self._rank_local else range(len(plans))
        # Each plan's storage_data: the file-name prefix of its rank's files.
        return [
            dataclasses.replace(plan, storage_data=_layout.rank_prefix(rank, tag))
            for rank, plan in zip(ranks, plans, strict=True)
        ]

    @ends_hold_on_error
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Serialise this rank's items to staging files and upload them (all ranks)."""
        self._planner = planner
        prefix = plan.storage_data
        if not isinstance(prefix, str):  # a plan the coordinator did not name
            prefix = _layout.rank_prefix(self._rank, _layout.save_tag(self._save_id))
        save = RankSave(
            self.volume,
            self.options,
            rank=self._rank,
            prefix=prefix,
            items=plan.items,
            staging=self._staging_disk,
            keepers=self._location.keepers(sync=self.options.sync_files),
            transforms=self._transforms,
        )
        try:
            results = save.run(planner)
        finally:
            self._state_copy.release()  # serialised: the buffers may serve the next save
            if not self._commits_here():
                self._end_hold(after=planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit (coordinator): check all files, publish the manifest, then ``.metadata``.

        In a rank-local save every rank commits its own files: its manifest, then
        ``__<rank>.metadata``.
        """
        try:
            self._finish(metadata, results)
        finally:
            self._end_hold(after=self._planner)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md: dict[Any, StorageInfo] = {}
        files: dict[str, FileRecord] = {}
        for rank_results in results:
            for wr in rank_results:
                data = wr.storage_data
                if not isinstance(data, WrittenItem):
                    raise CheckpointCorruptError(
                        f"A write result for {wr.index} came from another storage writer "
                        f"({type(data).__name__}); every rank must save with VolumeWriter."
                    )
                storage_md[wr.index] = data.info
                files[data.info.relative_path] = data.record
        metadata.storage_data = storage_md
        if hasattr(metadata, "storage_meta"):
            metadata.storage_meta = self.storage_meta()
        if DCP_VERSION is not None and hasattr(metadata, "version"):
            metadata.version = DCP_VERSION
        manifest = self._commit().publish(files, pickle.dumps(metadata), ranks=len(results))
        logger.info(
            "committed checkpoint %s%s: %d files, %.1f MiB",
            self.volume.display_url,
            f" (rank {self._rank}, rank-local)" if self._rank_local else "",
            len(files),
            manifest.total_bytes / 2**20,
        )

    # -- internals --------------------------------------------------------------------------

    def _commits_here(self) -> bool:
        """Whether DCP calls ``finish`` on this rank (the coordinator; every rank if rank-local)."""
        return self._is_coordinator or self._rank_local

    def _end_hold(self, after: object = None) -> None:
        """End this save's hold on the collector (once ``after``, its planner, is dropped)."""
        self._planner = None
        self._collector.end(after)

    def _commit(self) -> Commit:
        """The commit of this save: the coordinator's, or in a rank-local save this rank's."""
        return Commit(
            self.volume,
            self._save_id,
            overwrite=self.options.overwrite,
            rank=self._rank if self._rank_local else None,
            world_size=self._world_size,
            keepers=self._location.keepers(sync=self.options.sync_files),
            abandoned=self._abandoned,
        )


# FileSystemWriter's keywords that this writer accepts without effect; each is named
# in a warning once per process (a writer is often made per save).
_IGNORED_KEYWORDS_WARNED: set[str] = set()


def _warn_ignored(**given: int | None) -> None:
    """Warn, once per process and keyword, that stock keywords given here have no effect."""
    named = sorted(k for k, v in given.items() if v is not None)
    fresh = [k for k in named if k not in _IGNORED_KEYWORDS_WARNED]
    if not fresh:
        return
    _IGNORED_KEYWORDS_WARNED.update(fresh)
    logger.warning(
        "VolumeWriter ignores %s (FileSystemWriter's keywords, accepted so that its calls run "
        "unchanged): it serialises in one thread and uploads upload_concurrency streams at "
        "once. Fix: drop them, and set upload_concurrency= (default 8) to change how many "
        "streams go up at once.",
        " and ".join(f"{k}={given[k]}" for k in fresh),
    )
