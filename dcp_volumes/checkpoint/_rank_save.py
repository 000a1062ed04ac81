"""One rank's part of a save: its items serialised into staged files, each uploaded once closed.

Items are written in stock DCP's byte format (``_byte_format``), into files hashed
on their way to disk, and each file is handed to the save's sinks (``_tiers``: the
upload to the volume, ``VolumeUpload``, and a keeper such as the local tier) on
the upload pool the moment it is closed, so serialisation of later files
overlaps the upload of earlier ones (``RankSave``).

How the files go up (``upload_shape``): what a save pays beyond its bytes is
per request: a round trip (20 ms and more a network away) and the server's
work for each PUT, which can outweigh a few MiB of transfer. And a file can go
up only once it is serialised, so the last file's upload is the save's tail.
Hence two waves per stream, each file one PUT: first a large file per stream
(three quarters of the stream's share), then a small one (the last quarter),
whose upload after serialisation ends is short. Stores whose client holds
every part in memory while it is in flight (``capabilities.buffers_uploads``,
the fsspec clients) keep files within a share of the rank's bytes instead.
obstore sends maps of the staged files whose sent pages are dropped as they go
(``_volume/_mapped.py``), so its uploads hold little RSS whatever the file
size. The shapes measured are in benchmarks/README.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass
from typing import cast

from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes._exceptions import DiskFullError
from dcp_volumes._exit_safe import submit
from dcp_volumes._staging_disk import StagingArea, disk_full_error
from dcp_volumes._torch.checkpoint import StorageInfo, StreamTransforms
from dcp_volumes._volume import Volume, redact_url
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._byte_format import (
    HashingFile,
    data_bytes,
    estimate_bytes,
    without_zip_crc32,
    write_item,
)
from dcp_volumes.checkpoint._manifest import FileRecord
from dcp_volumes.checkpoint._tiers import FileKeeper, FileSink
from dcp_volumes.checkpoint._writer_options import WriterOptions

logger = logging.getLogger(__name__)

# Files renamed or copied at once per rank on a mount.
_MAX_FILES_IN_FLIGHT = 4
# Clients that buffer uploads may hold this share of a rank's bytes in RAM ...
_UPLOAD_RAM_SHARE = 0.25
# ... but every file is at least this large: smaller files make the
# per-request cost dominate.
_MIN_STREAM_BYTES = 2 * 2**20
# The share of a stream's bytes in its first (large) file; the rest is its second.
_FIRST_WAVE_SHARE = 0.75


@dataclass(frozen=True)
class WrittenItem:
    """``WriteResult.storage_data`` on its way to ``finish``: stock info plus the file record.

    Kept apart from ``FileRecord``: DCP carries one object per *item* from
    ``write_data`` to ``finish``, and an item's place (stock's ``StorageInfo``, which
    ``.metadata`` keeps: stock readers must not need dcp_volumes to unpickle it) is
    not a fact of its file; the records go to the manifest.
    """

    info: StorageInfo
    record: FileRecord


class RankSave:
    """One rank's ``write_data``: serialise its items into files and upload each once closed.

    Files are cut so that the ``i``-th holds at most ``shape.size_of(i)`` bytes of
    tensor data (plus headers; or one item larger than that), and at most
    ``shape.files_in_flight`` are uploading at once, so what the uploads hold
    stays within files in flight x file size. Stream transforms
    (``_extensions=``, compression) wrap each item's bytes on their way into the
    file, as stock DCP's writer does: offsets, lengths and checksums are those of
    the stored bytes, and the item's descriptors go into ``.metadata``.

    Each closed file goes to the volume (``VolumeUpload``) and to ``keepers``
    (``_tiers.FileKeeper``: the local tier), on the upload threads. The files are
    staged in the first keeper's directory (where they stay) or in a new
    directory of ``staging`` (removed once uploaded, unless ``keep_staging``).
    The first failure (serialising or uploading) stops serialisation, cancels
    queued uploads and is raised after the running ones end; a failed save's
    staged files are removed (a keeper's too: it has no manifest to say they are
    incomplete).
    """

    def __init__(
        self,
        volume: Volume,
        options: WriterOptions,
        *,
        rank: int,
        prefix: str,
        items: Sequence[WriteItem],
        staging: StagingArea,
        keepers: Sequence[FileKeeper],
        transforms: StreamTransforms | None,
    ) -> None:
        self.volume = volume
        self.options = options
        self.rank = rank
        self.prefix = prefix
        # Objects first, tensors after (as stock DCP orders them).
        self.items = [i for i in items if i.type == WriteItemType.BYTE_IO]
        self.items += [i for i in items if i.type != WriteItemType.BYTE_IO]
        self.staging = staging
        self.keepers = list(keepers)
        self.transforms = transforms
        # Mount-path volumes get the file by rename: it must be on disk first.
        self.fsync = options.sync_files and volume.capabilities.local_files
        self.shape = upload_shape(
            volume,
            rank_bytes=estimate_bytes(self.items),
            concurrency=options.upload_concurrency,
            file_size=options.file_size,
            part_size=options.part_size,
        )
        upload = VolumeUpload(volume, self.shape, options.part_size,
                              keep=options.keep_staging or bool(self.keepers))
        self.sinks: list[FileSink] = [upload, *self.keepers]
        self.save_dir = ""
        self.results: list[WriteResult] = []
        self.bytes_written = 0  # of the closed files
        self.files = 0  # files opened: the next file's index
        self._file: HashingFile | None = None  # the open file
        self._rel = ""  # its path in the checkpoint
        self._data = 0  # tensor data bytes in it (an object counts as its stored bytes)
        self._limit = 0  # the data bytes it may take
        self._placed: list[tuple[WriteItem, StorageInfo]] = []  # its items and their places
        self._uploads: list[ThreadFuture[None]] = []
        # Set by the first upload that fails: serialisation stops. A flag, not a scan
        # of every upload before each item (items x files; benchmarks/HISTORY.md).
        self._upload_failed = threading.Event()

    def run(self, planner: SavePlanner) -> list[WriteResult]:
        """Serialise and upload every item; the write results once all uploads ended."""
        started = time.monotonic()
        self.save_dir = self._make_dir()
        try:
            self._serialise_and_upload(planner)
        except BaseException:
            self._discard()
            raise
        if not self.keepers and not self.options.keep_staging:
            StagingArea.remove(self.save_dir)
        elapsed = max(time.monotonic() - started, 1e-9)
        logger.debug(
            "rank %d wrote %d files (%.1f MiB) to %s in %.2fs (%.0f MiB/s)",
            self.rank,
            self.files,
            self.bytes_written / 2**20,
            self.volume.display_url,
            elapsed,
            self.bytes_written / 2**20 / elapsed,
        )
        return self.results

    def _make_dir(self) -> str:
        if self.keepers:
            return self.keepers[0].staging_dir(self.rank)
        name = _layout.checkpoint_name(self.volume.root)
        return self.staging.new_dir(f"{name}-r{self.rank}")

    def _discard(self) -> None:
        """A failed save's files are never trusted: removing them gives the disk space back."""
        if self.options.keep_staging:
            return
        for keeper in self.keepers:
            keeper.discard(self.prefix)
        if not self.keepers:
            StagingArea.remove(self.save_dir)

    def _serialise_and_upload(self, planner: SavePlanner) -> None:
        with ThreadPoolExecutor(
            max_workers=self.shape.files_in_flight, thread_name_prefix="dcpv-upload"
        ) as pool:
            try:
                with without_zip_crc32():
                    for item in self.items:
                        if self._upload_failed.is_set():
                            break  # raised by _wait_uploads
                        self._write(item, planner, pool)
                    self._close_and_upload(pool)
            except BaseException as exc:
                full = self._abort(exc)
                if full is not None:
                    raise full from exc
                raise
            self._wait_uploads()

    def _write(self, item: WriteItem, planner: SavePlanner, pool: ThreadPoolExecutor) -> None:
        """Serialise ``item`` into the open file, first closing a full one."""
        nbytes = data_bytes(item)
        if self._file is not None and self._data + nbytes > self._limit:
            self._close_and_upload(pool)
        file = self._file if self._file is not None else self._open()
        offset = file.tell()
        descriptors = write_item(file, planner.resolve_data(item), item, self.transforms)
        written = file.tell() - offset
        self._placed.append((item, StorageInfo(self._rel, offset, written)
                             if descriptors is None else
                             StorageInfo(self._rel, offset, written,
                                         transform_descriptors=descriptors)))
        self._data += nbytes if item.tensor_data is not None else written

    def _open(self) -> HashingFile:
        name = _layout.data_file_name(self.prefix, self.files)
        self.files += 1
        self._rel = _layout.relative_path(name, self.options.prefix_spread)
        local = os.path.join(self.save_dir, *self._rel.split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        self._file = HashingFile(local)
        self._data = 0
        self._limit = self.shape.size_of(self.files - 1)
        return self._file

    def _close_and_upload(self, pool: ThreadPoolExecutor) -> None:
        """Close the open file, record its items' results and hand it to the sinks."""
        file = self._file
        if file is None:
            return
        record = dataclasses.replace(file.close(fsync=self.fsync), path=self._rel)
        self.bytes_written += record.size
        for item, info in self._placed:
            self.results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=info.length,
                    storage_data=WrittenItem(info, record),
                )
            )
        self._placed.clear()
        uploading = submit(pool, functools.partial(self._hand_over, record, file.path))
        uploading.add_done_callback(self._note_failure)
        self._uploads.append(uploading)
        self._file = None

    def _hand_over(self, record: FileRecord, local_path: str) -> None:
        """Give a closed file to every sink (upload threads). Its write results reach the
        commit only once this returned: on a store whose listings do not lag they vouch
        for the file."""
        for sink in self.sinks:
            sink.put(record, local_path)

    def _note_failure(self, upload_done: ThreadFuture[None]) -> None:
        if not upload_done.cancelled() and upload_done.exception() is not None:
            self._upload_failed.set()

    def _abort(self, exc: BaseException) -> DiskFullError | None:
        """Stop after a failure while serialising; the ``DiskFullError`` it means, if any."""
        failed = self._file
        if failed is not None:
            failed.abort()
        for f in self._uploads:
            f.cancel()
        written = self.bytes_written + (failed.tell() if failed is not None else 0)
        # The estimate counts objects by their slack only: the failed write tells more.
        wanted = self.bytes_written + (failed.wanted if failed is not None else 0)
        return disk_full_error(
            failed.error or exc if failed is not None else exc,
            os.path.dirname(self.save_dir),
            doing=f"serialising checkpoint files ({written / 2**20:.1f} MiB written)",
            needed=max(estimate_bytes(self.items), wanted),
            fix="Nothing was committed and the staged files are removed. Fix: free space "
            "there, or point staging_dir= (or DCP_VOLUMES_STAGING) at a larger local disk, "
            "and save again.",
        )

    def _wait_uploads(self) -> None:
        """Wait for every upload; the first failure cancels the queued ones and is raised."""
        _, not_done = wait(self._uploads, return_when=FIRST_EXCEPTION)
        for f in self._uploads:
            if f.done() and not f.cancelled() and f.exception() is not None:
                for other in not_done:
                    other.cancel()
                raise cast(BaseException, f.exception())


