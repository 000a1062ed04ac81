"""The fsspec backend: GCS (gcsfs) and every other protocol fsspec knows.

fsspec implementations disagree on listings (``find`` returns a dict or a
list, not every ``ls`` takes ``refresh``; size, etag and mtime go by other keys
on each store); this module absorbs that. Creating a client costs 0.3-1 s
(service models, sessions) and writers and readers make a ``Volume`` per
checkpoint, so volumes with the same protocol and options share one client
per process; the pid is part of the key, so a forked child never reuses its
parent's client (sockets, event loops and locks do not survive fork).

Errors: each client (botocore under s3fs, azure-core under adlfs, gcsfs, and
the aiohttp, urllib3 and http.client beneath them) is mapped to the neutral
kinds (``_errors.py``) by its exception types and structured attributes
(botocore's ``response`` codes, azure's ``status_code``/``error_code``,
gcsfs's ``HttpError.code``, aiohttp's ``status``); see ``_neutral``.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
import fsspec.core

from dcp_volumes._exceptions import BackendNotInstalledError, ConfigurationError
from dcp_volumes._volume._backend import Capabilities, Data, FileInfo, Listing, scatter
from dcp_volumes._volume._client_watchdog import watch_client_start
from dcp_volumes._volume._errors import (
    AccessDenied,
    AlreadyExists,
    BackendError,
    BucketNotFound,
    ConnectionFailed,
    NotAFile,
    NotFound,
    PreconditionFailed,
    RequestFailed,
    ServerError,
    Throttled,
    Timeout,
    describe,
    from_builtin,
    map_exceptions,
)

_CLIENTS: dict[tuple[int, str, str], fsspec.AbstractFileSystem] = {}
_CLIENTS_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    global _CLIENTS_LOCK  # another thread may have held it at the fork
    _CLIENTS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)

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
# Stores whose listings show every write that returned (S3, GCS and Azure Blob are
# strongly consistent); another protocol is not known to (``Capabilities.listing_lags``).
_LISTS_WRITES_AT_ONCE = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def filesystem_class(protocol: str) -> type[fsspec.AbstractFileSystem]:
    """The fsspec class for ``protocol``; a clear error when it is unknown or not installed."""
    try:
        cls: type[fsspec.AbstractFileSystem] = fsspec.get_filesystem_class(protocol)
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
    return cls


def strip_protocol(protocol: str, url: str) -> str:
    """``url`` as a location of ``protocol``'s fsspec class (no protocol, no slashes at the end)."""
    filesystem_class(protocol)  # a clear error when the implementation is missing
    return str(fsspec.core.strip_protocol(url)).rstrip("/")


