"""dcp_volumes: fast, fault-tolerant PyTorch checkpoints and training inputs on remote volumes."""

from dcp_volumes._exceptions import (
    BackendNotInstalledError,
    BucketNotFoundError,
    CacheError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    DatasetChangedError,
    DcpVolumesError,
    StagingError,
    VolumeAccessError,
    VolumeError,
    VolumeExistsError,
    VolumeNotFoundError,
)
from dcp_volumes.checkpoint._discovery import CheckpointInfo
from dcp_volumes.checkpoint._manager import CheckpointManager
from dcp_volumes.checkpoint._reader import VolumeReader
from dcp_volumes.checkpoint._writer import VolumeWriter
from dcp_volumes.data._cache import FileCache
from dcp_volumes.data._dataset import VolumeDataset
from dcp_volumes.data._loader import DataLoader

__version__ = "0.1.0"

__all__ = [
    "BackendNotInstalledError",
    "BucketNotFoundError",
    "CacheError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ConfigurationError",
    "DataLoader",
    "DatasetChangedError",
    "DcpVolumesError",
    "FileCache",
    "StagingError",
    "VolumeAccessError",
    "VolumeDataset",
    "VolumeError",
    "VolumeExistsError",
    "VolumeNotFoundError",
    "VolumeReader",
    "VolumeWriter",
    "__version__",
]
