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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_volumes import _exit_safe
from dcp_volumes._exceptions import (
    CheckpointCorruptError,
    CheckpointExistsError,
    ConfigurationError,
    VolumeExistsError,
)
from dcp_volumes._sizes import parse_size
from dcp_volumes._staging import DEFAULT_HEADROOM_BYTES, StagingArea
from dcp_volumes._torch import DCP_VERSION, STAGING_FUTURES, StorageInfo
from dcp_volumes._volume import LAG_TOTAL_S, FileInfo, RetryPolicy, Volume, until_shown
from dcp_volumes._world import World, distributed
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._compression import ZstdCompression
from dcp_volumes.checkpoint._extensions import check_serialization_format, writer_transforms
from dcp_volumes.checkpoint._manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    FileRecord,
    Manifest,
    check_listing_settled,
    is_commit_marker,
    manifest_rank,
    rank_manifest_name,
    rank_metadata_name,
    read_manifest,
)
from dcp_volumes.checkpoint._rank_upload import (
    MIN_PART_SIZE,
    upload_file,
    upload_shape,
)
from dcp_volumes.checkpoint._shards import WrittenItem, estimate_bytes, write_and_upload
from dcp_volumes.checkpoint._stager import CpuStager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriterOptions:
    """Validated options of a ``VolumeWriter`` (sizes in bytes).

    Attributes:
        staging_dir: local directory for staged files; ``None``: ``DCP_VOLUMES_STAGING``
            or a private temp dir.
        overwrite: replace a committed checkpoint at the same location.
        keep_staging: keep the staged files after the upload.
        local_copy_dir: root of the local tier; the files of a checkpoint are
            staged into and kept in ``local_copy_dir/<checkpoint name>``.
        upload_concurrency: streams in flight for this rank: a file each (one
            PUT), or the parts of a file larger than ``part_size``.
        part_size: multipart part size.
        file_size: target size of one data file; a rank's items are split
            into files of about this size so upload overlaps serialisation.
        prefix_spread: ``0`` off; ``N > 1`` spreads files over ``N`` hashed
            sub-prefixes of the checkpoint directory.
        cache_staged_state_dict: reuse the CPU staging buffers of
            ``dcp.async_save`` across saves.
        staging_headroom: free space to leave on the staging disk.
        async_staging: ``stage`` copies in a background thread and returns a future
            (``dcp.async_save`` then returns an ``AsyncSaveResponse``).
        sync_files: fsync staged files that become the checkpoint's own (mount
            volumes, the local tier); stock's ``sync_files``.
    """

    staging_dir: str | None = None
    overwrite: bool = False
    keep_staging: bool = False
    local_copy_dir: str | None = None
    upload_concurrency: int = 8
    part_size: int = 32 * 2**20
    file_size: int = 256 * 2**20
    prefix_spread: int = 0
    cache_staged_state_dict: bool = True
    staging_headroom: int = DEFAULT_HEADROOM_BYTES
    async_staging: bool = False
    sync_files: bool = True

    def __post_init__(self) -> None:
        if self.upload_concurrency < 1:
            raise ConfigurationError(
                f"upload_concurrency={self.upload_concurrency} must be >= 1."
            )
        if self.part_size < MIN_PART_SIZE:
            raise ConfigurationError(
                f"part_size={self.part_size} bytes is below 5 MiB, the smallest multipart "
                "part object stores accept. Use e.g. part_size='32MiB'."
            )
        if self.file_size < 1:
            raise ConfigurationError(f"file_size={self.file_size} must be >= 1 byte.")
        if self.prefix_spread < 0 or self.prefix_spread == 1:
            raise ConfigurationError(
                f"prefix_spread={self.prefix_spread}: use 0 (off) or a number of prefixes >= 2."
            )
        if self.staging_headroom < 0:
            raise ConfigurationError("staging_headroom must be >= 0 bytes.")


@dataclass(frozen=True)
class _RankFiles:
    """``SavePlan.storage_data`` set by the coordinator: a rank's file-name prefix."""

    prefix: str