class FsspecBackend:
    """Locations of one fsspec protocol, through a client shared in this process."""

    def __init__(self, protocol: str, storage_options: Mapping[str, Any]) -> None:
        self._protocol = protocol
        self._options = dict(storage_options)
        self._cls = filesystem_class(protocol)
        self._fs: fsspec.AbstractFileSystem | None = None
        # Create-only puts are sent as such (gcsfs: ifGenerationMatch=0), but whether
        # the server decides them is not known here (GCS does, its emulator does
        # not), so the volume also checks first.
        self.capabilities = Capabilities(
            local_files=False, atomic_create=False, buffers_uploads=True,
            listing_lags=protocol not in _LISTS_WRITES_AT_ONCE,
        )

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            key = (os.getpid(), self._protocol, fsspec.utils.tokenize(self._options))
            with _CLIENTS_LOCK:
                fs = _CLIENTS.get(key)
                if fs is None:
                    # skip_instance_cache: a forked child must not reuse the parent's
                    # client. No listings cache: other ranks and jobs change the volume.
                    options = {"use_listings_cache": False, **self._options}
                    with watch_client_start(self._protocol):
                        fs = self._cls(skip_instance_cache=True, **options)
                    _CLIENTS[key] = fs
            self._fs = fs
        return self._fs

    def _strip(self, name: str) -> str:
        if "://" not in name:  # listings name entries without the protocol
            name = f"{self._protocol}://{name}"
        return str(fsspec.core.strip_protocol(name)).rstrip("/")

    def check_root(self, root: str, *, create: bool) -> Listing:
        # info(), not exists(): exists() turns "access denied" into False, and wrong
        # credentials must not read as a missing bucket.
        with map_exceptions(_neutral):
            self.fs.info(root.split("/", 1)[0])
        return self.list(root, recursive=False)

    def head(self, path: str) -> FileInfo:
        with map_exceptions(_neutral):
            raw = self.fs.info(path)
        if raw.get("type") == "directory":
            raise NotAFile(f"{path} is a directory/prefix, not a file")
        return _file_info(raw, path)

    def list(self, prefix: str, *, recursive: bool) -> Listing:
        with map_exceptions(_neutral):
            entries = self._entries(prefix, recursive=recursive)
        files, dirs = [], []
        for raw in entries:
            name = self._strip(str(raw["name"]))
            if raw.get("type") == "directory":
                dirs.append(name)
            else:
                files.append(_file_info(raw, name))
        return Listing(files=files, dirs=dirs)

    def _entries(self, prefix: str, *, recursive: bool) -> Sequence[Any]:
        """The raw entries below ``prefix`` (one level, or all), as the client lists them."""
        if recursive:
            found = self.fs.find(prefix, detail=True)
            return list(found.values()) if isinstance(found, dict) else list(found)
        try:
            return list(self.fs.ls(prefix, detail=True, refresh=True))
        except TypeError:  # backends without a refresh flag
            return list(self.fs.ls(prefix, detail=True))
        except FileNotFoundError:
            return []

    def read(self, path: str, start: int, end: int | None) -> Data:
        if end is not None and end <= start:
            return b""
        with map_exceptions(_neutral):
            return self.fs.cat_file(path, start=start or None, end=end)

    def read_whole(self, path: str, expect: int) -> Data:
        # One GET for one byte more than expected: a file that grew or shrank shows
        # in the length (a whole read would cost a HEAD first on some backends; an
        # empty range is an error, hence the whole read for 0).
        with map_exceptions(_neutral):
            if expect:
                return self.fs.cat_file(path, start=0, end=expect + 1)
            return self.fs.cat_file(path)

    def read_into(self, path: str, start: int, outs: Sequence[memoryview]) -> int:
        length = sum(len(o) for o in outs)
        data = memoryview(self.read(path, start, start + length)) if length else memoryview(b"")
        return scatter(data, outs)

    def upload(
        self, local_path: str, path: str, *, size: int, part_size: int, concurrency: int,
        move: bool,
    ) -> None:
        with map_exceptions(_neutral):
            self.fs.put_file(local_path, path, **self._upload_options(part_size, concurrency))
        if move:
            os.remove(local_path)

    def _upload_options(self, part_size: int, concurrency: int) -> dict[str, Any]:
        """Keyword arguments that tune ``put_file`` of this protocol's implementation."""
        if self._protocol in ("s3", "s3a"):
            return {"chunksize": part_size, "max_concurrency": concurrency}
        if self._protocol in ("gs", "gcs"):
            return {"chunksize": part_size}
        if self._protocol in ("az", "abfs", "abfss"):
            return {"max_concurrency": concurrency}
        return {}

    def put(self, path: str, data: Data, *, create_only: bool) -> None:
        with map_exceptions(_neutral):
            self.fs.pipe_file(path, bytes(data), mode="create" if create_only else "overwrite")

    def delete(self, paths: Sequence[str]) -> None:
        with map_exceptions(_neutral):
            try:
                self.fs.rm(list(paths))
            except FileNotFoundError:
                for path in paths:  # some were already gone: one by one
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(path)

    def copy(self, src: str, dst: str) -> None:
        with map_exceptions(_neutral):
            self.fs.copy(src, dst)


def _file_info(raw: Mapping[str, Any], path: str) -> FileInfo:
    """The ``FileInfo`` at ``path`` of one fsspec ``info``/``ls``/``find`` entry."""
    etag = raw.get("ETag") or raw.get("etag") or raw.get("md5Hash") or raw.get("generation")
    mtime = raw.get("mtime") or raw.get("LastModified") or raw.get("last_modified")
    if mtime is not None and hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    elif not isinstance(mtime, (int, float)):
        mtime = None
    return FileInfo(
        path=path,
        size=int(raw.get("size") or 0),
        etag=str(etag).strip('"') if etag else None,
        mtime=float(mtime) if mtime is not None else None,
    )


# -- errors -----------------------------------------------------------------------------------

# Service error codes and HTTP statuses (S3's and Azure's codes, any store's statuses),
# each to the kind it means.
_CODE_KINDS: dict[str, type[BackendError]] = {
    **dict.fromkeys(("NoSuchBucket", "ContainerNotFound", "BucketNotFound"), BucketNotFound),
    **dict.fromkeys(
        ("412", "PreconditionFailed", "BlobAlreadyExists", "ConditionNotMet"), PreconditionFailed
    ),
    **dict.fromkeys(("404", "NoSuchKey", "NotFound", "BlobNotFound"), NotFound),
    **dict.fromkeys(
        (
            "401",
            "403",
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AuthenticationFailed",
            "AuthorizationFailure",
            "ExpiredToken",
            "InvalidToken",
        ),
        AccessDenied,
    ),
    **dict.fromkeys(
        ("429", "SlowDown", "Throttling", "ThrottlingException", "ServerBusy"), Throttled
    ),
    **dict.fromkeys(
        ("500", "502", "503", "504", "InternalError", "ServiceUnavailable"), ServerError
    ),
    **dict.fromkeys(
        ("408", "RequestTimeout", "RequestTimeTooSkewed", "OperationTimedOut"), Timeout
    ),
}
# Which transient kind wins when an error names several.
_TRANSIENT_ORDER: tuple[type[BackendError], ...] = (Throttled, ServerError, Timeout)


