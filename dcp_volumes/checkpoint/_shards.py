"""Data files of a checkpoint: items serialised into hashed files, and read back.

The byte format is stock DCP's (``torch.distributed.checkpoint.filesystem``):
``BYTE_IO`` items as raw bytes, tensors as ``torch.save`` of a CPU tensor whose
storage holds only its data, back to back (with torch.save's switch for no
zip CRC-32 set); ``StorageInfo(relative_path, offset, length)`` locates each
item. Writing hashes every byte on its way to disk and hands each file to an
upload callback the moment it is closed, so serialisation of later files
overlaps the upload of earlier ones.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass
from typing import IO, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes._exceptions import CheckpointCorruptError
from dcp_volumes._exit_safe import submit
from dcp_volumes._staging import disk_full_error
from dcp_volumes._torch import StorageInfo, StreamTransforms, load_tensor_in_place
from dcp_volumes._volume import Volume, pieces, redact_url
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._manifest import Checksum, FileRecord

# Slack per item on top of the raw tensor bytes (torch.save's zip headers).
_ITEM_OVERHEAD = 4096

# Writes smaller than this are gathered in memory and stored together:
# torch.save makes ~40 small writes per item, each a Python call into the
# hash and the file otherwise (half the CPU of a save of small tensors).
_GATHER = 64 * 1024

# torch.save gives every zip record a CRC-32 that torch.load never checks; each data
# file is hashed whole for the manifest instead, so the CRC is CPU spent for nothing
# (benchmarks/README.md). Its public switch is process-wide in torch before config
# overrides became per thread: one save at a time flips it.
_CRC32_SWITCH = threading.Lock()


# upload(local_path, relative_path, size): put one closed file on the volume.
Upload = Callable[[str, str, int], None]


@dataclass(frozen=True)
class WrittenItem:
    """``WriteResult.storage_data`` on its way to ``finish``: stock info plus the file record.

    ``finish`` keeps only ``info`` for ``.metadata`` (stock readers must not
    need dcp_volumes to unpickle it); the records go to the manifest.
    """

    info: StorageInfo
    record: FileRecord


class HashingFile:
    """A write-only file that hashes every byte on its way to disk (tensor data
    without an extra copy; small writes gathered first).

    It also notes where the data of each tensor announced with
    ``expect_tensor`` lands: ``torch.save`` writes a storage as one
    ``write`` of a view of the tensor's own memory.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._hash = Checksum()
        self._size = 0  # bytes written so far, the gathered ones included
        self._gathered = bytearray()
        self._tensors: dict[int, tuple[int, int]] = {}
        self._expected: tuple[int, int, int] | None = None  # item offset, address, nbytes
        # The first failed write, and the file size it was to reach: torch's
        # serializer replaces the error with its own.
        self.error: OSError | None = None
        self.wanted = 0

    def expect_tensor(self, tensor: torch.Tensor) -> None:
        """The next item is ``tensor`` (from ``plain_cpu_tensor``): note where its data goes."""
        nbytes = tensor.numel() * tensor.element_size()
        self._expected = None
        if nbytes and tensor.is_contiguous() and sys.byteorder == "little":
            self._expected = (self._size, tensor.data_ptr(), nbytes)

    def write(self, data: Any) -> int:
        view = memoryview(data)
        size = view.nbytes
        expected = self._expected
        if expected is not None and size == expected[2] and _address(view) == expected[1]:
            self._tensors[expected[0]] = (self._size, size)
            self._expected = None
        if size < _GATHER:
            self._gathered += view
            self._size += size
            if len(self._gathered) >= _GATHER:
                self._drain()
            return size
        self._drain()
        self._size += size
        self._store(view.cast("B"))
        return size

    def _drain(self) -> None:
        if self._gathered:
            self._store(self._gathered)
            self._gathered.clear()

    def _store(self, data: bytearray | memoryview) -> None:
        """Hash ``data`` and write it: the file then reaches ``self._size`` bytes."""
        self._hash.update(data)
        try:
            for piece in pieces(data):  # see WRITE_PIECE
                self._f.write(piece)
        except OSError as exc:
            if self.error is None:
                self.error, self.wanted = exc, self._size
            raise

    def flush(self) -> None:
        self._drain()
        self._f.flush()

    def tell(self) -> int:
        return self._size

    def close(self, *, fsync: bool) -> FileRecord:
        # Flush before fsync: fsync only persists what reached the kernel.
        self.flush()
        if fsync:
            os.fsync(self._f.fileno())
        self._f.close()
        return FileRecord(size=self._size, checksum=self._hash.hexdigest(), tensors=self._tensors)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def plain_cpu_tensor(data: torch.Tensor) -> torch.Tensor:
    """The tensor as stock DCP serialises it: on CPU, storage no larger than its data."""
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        # torch.save writes the whole storage: a view into a big buffer would
        # drag the buffer along, so copy just this tensor.
        tensor = tensor.clone()
    return tensor