class VolumeWriter(_layout.CheckpointLocation, StorageWriter, AsyncStager):
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
        storage_options: passed to fsspec (endpoint, credentials...).
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
            ``FileSystemWriter`` runs unchanged; it has no effect: this writer
            serialises in one thread and uploads ``upload_concurrency``
            streams at once.
        per_thread_copy_ahead: stock's keyword for its GPU copy-ahead,
            accepted likewise without effect (``stage`` makes the host copy).

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
    ) -> None:
        super().__init__()
        check_serialization_format(serialization_format)
        if async_staging and not STAGING_FUTURES:  # pragma: no cover - torch < 2.9
            raise ConfigurationError(
                "async_staging=True needs torch >= 2.9, whose dcp.async_save takes a staging "
                "future and returns AsyncSaveResponse. Upgrade torch, or drop async_staging "
                "(staging then blocks for the host copy only)."
            )
        self._transforms = writer_transforms(_extensions, compression)
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
        if thread_count is not None or per_thread_copy_ahead is not None:
            logger.debug(
                "VolumeWriter ignores thread_count/per_thread_copy_ahead (FileSystemWriter's); "
                "it uploads upload_concurrency=%d streams at once",
                upload_concurrency,
            )
        self._storage_options = dict(storage_options or {})
        self._retry = retry
        self._volume = Volume(path, storage_options=self._storage_options, retry=retry)
        if self.options.local_copy_dir is not None:
            os.makedirs(self.options.local_copy_dir, exist_ok=True)
            staging_root: str | None = self.options.local_copy_dir
        else:
            staging_root = self.options.staging_dir
        self._staging = StagingArea(staging_root, headroom_bytes=self.options.staging_headroom)
        # Remove a temp staging dir we created when this writer goes away.
        self._finalizer: weakref.finalize | None = weakref.finalize(self, self._staging.close)
        self._save_id = uuid.uuid4().hex
        self._is_coordinator = False
        self._rank = 0
        self._rank_local = False
        self._world_size: int | None = None
        # The listing of the checkpoint's top level, started at set-up (see there).
        self._root_listing: ThreadFuture[list[FileInfo]] | None = None
        self._stager = CpuStager(
            cache=self.options.cache_staged_state_dict, background=self.options.async_staging
        )

    # -- identity ---------------------------------------------------------------------------

    @property
    def staging_dir(self) -> str:
        """The local staging directory (the local tier root when ``local_copy_dir`` is set)."""
        return self._staging.path

    def __getstate__(self) -> dict[str, Any]:
        # The PROCESS async checkpointer pickles the writer on every save: the
        # staging buffers (the stager pickles empty) and the finalizer stay here.
        state = self.__dict__.copy()
        state["_finalizer"] = None
        state["_root_listing"] = None
        return state

    def storage_meta(self) -> StorageMeta:
        """``StorageMeta`` stored in ``.metadata``: the checkpoint URL and this save's id."""
        return StorageMeta(checkpoint_id=self._volume.display_url, save_id=self._save_id)

    # -- AsyncStager ------------------------------------------------------------------------

    def stage(
        self, state_dict: STATE_DICT_TYPE
    ) -> STATE_DICT_TYPE | ThreadFuture[STATE_DICT_TYPE]:
        """Copy ``state_dict`` to CPU buffers that later training steps cannot change.

        With ``cache_staged_state_dict`` the buffers are allocated on the first
        save (pinned when CUDA is present) and refreshed in place afterwards;
        they are reallocated only when the structure, a shape or a dtype changes.
        With ``async_staging`` the copy runs in a background thread and a
        future of the staged copy is returned at once.
        """
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        """No-op: ``stage`` returns only once the copy is complete."""

    def close(self) -> None:
        """Give the staging buffers to the next save and remove a temporary staging directory.

        The buffers of the last two state-dict shapes are kept for later
        writers in this process; ``CheckpointManager.close`` frees them.
        """
        self._stager.close()
        if self._finalizer is not None:
            self._finalizer()

    # -- StorageWriter ----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; ``checkpoint_id`` (a URL or path) replaces the location."""
        self._relocate(checkpoint_id)
        self._root_listing = None  # of the old location, if a save stopped before planning
        self._save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record this rank's role (all ranks)."""
        self._is_coordinator = is_coordinator
        world = World.current() if distributed() else None
        rank = kwargs.get("rank")
        self._rank = int(rank if rank is not None else world.rank if world else 0)
        self._rank_local = not kwargs.get("use_collectives", True)
        # Recorded in a rank-local manifest so that a rank that died before writing
        # anything still makes the checkpoint incomplete (see _discovery).
        self._world_size = world.size if world else None
        if (is_coordinator or self._rank_local) and not self._volume.capabilities.local_files:
            self._start_root_listing()

    def _start_root_listing(self) -> None:
        """List the store's checkpoint prefix while DCP plans: ``prepare_global_plan``
        needs it, and asked there it was a round trip on the save's path. (A local
        directory is only made there, once staging is known to hold the save.)"""
        self._root_listing = _exit_safe.start(
            "dcpv-root", functools.partial(self._volume.check_root, create=True)
        )

    def _root_files(self) -> set[str]:
        """What is directly in the checkpoint (the listing started at set-up, if any)."""
        started, self._root_listing = self._root_listing, None
        listing = started.result() if started is not None else self._volume.check_root(create=True)
        return {f.path for f in listing}

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Check the staging directory can take this rank's bytes (all ranks)."""
        self._staging.check()
        self._staging.ensure_space(estimate_bytes(plan.items))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Check the volume, refuse or clear an existing checkpoint, name files (coordinator).

        In a rank-local save every rank calls it with its own plan alone.
        """
        if self._rank_local:
            return self._prepare_rank_local(plans)
        # One listing of the checkpoint's top level answers all that a save asks before
        # it starts (a missing bucket and refused credentials are errors of their own):
        # one round trip where a HEAD per question cost three. A rank-local checkpoint
        # here (rank 0's marker is enough, as stock DCP checks) counts as committed
        # too: its markers would otherwise outlive its files.
        top = self._root_files()
        committed = METADATA_NAME in top or rank_metadata_name(0) in top
        if committed:
            if not self.options.overwrite:
                raise CheckpointExistsError(
                    f"A committed checkpoint already exists at {self._volume.display_url}. "
                    "Fix: save to a new location, delete it, or pass overwrite=True to "
                    "VolumeWriter to replace it."
                )
            self._remove_committed()
        # A new id per save, also for a writer reused without reset(): its tag
        # makes this save's file names its own.
        self._save_id = uuid.uuid4().hex
        tag = _layout.save_tag(self._save_id)
        return [
            dataclasses.replace(plan, storage_data=_RankFiles(_layout.rank_prefix(i, tag)))
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Serialise this rank's items to staging files and upload them (all ranks)."""
        storage = plan.storage_data
        if isinstance(storage, _RankFiles):
            prefix = storage.prefix
        else:
            prefix = _layout.rank_prefix(self._rank, _layout.save_tag(self._save_id))
        keep = self.options.keep_staging or self.options.local_copy_dir is not None
        local_copy = self.local_copy_path
        if local_copy is not None:
            # The ranks of a node share this directory. An earlier save of this
            # checkpoint name left this rank's files here (under other names now):
            # this save's copy replaces them; other ranks' files are theirs.
            _remove_local_files(local_copy, _layout.rank_name_start(self._rank))
            save_dir = local_copy
            os.makedirs(save_dir, exist_ok=True)
        else:
            name = _layout.checkpoint_name(self._volume.root)
            save_dir = self._staging.new_dir(f"{name}-r{self._rank}")
        shape = upload_shape(
            self._volume,
            rank_bytes=estimate_bytes(plan.items),
            concurrency=self.options.upload_concurrency,
            file_size=self.options.file_size,
            part_size=self.options.part_size,
        )
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        started = time.monotonic()
        try:
            results, nbytes, nfiles = write_and_upload(
                items,
                planner,
                prefix=prefix,
                save_dir=save_dir,
                prefix_spread=self.options.prefix_spread,
                file_size=shape.size_of,
                # Mount-path volumes get the file by rename: it must be on disk first.
                fsync=self.options.sync_files
                and (self._volume.capabilities.local_files or local_copy is not None),
                files_in_flight=shape.files_in_flight,
                transforms=self._transforms,
                upload=lambda local, rel, size: upload_file(
                    self._volume,
                    local,
                    rel,
                    size,
                    keep=keep,
                    shape=shape,
                    part_size=self.options.part_size,
                ),
            )
        except BaseException:
            # A failed save's files are never trusted (the local tier's included, as
            # it has no manifest); removing them gives the disk space back.
            if self.options.keep_staging:
                pass
            elif local_copy is not None:
                _remove_local_files(save_dir, prefix)
            else:
                StagingArea.remove(save_dir)
            raise
        finally:
            self._stager.release()  # serialised: the buffers may serve the next save
        if not keep:
            StagingArea.remove(save_dir)
        elapsed = max(time.monotonic() - started, 1e-9)
        logger.debug(
            "rank %d wrote %d files (%.1f MiB) to %s in %.2fs (%.0f MiB/s)",
            self._rank,
            nfiles,
            nbytes / 2**20,
            self._volume.display_url,
            elapsed,
            nbytes / 2**20 / elapsed,
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit (coordinator): check all files, publish the manifest, then ``.metadata``.

        In a rank-local save every rank commits its own files: its manifest, then
        ``__<rank>.metadata``.
        """
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
        extra: dict[str, Any] = {"writer": "dcp_volumes", "save_id": self._save_id}
        if self._rank_local:
            extra.update(rank_local=True, rank=self._rank, world_size=self._world_size)
            manifest_name = rank_manifest_name(self._rank)
            marker_name = rank_metadata_name(self._rank)
        else:
            extra["ranks"] = len(results)
            manifest_name, marker_name = MANIFEST_NAME, METADATA_NAME
        manifest = Manifest(files=files, extra=extra)
        # The one check that every rank's upload landed whole is a listing of the
        # checkpoint (one per rank as well would cost every save a round trip). It
        # runs while the manifest goes up, a round trip less per save: a manifest
        # means nothing until .metadata is beside it, and a failed check takes it back.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpv-commit") as pool:
            checked = _exit_safe.submit(pool, check_listing_settled, self._volume, manifest)
            published_manifest = committing = False
            try:
                self._publish_manifest(manifest, manifest_name, marker_name)
                published_manifest = True
                problems, _ = checked.result()
                if problems:
                    raise CheckpointCorruptError(
                        f"Not committing {self._volume.display_url}: the ranks' uploads did "
                        f"not land whole ({'; '.join(problems[:5])}), still so after listing "
                        f"again for {LAG_TOTAL_S:.0f} s. An upload was cut short, another "
                        "writer uses this location, or the store's listing lags its writes "
                        "longer than that; save again (on a store known to lag, to a fresh "
                        "location)."
                    )
                committing = True
                self._volume.publish(
                    marker_name, pickle.dumps(metadata), exclusive=not self.options.overwrite
                )
            except VolumeExistsError as exc:
                checked.exception()  # its outcome no longer matters; let it end first
                self._withdraw(manifest, manifest_name, published_manifest)
                raise CheckpointExistsError(
                    f"Another save is committing or committed {self._volume.display_url} "
                    "while this one ran; this save was not committed and its files were "
                    "removed. Fix: give each save its own location or pass overwrite=True."
                ) from exc
            except BaseException:
                checked.exception()
                # Not committed, so nothing may point at its files; once .metadata was
                # sent the commit may have landed, and its manifest stays.
                if published_manifest and not committing:
                    with contextlib.suppress(Exception):
                        self._volume.delete(manifest_name)
                raise
        local_copy = self.local_copy_path
        if local_copy is not None:
            Volume(local_copy).publish(manifest_name, manifest.to_json())
        logger.info(
            "committed checkpoint %s%s: %d files, %.1f MiB",
            self._volume.display_url,
            f" (rank {self._rank}, rank-local)" if self._rank_local else "",
            len(files),
            manifest.total_bytes / 2**20,
        )

    # -- internals --------------------------------------------------------------------------

    def _publish_manifest(self, manifest: Manifest, manifest_name: str, marker_name: str) -> None:
        """Publish the manifest, create-only unless overwrite: of two saves committing one
        location at once exactly one lands, and the manifest beside ``.metadata`` is
        always the committed save's own. Raises ``VolumeExistsError`` if another save's
        is there (one of a save that crashed before its commit is cleared first)."""
        exclusive = not self.options.overwrite
        try:
            self._volume.publish(manifest_name, manifest.to_json(), exclusive=exclusive)
        except VolumeExistsError:
            if not self._clear_stale_manifest(manifest_name, marker_name):
                raise
            self._volume.publish(manifest_name, manifest.to_json(), exclusive=exclusive)

    def _clear_stale_manifest(self, manifest_name: str, marker_name: str) -> bool:
        """Remove a manifest left by a save that crashed before its commit; ``False``
        when another save committed here instead.

        A save in its commit window publishes its marker (``.metadata``, or a rank's
        ``__<rank>.metadata``) milliseconds after its manifest: one still without
        it after ``LAG_TOTAL_S`` belongs to a save that died (nothing loads it:
        without the marker it is not a checkpoint). Deleting it only now, not when
        this save starts, never takes the manifest of a save that is committing.
        """
        if until_shown(lambda: self._volume.exists(marker_name), bool,
                       what=f"{marker_name} beside {manifest_name}"):
            return False
        logger.info(
            "removing %s of a save that crashed before committing %s",
            manifest_name,
            self._volume.display_url,
        )
        self._volume.delete(manifest_name)
        return True

    def _withdraw(self, manifest: Manifest, manifest_name: str, published_manifest: bool) -> None:
        """Remove what this save uploaded after another save won the commit.

        Its data files have names of their own (the save tag), so the winner's
        files stay untouched; its manifest is removed only if it is still this
        save's own (the winner's commit may have landed beside it).
        """
        if published_manifest:
            try:
                current = read_manifest(self._volume, manifest_name)
            except CheckpointCorruptError:
                current = None  # not a manifest of this save's
            if current is not None and current.extra.get("save_id") == self._save_id:
                self._volume.delete(manifest_name)
        self._volume.delete_many(list(manifest.files))

    def _remove_committed(self) -> None:
        """Delete the committed checkpoint here: ``.metadata`` first, so it turns incomplete."""
        old_files: list[str] = []
        try:
            old = read_manifest(self._volume)
        except CheckpointCorruptError:
            old = None
        self._volume.delete(METADATA_NAME)
        listing = [f.path for f in self._volume.list()]
        # A rank-local checkpoint's markers go first too, then its manifests.
        self._volume.delete_many([p for p in listing if is_commit_marker(p)])
        logger.info("overwrite: removed the commit markers of %s", self._volume.display_url)
        if old is not None:
            old_files = list(old.files)
        else:
            old_files = [
                p for p in listing if p.endswith(_layout.DATA_SUFFIX) or is_commit_marker(p)
            ]
        self._volume.delete(MANIFEST_NAME)
        self._volume.delete_many([p for p in listing if manifest_rank(p) is not None])
        self._volume.delete_many(old_files)

    def _prepare_rank_local(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Rank-local save: check and clear this rank's own files only; name them."""
        where = self._volume.display_url
        marker = rank_metadata_name(self._rank)
        top = self._root_files()  # one round trip
        committed = marker in top
        if METADATA_NAME in top:
            raise CheckpointExistsError(
                f"{where} holds a checkpoint saved with collectives (.metadata); a rank-local "
                "save (use_collectives=False) cannot replace it: without collectives the ranks "
                "cannot agree on who deletes it. Fix: save to a new location, or delete it "
                "first (dcp-volumes gc, or remove the directory)."
            )
        if committed:
            if not self.options.overwrite:
                raise CheckpointExistsError(
                    f"Rank {self._rank} already committed a rank-local checkpoint at {where} "
                    f"({marker}). Fix: save to a new location, delete it, or pass "
                    "overwrite=True to VolumeWriter to replace it."
                )
            self._remove_rank_files()
        # Each rank's save has its own id and tag: its file names are its own.
        self._save_id = uuid.uuid4().hex
        prefix = _layout.rank_prefix(self._rank, _layout.save_tag(self._save_id))
        return [dataclasses.replace(plan, storage_data=_RankFiles(prefix)) for plan in plans]

    def _remove_rank_files(self) -> None:
        """Overwrite in a rank-local save: this rank's marker first, then its manifest, files."""
        try:
            old = read_manifest(self._volume, rank_manifest_name(self._rank))
        except CheckpointCorruptError:
            old = None
        self._volume.delete(rank_metadata_name(self._rank))
        if old is not None:
            files = list(old.files)
        else:  # a stock rank-local save: its files carry the rank's prefix
            prefix = f"__{self._rank}_"
            files = [
                f.path
                for f in self._volume.list()
                if f.path.rsplit("/", 1)[-1].startswith(prefix)
                and f.path.endswith(_layout.DATA_SUFFIX)
            ]
        self._volume.delete(rank_manifest_name(self._rank))
        self._volume.delete_many(files)
        logger.info("overwrite: removed rank %d's checkpoint files at %s", self._rank,
                    self._volume.display_url)


def _remove_local_files(local_copy: str, name_prefix: str) -> None:
    """Remove the data files starting with ``name_prefix`` from a local copy directory."""
    for dirpath, _, names in os.walk(local_copy):
        for name in names:
            if name.startswith(name_prefix) and name.endswith(_layout.DATA_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(dirpath, name))
