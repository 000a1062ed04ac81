"""The encrypted item format, as a DCP ``StreamTransformExtension`` stock readers can use.

Each stored item (what DCP's stream transforms see: one tensor's or one
blob's bytes) becomes::

    header | frame 0 | frame 1 | ... | frame n-1 (final)
    header = MAGIC, flags (bit 0: zstd inside), frame size, key check,
             stream id (16 random bytes), key id
    frame  = nonce (12 random bytes) | AES-256-GCM(plaintext frame) | tag (16)

Every frame's associated data is the whole header plus the frame's index and
a final-frame flag: a frame moved to another index, dropped, repeated, taken
from another item or file (another stream id), or a stream cut at a frame
boundary (its last frame then lacks the final flag) fails authentication.
The item's descriptor in ``.metadata``
(``dcp_volumes.aes256gcm/1;key=ID;stream=HEX[;zstd]``) repeats the key id and
stream id, so swapping two whole items' bytes is refused too. The key check
(an HMAC of a constant) tells "wrong key" from "altered bytes".

A contiguous tensor's item written by ``VolumeWriter`` also records where its
data lies in the plaintext, with its dtype and shape (version 2:
``...;tensor=OFFSET:NBYTES:DTYPE:SHAPE``), and binds that field into the final
frame's associated data: ``VolumeReader`` then decrypts the data frames
straight into the target tensor (no ``torch.load``, no buffer; the writer's
stream is a ``TensorPlacingStream``, the reader's extension a
``TensorPlacingExtension``), and an altered field fails authentication like an
altered frame. Stock readers given the extension decrypt the item whole and
``torch.load`` it as before.

Compression composes inside one extension (compress, then encrypt): torch's
readers undo a chain of extensions in the wrong order, so a chain could not be
read back by them.
"""

from __future__ import annotations

import bisect
import io
import os
import struct
import sys
import threading
from typing import IO, Any, ClassVar, cast

import numpy as np
import torch

from dcp_volumes._exceptions import CheckpointTamperedError, EncryptionKeyError
from dcp_volumes._streams import MemoryReader
from dcp_volumes._torch.checkpoint import ExtensionRegistry, StreamTransformExtension
from dcp_volumes.checkpoint._compression import ZstdCompression
from dcp_volumes.checkpoint._encryption import Encryption, key_check, require_cipher
from dcp_volumes.checkpoint._extensions import (
    PieceDecoder,
    TensorPlacement,
    TensorPlacingExtension,
    TensorPlacingStream,
)

__all__ = ["REGISTRY_NAME", "EncryptedStreams", "describe", "registry_for"]

REGISTRY_NAME = "dcp_volumes.aes256gcm"
FORMAT_VERSION = "1"
# Items whose final frame binds where the tensor's data lies (the descriptor's tensor=).
TENSOR_FORMAT_VERSION = "2"
_READABLE_VERSIONS = frozenset({FORMAT_VERSION, TENSOR_FORMAT_VERSION})
MAGIC = b"DCPVENC1"
FRAME_SIZE = 1 << 20
NONCE_BYTES = 12
TAG_BYTES = 16
_FRAME_OVERHEAD = NONCE_BYTES + TAG_BYTES
_ZSTD_FLAG = 0x01
_FIXED = struct.Struct(">8sBI8s16sB")  # magic, flags, frame size, key check, stream id, id len
_FRAME_AAD = struct.Struct(">QB")  # frame index, final flag
# A header naming a larger frame is damage, not a format (and would ask for its memory).
_MAX_FRAME_SIZE = 64 << 20

_CHECK_AT = 8 + 1 + 4  # the key check's offset in the header (after magic, flags, frame size)
# Each reading thread's scratch frame (_edge_frame).
_EDGE = threading.local()
# The descriptor of the item this thread is writing: torch asks for descriptors right
# after transform_to, in the same thread, and the writer's threads share one extension.
_WRITING = threading.local()


def _descriptor(key_id: str, stream_id: bytes | None, zstd: bool) -> str:
    parts = [f"{REGISTRY_NAME}/{FORMAT_VERSION}", f"key={key_id}"]
    if stream_id is not None:
        parts.append(f"stream={stream_id.hex()}")
    if zstd:
        parts.append("zstd")
    return ";".join(parts)


