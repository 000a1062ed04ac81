"""Stock DCP's stream extensions (``_extensions=``, ``_extension_registry=``), ours too.

``FileSystemWriter(_extensions=[...])`` passes each item's bytes through the
extensions' streams and records their descriptors in the item's
``_StorageInfo.transform_descriptors``; ``FileSystemReader`` looks the
descriptors up in an ``ExtensionRegistry`` to undo them. ``VolumeWriter``
uses torch's own writer-side transforms, and the reader
undoes them in the order torch's reader does, so the bytes and ``.metadata``
are stock's, both ways. Torch (2.7+) marks the API experimental;
on a torch without it, asking for an extension is refused with a message.
``encryption=`` is one extension that compresses (if asked) and then
encrypts (``_encryption_stream``): the one way to have both that stock
readers undo in the right order.

A transform may also place a tensor item's data itself, so that a load needs
no intermediate buffer: its write stream is a ``TensorPlacingStream`` (told
which tensor an item is, it records where the data lies in the item) and its
reader a ``TensorPlacingExtension`` (it says where, as a ``TensorPlacement``,
and decodes the data straight into the target). The byte format and the
reader's file reads use these types, never a particular transform.
"""

from __future__ import annotations

import abc
import contextlib
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from dcp_volumes._exceptions import CheckpointCorruptError, ConfigurationError, EncryptionError
from dcp_volumes._streams import MemoryReader
from dcp_volumes._torch.checkpoint import (
    ExtensionRegistry,
    SerializationFormat,
    StreamTransformExtension,
    StreamTransforms,
)
from dcp_volumes.checkpoint._compression import ZstdCompression, resolve


class TensorPlacingStream(abc.ABC):
    """A transform's write stream that notes where a tensor item's data lies in what
    it is given, so that its reader can decode the data straight into the target
    (``TensorPlacingExtension``).

    ``descriptor`` is the item's transform descriptor, complete once the stream is
    closed (it may then record where the data lies): the writer stores it in place
    of the one the extension gave before the item was written.
    """

    descriptor: str

    @abc.abstractmethod
    def expect_tensor(self, tensor: torch.Tensor) -> None:
        """The item is ``tensor``, written next by ``torch.save``: note where its data lands."""

    @abc.abstractmethod
    def write_framed(self, head: bytes, data: memoryview, tail: bytes) -> None:
        """One contiguous tensor item as ``torch.save`` lays it out: ``head``, the
        tensor's bytes (``data``), ``tail``; the data's place is noted."""


