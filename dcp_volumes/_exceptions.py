"""Exception hierarchy: one root, built-in bases where the meaning matches.

Callers can catch ``DcpVolumesError`` for everything this library raises, or
the built-in (``FileNotFoundError``, ``PermissionError``...) they already
handle. Messages say what happened, why, and how to fix it; they never carry
credentials (see ``_redact``).
"""

from __future__ import annotations


class DcpVolumesError(Exception):
    """Root of every error raised by dcp_volumes."""


class ConfigurationError(DcpVolumesError, ValueError):
    """An argument or option is invalid (bad URL, bad size, bad count...)."""


class BackendNotInstalledError(DcpVolumesError, ImportError):
    """The fsspec implementation for a URL's protocol is not installed."""


class VolumeError(DcpVolumesError, OSError):
    """A volume operation failed after retries (network, server, unknown backend error)."""


class VolumeNotFoundError(VolumeError, FileNotFoundError):
    """A file, prefix, bucket or container does not exist on the volume."""


class BucketNotFoundError(VolumeNotFoundError):
    """The bucket or container named in a URL does not exist."""


class VolumeAccessError(VolumeError, PermissionError):
    """Credentials are missing or wrong, or they do not allow the operation."""


class VolumeExistsError(VolumeError, FileExistsError):
    """An exclusive write found the target already present."""


class StagingError(DcpVolumesError, OSError):
    """The local staging directory is missing, read-only or too small."""


class CheckpointError(DcpVolumesError):
    """A checkpoint cannot be written or read as asked."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (no ``.metadata``) at the given location."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists where a save was asked to write."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, has the wrong size, or fails its checksum."""


class CacheError(DcpVolumesError, OSError):
    """The local file cache cannot hold or serve a file."""


class DatasetChangedError(DcpVolumesError):
    """The data on the volume differs from what a saved loader state was built on."""