def _loaded(module: str) -> Any:
    """``module`` if this process imported it, else ``None``: a client's exception can
    only exist once its module is loaded, and nothing is imported to look for one."""
    return sys.modules.get(module)


def _network_errors() -> tuple[type[BaseException], ...]:
    """The clients' exception types for a connection that failed or broke mid-answer."""
    found: list[type[BaseException]] = [http.client.IncompleteRead]
    if botocore := _loaded("botocore.exceptions"):
        found += [
            botocore.EndpointConnectionError,
            botocore.ConnectionClosedError,
            botocore.ReadTimeoutError,
            botocore.ConnectTimeoutError,
            botocore.ResponseStreamingError,
            botocore.IncompleteReadError,
        ]
    if aiohttp := _loaded("aiohttp"):
        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    if azure := _loaded("azure.core.exceptions"):
        found += [azure.ServiceRequestError, azure.ServiceResponseError]
    if urllib3 := _loaded("urllib3.exceptions"):
        found.append(urllib3.ProtocolError)
    return tuple(found)


def _credential_errors() -> tuple[type[BaseException], ...]:
    """The clients' exception types for credentials that are missing or refused."""
    found: list[type[BaseException]] = []
    if botocore := _loaded("botocore.exceptions"):
        found += [botocore.NoCredentialsError, botocore.PartialCredentialsError]
    if azure := _loaded("azure.core.exceptions"):
        found.append(azure.ClientAuthenticationError)
    return tuple(found)


def _codes(exc: BaseException) -> set[str]:
    """The service codes and HTTP statuses of ``exc`` and the errors it chains, from the
    structured attributes of each client's error type (s3fs raises an ``OSError`` whose
    cause is botocore's ``ClientError``)."""
    botocore = _loaded("botocore.exceptions")
    azure = _loaded("azure.core.exceptions")
    gcsfs = _loaded("gcsfs.retry")
    aiohttp = _loaded("aiohttp")
    codes: set[str] = set()
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        found: list[object] = []
        if botocore and isinstance(cur, botocore.ClientError):
            found += [
                cur.response.get("Error", {}).get("Code"),
                cur.response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            ]
        if azure and isinstance(cur, azure.HttpResponseError):
            found += [cur.status_code, cur.error_code]
        if gcsfs and isinstance(cur, gcsfs.HttpError):
            found.append(cur.code)
        if aiohttp and isinstance(cur, aiohttp.ClientResponseError):
            found.append(cur.status)
        codes.update(str(c) for c in found if isinstance(c, (int, str)) and c != "")
        cur = cur.__cause__ or cur.__context__
    return codes


def _neutral(exc: Exception) -> BackendError | None:
    """The neutral kind of an fsspec client's exception, or ``None`` for one none names.

    A built-in "not found", "exists" or "denied" is final; otherwise a network
    failure or a code that means "try again" is transient; then the codes that
    mean a final answer.
    """
    detail = describe(exc)
    codes = _codes(exc)
    kinds = {_CODE_KINDS[c] for c in codes if c in _CODE_KINDS}
    definite = isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError))
    if not definite:
        if isinstance(exc, _network_errors()):
            return ConnectionFailed(detail)
        for kind in _TRANSIENT_ORDER:
            if kind in kinds:
                return kind(detail)
        builtin = from_builtin(exc)
        if builtin is not None and builtin.transient:
            return builtin
    if BucketNotFound in kinds:
        return BucketNotFound(detail)
    if isinstance(exc, FileExistsError):
        return AlreadyExists(detail)
    if PreconditionFailed in kinds:
        return PreconditionFailed(detail)
    if isinstance(exc, FileNotFoundError) or NotFound in kinds:
        return NotFound(detail)
    # The status and the service's code, for the errors that are told apart by them
    # (a refused server-side encryption key: _errors.encryption_refusal).
    status = next((int(c) for c in codes if c.isdigit()), None)
    code = next((c for c in sorted(codes) if not c.isdigit()), None)
    if (
        isinstance(exc, PermissionError)
        or AccessDenied in kinds
        or isinstance(exc, _credential_errors())
    ):
        return AccessDenied(detail, status=status, code=code)
    if status == 400:
        return RequestFailed(detail, status=status, code=code)
    return from_builtin(exc)