def describe(descriptors: Any) -> str | None:
    """The key id an item's transform descriptors name, if it is encrypted by us."""
    for desc in descriptors or ():
        if isinstance(desc, str) and desc.startswith(REGISTRY_NAME + "/"):
            return _parse_version(desc.partition("/")[2]).get("key")
    return None


def _parse_version(version: str) -> dict[str, str]:
    head, *rest = version.split(";")
    fields = {"version": head}
    for part in rest:
        name, _, value = part.partition("=")
        fields[name] = value or "1"
    return fields


class _FrameWriter(io.RawIOBase, TensorPlacingStream):
    """Encrypts what is written to it into ``output``, frame by frame; ``close`` writes the
    final frame (possibly empty) and leaves ``output`` open.

    A tensor announced with ``expect_tensor`` (or written with ``write_framed``) has its
    data's place in the plaintext noted: ``close`` binds it, with the dtype and shape,
    into the final frame's associated data, and ``descriptor`` records it, so that a
    reader may decrypt the data straight into its target tensor.
    """

    def __init__(self, cipher: Any, header: bytes, output: IO[bytes], descriptor: str) -> None:
        super().__init__()
        self._cipher = cipher
        self._header = header
        self._out = output
        self._buf = bytearray()
        self._index = 0
        self._pos = 0  # plaintext bytes written so far
        self._sealed: bytearray | None = None  # reused for whole frames' ciphertext
        self._expected: tuple[int, int, str] | None = None  # address, nbytes, dtype:shape
        self._tensor: str | None = None  # the tensor field, once its data went by
        self.descriptor = descriptor
        output.write(header)

    def writable(self) -> bool:
        return True

    def expect_tensor(self, tensor: torch.Tensor) -> None:
        """The item is ``tensor`` (as ``torch.save`` writes it): note where its data lands."""
        nbytes = tensor.numel() * tensor.element_size()
        self._expected = None
        if nbytes and tensor.is_contiguous() and sys.byteorder == "little":
            self._expected = (tensor.data_ptr(), nbytes, _tensor_kind(tensor.dtype, tensor.shape))

    def write_framed(self, head: bytes, data: memoryview, tail: bytes) -> None:
        """One contiguous tensor item as ``torch.save`` lays it out (``_byte_format._Frame``)."""
        self.write(head)
        self._note(data.nbytes, self._expected[2] if self._expected else None)
        self.write(data)
        self.write(tail)

    def _note(self, nbytes: int, kind: str | None) -> None:
        self._expected = None
        if kind is not None and self._tensor is None:
            self._tensor = f"{self._pos}:{nbytes}:{kind}"

    def _emit(self, data: Any, final: bool) -> None:
        nonce = os.urandom(NONCE_BYTES)
        aad = _frame_aad(self._header, self._index, final, self._tensor)
        self._out.write(nonce)
        if len(data) < FRAME_SIZE:  # a small item's only frame: no buffer to keep
            self._out.write(self._cipher.encrypt(nonce, data, aad))
        else:
            if self._sealed is None:
                self._sealed = bytearray(FRAME_SIZE + TAG_BYTES)
            sealed = memoryview(self._sealed)
            self._cipher.encrypt_into(nonce, data, aad, sealed)
            self._out.write(sealed)  # written out before the next frame reuses the buffer
        self._index += 1

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        expected = self._expected
        if expected is not None and n == expected[1] and _address(view) == expected[0]:
            self._note(n, expected[2])
        if self._buf:
            take = min(FRAME_SIZE - len(self._buf), len(view))
            self._buf += view[:take]
            view = view[take:]
            if not view:  # a full buffer may still be the final frame: hold it
                self._pos += n
                return n
            self._emit(self._buf, final=False)
            self._buf = bytearray()
        # More than a frame left: its whole frames go out without a copy.
        while len(view) > FRAME_SIZE:
            self._emit(view[:FRAME_SIZE], final=False)
            view = view[FRAME_SIZE:]
        self._buf += view
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                if self._tensor is not None:
                    # Version 2: the final frame binds the tensor field (older readers
                    # would fail its authentication, so they are told to upgrade).
                    rest = self.descriptor.partition(";")[2]
                    self.descriptor = (f"{REGISTRY_NAME}/{TENSOR_FORMAT_VERSION};{rest}"
                                       f";tensor={self._tensor}")
                self._emit(bytes(self._buf), final=True)
                self._buf = bytearray()
                self._out.flush()
            finally:
                super().close()


