"""How one rank's staged files go up: how many at once, each upload, and the check after.

Throughput comes from many streams in flight (real stores cap each stream).
Object-store clients hold each part (a whole small file) in memory while it
is in flight (``capabilities.buffers_uploads``), so the shape keeps those
buffers within a share of the rank's bytes.
"""

from __future__ import annotations

import logging

from torch.distributed.checkpoint.storage import WriteResult

from dcp_volumes._exceptions import VolumeError
from dcp_volumes._volume import Volume, redact_url
from dcp_volumes.checkpoint._manifest import check_listing
from dcp_volumes.checkpoint._shards import WrittenItem

logger = logging.getLogger("dcp_volumes.checkpoint._writer")

# S3 rejects multipart parts below 5 MiB (except the last one).
MIN_PART_SIZE = 5 * 2**20
# Files uploaded at once per rank (they share the transfers in flight).
_MAX_FILES_IN_FLIGHT = 4
# Upload buffers may take this share of a rank's checkpoint bytes in RAM, so an
# async save needs about 1.25x the state: the staged copy plus this.
_UPLOAD_RAM_SHARE = 0.25


def upload_shape(
    volume: Volume, *, rank_bytes: int, concurrency: int, file_size: int
) -> tuple[int, int, int]:
    """(files in flight, transfers per file, file size) for a rank's upload.

    Within a budget of ``_UPLOAD_RAM_SHARE`` of the rank's bytes, keep
    ``concurrency`` streams busy by making files small enough that each is
    one PUT (no multipart round trips); large states keep ``file_size`` files.
    """
    if not volume.capabilities.buffers_uploads:
        return min(_MAX_FILES_IN_FLIGHT, concurrency), 1, file_size
    budget = max(concurrency * MIN_PART_SIZE, int(rank_bytes * _UPLOAD_RAM_SHARE))
    file_size = min(file_size, max(MIN_PART_SIZE, budget // concurrency))
    files_in_flight = max(1, min(concurrency, budget // file_size))
    return files_in_flight, max(1, concurrency // files_in_flight), file_size


def upload_file(
    volume: Volume,
    local: str,
    rel: str,
    size: int,
    *,
    keep: bool,
    per_file: int,
    part_size: int,
) -> None:
    """Upload one closed file (upload threads); sizes are checked by ``verify_uploaded``.

    ``keep``: the staged file stays (the local tier); otherwise it is moved
    (renamed on a mount, removed after the upload elsewhere).
    """
    volume.put_file(
        local, rel, part_size=part_size, concurrency=per_file, move=not keep, verify_size=False
    )
    logger.debug("uploaded %s (%d bytes)", redact_url(volume.url_of(rel)), size)


def verify_uploaded(volume: Volume, rank: int, results: list[WriteResult]) -> None:
    """Every file of this rank is on the volume with its size: one listing, not a HEAD each."""
    files = {
        wr.storage_data.info.relative_path: wr.storage_data.record
        for wr in results
        if isinstance(wr.storage_data, WrittenItem)
    }
    problems = check_listing(files, volume.list())
    if problems:
        raise VolumeError(
            f"Rank {rank}'s upload to {volume.display_url} did not land whole "
            f"({'; '.join(problems[:5])}). The upload was cut short or another writer "
            "uses this location; save again."
        )
