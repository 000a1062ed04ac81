"""dcp_volumes: fast, fault-tolerant PyTorch checkpoints and training inputs on remote volumes."""

import importlib as _importlib
import typing as _typing

from dcp_volumes._exceptions import (
    BackendNotInstalledError,
    BucketNotFoundError,
    CacheError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointTamperedError,
    CheckpointVersionError,
    ConfigurationError,
    DatasetChangedError,
    DcpVolumesError,
    DiskFullError,
    EncryptionError,
    EncryptionKeyError,
    StagingError,
    VolumeAccessError,
    VolumeEncryptionError,
    VolumeError,
    VolumeExistsError,
    VolumeNotFoundError,
    storage_error,
)
from dcp_volumes._volume._retry import RetryPolicy

if _typing.TYPE_CHECKING:
    from dcp_volumes.checkpoint._compression import ZstdCompression
    from dcp_volumes.checkpoint._discovery import CheckpointInfo
    from dcp_volumes.checkpoint._encryption import Encryption
    from dcp_volumes.checkpoint._manager import CheckpointManager
    from dcp_volumes.checkpoint._reader import VolumeReader
    from dcp_volumes.checkpoint._routing import Route, Routing, active_routes, route, unroute
    from dcp_volumes.checkpoint._writer import VolumeWriter
    from dcp_volumes.data._cache import FileCache
    from dcp_volumes.data._dataset import VolumeDataset
    from dcp_volumes.data._loader import DataLoader
    from dcp_volumes.goodput._report import GoodputReport, goodput_report
    from dcp_volumes.safetensors._export import export_safetensors
    from dcp_volumes.safetensors._reader import SafetensorsReader
    from dcp_volumes.safetensors._writer import SafetensorsWriter

# The classes import torch (seconds to start); load them on first use so that
# `import dcp_volumes` and CLI commands that need no torch stay fast.
_LAZY = {
    "CheckpointInfo": "dcp_volumes.checkpoint._discovery",
    "CheckpointManager": "dcp_volumes.checkpoint._manager",
    "Encryption": "dcp_volumes.checkpoint._encryption",
    "VolumeReader": "dcp_volumes.checkpoint._reader",
    "VolumeWriter": "dcp_volumes.checkpoint._writer",
    "Route": "dcp_volumes.checkpoint._routing",
    "Routing": "dcp_volumes.checkpoint._routing",
    "active_routes": "dcp_volumes.checkpoint._routing",
    "route": "dcp_volumes.checkpoint._routing",
    "unroute": "dcp_volumes.checkpoint._routing",
    "ZstdCompression": "dcp_volumes.checkpoint._compression",
    "FileCache": "dcp_volumes.data._cache",
    "VolumeDataset": "dcp_volumes.data._dataset",
    "DataLoader": "dcp_volumes.data._loader",
    "SafetensorsReader": "dcp_volumes.safetensors._reader",
    "SafetensorsWriter": "dcp_volumes.safetensors._writer",
    "export_safetensors": "dcp_volumes.safetensors._export",
    "GoodputReport": "dcp_volumes.goodput._report",
    "goodput_report": "dcp_volumes.goodput._report",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dcp_volumes' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {n for n in globals() if n.startswith("_")})

__version__ = "0.1.0"

__all__ = [
    "BackendNotInstalledError",
    "BucketNotFoundError",
    "CacheError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointTamperedError",
    "CheckpointVersionError",
    "ConfigurationError",
    "DataLoader",
    "DatasetChangedError",
    "DcpVolumesError",
    "DiskFullError",
    "Encryption",
    "EncryptionError",
    "EncryptionKeyError",
    "FileCache",
    "GoodputReport",
    "RetryPolicy",
    "Route",
    "Routing",
    "SafetensorsReader",
    "SafetensorsWriter",
    "StagingError",
    "VolumeAccessError",
    "VolumeDataset",
    "VolumeEncryptionError",
    "VolumeError",
    "VolumeExistsError",
    "VolumeNotFoundError",
    "VolumeReader",
    "VolumeWriter",
    "ZstdCompression",
    "__version__",
    "active_routes",
    "export_safetensors",
    "goodput_report",
    "route",
    "storage_error",
    "unroute",
]
