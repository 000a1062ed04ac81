"""The validated options of a ``VolumeWriter``, read by the writer, a rank's save and the commit."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes._staging_disk import DEFAULT_HEADROOM_BYTES

# S3 rejects multipart parts below 5 MiB (except the last one).
MIN_PART_SIZE = 5 * 2**20


@dataclass(frozen=True)
class WriterOptions:
    """Validated options of a ``VolumeWriter`` (sizes in bytes).

    Attributes:
        staging_dir: local directory for staged files; ``None``: ``DCP_VOLUMES_STAGING``
            or a private temp dir.
        overwrite: replace a committed checkpoint at the same location.
        keep_staging: keep the staged files after the upload.
        local_copy_dir: root of the local tier; the files of a checkpoint are
            staged into and kept in ``local_copy_dir/<checkpoint name>``.
        upload_concurrency: streams in flight for this rank: a file each (one
            PUT), or the parts of a file larger than ``part_size``.
        part_size: multipart part size.
        file_size: target size of one data file; a rank's items are split
            into files of about this size so upload overlaps serialisation.
        prefix_spread: ``0`` off; ``N > 1`` spreads files over ``N`` hashed
            sub-prefixes of the checkpoint directory.
        cache_staged_state_dict: reuse the CPU staging buffers of
            ``dcp.async_save`` across saves.
        staging_headroom: free space to leave on the staging disk.
        async_staging: ``stage`` copies in a background thread and returns a future
            (``dcp.async_save`` then returns an ``AsyncSaveResponse``).
        sync_files: fsync staged files that become the checkpoint's own (mount
            volumes, the local tier); stock's ``sync_files``.
    """

    staging_dir: str | None = None
    overwrite: bool = False
    keep_staging: bool = False
    local_copy_dir: str | None = None
    upload_concurrency: int = 8
    part_size: int = 32 * 2**20
    file_size: int = 256 * 2**20
    prefix_spread: int = 0
    cache_staged_state_dict: bool = True
    staging_headroom: int = DEFAULT_HEADROOM_BYTES
    async_staging: bool = False
    sync_files: bool = True

    def __post_init__(self) -> None:
        if self.upload_concurrency < 1:
            raise ConfigurationError(
                f"upload_concurrency={self.upload_concurrency} must be >= 1."
            )
        if self.part_size < MIN_PART_SIZE:
            raise ConfigurationError(
                f"part_size={self.part_size} bytes is below 5 MiB, the smallest multipart "
                "part object stores accept. Use e.g. part_size='32MiB'."
            )
        if self.file_size < 1:
            raise ConfigurationError(f"file_size={self.file_size} must be >= 1 byte.")
        if self.prefix_spread < 0 or self.prefix_spread == 1:
            raise ConfigurationError(
                f"prefix_spread={self.prefix_spread}: use 0 (off) or a number of prefixes >= 2."
            )
        if self.staging_headroom < 0:
            raise ConfigurationError("staging_headroom must be >= 0 bytes.")