def _header(zstd: bool, key: bytes, stream_id: bytes, key_id: str) -> bytes:
    """An item's header, as its writer writes it (and a piece decoder expects it)."""
    encoded = key_id.encode()
    return _FIXED.pack(MAGIC, _ZSTD_FLAG if zstd else 0, FRAME_SIZE, key_check(key),
                       stream_id, len(encoded)) + encoded


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _tensor_kind(dtype: Any, shape: Any) -> str:
    """``dtype:shape`` as the tensor field writes it (``float32:4x8``; a scalar: ``float32:``)."""
    return f"{str(dtype).removeprefix('torch.')}:{'x'.join(str(int(d)) for d in shape)}"


def _frame_aad(header: bytes, index: int, final: bool, tensor: str | None) -> bytes:
    aad = header + _FRAME_AAD.pack(index, final)
    if final and tensor is not None:
        aad += b"tensor=" + tensor.encode("ascii")
    return aad


def _placement(fields: dict[str, str]) -> TensorPlacement | None:
    """Where an item's plaintext holds its tensor's data, from its descriptor's fields
    (the tensor field); None: not recorded, unreadable, or compressed."""
    if "zstd" in fields or "tensor" not in fields:
        return None
    try:
        at, nbytes, dtype_name, shape = fields["tensor"].split(":")
        offset, size = int(at), int(nbytes)
        dims = tuple(int(d) for d in shape.split("x")) if shape else ()
    except ValueError:
        return None
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        return None  # a dtype this torch lacks: the item is undone whole
    return TensorPlacement(offset, size, dtype, dims)


class _Compressed(io.RawIOBase):
    """Writes go through the compressor into the frames; ``close`` ends both, in order
    (the compressor leaves what it writes into open)."""

    def __init__(self, compressor: IO[bytes], frames: _FrameWriter) -> None:
        super().__init__()
        self._compressor = compressor
        self._frames = frames

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._compressor.write(b)
        return len(memoryview(b))

    def close(self) -> None:
        if not self.closed:
            try:
                self._compressor.close()
                self._frames.close()
            finally:
                super().close()


