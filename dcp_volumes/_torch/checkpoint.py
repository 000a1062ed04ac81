"""What the checkpoint side takes from torch beyond its stable public API.

Version guards (DCP features newer than the oldest torch we support, 2.6) and
the private names the writer, reader and stager need, each behind one alias or
function (see ``dcp_volumes._torch``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from dcp_volumes._streams import MemoryReader

__all__ = [
    "DCP_VERSION",
    "EXTENSIONS_AVAILABLE",
    "STAGING_FUTURES",
    "ExtensionRegistry",
    "SerializationFormat",
    "StorageInfo",
    "StreamTransformExtension",
    "StreamTransforms",
    "ZStandard",
    "copy_state_dict",
    "copy_tensors",
    "create_cpu_state_dict",
    "load_tensor_in_place",
]

# DCP's record of where an item lies in a file (relative path, offset, length):
# ``.metadata`` holds these, and stock readers accept only this very type.
StorageInfo = _StorageInfo

# The format version stock writers stamp into ``.metadata`` (torch >= 2.7).
try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    DCP_VERSION: str | None = CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover - torch < 2.7
    DCP_VERSION = None

# ``dcp.async_save`` takes a stager's future and answers ``AsyncSaveResponse`` (torch >= 2.9).
try:
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    STAGING_FUTURES = AsyncSaveResponse is not None
except ImportError:  # pragma: no cover - torch < 2.9
    STAGING_FUTURES = False

# DCP's stream extensions (torch >= 2.7, experimental: a private module) and the
# writer's chain of them.
try:
    from torch.distributed.checkpoint._extension import (
        ExtensionRegistry,
        StreamTransformExtension,
        ZStandard,
    )
    from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

    StreamTransforms: Any = _StorageWriterTransforms
except ImportError:  # pragma: no cover - torch < 2.7
    ExtensionRegistry = None  # type: ignore[misc,assignment]
    StreamTransformExtension = object  # type: ignore[misc,assignment]
    ZStandard = None  # type: ignore[misc,assignment]
    StreamTransforms = None

EXTENSIONS_AVAILABLE = ZStandard is not None

# The item formats of stock writers (torch >= 2.8).
try:
    from torch.distributed.checkpoint.filesystem import SerializationFormat
except ImportError:  # pragma: no cover - torch < 2.8
    SerializationFormat = None  # type: ignore[misc,assignment]

# torch.distributed's state-dict copy helpers (private): without them the
# public BlockingAsyncStager does the work (it cannot notice a change of shapes).
try:
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    copy_state_dict: Any = _copy_state_dict
    create_cpu_state_dict: Any = _create_cpu_state_dict
except ImportError:  # pragma: no cover - depends on the torch version
    copy_state_dict = None
    create_cpu_state_dict = None


def copy_tensors(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every ``i``, in one call where torch has it."""
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        foreach_copy(targets, sources)
        return
    for target, source in zip(targets, sources, strict=True):  # pragma: no cover - old torch
        target.copy_(source)


def load_tensor_in_place(view: memoryview) -> torch.Tensor:
    """Deserialise a ``torch.save``'d tensor whose storage aliases ``view`` (no copy).

    ``torch.load`` copies every storage out of its stream; handing torch's own
    loader the buffer as the "mmapped" storage (what ``torch.load(mmap=True)``
    does for files) leaves one copy per load, into the target tensor. A torch
    whose private loader differs falls back to ``torch.load``.
    """
    if len(view):
        try:
            storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
            reader = torch._C.PyTorchFileReader(MemoryReader(view))  # type: ignore[call-overload]
            return cast(
                torch.Tensor,
                torch.serialization._load(  # type: ignore[no-untyped-call]
                    reader,
                    "cpu",
                    torch._weights_only_unpickler,
                    overall_storage=storage,
                    encoding="utf-8",
                ),
            )
        except Exception:  # the stock path below reports real damage
            pass
    return cast(
        torch.Tensor,
        torch.load(MemoryReader(view), map_location="cpu", weights_only=True),  # type: ignore[arg-type]
    )
