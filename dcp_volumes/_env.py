"""Environment variables, read in this one place.

| variable                    | meaning                                          |
|-----------------------------|--------------------------------------------------|
| ``DCP_VOLUMES_STAGING``     | default local staging dir for checkpoint writes  |
| ``DCP_VOLUMES_CACHE``       | default local cache dir for training inputs      |
| ``DCP_VOLUMES_MAX_RETRIES`` | attempts per volume call on transient errors     |
| ``DCP_VOLUMES_STORAGE_OPTIONS`` | JSON object: options of a remote URL given none |
| ``DCP_VOLUMES_ROUTE``       | URL prefixes ``route()`` routes (comma-separated) |
| ``DCP_VOLUMES_ROUTE_CONFIG`` | TOML or JSON file of routing defaults and per-prefix options |
| ``DCP_VOLUMES_BACKEND``     | ``fsspec``: S3/Azure through s3fs/adlfs, not obstore |
| ``DCP_VOLUMES_CLIENT_START_TIMEOUT`` | seconds until a client creation is stuck (0: never) |
| ``DCP_VOLUMES_EXIT_TIMEOUT`` | seconds a save in flight may take once the interpreter exits |
| ``DCP_VOLUMES_ENCRYPTION_KEY`` | base64 of the 32-byte key of ``Encryption.from_env()`` |
| ``DCP_VOLUMES_ENCRYPTION_KEY_ID`` | the id recorded with that key (default ``default``) |
| ``AWS_ENDPOINT_URL[_S3]`` (the SDKs') | the S3 endpoint; its scheme decides plain http |
| ``AWS_EC2_METADATA_DISABLED`` (botocore's) | ``true``: no credentials from instance metadata |
| ``AWS_UNSIGNED_PAYLOAD`` (obstore's) | set: it decides payload signing (else unsigned over TLS) |
"""

from __future__ import annotations

import json
import os
from typing import Any

STAGING = "DCP_VOLUMES_STAGING"
CACHE = "DCP_VOLUMES_CACHE"
MAX_RETRIES = "DCP_VOLUMES_MAX_RETRIES"
STORAGE_OPTIONS = "DCP_VOLUMES_STORAGE_OPTIONS"
BACKEND = "DCP_VOLUMES_BACKEND"
CLIENT_START_TIMEOUT = "DCP_VOLUMES_CLIENT_START_TIMEOUT"
EXIT_TIMEOUT = "DCP_VOLUMES_EXIT_TIMEOUT"
ROUTE = "DCP_VOLUMES_ROUTE"
ROUTE_CONFIG = "DCP_VOLUMES_ROUTE_CONFIG"
ENCRYPTION_KEY = "DCP_VOLUMES_ENCRYPTION_KEY"
ENCRYPTION_KEY_ID = "DCP_VOLUMES_ENCRYPTION_KEY_ID"


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
    return _seconds(CLIENT_START_TIMEOUT, default, "120, 0 to turn the watchdog off")


def exit_timeout(default: float = 600.0) -> float:
    """Seconds a save in flight may still take once the interpreter exits (0: no bound)."""
    return _seconds(EXIT_TIMEOUT, default, "600, 0 for no bound")


def _seconds(name: str, default: float, example: str) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return max(0.0, float(raw))
    except ValueError:
        from dcp_volumes._exceptions import ConfigurationError

        raise ConfigurationError(
            f"{name}={raw!r} is not a number of seconds; set it to e.g. {example}, or unset it."
        ) from None


def world_info() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as torchrun sets them."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, local_rank, local_world


def storage_options() -> dict[str, Any]:
    """The options in ``DCP_VOLUMES_STORAGE_OPTIONS``: the default of every entry point.

    ``Volume`` applies them to a remote URL given no ``storage_options``
    (``None``), so ``VolumeWriter``, ``VolumeReader``, ``CheckpointManager``,
    ``VolumeDataset``, ``FileCache``, ``route()`` and the CLI all honour them;
    explicit options, ``{}`` included, replace them whole (never merged). Local
    paths take no options.
    """
    raw = os.environ.get(STORAGE_OPTIONS)
    return parse_options(raw, STORAGE_OPTIONS) if raw else {}


def parse_options(text: str, source: str) -> dict[str, Any]:
    """Storage options given as JSON object text (``source`` names where, for the error)."""
    from dcp_volumes._exceptions import ConfigurationError

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(
            f"{source} is not valid JSON ({exc.msg} at char {exc.pos}); pass an object such "
            'as \'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'.'
        ) from None
    if not isinstance(value, dict):
        raise ConfigurationError(f"{source} must be a JSON object ({{...}}).")
    return value


def route_prefixes() -> list[str]:
    """The URL prefixes of ``DCP_VOLUMES_ROUTE`` (comma-separated; empty when unset)."""
    raw = os.environ.get(ROUTE) or ""
    return [p.strip() for p in raw.split(",") if p.strip()]


def route_config() -> str | None:
    """The path in ``DCP_VOLUMES_ROUTE_CONFIG`` (a TOML or JSON file), if set."""
    return os.environ.get(ROUTE_CONFIG) or None


def backend() -> str:
    """``"fsspec"`` to send S3 and Azure through s3fs/adlfs; ``"auto"`` (default): obstore."""
    raw = (os.environ.get(BACKEND) or "auto").strip().lower()
    if raw not in ("auto", "obstore", "fsspec"):
        from dcp_volumes._exceptions import ConfigurationError

        raise ConfigurationError(
            f"{BACKEND}={raw!r} is not a backend; set it to 'fsspec' or 'auto', or unset it."
        )
    return raw


# Variables through which the AWS credential chain finds credentials without
# asking the instance-metadata service.
_AWS_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


def aws_metadata_disabled() -> bool:
    """botocore's ``AWS_EC2_METADATA_DISABLED``: never ask the instance-metadata service."""
    return os.environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true"


def aws_credentials_in_environment() -> bool:
    """Whether the environment gives the AWS credential chain something besides metadata."""
    return any(os.environ.get(name) for name in _AWS_CREDENTIAL_VARIABLES)


# Where the AWS SDKs (and obstore) take an S3 endpoint from, the most specific first:
# the service's own variable wins over the one for every service.
AWS_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")


def aws_endpoint() -> str:
    """The S3 endpoint the environment gives (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
    ``AWS_ENDPOINT``, in that order), or ``""``."""
    return aws_endpoint_source()[1]


def aws_endpoint_source() -> tuple[str, str]:
    """(the variable, its value) that gives the S3 endpoint, or ``("", "")`` when none does."""
    for name in AWS_ENDPOINT_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return "", ""


def aws_unsigned_payload_set() -> bool:
    """Whether ``AWS_UNSIGNED_PAYLOAD`` (obstore reads it) chooses payload signing itself."""
    return bool(os.environ.get("AWS_UNSIGNED_PAYLOAD", "").strip())


def encryption_key() -> tuple[str, str] | None:
    """(the base64 key text, its key id or ``""``) from ``DCP_VOLUMES_ENCRYPTION_KEY[_ID]``,
    or ``None`` when no key is set."""
    raw = os.environ.get(ENCRYPTION_KEY, "").strip()
    if not raw:
        return None
    return raw, os.environ.get(ENCRYPTION_KEY_ID, "").strip()
