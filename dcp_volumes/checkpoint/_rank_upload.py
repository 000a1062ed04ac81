"""How one rank's staged files go up: how many at once, and each upload.

Throughput comes from many streams in flight (real stores cap each stream).
Object-store clients hold each part (a whole small file) in memory while it
is in flight (``capabilities.buffers_uploads``), so the shape keeps those
buffers within a share of the rank's bytes. (obstore's are maps of the
staged files whose sent pages are dropped as they go, so what they hold in
RSS is well below that share; see ``_volume/_mapped.py``.)
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from dcp_volumes._volume import Volume, redact_url

logger = logging.getLogger("dcp_volumes.checkpoint._writer")

# S3 rejects multipart parts below 5 MiB (except the last one).
MIN_PART_SIZE = 5 * 2**20
# Files uploaded at once per rank (they share the transfers in flight).
_MAX_FILES_IN_FLIGHT = 4
# Upload buffers may take this share of a rank's checkpoint bytes in RAM ...
_UPLOAD_RAM_SHARE = 0.25
# ... but at least this much per stream: smaller files make the per-request
# cost dominate.
_MIN_STREAM_BYTES = 2 * 2**20


@dataclass(frozen=True)
class UploadShape:
    """How a rank's files go up: ``files_in_flight`` at once, ``per_file`` transfers
    each, files of at most ``file_size``, and at most ``budget`` bytes held in flight."""

    files_in_flight: int
    per_file: int
    file_size: int
    budget: InFlightBytes | None


def upload_shape(
    volume: Volume, *, rank_bytes: int, concurrency: int, file_size: int
) -> UploadShape:
    """The upload shape for a rank of ``rank_bytes``.

    Within a budget of ``_UPLOAD_RAM_SHARE`` of the rank's bytes, keep
    ``concurrency`` streams busy by making files small enough that each is
    one PUT (no multipart round trips); large states keep ``file_size`` files.
    """
    if not volume.capabilities.buffers_uploads:
        return UploadShape(min(_MAX_FILES_IN_FLIGHT, concurrency), 1, file_size, None)
    budget = max(concurrency * _MIN_STREAM_BYTES, int(rank_bytes * _UPLOAD_RAM_SHARE))
    file_size = min(file_size, max(_MIN_STREAM_BYTES, budget // concurrency))
    files_in_flight = max(1, min(concurrency, budget // file_size))
    return UploadShape(
        files_in_flight, max(1, concurrency // files_in_flight), file_size, InFlightBytes(budget)
    )


class InFlightBytes:
    """A byte budget shared by a rank's upload threads.

    Files are cut at ``file_size`` but one tensor may be larger, so counting
    files alone does not bound the memory: each upload holds its bytes here
    (a file larger than the whole budget waits until it is alone).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        nbytes = min(nbytes, self.limit)
        with self._changed:
            self._changed.wait_for(lambda: self._held + nbytes <= self.limit)
            self._held += nbytes
        try:
            yield
        finally:
            with self._changed:
                self._held -= nbytes
                self._changed.notify_all()


def upload_file(
    volume: Volume,
    local: str,
    rel: str,
    size: int,
    *,
    keep: bool,
    shape: UploadShape,
    part_size: int,
) -> None:
    """Upload one closed file (upload threads); the commit's listing checks its size.

    ``keep``: the staged file stays (the local tier); otherwise it is moved
    (renamed on a mount, removed after the upload elsewhere).
    """
    # A multipart upload holds its parts in flight, a single PUT the whole file.
    held = size if size <= part_size else min(size, shape.per_file * part_size)
    with shape.budget.hold(held) if shape.budget is not None else contextlib.nullcontext():
        volume.put_file(
            local,
            rel,
            part_size=part_size,
            concurrency=shape.per_file,
            move=not keep,
            verify_size=False,
        )
    logger.debug("uploaded %s (%d bytes)", redact_url(volume.url_of(rel)), size)
