"""The safetensors file format: the header, written as the ``safetensors`` library
writes it and parsed with its checks.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON (padded
with spaces to a multiple of 8), then the tensors' bytes back to back. The JSON
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets into the data that follows the header) and may hold ``__metadata__``
(strings only; ``{"format": "pt"}`` for torch). The library orders tensors by
dtype (widest first, its enum order) then name, and so do we: a file written
here is byte for byte what ``safetensors.torch.save`` writes for the same tensors.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dcp_volumes._exceptions import CheckpointCorruptError

#: Bytes of the little-endian header length in front of every file.
LENGTH_BYTES = 8
# safetensors refuses headers larger than this; so do we (a hostile length
# must not make a reader allocate gigabytes).
MAX_HEADER_BYTES = 100_000_000
#: What the first ranged read of a file asks for: the length and, usually, the whole header.
FIRST_READ_BYTES = 64 * 1024

# safetensors' dtype names in its enum order (the order files sort by, widest
# last), with the torch dtype of each this torch has.
_DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu", "I16": "int16",
    "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
    "F32": "float32", "C64": "complex64", "F64": "float64", "I64": "int64", "U64": "uint64",
}
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in _TORCH_NAMES.items() if hasattr(torch, attr)
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}
_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}


class SafetensorsError(CheckpointCorruptError):
    """A safetensors file or index that cannot be read as it claims (bad header,
    overlapping or out-of-file offsets, an unknown dtype, a missing file, a
    tensor whose shape disagrees with the target)."""


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise SafetensorsError(
            f"safetensors cannot store dtype {dtype}. Fix: cast the tensor to one it knows "
            f"({', '.join(sorted(str(d) for d in _NAMES))})."
        ) from None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its name, dtype, shape and byte span in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A file's parsed header: where its data starts and its tensors by name."""

    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layout(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[TensorEntry]]:
    """The header bytes (length included) of a file holding ``tensors`` (name, dtype,
    shape), and where each tensor's bytes go, in the order safetensors writes them."""
    ordered = sorted(tensors, key=lambda t: (-_RANK[dtype_name(t[1])], t[0]))
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    spans = []
    offset = 0
    for name, dtype, shape in ordered:
        nbytes = _numel(shape) * dtype.itemsize
        doc[name] = {"dtype": dtype_name(dtype), "shape": [int(d) for d in shape],
                     "data_offsets": [offset, offset + nbytes]}
        spans.append((name, dtype, tuple(int(d) for d in shape), offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    start = LENGTH_BYTES + len(text)
    entries = [TensorEntry(n, d, s, start + b, start + e) for n, d, s, b, e in spans]
    return struct.pack("<Q", len(text)) + text, entries


def header_length(first: bytes, where: str) -> int:
    """The JSON header's length from a file's first bytes (checked against the limit)."""
    if len(first) < LENGTH_BYTES:
        raise SafetensorsError(
            f"{where} is not a safetensors file: {len(first)} bytes, shorter than the "
            "8-byte header length. Fix: re-export or re-upload the file."
        )
    (length,) = struct.unpack("<Q", first[:LENGTH_BYTES])
    if length > MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"{where}: the header length {length} is larger than safetensors allows "
            f"({MAX_HEADER_BYTES}); the file is damaged or not a safetensors file."
        )
    return int(length)


def parse_header(raw: bytes, file_size: int | None, where: str) -> Header:
    """Parse the JSON header ``raw`` (without the 8-byte length) of a file of
    ``file_size`` bytes, with safetensors' checks; errors name the file and tensor."""
    data_start = LENGTH_BYTES + len(raw)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{where}: the header is not JSON ({exc}).") from None
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{where}: the header is not a JSON object.")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError(f"{where}: __metadata__ must map strings to strings.")
    tensors: dict[str, TensorEntry] = {}
    for name, info in doc.items():
        tensors[name] = _entry(name, info, data_start, where)
    end = data_start
    for entry in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
        if entry.start < end:
            raise SafetensorsError(
                f"{where}: the bytes of tensor {entry.name!r} overlap another tensor's "
                f"(they start at data offset {entry.start - data_start}, before "
                f"{end - data_start}). The file is damaged or hostile; it is not loaded."
            )
        if entry.start > end:
            raise SafetensorsError(
                f"{where}: a gap before tensor {entry.name!r} (data offset "
                f"{entry.start - data_start}, expected {end - data_start}); safetensors "
                "refuses such files."
            )
        end = entry.end
    if file_size is not None and end != file_size:
        last = max(tensors.values(), key=lambda e: e.end).name if tensors else "(none)"
        raise SafetensorsError(
            f"{where}: the header's tensors end at byte {end} (last: {last!r}) but the file "
            f"has {file_size} bytes; it is truncated or damaged. Fix: re-export or re-upload it."
        )
    return Header(data_start, tensors, {str(k): str(v) for k, v in metadata.items()})


def _entry(name: str, info: Any, data_start: int, where: str) -> TensorEntry:
    if not isinstance(info, dict):
        raise SafetensorsError(f"{where}: the entry of tensor {name!r} is not an object.")
    named = info.get("dtype")
    dtype = TORCH_DTYPES.get(named) if isinstance(named, str) else None
    if dtype is None:
        why = "this torch cannot hold" if named in _RANK else "safetensors does not know"
        raise SafetensorsError(f"{where}: tensor {name!r} has dtype {named!r}, which {why}.")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)):
        raise SafetensorsError(
            f"{where}: tensor {name!r} needs a shape of non-negative ints and data_offsets "
            f"[begin, end]; got shape={shape!r}, data_offsets={offsets!r}."
        )
    begin, end = offsets
    if end < begin or end - begin != _numel(shape) * dtype.itemsize:
        raise SafetensorsError(
            f"{where}: tensor {name!r} of shape {shape} and dtype {info['dtype']} needs "
            f"{_numel(shape) * dtype.itemsize} bytes but its data_offsets {offsets} span "
            f"{end - begin}."
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)
