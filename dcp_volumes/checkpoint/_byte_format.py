"""The byte format of a checkpoint's data files, and the file that hashes them as they are written.

The format is stock DCP's (``torch.distributed.checkpoint.filesystem``):
``BYTE_IO`` items as raw bytes, tensors as ``torch.save`` of a CPU tensor whose
storage holds only its data, back to back (with torch.save's switch for no
zip CRC-32 set); ``StorageInfo(relative_path, offset, length)`` locates each
item. A contiguous tensor's item is written as torch.save's bytes around its
data (``_Frame``, made once per dtype and shape) without running torch.save:
its calls cost more than a small tensor's data. ``HashingFile`` hashes every
byte on its way to disk, for the manifest.
A rank's save (``_rank_save``) writes items with ``write_item``; the reader's
``FileRead`` reads them back.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import IO, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.planner import WriteItem

from dcp_volumes._torch.checkpoint import StreamTransforms
from dcp_volumes._volume import pieces
from dcp_volumes.checkpoint._extensions import TensorPlacingStream
from dcp_volumes.checkpoint._manifest import Checksum, FileRecord

# Slack per item on top of the raw tensor bytes (torch.save's zip headers).
_ITEM_OVERHEAD = 4096

# Writes smaller than this are gathered in memory and stored together:
# torch.save makes ~40 small writes per item, each a Python call into the
# hash and the file otherwise (half the CPU of a save of small tensors).
_GATHER = 64 * 1024

# Tensor frames kept (a model has a few hundred distinct dtype and shape pairs).
_FRAMES_KEPT = 4096
# Larger tensors go through torch.save: its calls cost little beside their data, and
# a frame's probe is a tensor of the same size (memory a save must not add).
_FRAMED_MAX_BYTES = 1 << 20

# torch.save gives every zip record a CRC-32 that torch.load never checks; each data
# file is hashed whole for the manifest instead, so the CRC is CPU spent for nothing
# (benchmarks/HISTORY.md). Its public switch is process-wide in torch before config
# overrides became per thread: one save at a time flips it.
_CRC32_SWITCH = threading.Lock()


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

    def write_framed(self, head: bytes, data: memoryview, tail: bytes) -> None:
        """One tensor item as ``torch.save`` lays it out: ``head``, the tensor's bytes
        (``data``, C-contiguous), ``tail``; the data's place is noted for the record."""
        size = data.nbytes
        start = self._size
        self._tensors[start] = (start + len(head), size)
        if size < _GATHER:
            self._gathered += head
            self._gathered += data
            self._gathered += tail
            self._size += len(head) + size + len(tail)
            if len(self._gathered) >= _GATHER:
                self._drain()
            return
        self.write(head)
        self._drain()
        self._size += size
        self._store(data)
        self.write(tail)

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


class _Frame:
    """What ``torch.save`` writes around a tensor's data: the same bytes for every
    contiguous CPU tensor of one dtype and shape (its zip records carry no CRC-32 in
    a save, and nothing else in them depends on the values)."""

    __slots__ = ("data", "head", "tail")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        probe = torch.zeros(shape, dtype=dtype)
        nbytes = probe.numel() * probe.element_size()
        writes: list[bytes] = []
        at = -1  # which write was the data

        class _Recorder(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, data: Any) -> int:
                nonlocal at
                view = memoryview(data)
                if at < 0 and view.nbytes == nbytes and _address(view) == probe.data_ptr():
                    at = len(writes)
                    writes.append(b"")  # the data itself: not kept
                else:
                    writes.append(view.tobytes())
                return view.nbytes

        # Inside without_zip_crc32, as every write_item.
        torch.save(probe, cast(IO[bytes], _Recorder()))
        if at < 0:
            raise ValueError(f"torch.save did not write a {dtype} tensor's data in one piece")
        self.head = b"".join(writes[:at])
        self.tail = b"".join(writes[at + 1 :])
        self.data = ctypes.c_char * nbytes  # the data's type, made once

    def data_of(self, tensor: torch.Tensor) -> memoryview:
        """The bytes of ``tensor`` (C-contiguous, on CPU) without a copy, valid while it lives."""
        return memoryview(self.data.from_address(tensor.data_ptr())).cast("B")


