"""The Hugging Face layout of a model in files: which tensor goes in which file,
the files' names, and ``model.safetensors.index.json``.

Tensors are packed in the order given into files of at most ``max_shard_size``
bytes, as ``huggingface_hub.split_torch_state_dict_into_shards`` (what
``save_pretrained`` calls) packs them: a tensor that would tip a file over the
limit starts the next one; a tensor larger than the limit gets a file of its own.
Files are named ``model-00001-of-0000N.safetensors`` (``model.safetensors``
when there is one), and the index, ``json.dumps(..., indent=2, sort_keys=True)``
as ``save_pretrained`` writes it, maps every tensor to its file. The index is
written for one file too: it is the export's commit marker.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dcp_volumes.safetensors._format import SafetensorsError

#: The index's name, as transformers names it.
INDEX_NAME = "model.safetensors.index.json"
#: The one file of a model that fits in one.
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class Planned:
    """A tensor to write: its name, the bytes it takes in the file and its element count."""

    name: str
    nbytes: int
    numel: int


def file_name(index: int, count: int) -> str:
    """The name of file ``index`` (0-based) of ``count``, as transformers names them."""
    if count == 1:
        return SINGLE_NAME
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def split_into_files(tensors: Sequence[Planned], max_shard_size: int) -> list[list[Planned]]:
    """The tensors of each file, packed in order (huggingface_hub's rule)."""
    files: list[list[Planned]] = []
    current: list[Planned] = []
    size = 0
    for tensor in tensors:
        if tensor.nbytes > max_shard_size:
            files.append([tensor])
            continue
        if current and size + tensor.nbytes > max_shard_size:
            files.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.nbytes
    if current:
        files.append(current)
    return files


def index_document(files: Sequence[Sequence[Planned]]) -> bytes:
    """``model.safetensors.index.json`` for these files, as ``save_pretrained`` writes it."""
    weight_map = {t.name: file_name(i, len(files)) for i, ts in enumerate(files) for t in ts}
    doc = {
        "metadata": {
            "total_parameters": sum(t.numel for ts in files for t in ts),
            "total_size": sum(t.nbytes for ts in files for t in ts),
        },
        "weight_map": weight_map,
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def parse_index(data: bytes, where: str) -> dict[str, str]:
    """The weight map (tensor -> file name) of an index, checked: every file name is a
    plain name in the same directory."""
    try:
        doc: Any = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{where} is not JSON ({exc}).") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise SafetensorsError(f"{where} has no weight_map of tensor names to file names.")
    for name, file in weight_map.items():
        if not file or "/" in file or "\\" in file or file in (".", ".."):
            raise SafetensorsError(
                f"{where}: tensor {name!r} is mapped to {file!r}, which is not a file name in "
                "the model's directory; the index is refused."
            )
    return dict(weight_map)
