"""The validated options of a ``VolumeDataset``, read by the dataset and its loader."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes.data._cache_options import DEFAULT_CACHE_LIMIT


@dataclass(frozen=True)
class DatasetOptions:
    """Validated options of a ``VolumeDataset`` (see its docstring for each).

    The transform and the storage options are not options of this kind (a callable
    and the client's settings): the dataset keeps them itself.

    Attributes:
        cache_dir: the node-local cache; ``None``: ``DCP_VOLUMES_CACHE`` or
            ``~/.cache/dcp_volumes``.
        cache_limit: bytes the cache may hold, as given (the cache parses it
            where it is made: a dataset read in place makes none).
        shuffle: a new permutation every epoch.
        seed: the order and augmentation seed, in ``[0, 2**63)``.
        suffixes: only files ending with one of these; ``None``: every file.
        last_batch: ``"pad"`` or ``"drop"`` the last partial global batch.
        batch_size: per-rank batch size (a stock DataLoader's hint).
        prefetch: files each worker fetches ahead.
        prefetch_threads: download threads per worker.
        seed_rngs: seed torch/numpy/random around each transform call.
        on_data_change: ``"error"`` or ``"warn"`` when a state's listing differs.
        cache_local: also cache files of local/mounted paths.
        share_listing: list on rank 0 and broadcast when a process group is up.
        list_concurrency: parallel listing/stat requests.
    """

    cache_dir: str | None = None
    cache_limit: int | str | None = DEFAULT_CACHE_LIMIT
    shuffle: bool = True
    seed: int = 0
    suffixes: tuple[str, ...] | None = None
    last_batch: str = "pad"
    batch_size: int = 1
    prefetch: int = 16
    prefetch_threads: int = 8
    seed_rngs: bool = True
    on_data_change: str = "error"
    cache_local: bool = True
    share_listing: bool = True
    list_concurrency: int = 16

    def __post_init__(self) -> None:
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not (0 <= self.seed < 2**63)
        ):
            raise ConfigurationError(f"seed={self.seed!r} must be an int in [0, 2**63).")
        if self.last_batch not in ("pad", "drop"):
            raise ConfigurationError(
                f"last_batch={self.last_batch!r}: use 'pad' (complete the last global batch by "
                "repeating samples from the start of the epoch) or 'drop' (skip it)."
            )
        if self.on_data_change not in ("error", "warn"):
            raise ConfigurationError(
                f"on_data_change={self.on_data_change!r}: use 'error' (refuse to resume on "
                "changed data) or 'warn' (resume anyway, logging a warning)."
            )
        for name in ("batch_size", "prefetch", "prefetch_threads", "list_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name}={value!r} must be an int >= 1.")