_frames: dict[tuple[torch.dtype, torch.Size], _Frame | None] = {}
_frames_lock = threading.Lock()
# Dtypes whose tensors torch.save writes as plain data (no conjugate or quantized state).
_FRAMED_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
})


def _frame_of(tensor: torch.Tensor) -> _Frame | None:
    """The frame ``torch.save`` puts around ``tensor``, or None where it must run itself."""
    if (
        type(tensor) is not torch.Tensor
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.dtype not in _FRAMED_DTYPES
        or not tensor.is_contiguous()
        or tensor.requires_grad
        or tensor.numel() == 0
        or tensor.numel() * tensor.element_size() > _FRAMED_MAX_BYTES
    ):
        return None
    key = (tensor.dtype, tensor.shape)
    try:
        return _frames[key]
    except KeyError:
        pass
    frame: _Frame | None
    try:
        frame = _Frame(tensor.dtype, tuple(tensor.shape))
    except ValueError:
        frame = None
    with _frames_lock:
        if len(_frames) >= _FRAMES_KEPT:
            _frames.clear()
        _frames[key] = frame
    return frame


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


def data_bytes(item: WriteItem) -> int:
    """A tensor item's raw data bytes (0 for an object)."""
    data = item.tensor_data
    return 0 if data is None else data.size.numel() * data.properties.dtype.itemsize


def estimate_bytes(items: Sequence[WriteItem]) -> int:
    """Bytes the items take on disk, about (an object counts as its slack only)."""
    return sum(_ITEM_OVERHEAD + data_bytes(item) for item in items)


@contextlib.contextmanager
def without_zip_crc32() -> Iterator[None]:
    """``torch.save`` in this block writes its zip records without a CRC-32 (the
    stored field is 0; torch.load reads them as before); the setting is restored after."""
    with _CRC32_SWITCH:
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(previous)


def write_item(
    file: HashingFile,
    data: io.BytesIO | torch.Tensor,
    item: WriteItem,
    transforms: StreamTransforms | None,
) -> list[str] | None:
    """Serialise one item into ``file`` (inside ``without_zip_crc32``); returns its
    transform descriptors (None: none)."""
    out: IO[bytes] = cast(IO[bytes], file)
    descriptors: list[str] = []
    if transforms is not None:
        out, descriptors = transforms.transform_save_stream(item, cast(io.IOBase, file))
    # A transform that places tensors notes where a tensor's data lies in what it is
    # given, so that a reader can decode it straight into the target (``_extensions``).
    placing = out if isinstance(out, TensorPlacingStream) else None
    if isinstance(data, io.BytesIO):
        out.write(data.getbuffer())
    elif (not descriptors or placing is not None) and (frame := _frame_of(data)) is not None:
        # torch.save's bytes without running it: its calls cost more than a small
        # tensor's data. A view's storage may be larger: only its own bytes are written.
        if placing is not None:
            placing.expect_tensor(data)
        (placing or file).write_framed(frame.head, frame.data_of(data), frame.tail)
    else:
        # torch.save streams each storage as a memoryview: no copy in RAM.
        tensor = plain_cpu_tensor(data)
        if not descriptors:  # only untransformed data lies in the file as it is in memory
            file.expect_tensor(tensor)
        elif placing is not None:
            placing.expect_tensor(tensor)
        torch.save(tensor, out)
        del tensor
    if transforms is not None:
        out.close()  # ends the transform (a compressor's last frame); the file stays open
    if placing is not None:
        # The outermost transform's descriptor comes first: as it was, or with where the
        # tensor's data lies.
        descriptors[0] = placing.descriptor
    # As stock: no descriptors field at all for an item without transforms.
    return descriptors or None