def _data_bytes(item: WriteItem) -> int:
    """A tensor item's raw data bytes (0 for an object)."""
    data = item.tensor_data
    return 0 if data is None else data.size.numel() * data.properties.dtype.itemsize


def estimate_bytes(items: Sequence[WriteItem]) -> int:
    """Bytes the items take on disk, about (an object counts as its slack only)."""
    return sum(_ITEM_OVERHEAD + _data_bytes(item) for item in items)


def write_and_upload(
    items: Sequence[WriteItem],
    planner: SavePlanner,
    *,
    prefix: str,
    save_dir: str,
    prefix_spread: int,
    file_size: Callable[[int], int],
    fsync: bool,
    files_in_flight: int,
    upload: Upload,
    transforms: StreamTransforms | None = None,
) -> tuple[list[WriteResult], int, int]:
    """Serialise ``items`` into files of at most ``file_size(i)`` bytes of tensor data
    for the ``i``-th file (plus headers; or one item larger than that), uploading
    each once closed, so what the uploads hold in flight stays within files in
    flight x file size.

    ``transforms`` (``_extensions=``, compression) wrap each item's bytes on
    their way into the file, as stock DCP's writer does: the offsets, lengths
    and checksums are those of the stored (transformed) bytes, and the item's
    transform descriptors go into ``.metadata``.

    Returns the write results, the bytes written and the number of files,
    once every upload has finished. The first failure (serialising or
    uploading) stops further serialisation, cancels queued uploads and is
    raised after the running ones end.
    """
    results: list[WriteResult] = []
    uploads: list[ThreadFuture[None]] = []
    pending: list[tuple[WriteItem, int, int, list[str] | None]] = []
    state: dict[str, Any] = {"file": None, "rel": "", "total": 0, "index": 0, "data": 0}
    # Set by the first upload that fails: serialisation stops. A flag, not a scan
    # of every upload before each item (items x files; benchmarks/README.md).
    upload_failed = threading.Event()

    def note_failure(upload_done: ThreadFuture[None]) -> None:
        if not upload_done.cancelled() and upload_done.exception() is not None:
            upload_failed.set()

    def close_and_upload(pool: ThreadPoolExecutor) -> None:
        current: HashingFile | None = state["file"]
        if current is None:
            return
        record = current.close(fsync=fsync)
        state["total"] += record.size
        rel = state["rel"]
        for item, offset, length, descriptors in pending:
            info = (
                StorageInfo(rel, offset, length)
                if descriptors is None
                else StorageInfo(rel, offset, length, transform_descriptors=descriptors)
            )
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=length,
                    storage_data=WrittenItem(info, record),
                )
            )
        pending.clear()
        uploading = submit(pool, upload, current.path, rel, record.size)
        uploading.add_done_callback(note_failure)
        uploads.append(uploading)
        state["file"] = None

    with ThreadPoolExecutor(max_workers=files_in_flight, thread_name_prefix="dcpv-upload") as pool:
        try:
            with _without_zip_crc32():
                for item in items:
                    if upload_failed.is_set():
                        break  # reported below
                    if (
                        state["file"] is not None
                        and state["data"] + _data_bytes(item) > file_size(state["index"] - 1)
                    ):
                        close_and_upload(pool)
                    if state["file"] is None:
                        name = _layout.data_file_name(prefix, state["index"])
                        state["index"] += 1
                        state["rel"] = _layout.relative_path(name, prefix_spread)
                        local = os.path.join(save_dir, *state["rel"].split("/"))
                        os.makedirs(os.path.dirname(local), exist_ok=True)
                        state["file"] = HashingFile(local)
                        state["data"] = 0
                    current: HashingFile = state["file"]
                    offset = current.tell()
                    data = planner.resolve_data(item)
                    descriptors = _write_item(current, data, item, transforms)
                    written = current.tell() - offset
                    pending.append((item, offset, written, descriptors))
                    state["data"] += _data_bytes(item) if item.tensor_data is not None else written
                    del data
                close_and_upload(pool)
        except BaseException as exc:
            failed: HashingFile | None = state["file"]
            if failed is not None:
                failed.abort()
            for f in uploads:
                f.cancel()
            written = state["total"] + (failed.tell() if failed is not None else 0)
            # The estimate counts objects by their slack only: the failed write tells more.
            wanted = state["total"] + (failed.wanted if failed is not None else 0)
            full = disk_full_error(
                failed.error or exc if failed is not None else exc,
                os.path.dirname(save_dir),
                doing=f"serialising checkpoint files ({written / 2**20:.1f} MiB written)",
                needed=max(estimate_bytes(items), wanted),
                fix="Nothing was committed and the staged files are removed. Fix: free space "
                "there, or point staging_dir= (or DCP_VOLUMES_STAGING) at a larger local disk, "
                "and save again.",
            )
            if full is not None:
                raise full from exc
            raise
        _, not_done = wait(uploads, return_when=FIRST_EXCEPTION)
        for f in uploads:
            if f.done() and not f.cancelled() and f.exception() is not None:
                for other in not_done:
                    other.cancel()
                raise cast(BaseException, f.exception())
    return results, state["total"], state["index"]


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """``torch.save`` in this block writes its zip records without a CRC-32 (the
    stored field is 0; torch.load reads them as before); the setting is restored after."""
    with _CRC32_SWITCH:
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(previous)