@dataclass(frozen=True)
class TensorPlacement:
    """Where an item's decoded bytes hold its tensor's data, contiguous: ``nbytes``
    from ``offset``, of a tensor of ``dtype`` and ``shape`` (the whole saved piece)."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class PieceDecoder(abc.ABC):
    """Decodes one stored item's tensor data into its target from the item's bytes as
    they arrive: in pieces that start and end at ``cuts``, in any order, from any
    thread (each piece once). ``finish`` then says whether the target holds the data."""

    cuts: Sequence[int]  # offsets in the stored item where a piece may start or end

    @abc.abstractmethod
    def feed(self, at: int, data: memoryview) -> None:
        """The item's stored bytes from ``at`` (both ends of ``data`` are in ``cuts``)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Every piece was fed: raise unless the target holds the item's data."""


class TensorPlacingExtension(abc.ABC):
    """A reader-side stream transform (built from one item's descriptor) that can decode
    the item's tensor data straight into a target tensor's memory."""

    def piece_decoder(self, stored: int, target: memoryview) -> PieceDecoder | None:
        """A decoder of the item's tensor data into ``target`` (as ``decode_tensor_into``)
        from its ``stored`` bytes as they arrive in pieces; None: the item is decoded
        whole, once all of it is in memory."""
        return None

    @abc.abstractmethod
    def tensor_placement(self) -> TensorPlacement | None:
        """Where the item's decoded bytes hold its tensor's data; None: not recorded
        (the item is undone whole)."""

    @abc.abstractmethod
    def decode_tensor_into(self, input: IO[bytes], target: memoryview) -> bool:
        """Decode the item (``input``, its stored bytes) and put its tensor's data in
        ``target`` (the bytes of a contiguous tensor ``tensor_placement`` describes);
        False: the item cannot be placed, nothing was read."""


def writer_transforms(
    extensions: Sequence[Any] | None,
    compression: str | ZstdCompression | None,
    encryption: Any | None = None,
) -> Any | None:
    """Torch's writer-side transforms for ``_extensions`` plus ``compression`` and
    ``encryption`` (None: none)."""
    chosen = list(extensions or ())
    zstd = resolve(compression)
    if encryption is not None:
        return _encrypting(chosen, zstd, encryption)
    if zstd is not None:
        chosen.append(zstd)
    if not chosen:
        return None
    if StreamTransforms is None:  # pragma: no cover - torch < 2.7
        raise ConfigurationError(
            "_extensions= and compression= need torch >= 2.7, whose DCP has stream "
            "extensions. Upgrade torch, or save without them."
        )
    for ext in chosen:
        if not isinstance(ext, StreamTransformExtension):
            raise ConfigurationError(
                f"_extensions holds {ext!r}, which is not a StreamTransformExtension (from "
                "torch.distributed.checkpoint._extension); only stream transforms change "
                "how items are stored."
            )
    if len(chosen) > 1:
        # Torch's reader undoes a chain in the order it was applied, not the reverse
        # (seen on torch 2.13): a stock reader could not load such a checkpoint.
        raise ConfigurationError(
            f"{len(chosen)} stream transforms were given ({', '.join(map(repr, chosen))}, "
            "counting compression=); stock DCP readers undo a chain of them in the wrong "
            "order, so the checkpoint would not load. Use one: either compression= or a "
            "single _extensions entry."
        )
    return StreamTransforms(chosen)


def _encrypting(chosen: list[Any], zstd: ZstdCompression | None, encryption: Any) -> Any:
    """One extension that compresses (if asked) and then encrypts each item."""
    from dcp_volumes.checkpoint._encryption import Encryption
    from dcp_volumes.checkpoint._encryption_stream import EncryptedStreams

    if not isinstance(encryption, Encryption):
        raise ConfigurationError(
            f"encryption={encryption!r} is not an Encryption: pass "
            "Encryption(key=<32 bytes>, key_id=...) or Encryption.from_env()."
        )
    if chosen:
        raise ConfigurationError(
            "encryption= cannot be combined with _extensions= (stock DCP readers undo a "
            "chain of stream transforms in the wrong order). encryption= compresses too: "
            "pass compression='zstd' beside it."
        )
    if StreamTransforms is None:  # pragma: no cover - torch < 2.7
        raise ConfigurationError(
            "encryption= needs torch >= 2.7, whose DCP has stream extensions. Upgrade torch."
        )
    return StreamTransforms([EncryptedStreams(encryption, zstd)])


def default_registry(encryption: Any | None = None) -> Any | None:
    """Torch's default registry with our zstd decoder (it also reads ``compression.zstd``)
    and our decrypter (keys: ``encryption``, else the environment's)."""
    if ExtensionRegistry is None:  # pragma: no cover - torch < 2.7
        return None
    from dcp_volumes.checkpoint._encryption_stream import registry_for

    return registry_for(encryption)


class ReaderTransforms:
    """Undoes the stream transforms named by an item's descriptors (reader side).

    Args:
        registry: an ``ExtensionRegistry`` as ``FileSystemReader`` takes it;
            ``None``: torch's defaults plus ``ZstdCompression``.
    """

    def __init__(self, registry: Any | None = None, encryption: Any | None = None) -> None:
        if registry is not None and ExtensionRegistry is not None and not isinstance(
            registry, ExtensionRegistry
        ):
            raise ConfigurationError(
                f"_extension_registry={registry!r} is not a torch ExtensionRegistry; build one "
                "with ExtensionRegistry() and register(YourExtension)."
            )
        if encryption is not None:
            from dcp_volumes.checkpoint._encryption import Encryption

            if not isinstance(encryption, Encryption):
                raise ConfigurationError(
                    f"encryption={encryption!r} is not an Encryption: pass "
                    "Encryption(key=<32 bytes>, key_id=...) or Encryption.from_env()."
                )
            if registry is not None:
                from dcp_volumes.checkpoint._encryption_stream import bound_class

                # The caller's registry stays as it is: ours is a copy with the decrypter.
                mine = ExtensionRegistry()
                for cls in registry.extensions.values():
                    mine.register(cls)
                mine.register(bound_class(encryption))
                registry = mine
        self.registry = registry
        self.encryption = encryption
        self._default: Any | None = None  # default_registry(encryption), built once

    def __getstate__(self) -> dict[str, Any]:
        # The default registry holds a class made for these keys (not picklable): it is
        # built again after unpickling.
        return {**self.__dict__, "_default": None}

    def untransform(
        self, req: ReadItem, descriptors: Sequence[str], stream: IO[bytes], where: str
    ) -> IO[bytes]:
        """``stream`` (one stored item) as the bytes the writer's planner produced.

        Reads the item whole into memory. An extension that cannot be found or
        built raises ``ConfigurationError``; one that fails on the bytes,
        ``CheckpointCorruptError``.
        """
        extensions = self._extensions(req, descriptors, where)
        with _decoding_errors(req, descriptors, where):
            # In the order torch's FileSystemReader applies them (stock's format).
            for ext in extensions:
                if isinstance(ext, StreamTransformExtension):
                    stream = ext.transform_from(stream)
            if isinstance(stream, (io.BytesIO, MemoryReader)) and stream.tell() == 0:
                return stream  # already in memory (our decoders' result): no copy
            return io.BytesIO(stream.read())

    def _extensions(self, req: ReadItem, descriptors: Sequence[str], where: str) -> list[Any]:
        """The extensions that undo ``descriptors`` (errors name the item and file)."""
        if ExtensionRegistry is None:  # pragma: no cover - torch < 2.7
            raise CheckpointCorruptError(
                f"{req.storage_index.fqn} in {where} was saved with stream transforms "
                f"{list(descriptors)} that this torch cannot undo; load with torch >= 2.7."
            )
        try:
            return list(self._registry().from_descriptor_list(descriptors))
        except EncryptionError as exc:
            raise type(exc)(f"{req.storage_index.fqn} in {where}: {exc}") from exc
        except ValueError as exc:  # torch's registry: an unknown or unusable extension
            raise ConfigurationError(
                f"{req.storage_index.fqn} in {where} was saved with stream transforms "
                f"{list(descriptors)} that cannot be undone here ({exc}). Fix: pass "
                "VolumeReader(_extension_registry=...) with the extension registered, or "
                "install its library (zstd: pip install 'dcp_volumes[zstd]')."
            ) from exc

    def _registry(self) -> Any:
        """The registry the extensions are looked up in (the default one built once)."""
        if self.registry is not None:
            return self.registry
        if self._default is None:
            self._default = default_registry(self.encryption)
        return self._default

    def placement(self, descriptors: Sequence[str] | None) -> TensorPlacement | None:
        """Where the decoded bytes of the item saved with ``descriptors`` hold its tensor's
        data, if its one transform can put them straight into a target
        (``TensorPlacingExtension``); None: undo the item whole with ``untransform``."""
        placer = self._placer(descriptors)
        return None if placer is None else placer.tensor_placement()

    def _placer(self, descriptors: Sequence[str] | None) -> TensorPlacingExtension | None:
        """The item's one transform, if it places tensors; None also where it cannot be
        built (``untransform`` and ``decode_into`` say why, naming the item and file)."""
        if not descriptors or ExtensionRegistry is None:
            return None
        try:
            return _placer(self._registry().from_descriptor_list(descriptors))
        except Exception:
            return None

    def decode_into(
        self, req: ReadItem, descriptors: Sequence[str], stream: IO[bytes], target: memoryview,
        where: str,
    ) -> bool:
        """Decode a tensor item's data straight into ``target`` (the bytes of a contiguous
        tensor as ``placement`` describes); False: not such an item (undo it with
        ``untransform``), nothing was read."""
        placer = _placer(self._extensions(req, descriptors, where))
        if placer is None:
            return False
        with _decoding_errors(req, descriptors, where):
            return placer.decode_tensor_into(stream, target)


    def piece_decoder(
        self, req: ReadItem, descriptors: Sequence[str], stored: int, target: memoryview,
        where: str,
    ) -> PieceDecoder | None:
        """A decoder that puts a tensor item's data straight into ``target`` (as
        ``decode_into``) from its ``stored`` bytes as they arrive, its errors naming the
        item and the file; None: fetch the item and ``decode_into`` (or ``untransform``)
        it whole, which also reports why it cannot be undone."""
        placer = self._placer(descriptors)
        if placer is None:
            return None
        with _decoding_errors(req, descriptors, where):
            decoder = placer.piece_decoder(stored, target)
        return None if decoder is None else _Named(decoder, req, descriptors, where)


class _Named(PieceDecoder):
    """A piece decoder whose errors name its item and file (``_decoding_errors``)."""

    def __init__(self, inner: PieceDecoder, req: ReadItem, descriptors: Sequence[str],
                 where: str) -> None:
        self.cuts = inner.cuts
        self._inner = inner
        self._about = (req, descriptors, where)

    def feed(self, at: int, data: memoryview) -> None:
        with _decoding_errors(*self._about):
            self._inner.feed(at, data)

    def finish(self) -> None:
        with _decoding_errors(*self._about):
            self._inner.finish()


@contextlib.contextmanager
def _decoding_errors(req: ReadItem, descriptors: Sequence[str], where: str) -> Iterator[None]:
    """What an item's transforms raise on its bytes, naming the item and the file: an
    encryption error as its own kind, anything else as a damaged file."""
    try:
        yield
    except EncryptionError as exc:
        raise type(exc)(f"{req.storage_index.fqn} in {where}: {exc}") from exc
    except Exception as exc:  # what a decoder raises on bad input is its own type
        raise CheckpointCorruptError(
            f"{req.storage_index.fqn} in {where} cannot be decoded by its stream "
            f"transforms {list(descriptors)} ({type(exc).__name__}: {exc}). The file is "
            "damaged; load with verify=True to check it, or load an older checkpoint."
        ) from exc


def _placer(extensions: Sequence[Any]) -> TensorPlacingExtension | None:
    """An item's one transform, if it places tensors (a chain is undone whole)."""
    if len(extensions) == 1 and isinstance(extensions[0], TensorPlacingExtension):
        return extensions[0]
    return None


def check_serialization_format(fmt: Any) -> None:
    """Refuse every ``serialization_format`` but stock's ``TORCH_SAVE`` (None: the default)."""
    if fmt is None:
        return
    name = getattr(fmt, "value", fmt)
    if name == "torch_save":
        return
    if name == "safetensors":
        raise ConfigurationError(
            "VolumeWriter writes DCP's torch_save format (what FileSystemReader, FsspecReader "
            "and VolumeReader load item by item); serialization_format=SAFETENSORS writes "
            "files only torch's HuggingFace reader understands. Fix: drop "
            "serialization_format, or use torch's HuggingFaceStorageWriter for safetensors."
        )
    known = [f.value for f in SerializationFormat] if SerializationFormat is not None else []
    raise ConfigurationError(
        f"serialization_format={fmt!r} is unknown (torch offers {known}); VolumeWriter writes "
        "SerializationFormat.TORCH_SAVE."
    )
