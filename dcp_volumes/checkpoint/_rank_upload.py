"""How one rank's staged files go up: how many at once, and each upload.

What a save pays beyond its bytes is per request: a round trip (20 ms and
more a network away) and the server's work for each PUT, which on the 2-core
machines here costs more than a few MiB of transfer (the shapes measured are
in benchmarks/README.md). So a rank's bytes go up in one wave: a file per
stream, each file one PUT. Stores whose client holds every part in memory
while it is in flight (``capabilities.buffers_uploads``, the fsspec clients)
keep files smaller, within a share of the rank's bytes. obstore sends maps of
the staged files whose sent pages are dropped as they go (``_volume/_mapped.py``),
so its uploads hold little RSS whatever the file size.
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
# Files renamed or copied at once per rank on a mount.
_MAX_FILES_IN_FLIGHT = 4
# Clients that buffer uploads may hold this share of a rank's bytes in RAM ...
_UPLOAD_RAM_SHARE = 0.25
# ... but every file is at least this large: smaller files make the
# per-request cost dominate.
_MIN_STREAM_BYTES = 2 * 2**20


@dataclass(frozen=True)
class UploadShape:
    """How a rank's files go up: ``files_in_flight`` at once, files of at most
    ``file_size``, up to ``streams`` transfers for one file larger than a part,
    and (clients that buffer) at most ``budget`` bytes held in flight."""

    files_in_flight: int
    streams: int
    file_size: int
    budget: InFlightBytes | None


def upload_shape(
    volume: Volume, *, rank_bytes: int, concurrency: int, file_size: int, part_size: int
) -> UploadShape:
    """The upload shape for a rank of ``rank_bytes`` with ``concurrency`` streams.

    Object stores: files of ``rank_bytes / concurrency`` (at least 2 MiB, at most
    ``file_size`` and ``part_size``), so every stream carries one PUT and the
    rank's uploads are one wave; a client that buffers uploads gets files small
    enough for its memory budget. Mounts keep ``file_size`` files.
    """
    caps = volume.capabilities
    if caps.local_files:
        return UploadShape(min(_MAX_FILES_IN_FLIGHT, concurrency), 1, file_size, None)
    per_stream = -(-rank_bytes // concurrency)
    size = min(file_size, part_size, max(_MIN_STREAM_BYTES, per_stream))
    budget = None
    if caps.buffers_uploads:
        budget = InFlightBytes(
            max(concurrency * _MIN_STREAM_BYTES, int(rank_bytes * _UPLOAD_RAM_SHARE))
        )
        size = min(size, max(_MIN_STREAM_BYTES, budget.limit // concurrency))
    return UploadShape(concurrency, concurrency, size, budget)


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
    # A file larger than a part (one tensor larger than the files) goes up in
    # parallel parts: alone at the end of a save, one stream would be its tail.
    parts = min(shape.streams, -(-size // part_size))
    # A multipart upload holds its parts in flight, a single PUT the whole file.
    held = size if parts <= 1 else min(size, parts * part_size)
    with shape.budget.hold(held) if shape.budget is not None else contextlib.nullcontext():
        volume.put_file(
            local,
            rel,
            part_size=part_size,
            concurrency=max(1, parts),
            move=not keep,
            verify_size=False,
        )
    logger.debug("uploaded %s (%d bytes)", redact_url(volume.url_of(rel)), size)
