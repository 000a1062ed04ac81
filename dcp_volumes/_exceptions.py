"""Exception hierarchy: one root, built-in bases where the meaning matches.

Callers can catch ``DcpVolumesError`` for everything this library raises, or
the built-in (``FileNotFoundError``, ``PermissionError``...) they already
handle. Messages say what happened, why, and how to fix it; they never carry
credentials (see ``_redact``).
"""

from __future__ import annotations

import errno
import threading
import weakref
from collections import deque
from types import FrameType, TracebackType
from typing import Any

# The dcp_volumes errors created lately, held weakly: where a caller catches one and
# raises another error without chaining it (DCP's load keeps only the text of a
# failed metadata read), ``storage_error`` finds it again by structure (see
# ``_swallowed_by``). Alive only as long as something else holds the error.
_RECENT: deque[weakref.ref[DcpVolumesError]] = deque(maxlen=256)
_RECENT_LOCK = threading.Lock()


class DcpVolumesError(Exception):
    """Root of every error raised by dcp_volumes."""

    def __init__(self, *args: object, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # ImportError's name=/path= pass through
        with _RECENT_LOCK:
            _RECENT.append(weakref.ref(self))


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


class EncryptionError(CheckpointError):
    """A checkpoint's client-side encryption (``Encryption``) refused to read or write it."""


class EncryptionKeyError(EncryptionError, PermissionError):
    """The key an encrypted checkpoint needs is missing, or the key given is not its key."""


class CheckpointTamperedError(EncryptionError, CheckpointCorruptError):
    """An encrypted checkpoint file failed authentication: its bytes were altered,
    truncated, reordered or taken from another file."""


class VolumeEncryptionError(VolumeAccessError):
    """The store refused a request for its own (server-side) encryption: the bucket
    requires encryption headers that were not sent, or an SSE-C object was read
    without its customer key or with the wrong one."""


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

    It also finds a dcp_volumes error that DCP caught and replaced by another
    without chaining it: a load from a missing checkpoint, where DCP catches our
    ``CheckpointNotFoundError`` and raises ``AssertionError("metadata is None;
    ...")`` in the same call, gives the ``CheckpointNotFoundError`` back.

    ``CheckpointManager`` does this itself.
    """
    chain = _chain(exc)
    for cur in chain:
        if isinstance(cur, DcpVolumesError):
            return cur
    for cur in chain:
        swallowed = _swallowed_by(cur)
        if swallowed is not None:
            return swallowed
    return None


def rank_failures(exc: BaseException) -> list[tuple[int, BaseException]]:
    """The (rank, error) pairs in torch's ``CheckpointException.failures``, by rank.

    ``failures`` maps a rank to ``(exception, traceback)`` (or to the exception);
    ``[]`` for any other error.
    """
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    found = []
    for rank, wrapped in failures.items():
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        if isinstance(inner, BaseException):
            found.append((rank, inner))
    return sorted(found, key=lambda pair: str(pair[0]))


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, the failures of each rank inside it, and their causes and contexts."""
    seen: set[int] = set()
    out: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        out.append(cur)
        todo.extend(inner for _, inner in rank_failures(cur))
        todo.extend(nxt for nxt in (cur.__cause__, cur.__context__) if nxt is not None)
    return out


def _swallowed_by(exc: BaseException) -> DcpVolumesError | None:
    """A dcp_volumes error caught by the very function call that then raised ``exc``.

    Python chains an error raised *inside* an ``except`` block; one raised after
    the block (``except Exception as e: failed = e`` ... ``raise AssertionError(
    f"...{failed}")``, as DCP's load does with a failed metadata read) carries only
    the text. The link is structural: our error's traceback runs through the frame
    where it was caught, and ``exc`` was raised in that same frame (one call of one
    function, not one function). An error that only passed through a frame ended
    that call, unless caught there, so a later error of the same call is one that
    caught it (or was raised while handling it, and is chained anyway).
    """
    raised_in = _frames(exc.__traceback__)[-1:]
    if not raised_in:
        return None
    with _RECENT_LOCK:
        candidates = [ref() for ref in _RECENT]
    for candidate in candidates:  # oldest first: the first failure is the cause
        if candidate is None or candidate is exc:
            continue
        if any(frame is raised_in[0] for frame in _frames(candidate.__traceback__)):
            return candidate
    return None


def _frames(tb: TracebackType | None) -> list[FrameType]:
    """The frames of a traceback, outermost first (the last one raised)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames
