"""Backend clients of a ``Volume``: which fsspec class serves a protocol, and shared clients.

Creating an object-store client costs 0.3-1 s (service models, sessions), and
writers and readers make a ``Volume`` per checkpoint, so volumes with the same
protocol and options share one client per process. The process id is part of
every cache key: a forked child never reuses its parent's client (sockets,
event loops and locks do not survive fork). Errors are raised as they come;
``Volume`` translates them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import fsspec

from dcp_volumes._client_watchdog import watch_client_start
from dcp_volumes._exceptions import BackendNotInstalledError, ConfigurationError
from dcp_volumes._s3_transport import S3Transport

# One client per (process, protocol, options): see Volume.fs and Volume.s3.
_CLIENTS: dict[tuple[int, str, str], fsspec.AbstractFileSystem] = {}
_TRANSPORTS: dict[tuple[int, str], S3Transport | None] = {}
_CLIENTS_LOCK = threading.Lock()
# One botocore session per profile, shared by the process's S3 clients and
# inherited by forked children (DataLoader workers): a session caches the parsed
# service model and endpoint rules, which a fresh one re-parses (~80 ms of CPU
# alone, ~0.5 s per worker when workers start together). A session holds no
# connections, so sharing it over fork is safe; clients stay per process.
_SESSIONS: dict[str | None, Any] = {}


def _new_lock_in_child() -> None:
    global _CLIENTS_LOCK  # another thread may have held it at the fork
    _CLIENTS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)

S3_PROTOCOLS = frozenset({"s3", "s3a"})
_EXTRA_FOR_PROTOCOL = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "adl": "azure",
}


def filesystem_class(protocol: str) -> type[fsspec.AbstractFileSystem]:
    """The fsspec class for ``protocol``; a clear error when it is unknown or not installed."""
    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        extra = _EXTRA_FOR_PROTOCOL.get(protocol)
        hint = (
            f"pip install 'dcp_volumes[{extra}]'"
            if extra
            else f"install the fsspec implementation for '{protocol}://'"
        )
        raise BackendNotInstalledError(
            f"No fsspec backend is installed for '{protocol}://' URLs, so this "
            f"volume cannot be opened. Fix: {hint}."
        ) from exc
    except ValueError as exc:
        raise ConfigurationError(
            f"Unknown URL protocol '{protocol}://'. Use s3://, gs://, az://, file://, "
            "a plain local or mounted path, or a protocol that fsspec knows "
            "(fsspec.available_protocols())."
        ) from exc


def shared_filesystem(
    cls: type[fsspec.AbstractFileSystem], protocol: str, storage_options: Mapping[str, Any]
) -> fsspec.AbstractFileSystem:
    """This process's client of ``cls`` for ``storage_options``, created on first use."""
    key = (os.getpid(), protocol, fsspec.utils.tokenize(storage_options))
    with _CLIENTS_LOCK:
        fs = _CLIENTS.get(key)
        if fs is None:
            # skip_instance_cache: a forked child must not reuse the parent's
            # client (the pid in the key does the same for our cache).
            # No listings cache: other ranks and jobs change the volume.
            options = {"use_listings_cache": False, **storage_options}
            with watch_client_start(protocol):
                fs = cls(skip_instance_cache=True, **options)
            _CLIENTS[key] = fs
    return fs


def shared_s3_transport(storage_options: Mapping[str, Any]) -> S3Transport | None:
    """This process's botocore transport for ``storage_options`` (``None``: keep s3fs)."""
    key = (os.getpid(), fsspec.utils.tokenize(storage_options))
    with _CLIENTS_LOCK:
        if key not in _TRANSPORTS:  # a None answer is cached too
            with watch_client_start("S3"):
                _TRANSPORTS[key] = S3Transport.for_options(
                    storage_options, session=_session(storage_options.get("profile"))
                )
        return _TRANSPORTS[key]


def _session(profile: str | None) -> Any:
    """The shared botocore session for ``profile`` (call with ``_CLIENTS_LOCK`` held)."""
    session = _SESSIONS.get(profile)
    if session is None:
        try:
            import botocore.session
        except ImportError:
            return None  # for_options then keeps s3fs
        session = _SESSIONS[profile] = botocore.session.Session(profile=profile)
    return session


def upload_options(protocol: str, part_size: int | None, concurrency: int | None) -> dict[str, Any]:
    """Keyword arguments that tune ``fs.put_file`` of ``protocol``'s fsspec backend."""
    kwargs: dict[str, Any] = {}
    if protocol in S3_PROTOCOLS:
        if part_size:
            kwargs["chunksize"] = part_size
        if concurrency:
            kwargs["max_concurrency"] = concurrency
    elif protocol in ("gs", "gcs") and part_size:
        kwargs["chunksize"] = part_size
    elif protocol in ("az", "abfs", "abfss") and concurrency:
        kwargs["max_concurrency"] = concurrency
    return kwargs