def _write_item(
    file: HashingFile,
    data: io.BytesIO | torch.Tensor,
    item: WriteItem,
    transforms: StreamTransforms | None,
) -> list[str] | None:
    """Serialise one item into ``file``; returns its transform descriptors (None: none)."""
    out: IO[bytes] = cast(IO[bytes], file)
    descriptors: list[str] = []
    if transforms is not None:
        out, descriptors = transforms.transform_save_stream(item, cast(io.IOBase, file))
    if isinstance(data, io.BytesIO):
        out.write(data.getbuffer())
    else:
        # torch.save streams each storage as a memoryview: no copy in RAM.
        tensor = plain_cpu_tensor(data)
        if not descriptors:  # only untransformed data lies in the file as it is in memory
            file.expect_tensor(tensor)
        torch.save(tensor, out)
        del tensor
    if transforms is not None:
        out.close()  # ends the transform (a compressor's last frame); the file stays open
    # As stock: no descriptors field at all for an item without transforms.
    return descriptors or None


def load_tensor(view: memoryview) -> torch.Tensor:
    """Deserialise a ``torch.save``'d tensor whose storage aliases ``view`` (no copy)."""
    return load_tensor_in_place(view)


def advise_willneed(path: str, spans: Sequence[tuple[int, int]]) -> None:
    """Ask the kernel to read a local file's spans ahead (best effort; a no-op off Linux)."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # reported when the file is opened for reading
    try:
        with contextlib.suppress(OSError):
            for start, end in spans:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def missing_file_error(
    source: Volume, rel: str, *, looked_s: float = 0.0
) -> CheckpointCorruptError:
    """The error for a data file that is not there (``looked_s``: asked again that long)."""
    again = f" (not found, also when asked again for {looked_s:.0f} s)" if looked_s else ""
    return CheckpointCorruptError(
        f"The checkpoint file {redact_url(source.url_of(rel))} is missing{again}. The "
        "checkpoint is damaged; load an older one."
    )


def truncated_file_error(
    source: Volume, rel: str, start: int, end: int, got: int
) -> CheckpointCorruptError:
    """The error for a data file that ends before ``end`` (``got`` bytes from ``start``)."""
    return CheckpointCorruptError(
        f"The checkpoint file {redact_url(source.url_of(rel))} ends before byte {end} "
        f"that .metadata points to (got {got} of {end - start} bytes from "
        f"{start}). The file was truncated; load an older checkpoint."
    )


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The part of a saved tensor a read item asks for (resharding)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor
