"""Pin the public surface: what `dcp_volumes` exports is a deliberate decision."""

from __future__ import annotations

import dcp_volumes

EXPECTED = {
    "CheckpointInfo",
    "CheckpointManager",
    "DataLoader",
    "FileCache",
    "VolumeDataset",
    "VolumeReader",
    "VolumeWriter",
    # compression="zstd" with a level and threads (VolumeWriter(compression=...))
    "ZstdCompression",
    # Hugging Face safetensors on volumes: save, load, export (issue 46)
    "SafetensorsReader",
    "SafetensorsWriter",
    "export_safetensors",
    # client-side checkpoint encryption (VolumeWriter/VolumeReader/CheckpointManager(encryption=))
    "Encryption",
    # the retry/timeout policy the classes above take as retry=
    "RetryPolicy",
    # errors users catch
    "BucketNotFoundError",
    "CacheError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "ConfigurationError",
    "DatasetChangedError",
    "DcpVolumesError",
    "DiskFullError",
    "StagingError",
    "VolumeAccessError",
    "VolumeError",
    "VolumeExistsError",
    "VolumeNotFoundError",
    "BackendNotInstalledError",
    # encryption: client-side keys and tampering, and the store's own (SSE) refusals
    "EncryptionError",
    "EncryptionKeyError",
    "CheckpointTamperedError",
    "VolumeEncryptionError",
    # the typed error behind DCP's CheckpointException (a BaseException)
    "storage_error",
    # routing dcp.save/async_save/load to the classes above for chosen URL prefixes
    "Route",
    "Routing",
    "active_routes",
    "route",
    "unroute",
    # the goodput of the user's own job, from the records the manager and loader keep
    "goodput_report",
    "GoodputReport",
    "__version__",
}


def test_all_is_pinned() -> None:
    assert set(dcp_volumes.__all__) == EXPECTED


def test_every_exported_name_resolves() -> None:
    for name in dcp_volumes.__all__:
        assert getattr(dcp_volumes, name) is not None, name


def test_private_modules_stay_private() -> None:
    public = {n for n in dir(dcp_volumes) if not n.startswith("_")}
    # Only exports, subpackages and the launcher (python -m dcp_volumes.run) may appear
    # without an underscore.
    assert public - set(dcp_volumes.__all__) <= {"checkpoint", "data", "cli", "run", "goodput"}
