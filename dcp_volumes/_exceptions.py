"""Exception hierarchy: one root, built-in bases where the meaning matches.

Callers can catch ``DcpVolumesError`` for everything this library raises, or
the built-in (``FileNotFoundError``, ``PermissionError``...) they already
handle. Messages say what happened, why, and how to fix it; they never carry
credentials (see ``_redact``).
"""

from __future__ import annotations

import errno


class DcpVolumesError(Exception):
    """Root of every error raised by dcp_volumes."""


class ConfigurationError(DcpVolumesError, ValueError):
    """An argument or option is invalid (bad URL, bad size, bad count...)."""


class BackendNotInstalledError(DcpVolumesError, ImportError):
    """A library a feature needs is not installed (an fsspec protocol's, zstd)."""


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


class CheckpointVersionError(CheckpointError):
    """A checkpoint was written in a newer format than this version of dcp_volumes reads."""


class CacheError(DcpVolumesError, OSError):
    """The local file cache cannot hold or serve a file."""


class DiskFullError(StagingError, CacheError):
    """A local disk (staging or cache) ran out of space part-way through a write.

    Both a ``StagingError`` (checkpoint side) and a ``CacheError`` (data side),
    so the handler a user already has for either catches it; ``errno`` is
    ``ENOSPC``. ``directory``, ``needed`` and ``free`` (bytes; ``None`` where
    unknown) say where and how much. What was partly written has been removed.
    """

    def __init__(
        self,
        message: str,
        directory: str = "",
        needed: int | None = None,
        free: int | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC
        self.directory = directory
        self.needed = needed
        self.free = free


class DatasetChangedError(DcpVolumesError):
    """The data on the volume differs from what a saved loader state was built on."""


def storage_error(exc: BaseException) -> DcpVolumesError | None:
    """The dcp_volumes error behind ``exc``, or ``None`` if there is none.

    DCP wraps every storage error of every rank in ``CheckpointException``,
    which derives from ``BaseException``: ``except DcpVolumesError`` around a
    direct ``dcp.save``/``dcp.load`` never fires. This finds the typed error
    inside (in the failures of each rank, and along ``__cause__``/``__context__``)::

        try:
            dcp.load(state, storage_reader=VolumeReader(url))
        except BaseException as exc:
            raise storage_error(exc) or exc

    ``CheckpointManager`` does this itself.
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, DcpVolumesError):
            return cur
        failures = getattr(cur, "failures", None)  # torch's CheckpointException
        if isinstance(failures, dict):
            for _, wrapped in sorted(failures.items(), key=lambda kv: str(kv[0])):
                inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
                if isinstance(inner, BaseException):
                    todo.append(inner)
        for nxt in (cur.__cause__, cur.__context__):
            if nxt is not None:
                todo.append(nxt)
    return None
