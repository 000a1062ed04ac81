"""``ReaderOptions``: a ``VolumeReader``'s settings, checked once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_volumes._exceptions import ConfigurationError

__all__ = ["DEFAULT_COALESCE_GAP", "ReaderOptions"]

# Ranges closer than this are fetched as one request: one round trip costs
# more than reading a few hundred KiB that are then thrown away.
DEFAULT_COALESCE_GAP = 2**20


@dataclass(frozen=True)
class ReaderOptions:
    """Validated options of a ``VolumeReader`` (sizes in bytes).

    Attributes:
        verify: read every referenced file whole and check its checksum.
        local_copy_dir: root of the local tier written by ``VolumeWriter``.
        read_concurrency: ranged GETs in flight.
        part_size: largest single ranged GET; longer ranges are split.
        coalesce_gap: ranges closer than this are fetched as one.
        prefetch_bytes: bytes fetched ahead of deserialisation.
    """

    verify: bool = False
    local_copy_dir: str | None = None
    read_concurrency: int = 16
    part_size: int = 16 * 2**20
    coalesce_gap: int = DEFAULT_COALESCE_GAP
    prefetch_bytes: int = 1 * 2**30

    def __post_init__(self) -> None:
        if self.read_concurrency < 1:
            raise ConfigurationError(f"read_concurrency={self.read_concurrency} must be >= 1.")
        if self.part_size < 1:
            raise ConfigurationError(f"part_size={self.part_size} must be >= 1 byte.")
        if self.coalesce_gap < 0 or self.prefetch_bytes < 0:
            raise ConfigurationError("coalesce_gap and prefetch_bytes must be >= 0 bytes.")
