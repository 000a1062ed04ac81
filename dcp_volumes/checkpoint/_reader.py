"""VolumeReader: a DCP ``StorageReader`` that fetches coalesced byte ranges in parallel.

Reads any standard DCP checkpoint (ours or a stock writer's). For each data
file a rank needs, neighbouring byte ranges are merged, fetched as parallel
ranged GETs, and the items are deserialised from memory; files on a local
volume are read in place instead, like stock DCP's reader does, with no extra
copy. Where a manifest exists, file sizes are checked against it and every
file read whole is verified against its checksum (``verify=True`` reads every
file whole). Before the volume, the reader asks its sources of copies, in
order (``_tiers.FileSource``: with ``local_copy_dir``, this node's local copy;
the manager's list adds other nodes'): a copy is read whole and checked, and
read from the volume after all when it fails.

This module plans the reads and schedules, verifies and finishes them; the
reads of one file, up to handing its items to DCP's planner, are a ``FileRead``
(``_file_reads.py``).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_volumes import _exit_safe
from dcp_volumes._exceptions import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    VolumeNotFoundError,
)
from dcp_volumes._sizes import parse_size
from dcp_volumes._volume import LAG_TOTAL_S, FileInfo, RetryPolicy, redact_url
from dcp_volumes._world import available_cpus
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._collector_hold import HoldDuringTransfer, ends_hold_on_error
from dcp_volumes.checkpoint._discovery import (
    NO_STEP,
    CheckpointInfo,
    holds_save,
    newest_complete,
    scan,
)
from dcp_volumes.checkpoint._encryption import Encryption
from dcp_volumes.checkpoint._extensions import ReaderTransforms
from dcp_volumes.checkpoint._file_reads import Decoders, FileRead
from dcp_volumes.checkpoint._layout import (
    MANIFEST_NAME,
    METADATA_NAME,
    marker_rank,
    rank_manifest_name,
    rank_metadata_name,
)
from dcp_volumes.checkpoint._manifest import (
    FileRecord,
    Manifest,
    check_listing,
    check_listing_settled,
    read_manifest,
)
from dcp_volumes.checkpoint._metadata_pickle import loads_metadata
from dcp_volumes.checkpoint._reader_options import DEFAULT_COALESCE_GAP, ReaderOptions
from dcp_volumes.checkpoint._supply import CopyMissing
from dcp_volumes.checkpoint._tiers import SOURCE_NAMES, AtLocation, FileSource, Location, Offer

logger = logging.getLogger(__name__)

# Stored (compressed) bytes decoded ahead of deserialisation, at most.
_DECODE_AHEAD_BYTES = 256 * 2**20
# Smallest GET a file is split into to feed idle streams.
_MIN_SPLIT = 4 * 2**20
# Keys per page of a listing (S3, GCS and Azure alike).
_LISTING_PAGE = 1000
# A listing page costs about ten HEADs: S3 prices a LIST as a PUT (12.5 GETs or HEADs)
# and a full page is far more work for the server than one object's HEAD.
_PAGE_COST = 10


class VolumeReader(AtLocation, StorageReader):
    """DCP storage reader for any volume: object store, fsspec URL or mount path.

    Pass it to ``dcp.load``. Loads checkpoints written by ``VolumeWriter`` and
    by stock DCP writers (those have no manifest: verification is skipped and
    a debug log says so), on any number of ranks (resharding is DCP's planner).

    DCP calls, in this order (see ``torch.distributed.checkpoint.storage``):

    0. (all ranks) ``reset(checkpoint_id)`` when ``dcp.load`` gets a checkpoint_id.
    1. (all ranks) ``read_metadata()``: unpickles ``.metadata``; a missing one
       raises ``CheckpointNotFoundError`` saying whether nothing is there or a
       save left files without committing. (DCP then retries with ``rank=``
       for rank-local metadata of ``use_collectives=False`` checkpoints.)
    2. (all ranks) ``set_up_storage_reader(metadata, is_coordinator, ...)``: loads
       the manifest, if any (a rank-local checkpoint: the rank's own manifest).
    3. (all ranks) ``prepare_local_plan`` and 4. (coordinator)
       ``prepare_global_plan``: passed through.
    5. (all ranks) ``read_data(plan, planner)``: checks the needed files
       against the manifest (missing or short: ``CheckpointCorruptError``),
       fetches coalesced ranges in parallel, verifies whole files, and hands
       bytes and tensors to the planner. Returns a completed future.

    Args:
        path: the checkpoint's URL or directory.
        storage_options: client options (endpoint, credentials...); ``None``:
            ``DCP_VOLUMES_STORAGE_OPTIONS``, if set.
        verify: download every referenced file whole and check its checksum
            (otherwise only files read whole anyway are checked).
        local_copy_dir: the ``local_copy_dir`` given to ``VolumeWriter``: files
            in ``local_copy_dir/<checkpoint name>`` that match the manifest
            are read from there.
        read_concurrency: ranged reads in flight.
        retry: retry policy for transient volume errors.
        part_size: largest single ranged read (bytes or e.g. ``"16MiB"``).
        coalesce_gap: merge ranges closer than this (bytes or e.g. ``"1MiB"``).
        prefetch_bytes: how far fetching may run ahead of deserialisation.
        _extension_registry: stock DCP's ``ExtensionRegistry`` for items saved
            with stream transforms (``_extensions=``), as ``FileSystemReader``
            takes it; default: torch's (zstd included). Transformed items are
            fetched and undone whole; the rest keep ranged, in-place reads.
        _sources: the manager's list of sources of copies, asked in this order
            before the volume (default: the local copy in ``local_copy_dir``).
        encryption: the keys of a checkpoint written with ``VolumeWriter(
            encryption=...)`` (the current and previous ones); ``None``: the key
            in ``DCP_VOLUMES_ENCRYPTION_KEY``, if an item needs one.
    """

    options: ReaderOptions

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        verify: bool = False,
        local_copy_dir: str | os.PathLike[str] | None = None,
        read_concurrency: int = 16,
        retry: RetryPolicy | None = None,
        part_size: int | str = "16MiB",
        coalesce_gap: int | str = DEFAULT_COALESCE_GAP,
        prefetch_bytes: int | str = "1GiB",
        _extension_registry: Any | None = None,
        _sources: Sequence[FileSource] | None = None,
        encryption: Encryption | None = None,
    ) -> None:
        super().__init__()
        self._bytes_from = dict.fromkeys(SOURCE_NAMES, 0)
        self._transforms = ReaderTransforms(_extension_registry, encryption)
        self.options = ReaderOptions(
            verify=verify,
            local_copy_dir=os.fspath(local_copy_dir) if local_copy_dir is not None else None,
            read_concurrency=read_concurrency,
            part_size=int(parse_size(part_size, what="part_size") or 0),
            coalesce_gap=int(parse_size(coalesce_gap, what="coalesce_gap") or 0),
            prefetch_bytes=int(parse_size(prefetch_bytes, what="prefetch_bytes") or 0),
        )
        self._location = Location(
            path,
            storage_options=storage_options,
            retry=retry,
            local_copy_dir=self.options.local_copy_dir,
        )
        self._copies = list(_sources) if _sources is not None else self._location.sources()
        self._storage_data: dict[Any, Any] = {}
        self._metadata: Metadata | None = None
        self._metadata_error: CheckpointCorruptError | None = None
        self._manifest: Manifest | None = None
        self._manifest_loaded = False
        self._manifest_name = MANIFEST_NAME
        self._manifest_ahead: futures.Future[Manifest | None] | None = None
        # What read_metadata_ahead read (location, rank, .metadata, the manifest's GET):
        # kept across DCP's reset to the same location, used once.
        self._read_ahead: tuple[str, int | None, Metadata, Any] | None = None
        self._split = (self.options.part_size, False)  # per load: see _split_size
        self._load_id = uuid.uuid4().hex
        self._collector = HoldDuringTransfer()  # from set-up to this rank's read_data

    # -- identity ---------------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest | None:
        """The checkpoint's manifest once loaded (``None`` for stock checkpoints)."""
        return self._manifest

    @property
    def sources(self) -> dict[str, int]:
        """Bytes the last ``read_data`` read from each source, by its name
        (``_tiers.SOURCE_NAMES``; the volume's is ``"volume"``)."""
        return dict(self._bytes_from)

    # -- StorageReader ----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load; ``checkpoint_id`` (a URL or path) replaces the location."""
        self._location.move_to(checkpoint_id)
        self._storage_data = {}
        self._manifest = None
        self._manifest_loaded = False
        self._manifest_name = MANIFEST_NAME
        self._manifest_ahead = None
        self._load_id = uuid.uuid4().hex
        ahead, self._read_ahead = self._read_ahead, None
        if ahead is not None and ahead[0] == self.volume.url:
            self._read_ahead, self._manifest_ahead = ahead, ahead[3]

    def read_metadata_ahead(self, *, rank: int | None = None) -> Metadata:
        """Read the checkpoint's ``.metadata`` now, just before ``dcp.load`` with this reader.

        An error comes back typed here (``CheckpointNotFoundError``, ...), where DCP
        would keep only its message; DCP then resets the reader to the same location
        and the load uses what was read here instead of asking the volume again
        (``CheckpointManager.restore`` does this).

        Args:
            rank: a rank-local checkpoint (saved with ``use_collectives=False``):
                this rank, whose own ``__<rank>.metadata`` it loads.
        """
        metadata = self.read_metadata(**({"rank": rank} if rank is not None else {}))
        self._read_ahead = (self.volume.url, rank, metadata, self._manifest_ahead)
        return metadata

    def shared_read_ahead(self) -> tuple[Metadata, Manifest | None]:
        """What ``read_metadata_ahead`` read (``.metadata`` and the manifest), for the
        other ranks of a load: one rank reads them and broadcasts, instead of every rank
        asking the store for the same two objects (``CheckpointManager.restore``)."""
        if self._read_ahead is None:
            raise RuntimeError("shared_read_ahead() needs read_metadata_ahead() first")
        ahead = self._read_ahead[3]
        return self._read_ahead[2], ahead.result() if ahead is not None else None

    def use_shared_read_ahead(self, read: tuple[Metadata, Manifest | None]) -> None:
        """Load with what another rank read (``shared_read_ahead``), asking the store
        nothing."""
        metadata, manifest = read
        done: futures.Future[Manifest | None] = futures.Future()
        done.set_result(manifest)
        self._read_ahead = (self.volume.url, None, metadata, done)

    @ends_hold_on_error
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Unpickle ``.metadata`` (``__{rank}.metadata`` when DCP passes ``rank=``)."""
        self._collector.take()  # a load's first hook; its metadata lives as long as the load
        rank = kwargs.get("rank")
        ahead = self._read_ahead
        if ahead is not None and ahead[0] == self.volume.url and ahead[1] == rank:
            self._read_ahead = None
            return self._stamped(ahead[2])
        name = METADATA_NAME if rank is None else rank_metadata_name(int(rank))
        # DCP asks for the rank-local file only after .metadata failed; when that
        # file is absent too, the .metadata error is the one that says what is wrong.
        earlier, self._metadata_error = self._metadata_error, None
        if rank is None and not self._manifest_loaded and self._manifest_ahead is None:
            self._manifest_ahead = self._read_manifest_ahead()
        try:
            data = self.volume.read_bytes(name)
        except BucketNotFoundError:
            raise
        except VolumeNotFoundError:
            if rank is not None and earlier is not None:
                raise earlier from None
            raise self._not_found(name) from None
        try:
            metadata = loads_metadata(data, redact_url(self.volume.url_of(name)))
        except CheckpointCorruptError as exc:
            if rank is None:
                self._metadata_error = exc
            raise
        return self._stamped(metadata)

    def _stamped(self, metadata: Metadata) -> Metadata:
        """``metadata`` with this load's id (DCP >= 2.6 reads it from ``storage_meta``)."""
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self._load_id
        metadata.storage_meta = storage_meta
        return metadata

    @ends_hold_on_error
    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Take the storage index from ``metadata`` and load the manifest (all ranks)."""
        self._collector.take()
        if metadata.storage_data is None:
            raise CheckpointCorruptError(
                f"The .metadata of {self.volume.display_url} has no storage index; it was not "
                "written by a DCP storage writer."
            )
        self._storage_data = metadata.storage_data
        self._metadata = metadata
        rank = kwargs.get("rank")
        if not kwargs.get("use_collectives", True) and rank is not None:
            # A rank-local checkpoint: this rank's files are in its own manifest.
            self._manifest_name = rank_manifest_name(int(rank))
            self._manifest_loaded = False
        self._load_manifest()

    @ends_hold_on_error
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Passed through (all ranks)."""
        return plan

    @ends_hold_on_error
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Passed through (coordinator)."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch what ``plan`` needs, verify it, and hand it to ``planner`` (all ranks)."""
        try:
            done = self._read_data(plan, planner)
        except BaseException:
            self._collector.end()
            raise
        self._collector.end(after=planner)  # its plans and the metadata go with it
        return done

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._load_manifest()
        self._bytes_from = dict.fromkeys(SOURCE_NAMES, 0)
        try:
            jobs = self._plan_reads(plan)
        except BaseException:
            for source in self._copies:  # a source may be collective: the others wait in it
                source.offer(self._name(), {}).join()
            raise
        offers = self._ask_copies(jobs, planner)
        try:
            self._read_files(jobs, plan, planner)
        finally:
            for offer in offers:  # what a source runs for this load ends with it
                offer.join()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_files(self, jobs: Sequence[FileRead], plan: LoadPlan, planner: LoadPlanner) -> None:
        """Fetch (or take from a copy), verify and deliver ``jobs``."""
        self._split = self._split_size(sum(job.nbytes for job in jobs))
        decoders = self._decoders(jobs)
        with ThreadPoolExecutor(
            max_workers=self.options.read_concurrency, thread_name_prefix="dcpv-read"
        ) as pool:
            try:
                # The listing that checks sizes runs alongside the first fetches: a
                # load pays no extra round trip for it. Files from copies were
                # checked against the manifest's sizes already and are hashed whole
                # (one that fails falls back to a fetch, checked the same way):
                # a restore from copies alone asks the volume nothing more.
                remote = [job for job in jobs if not job.from_copy]
                listing = pool.submit(self._listing, remote) if self._manifest and remote else None
                submitted = 0
                in_flight = 0
                direct = 0
                for i, job in enumerate(jobs):
                    # Fetch ahead within the byte budget (always at least the current file).
                    while submitted < len(jobs) and (
                        submitted <= i
                        or in_flight + jobs[submitted].nbytes <= self.options.prefetch_bytes
                    ):
                        self._submit(pool, jobs[submitted], planner)
                        in_flight += jobs[submitted].nbytes
                        submitted += 1
                    if listing is not None:
                        self._check_sizes(remote, listing.result())
                        listing = None
                    self._finish_read(pool, job, planner)
                    self._bytes_from[job.supplier] += job.nbytes
                    in_flight -= job.nbytes
                    job.deliver(planner, decoders)
                    direct += len(job.direct)
                    job.release()
            except BaseException:
                for job in jobs:
                    job.cancel()
                raise
            finally:
                if decoders is not None:
                    decoders.pool.shutdown(wait=True, cancel_futures=True)
        logger.debug(
            "%s: %d of %d items read straight into their target tensors",
            self.volume.display_url,
            direct,
            len(plan.items),
        )

    # -- internals --------------------------------------------------------------------------

    def _not_found(self, name: str) -> CheckpointNotFoundError:
        where = self.volume.display_url
        # DCP asks for the rank-local marker only after .metadata failed: name the
        # file a save writes, so the message points at the right one.
        marker = METADATA_NAME if name == METADATA_NAME else f"{METADATA_NAME} (nor {name})"
        present = self.volume.list()
        ranks = sorted(r for r in (marker_rank(f.path) for f in present) if r is not None)
        if ranks and name == METADATA_NAME:
            return CheckpointNotFoundError(
                f"{where} is a rank-local checkpoint (saved with use_collectives=False: ranks "
                f"{_ranges(ranks)} each wrote __<rank>{METADATA_NAME}), so it has no "
                f"{METADATA_NAME}; dcp.load reads each rank's own marker instead."
            )
        if ranks:
            return CheckpointNotFoundError(
                f"{where} is a rank-local checkpoint with markers for ranks {_ranges(ranks)}, "
                f"not {name}: it was saved by other ranks (a rank-local checkpoint loads only on "
                "the ranks that saved it; it is not resharded), or that rank's save crashed or "
                "is still running. Fix: load it with the ranks that saved it, or load an older "
                "checkpoint."
            )
        if holds_save([f.path for f in present]):
            return CheckpointNotFoundError(
                f"The checkpoint at {where} is incomplete: {len(present)} files are there but "
                f"not {marker}, the marker a save writes last. A save crashed or is still "
                "running. Fix: wait for the save to finish, or load an older checkpoint."
            )
        found = scan(self.volume, listing=present, unnumbered=True) if present else []
        if found:
            return _run_root_error(where, marker, found)
        if present:
            shown = ", ".join(f.path for f in present[:3]) + (", ..." if len(present) > 3 else "")
            return CheckpointNotFoundError(
                f"{where} is not a checkpoint: it holds {len(present)} file(s) ({shown}) but "
                f"no {marker}, no data files of a DCP save and no checkpoints below it. Fix: "
                f"pass the URL of a checkpoint directory (one holding {METADATA_NAME}; "
                "`dcp-volumes ls ROOT` lists those under a run root)."
            )
        return CheckpointNotFoundError(
            f"No checkpoint at {where}: nothing is there (no {marker}). Fix: check the path or "
            "URL and storage_options, or save a checkpoint there first."
        )

    def _read_manifest_ahead(self) -> futures.Future[Manifest | None]:
        """The manifest's GET, started beside the ``.metadata`` one: a round trip less a load."""
        return _exit_safe.start("dcpv-manifest", read_manifest, self.volume, MANIFEST_NAME)

    def _load_manifest(self) -> None:
        if self._manifest_loaded:
            return
        ahead, self._manifest_ahead = self._manifest_ahead, None
        manifest = None
        if ahead is not None and self._manifest_name == MANIFEST_NAME:
            manifest = ahead.result()
        # Read before .metadata, it may belong to another save (none yet, or one this
        # commit replaced): then it is read again, after .metadata, as without the head start.
        if not self._covers(manifest):
            manifest = read_manifest(self.volume, self._manifest_name)
        self._manifest = manifest
        self._manifest_loaded = True
        if self._manifest is None:
            logger.debug(
                "%s has no manifest (stock DCP writer): verification skipped",
                self.volume.display_url,
            )
            if self.options.verify:
                logger.warning(
                    "verify=True but %s has no manifest (written by a stock DCP writer): "
                    "there are no checksums to verify against",
                    self.volume.display_url,
                )

    def _covers(self, manifest: Manifest | None) -> bool:
        """Whether ``manifest`` lists every file the loaded ``.metadata`` uses."""
        return manifest is not None and all(
            info.relative_path in manifest.files for info in self._storage_data.values()
        )

    def _plan_reads(self, plan: LoadPlan) -> list[FileRead]:
        per_file: dict[str, list[tuple[ReadItem, Any]]] = {}
        for req in plan.items:
            try:
                info = self._storage_data[req.storage_index]
            except KeyError:
                raise CheckpointCorruptError(
                    f"{req.storage_index.fqn} is not in the storage index of "
                    f"{self.volume.display_url}'s .metadata; the checkpoint is damaged."
                ) from None
            rel = _layout.inside(info.relative_path, f"{self.volume.display_url}/.metadata")
            per_file.setdefault(rel, []).append((req, info))
        manifest = self._manifest
        jobs = []
        for rel, reqs in sorted(per_file.items()):
            record = None
            if manifest is not None:
                record = manifest.files.get(rel)
                if record is None:
                    raise CheckpointCorruptError(
                        f"{redact_url(self.volume.url_of(rel))} is used by .metadata but not "
                        "listed in the manifest; the checkpoint is damaged or was modified "
                        "after it was committed."
                    )
            jobs.append(FileRead.planned(rel, reqs, record, self.volume,
                                         gap=self.options.coalesce_gap,
                                         verify=self.options.verify,
                                         transforms=self._transforms))
        return jobs

    @staticmethod
    def _decoders(jobs: Sequence[FileRead]) -> Decoders | None:
        """Threads to decompress (undo stream transforms) ahead, if any item needs it.

        Decompression is CPU work that releases the GIL: one thread per core
        keeps it off the critical path; twice that many items, and at most
        ``_DECODE_AHEAD_BYTES`` of stored bytes, are decoded ahead.
        """
        if not any(getattr(info, "transform_descriptors", None)
                   for job in jobs for _, info in job.reqs):
            return None
        workers = max(1, min(8, available_cpus()))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcpv-decode")
        return Decoders(pool, window=2 * workers, budget=_DECODE_AHEAD_BYTES)

    def _listing(self, jobs: Sequence[FileRead]) -> list[FileInfo]:
        """What the size check compares with: a listing of the checkpoint, or a HEAD of
        each file ``jobs`` read where that costs less than the listing's pages.

        On many ranks each reads a few of many ranks' files: every rank listing the
        whole checkpoint would make the load's requests grow with ranks squared, and
        be the same request sent N times.
        """
        pages = -(-len(self._manifest.files if self._manifest else ()) // _LISTING_PAGE)
        if len(jobs) >= _PAGE_COST * pages:
            return self.volume.list()

        def head(job: FileRead) -> FileInfo | None:
            try:
                return self.volume.info(job.rel)
            except VolumeNotFoundError:
                return None  # missing: the check says so (after the store's lag)

        with ThreadPoolExecutor(max_workers=min(len(jobs), self.options.read_concurrency),
                                thread_name_prefix="dcpv-head") as pool:
            return [info for info in pool.map(head, jobs) if info is not None]

    def _check_sizes(self, jobs: Sequence[FileRead], listing: Sequence[FileInfo]) -> None:
        """Every file the plan reads exists with the manifest's size (before any is used)."""
        expected = {job.rel: job.record for job in jobs if job.record is not None}
        if check_listing(expected, listing):
            # A listing that lags the save is no damage: list again for a moment.
            _, listing = check_listing_settled(self.volume, expected, listing)
        sizes = {f.path: f.size for f in listing}
        for job in jobs:
            if job.record is not None:
                self._check_file(job.rel, job.record, sizes)

    def _check_file(self, rel: str, record: FileRecord, sizes: Mapping[str, int]) -> None:
        url = redact_url(self.volume.url_of(rel))
        if rel not in sizes:
            raise CheckpointCorruptError(
                f"The checkpoint file {url} is missing ({record.size} bytes in the manifest; "
                f"not listed, also after listing again for {LAG_TOTAL_S:.0f} s). The "
                "checkpoint is damaged; load an older one."
            )
        if sizes[rel] != record.size:
            raise CheckpointCorruptError(
                f"The checkpoint file {url} has {sizes[rel]} bytes but the manifest says "
                f"{record.size}. The file was truncated or replaced; load an older checkpoint."
            )

    def _name(self) -> str:
        return _layout.checkpoint_name(self.volume.root)

    def _ask_copies(self, jobs: Sequence[FileRead], planner: LoadPlanner) -> list[Offer]:
        """Every rank: ask each source, in order, for the files no earlier one supplies
        (a source may be collective: each is asked, for nothing too). A supplied file is
        read whole from there and checked against the manifest; the rest, and a copy
        that fails, come from the volume."""
        by_rel = {job.rel: job for job in jobs}
        wanted = {job.rel: job.record for job in jobs if job.record is not None}
        offers = []
        for source in self._copies:
            # Up to prefetch_bytes may be copied into the reads' target tensors (and
            # scratch) as they arrive: no disk write, no buffer of their own.
            offer = source.offer(
                self._name(), dict(wanted),
                into=lambda rel: by_rel[rel].lay_out_whole(planner, self._saved_dtype),
                memory_bytes=self.options.prefetch_bytes)
            offers.append(offer)
            for rel, supply in offer.supplies.items():
                by_rel[rel].read_copy(supply, source.name)
                wanted.pop(rel, None)
        return offers

    def _split_size(self, total: int) -> tuple[int, bool]:
        """Bytes per GET, and whether that is a cap (``split_range``'s ``at_most``).

        Whole files while there are enough to keep every stream busy (``part_size``
        caps a GET either way). With fewer, a file is cut to a stream's share, as
        a cap: on a link that limits each connection's rate the longest GET sets
        the load's time. Where the server reads the whole object for every range
        (``ranged_reads_cost_whole_object``) each cut costs a whole read, so the
        share is only a target there (a file of 1.4 shares stays one GET).
        """
        part = self.options.part_size
        per_stream = -(-total // self.options.read_concurrency)
        cheap_ranges = not self.volume.capabilities.ranged_reads_cost_whole_object
        return max(min(_MIN_SPLIT, part), min(part, per_stream)), cheap_ranges and per_stream < part

    def _saved_dtype(self, fqn: str) -> Any:
        md = self._metadata.state_dict_metadata.get(fqn) if self._metadata else None
        properties = getattr(md, "properties", None)
        return getattr(properties, "dtype", None)

    def _submit(self, pool: ThreadPoolExecutor, job: FileRead, planner: LoadPlanner) -> None:
        job.start(pool, planner, self._saved_dtype, self._split)

    def _finish_read(self, pool: ThreadPoolExecutor, job: FileRead, planner: LoadPlanner) -> None:
        """Wait for a file's bytes and verify them; a bad copy falls back to the volume."""
        try:
            job.wait()
        except CopyMissing as exc:
            logger.warning("the %s copy of %s did not arrive (%s): reading it from the volume",
                           job.supplier, job.rel, exc)
            job.fall_back_to(self.volume)
            self._submit(pool, job, planner)
            self._finish_read(pool, job, planner)
            return
        if not job.checkable or job.record is None:
            return
        actual = job.actual_checksum()
        if actual == job.record.checksum:
            return
        if job.from_copy:
            logger.warning("%s copy of %s fails its checksum: reading it from the volume",
                           job.supplier, job.rel)
            job.fall_back_to(self.volume)
            self._submit(pool, job, planner)
            self._finish_read(pool, job, planner)
            return
        raise CheckpointCorruptError(
            f"The checkpoint file {redact_url(self.volume.url_of(job.rel))} fails its "
            f"checksum ({actual}, manifest {job.record.checksum}): its bytes changed after the "
            "save. Load an older checkpoint."
        )


def _run_root_error(
    where: str, marker: str, found: Sequence[CheckpointInfo]
) -> CheckpointNotFoundError:
    """The error for a run root (checkpoints below it) given where one checkpoint belongs."""
    shown = ", ".join(i.name + ("" if i.complete else " (partial)") for i in found[-8:])
    if all(i.complete for i in found):
        shown += ": all complete"
    older = f"{len(found) - 8} older, " if len(found) > 8 else ""
    what = (f"{where} is a run root, not a checkpoint: it has no {marker} of its own but "
            f"{len(found)} checkpoint(s) below it ({older}{shown}).")
    numbered = newest_complete([i for i in found if i.step != NO_STEP])
    best = numbered or next((i for i in reversed(found) if i.complete), None)
    if best is None:
        return CheckpointNotFoundError(
            f"{what} None of them is complete: their saves crashed or are still running. "
            "Fix: wait for a save to finish, or pass a checkpoint from another run."
        )
    manager = (f", or let CheckpointManager({where!r}).restore(state) load the newest "
               "complete one" if numbered is not None else "")
    return CheckpointNotFoundError(
        f"{what} Fix: pass one checkpoint's URL, e.g. {redact_url(best.url)}"
        f"{' (the newest complete one)' if numbered is not None else ''}{manager}."
    )


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (bounded: a job may have thousands of ranks)."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    text = ", ".join(parts[:8])
    return text + (", ..." if len(parts) > 8 else "")
