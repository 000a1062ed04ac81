"""Environment variables, read in this one place.

| variable                    | meaning                                          |
|-----------------------------|--------------------------------------------------|
| ``DCP_VOLUMES_STAGING``     | default local staging dir for checkpoint writes  |
| ``DCP_VOLUMES_CACHE``       | default local cache dir for training inputs      |
| ``DCP_VOLUMES_MAX_RETRIES`` | attempts per volume call on transient errors     |
| ``DCP_VOLUMES_STORAGE_OPTIONS`` | JSON object of fsspec options for the CLI    |
| ``DCP_VOLUMES_S3_TRANSPORT`` | ``0``: move S3 bytes through s3fs, not botocore |
| ``DCP_VOLUMES_CLIENT_START_TIMEOUT`` | seconds until a client creation is stuck (0: never) |
"""

from __future__ import annotations

import os

STAGING = "DCP_VOLUMES_STAGING"
CACHE = "DCP_VOLUMES_CACHE"
MAX_RETRIES = "DCP_VOLUMES_MAX_RETRIES"
STORAGE_OPTIONS = "DCP_VOLUMES_STORAGE_OPTIONS"
S3_TRANSPORT = "DCP_VOLUMES_S3_TRANSPORT"
CLIENT_START_TIMEOUT = "DCP_VOLUMES_CLIENT_START_TIMEOUT"


def staging_dir() -> str | None:
    """The staging directory the user configured, if any."""
    return os.environ.get(STAGING) or None


def cache_dir() -> str | None:
    """The cache directory the user configured, if any."""
    return os.environ.get(CACHE) or None


def max_retries(default: int) -> int:
    """Retry budget for transient volume errors."""
    raw = os.environ.get(MAX_RETRIES)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        from dcp_volumes._exceptions import ConfigurationError

        raise ConfigurationError(
            f"{MAX_RETRIES}={raw!r} is not an integer; set it to a count such as 5 or unset it."
        ) from None
    return max(1, value)


def client_start_timeout(default: float = 120.0) -> float:
    """Seconds a client creation may take before the watchdog calls it stuck (0: never)."""
    raw = os.environ.get(CLIENT_START_TIMEOUT)
    if not raw:
        return default
    try:
        return max(0.0, float(raw))
    except ValueError:
        from dcp_volumes._exceptions import ConfigurationError

        raise ConfigurationError(
            f"{CLIENT_START_TIMEOUT}={raw!r} is not a number of seconds; set it to e.g. 120, "
            "0 to turn the watchdog off, or unset it."
        ) from None


def world_info() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as torchrun sets them."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, local_rank, local_world


def storage_options() -> str | None:
    """The JSON text of ``DCP_VOLUMES_STORAGE_OPTIONS`` (used by the CLI), if set."""
    return os.environ.get(STORAGE_OPTIONS) or None


def s3_transport_enabled() -> bool:
    """Whether S3 bulk bytes may use the botocore transport (``_s3_transport.py``)."""
    return os.environ.get(S3_TRANSPORT, "1").strip().lower() not in ("0", "false", "no", "off")
