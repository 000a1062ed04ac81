"""How one rank's staged files go up: how many at once, how large, and each upload.

What a save pays beyond its bytes is per request: a round trip (20 ms and
more a network away) and the server's work for each PUT, which on the 2-core
machines here costs more than a few MiB of transfer. And a file can go up only
once it is serialised, so the last file's upload is the save's tail. Hence two
waves per stream, each file one PUT: first a large file per stream (three
quarters of the stream's share), then a small one (the last quarter), whose
upload after serialisation ends is short. Stores whose client holds every part
in memory while it is in flight (``capabilities.buffers_uploads``, the fsspec
clients) keep files within a share of the rank's bytes instead. obstore sends
maps of the staged files whose sent pages are dropped as they go
(``_volume/_mapped.py``), so its uploads hold little RSS whatever the file size.
The shapes measured are in benchmarks/README.md.
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
# The share of a stream's bytes in its first (large) file; the rest is its second.
_FIRST_WAVE_SHARE = 0.75


@dataclass(frozen=True)
class UploadShape:
    """How a rank's files go up: ``files_in_flight`` at once; the first
    ``files_in_flight`` files of at most ``first_size`` bytes, the later ones of
    ``file_size``; up to ``streams`` transfers for one file larger than a part;
    and (clients that buffer) at most ``budget`` bytes held in flight."""

    files_in_flight: int
    streams: int
    first_size: int
    file_size: int
    budget: InFlightBytes | None

    def size_of(self, index: int) -> int:
        """The target size of the rank's ``index``-th file (0-based)."""
        return self.first_size if index < self.files_in_flight else self.file_size


def upload_shape(
    volume: Volume, *, rank_bytes: int, concurrency: int, file_size: int, part_size: int
) -> UploadShape:
    """The upload shape for a rank of ``rank_bytes`` with ``concurrency`` streams.

    Object stores: a first wave of ``concurrency`` files of three quarters of
    ``rank_bytes / concurrency``, then files of the last quarter (each at least
    2 MiB, at most ``file_size`` and ``part_size``: one PUT each); a client that
    buffers uploads gets files small enough for its memory budget. Mounts keep
    ``file_size`` files.
    """
    caps = volume.capabilities
    if caps.local_files:
        files = min(_MAX_FILES_IN_FLIGHT, concurrency)
        return UploadShape(files, 1, file_size, file_size, None)
    per_stream = -(-rank_bytes // concurrency)
    cap = min(file_size, part_size)
    first = min(cap, max(_MIN_STREAM_BYTES, int(per_stream * _FIRST_WAVE_SHARE)))
    later = min(cap, max(_MIN_STREAM_BYTES, per_stream - first))
    budget = None
    if caps.buffers_uploads:
        budget = InFlightBytes(
            max(concurrency * _MIN_STREAM_BYTES, int(rank_bytes * _UPLOAD_RAM_SHARE))
        )
        first = later = min(cap, max(_MIN_STREAM_BYTES, budget.limit // concurrency))
    return UploadShape(concurrency, concurrency, first, later, budget)


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
