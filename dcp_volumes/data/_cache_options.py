"""The validated options of a ``FileCache``, and where a cache lives by default."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dcp_volumes import _env
from dcp_volumes._exceptions import ConfigurationError

# The default limit: on a smaller disk its free space is the limit, which is no news
# for a caller who set nothing (one who asked for more than the disk is told).
DEFAULT_CACHE_LIMIT = "100GB"


def default_cache_dir() -> str:
    """``DCP_VOLUMES_CACHE`` if set, else ``~/.cache/dcp_volumes``."""
    return _env.cache_dir() or os.path.join(os.path.expanduser("~"), ".cache", "dcp_volumes")


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> str:
    """The absolute directory a ``FileCache(cache_dir)`` uses."""
    chosen = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    return os.path.abspath(os.path.expanduser(chosen))


@dataclass(frozen=True)
class CacheOptions:
    """Validated options of a ``FileCache`` (sizes in bytes).

    Attributes:
        cache_dir: the cache directory, absolute (see ``resolve_cache_dir``).
        limit: most bytes of cached files; ``None``: no limit beyond the disk's
            free space.
        headroom: free space always left on the disk holding the cache.
        reconcile: check the directory at start-up (see ``FileCache.reconcile``).
        limit_chosen: the caller chose the limit (a default larger than the disk
            is no news, a chosen one is warned about).
    """

    cache_dir: str
    limit: int | None
    headroom: int = 0
    reconcile: bool = True
    limit_chosen: bool = False

    def __post_init__(self) -> None:
        if self.limit == 0:
            raise ConfigurationError("limit=0 leaves no room for any file; use None for no limit.")