# The placing side first: on a torch without extensions, StreamTransformExtension is object.
class EncryptedStreams(TensorPlacingExtension, StreamTransformExtension):
    """AES-256-GCM (after optional zstd) of every checkpoint item, as a DCP extension.

    Writers take an instance (``VolumeWriter(encryption=...)`` builds it);
    readers find the class in an ``ExtensionRegistry`` by its registry name.
    ``registry_for(enc)`` registers a subclass bound to ``enc``'s keys; the
    class itself, unbound, takes the key from ``Encryption.from_env()``.
    """

    encryption: ClassVar[Encryption | None] = None  # the keys of a bound subclass

    def __init__(
        self,
        encryption: Encryption,
        compression: ZstdCompression | None = None,
        *,
        expected: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self._encryption = encryption
        self._compression = compression
        self._expected = expected or {}  # a reader's: what the item's descriptor says

    def __repr__(self) -> str:
        return f"EncryptedStreams({self._encryption!r}, compression={self._compression!r})"

    @staticmethod
    def registry_name() -> str:
        return REGISTRY_NAME

    @classmethod
    def from_descriptor(cls, version: str) -> EncryptedStreams:
        """The decrypter for one item's descriptor (its key id, stream id, compression)."""
        fields = _parse_version(version)
        if fields["version"].partition(".")[0] not in _READABLE_VERSIONS:
            raise ValueError(
                f"Unknown {REGISTRY_NAME} version {fields['version']!r}: this checkpoint was "
                "written by a newer dcp_volumes; upgrade it to read the checkpoint."
            )
        key_id = fields.get("key", "")
        encryption = cls.encryption
        if encryption is None:
            try:
                encryption = Encryption.from_env()
            except Exception:
                raise EncryptionKeyError(
                    f"this item is encrypted (key id {key_id!r}) and no key was given. Fix: "
                    "pass encryption=Encryption(key=..., key_id=...) to VolumeReader or "
                    "CheckpointManager, register enc.extension_registry() with a stock "
                    "reader, or set DCP_VOLUMES_ENCRYPTION_KEY."
                ) from None
        if encryption.key_for(key_id) is None:
            raise _key_not_held(key_id, encryption)
        compression = ZstdCompression.from_descriptor("1") if "zstd" in fields else None
        return cls(encryption, compression, expected=fields)

    def get_descriptor(self) -> str:
        writing = getattr(_WRITING, "descriptor", None)
        if writing is not None:
            return cast(str, writing)
        return _descriptor(self._encryption.key_id, None, self._compression is not None)

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        """A stream that (compresses and) encrypts what is written to it into ``output``."""
        enc = self._encryption
        stream_id = os.urandom(16)
        zstd = self._compression is not None
        header = _header(zstd, enc.key, stream_id, enc.key_id)
        descriptor = _descriptor(enc.key_id, stream_id, zstd)
        frames = _FrameWriter(require_cipher()(enc.key), header, output, descriptor)
        _WRITING.descriptor = descriptor
        if self._compression is None:
            return cast(IO[bytes], frames)
        compressor = self._compression.transform_to(cast(IO[bytes], frames))
        return cast(IO[bytes], _Compressed(compressor, frames))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        """``input`` (one stored item) authenticated, decrypted (and decompressed) into memory."""
        plain = MemoryReader(self._decrypt(_whole(input)))
        if self._compression is not None:
            return self._compression.transform_from(cast(IO[bytes], plain))
        return cast(IO[bytes], plain)

    def tensor_placement(self) -> TensorPlacement | None:
        """Where this item's plaintext holds its tensor's data (its descriptor's tensor
        field, bound into its final frame); None: not recorded, or compressed."""
        return None if self._compression is not None else _placement(self._expected)

    def decode_tensor_into(self, input: IO[bytes], target: memoryview) -> bool:
        """Decrypt the item's tensor data straight into ``target`` (the bytes of a contiguous
        tensor of the dtype and shape its descriptor's tensor field names); False: the item
        has no such field (or ``target`` does not fit it), nothing was read."""
        placement = self.tensor_placement()
        if placement is None or placement.nbytes != len(target):
            return False
        self._decrypt(_whole(input), into=(placement.offset, target))
        return True

    def piece_decoder(self, stored: int, target: memoryview) -> PieceDecoder | None:
        """A decrypter of the item's tensor data into ``target`` from its ``stored`` bytes
        as they arrive, a frame at a time (``_FrameDecoder``); None: as
        ``decode_tensor_into`` (no tensor field, or ``target`` does not fit it)."""
        placement = self.tensor_placement()
        if placement is None or placement.nbytes != len(target):
            return None
        return _FrameDecoder(self._encryption, self._expected, stored, placement, target)

    def _decrypt(
        self, data: memoryview, into: tuple[int, memoryview] | None = None
    ) -> memoryview:
        """The plaintext of ``data``; with ``into`` (offset, view): the plaintext bytes from
        that offset land in the view instead (the rest in a scratch frame), nothing returned."""
        if len(data) < _FIXED.size or bytes(data[:8]) != MAGIC:
            raise _tampered("its encryption header is missing or damaged")
        _, flags, frame_size, check, stream_id, id_len = _FIXED.unpack_from(data)
        header_end = _FIXED.size + id_len
        key_id = bytes(data[_FIXED.size:header_end]).decode("ascii", "replace")
        header = bytes(data[:header_end])
        want = self._expected
        if (
            key_id != want.get("key", key_id)
            or stream_id.hex() != want.get("stream", stream_id.hex())
            or bool(flags & _ZSTD_FLAG) != ("zstd" in want if want else bool(flags & _ZSTD_FLAG))
            or not 0 < frame_size <= _MAX_FRAME_SIZE
        ):
            raise _header_mismatch()
        key = self._encryption.key_for(key_id)
        if key is None:  # from_descriptor checked it already
            raise _key_not_held(key_id, self._encryption)
        cipher = require_cipher()(key)
        body = data[header_end:]
        record = frame_size + _FRAME_OVERHEAD
        count = max(1, -(-len(body) // record))
        total = max(0, len(body) - count * _FRAME_OVERHEAD)
        # Uninitialised: every byte is decrypted into it (zero-filling costs a copy's time).
        out = memoryview(np.empty(0 if into else total, dtype=np.uint8))  # type: ignore[arg-type]
        scratch: memoryview | None = None
        wrong_check = check != key_check(key)
        tensor = want.get("tensor")  # bound into the final frame by who wrote it
        from cryptography.exceptions import InvalidTag

        for i in range(count):
            frame = body[i * record:(i + 1) * record]
            final = i == count - 1
            if len(frame) < _FRAME_OVERHEAD:
                raise _tampered("it is truncated")
            size = len(frame) - _FRAME_OVERHEAD
            pos = i * frame_size
            edge = False
            if into is None:
                dest = out[pos:pos + size]
            elif into[0] <= pos and pos + size <= into[0] + len(into[1]):
                dest = into[1][pos - into[0]:pos - into[0] + size]  # wholly the tensor's data
            else:
                if scratch is None:
                    scratch = memoryview(np.empty(frame_size, dtype=np.uint8))  # type: ignore[arg-type]
                dest, edge = scratch[:size], True
            try:
                cipher.decrypt_into(frame[:NONCE_BYTES], frame[NONCE_BYTES:],
                                    _frame_aad(header, i, final, tensor), dest)
            except InvalidTag:
                if wrong_check:
                    raise _wrong_key(key_id) from None
                raise _frame_failed(i, count) from None
            wrong_check = False  # a frame opened: the key is right, the header was altered
            if into is not None and edge:
                # The part of a head, tail or edge frame that is the tensor's data.
                lo = max(pos, into[0])
                hi = min(pos + size, into[0] + len(into[1]))
                if lo < hi:
                    into[1][lo - into[0]:hi - into[0]] = dest[lo - pos:hi - pos]
        if check != key_check(key):
            raise _check_altered()
        if into is not None and total < into[0] + len(into[1]):
            raise _ends_early()
        return out


class _FrameDecoder(PieceDecoder):
    """Decrypts one item's frames straight into its tensor's bytes as they arrive, in any
    order, from any thread.

    Each frame authenticates on its own against the header the item must have (rebuilt
    from its descriptor and the key), so no frame waits for the stored header; that
    header, when it arrives, must equal the rebuilt one. Where the two differ only in
    the key check, the frames tell a wrong key (none opens) from an altered check (they
    open), whichever arrives first.
    """

    def __init__(self, encryption: Encryption, fields: dict[str, str], stored: int,
                 placement: TensorPlacement, target: memoryview) -> None:
        key_id = fields.get("key", "")
        key = encryption.key_for(key_id)
        if key is None:  # from_descriptor checked it already
            raise _key_not_held(key_id, encryption)
        try:
            stream_id = bytes.fromhex(fields.get("stream", ""))
        except ValueError:
            raise _header_mismatch() from None
        self._key, self._key_id = key, key_id
        self._header = _header(False, key, stream_id, key_id)
        self._tensor = fields.get("tensor")
        head, record = len(self._header), FRAME_SIZE + _FRAME_OVERHEAD
        count = max(1, -(-(stored - head) // record))
        last = stored - head - (count - 1) * record
        if last < _FRAME_OVERHEAD:
            raise _tampered("it is truncated")
        if stored - head - count * _FRAME_OVERHEAD < placement.offset + placement.nbytes:
            raise _ends_early()
        self.cuts = [0, *(head + i * record for i in range(count)), stored]
        self._count = count
        self._data_at = placement.offset  # where the tensor's data starts in the plaintext
        self._target = target
        self._lock = threading.Lock()
        self._fed = 0  # header and frames decoded so far
        self._stored_header: bytes | None = None
        self._opened = False  # a frame authenticated
        self._failed: int | None = None  # the first frame that did not

    def feed(self, at: int, data: memoryview) -> None:
        cuts = self.cuts
        unit = bisect.bisect_left(cuts, at)
        if cuts[unit] != at or at + len(data) not in cuts:
            raise ValueError(f"a piece [{at}, {at + len(data)}) not cut at a frame's bounds")
        pos = 0
        while pos < len(data):
            size = cuts[unit + 1] - cuts[unit]
            piece = data[pos:pos + size]
            if unit == 0:
                self._take_header(bytes(piece))
            else:
                self._open(unit - 1, piece)
            pos += size
            unit += 1

    def finish(self) -> None:
        with self._lock:
            if self._fed != self._count + 1:
                raise _tampered("not all of it arrived")
            self._judge()

    def _take_header(self, stored: bytes) -> None:
        with self._lock:
            self._stored_header = stored
            self._fed += 1
            self._judge()

    def _open(self, index: int, frame: memoryview) -> None:
        from cryptography.exceptions import InvalidTag

        pos, size = index * FRAME_SIZE, len(frame) - _FRAME_OVERHEAD
        lo, target = self._data_at, self._target
        edge = not (lo <= pos and pos + size <= lo + len(target))
        dest = _edge_frame()[:size] if edge else target[pos - lo:pos - lo + size]
        final = index == self._count - 1
        try:
            require_cipher()(self._key).decrypt_into(
                frame[:NONCE_BYTES], frame[NONCE_BYTES:],
                _frame_aad(self._header, index, final, self._tensor), dest)
        except InvalidTag:
            with self._lock:
                self._fed += 1
                if self._failed is None:
                    self._failed = index
                self._judge()
            return
        if edge:  # the part of a head, tail or edge frame that is the tensor's data
            a, b = max(pos, lo), min(pos + size, lo + len(target))
            if a < b:
                target[a - lo:b - lo] = dest[a - pos:b - pos]
        with self._lock:
            self._fed += 1
            self._opened = True
            self._judge()

    def _judge(self) -> None:
        """Raise what is known to be wrong (under the lock)."""
        stored = self._stored_header
        if stored is None:
            return  # a frame that failed is judged once the header is known
        expected = self._header
        only_check = len(stored) == len(expected) and (
            stored[:_CHECK_AT] + stored[_CHECK_AT + 8:]
            == expected[:_CHECK_AT] + expected[_CHECK_AT + 8:]
        )
        if stored == expected:
            if self._failed is not None:
                raise _frame_failed(self._failed, self._count)
        elif not only_check:
            raise _header_mismatch()
        elif self._failed is not None:
            raise _wrong_key(self._key_id)
        elif self._opened:
            raise _check_altered()


def _edge_frame() -> memoryview:
    """This thread's frame of scratch, for frames only partly the tensor's data."""
    frame = getattr(_EDGE, "frame", None)
    if frame is None:
        frame = _EDGE.frame = memoryview(np.empty(FRAME_SIZE, dtype=np.uint8))  # type: ignore[arg-type]
    return cast(memoryview, frame)


def _whole(input: IO[bytes]) -> memoryview:
    """One stored item's bytes: an item already in memory (fetched bytes, a BytesIO) in place."""
    whole = getattr(input, "getbuffer", None)
    return memoryview(whole()) if callable(whole) else memoryview(input.read())


def _key_not_held(key_id: str, encryption: Encryption) -> EncryptionKeyError:
    return EncryptionKeyError(
        f"this item is encrypted with key id {key_id!r}, and the key given holds only "
        f"{encryption.key_ids}. Fix: add that key, e.g. "
        f"Encryption(key=..., key_id=..., previous={{{key_id!r}: old_key}})."
    )


def _wrong_key(key_id: str) -> EncryptionKeyError:
    return EncryptionKeyError(
        f"the key given for key id {key_id!r} is not the key this item was "
        "encrypted with. Fix: pass the key that wrote the checkpoint."
    )


def _frame_failed(index: int, count: int) -> CheckpointTamperedError:
    return _tampered(f"authentication of frame {index} of {count} failed")


def _header_mismatch() -> CheckpointTamperedError:
    return _tampered("its encryption header does not match what .metadata records for it")


def _check_altered() -> CheckpointTamperedError:
    return _tampered("its key check was altered")


def _ends_early() -> CheckpointTamperedError:
    return _tampered("it ends before its tensor's data")


def _tampered(why: str) -> CheckpointTamperedError:
    return CheckpointTamperedError(
        f"authentication failed: {why}. The stored bytes were altered, truncated, "
        "reordered or copied from another file; load an older checkpoint (or re-upload "
        "this one from an intact copy)."
    )


def registry_for(encryption: Encryption | None) -> Any:
    """A torch ``ExtensionRegistry`` with zstd and our decrypter (bound to ``encryption``'s
    keys; ``None``: the key from the environment)."""
    registry = ExtensionRegistry()
    registry.register(ZstdCompression)
    registry.register(bound_class(encryption))
    return registry


def bound_class(encryption: Encryption | None) -> type[EncryptedStreams]:
    """``EncryptedStreams`` reading with ``encryption``'s keys (``None``: the environment's)."""
    if encryption is None:
        return EncryptedStreams
    return type("EncryptedStreams", (EncryptedStreams,), {"encryption": encryption})