@dataclass(frozen=True)
class UploadShape:
    """How a rank's files go up: ``files_in_flight`` at once; the first
    ``files_in_flight`` files of at most ``first_size`` bytes, the later ones of
    ``file_size``; up to ``streams`` transfers for one file larger than a part;
    and (clients that buffer) at most ``budget`` bytes held in flight."""

    files_in_flight: int
    streams: int
    first_size: int
    file_size: int
    budget: InFlightBytes | None

    def size_of(self, index: int) -> int:
        """The target size of the rank's ``index``-th file (0-based)."""
        return self.first_size if index < self.files_in_flight else self.file_size


def upload_shape(
    volume: Volume, *, rank_bytes: int, concurrency: int, file_size: int, part_size: int
) -> UploadShape:
    """The upload shape for a rank of ``rank_bytes`` with ``concurrency`` streams.

    Object stores: a first wave of ``concurrency`` files of three quarters of
    ``rank_bytes / concurrency``, then files of the last quarter (each at least
    2 MiB, at most ``file_size`` and ``part_size``: one PUT each); a client that
    buffers uploads gets files small enough for its memory budget. Mounts keep
    ``file_size`` files.
    """
    caps = volume.capabilities
    if caps.local_files:
        files = min(_MAX_FILES_IN_FLIGHT, concurrency)
        return UploadShape(files, 1, file_size, file_size, None)
    per_stream = -(-rank_bytes // concurrency)
    cap = min(file_size, part_size)
    first = min(cap, max(_MIN_STREAM_BYTES, int(per_stream * _FIRST_WAVE_SHARE)))
    later = min(cap, max(_MIN_STREAM_BYTES, per_stream - first))
    budget = None
    if caps.buffers_uploads:
        budget = InFlightBytes(
            max(concurrency * _MIN_STREAM_BYTES, int(rank_bytes * _UPLOAD_RAM_SHARE))
        )
        first = later = min(cap, max(_MIN_STREAM_BYTES, budget.limit // concurrency))
    return UploadShape(concurrency, concurrency, first, later, budget)


class InFlightBytes:
    """A byte budget shared by a rank's upload threads.

    Files are cut at ``file_size`` but one tensor may be larger, so counting
    files alone does not bound the memory: each upload holds its bytes here
    (a file larger than the whole budget waits until it is alone).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        nbytes = min(nbytes, self.limit)
        with self._changed:
            self._changed.wait_for(lambda: self._held + nbytes <= self.limit)
            self._held += nbytes
        try:
            yield
        finally:
            with self._changed:
                self._held -= nbytes
                self._changed.notify_all()


@dataclass(frozen=True)
class VolumeUpload:
    """The sink that uploads a rank's closed files to the checkpoint's volume.

    ``keep``: the staged file stays (a keeper holds it, or ``keep_staging``);
    otherwise it is moved (renamed on a mount, removed after the upload elsewhere).
    """

    volume: Volume
    shape: UploadShape
    part_size: int
    keep: bool

    def put(self, record: FileRecord, local_path: str) -> None:
        """Upload one closed file (upload threads)."""
        size, part_size = record.size, self.part_size
        # A file larger than a part (one tensor larger than the files) goes up in
        # parallel parts: alone at the end of a save, one stream would be its tail.
        parts = min(self.shape.streams, -(-size // part_size))
        # A multipart upload holds its parts in flight, a single PUT the whole file.
        held = size if parts <= 1 else min(size, parts * part_size)
        budget = self.shape.budget
        with budget.hold(held) if budget is not None else contextlib.nullcontext():
            self.volume.put_file(
                local_path,
                record.path,
                part_size=part_size,
                concurrency=max(1, parts),
                move=not self.keep,
                verify_size=False,
            )
        logger.debug("uploaded %s (%d bytes)", redact_url(self.volume.url_of(record.path)), size)
