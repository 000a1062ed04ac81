""".metadata unpickled with a restricted unpickler: DCP's metadata types and plain data only.

DCP writes ``.metadata`` as a pickle, and stock readers ``pickle.loads`` it, so
listing or loading a checkpoint from someone else's bucket would run whatever
that pickle says. Here only the classes a DCP ``Metadata`` is made of may be
named (the way ``torch.load(weights_only=True)`` admits only tensor types);
anything else is refused with an error naming it. Written by hand because
``pickle`` offers the hook (``find_class``) but no allow-list of its own.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

from dcp_volumes._exceptions import CheckpointCorruptError

# (module, name) pairs besides DCP's metadata module, torch's dtypes and torch.Size.
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # rebuilds a torch.layout from its name
    ("pathlib", "PosixPath"),  # a stock writer's checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # torch on first use only: `dcp-volumes ls` and the demo's launcher stay light.
        import torch
        from torch.distributed.checkpoint import metadata as dcp_metadata

        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type):  # its dataclasses and enums, not functions
                return found
        elif module == "torch":
            found = getattr(torch, name, None)
            if isinstance(found, torch.dtype) or found is torch.Size:
                return found
        elif (module, name) in _ALLOWED:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    """A global that DCP metadata never names."""


def loads_metadata(data: bytes, where: str) -> Any:
    """Unpickle the ``.metadata`` at ``where`` (a URL for messages) with the allow-list.

    Raises ``CheckpointCorruptError`` for a damaged pickle, for one that names
    anything but DCP's metadata types (it could run code when unpickled), and for
    one that holds anything but a DCP ``Metadata``.
    """
    try:
        found = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise CheckpointCorruptError(
            f"{where} names {exc}, which DCP checkpoint metadata never contains; it was not "
            "unpickled, since unpickling it could run code. The checkpoint was tampered "
            "with or was not written by torch.distributed.checkpoint; do not load it."
        ) from None
    except Exception as exc:  # what a damaged pickle raises is open-ended
        raise CheckpointCorruptError(
            f"{where} cannot be unpickled ({type(exc).__name__}: {exc}). The checkpoint is "
            "damaged or was written by an incompatible torch; load an older checkpoint."
        ) from exc
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(found, Metadata):  # a valid pickle of plain data is not a checkpoint
        raise CheckpointCorruptError(
            f"{where} holds a {type(found).__name__}, not DCP Metadata: this is not a DCP "
            "checkpoint, or it is damaged. Fix: load an older checkpoint."
        )
    return found
