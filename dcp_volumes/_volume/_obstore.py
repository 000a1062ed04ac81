"""The obstore backend: S3 and Azure Blob through the Rust ``object_store`` crate.

One client library for the bulk bytes of both stores: multipart uploads read
straight from the staged file, ranged reads, HEAD, listings, batch deletes,
create-only puts and server-side copies, all with the GIL released and retried
by the client itself (``retry_config``, set from the volume's ``RetryPolicy``).
Stores are created lazily, one per bucket, in the process that uses them;
with stall detection, one per bucket and deadline class (``_stall.py``: a
stalled request is found in seconds, a slow one that moves is never cut), a
few at most, reused (``_obstore_stores.py``).

Fork: obstore's runtime threads do not exist in a child forked after the
parent did I/O through it, and the child hangs on its first call (tokio does
not support fork). So the process notes its first I/O here, a forked child
learns that it inherited a used runtime, and ``select_backend`` gives such a
child the fsspec backend instead (``survives_fork`` is False; the DataLoader
starts its workers with forkserver for that reason).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from dcp_volumes._exceptions import BackendNotInstalledError
from dcp_volumes._volume._backend import (
    Capabilities,
    Data,
    FileInfo,
    Listing,
    keys_by_bucket,
    scatter,
)
from dcp_volumes._volume._client_watchdog import watch_client_start
from dcp_volumes._volume._errors import (
    AccessDenied,
    BackendError,
    BucketNotFound,
    ConnectionFailed,
    InvalidKey,
    Misconfigured,
    NotFound,
    PreconditionFailed,
    RequestFailed,
    ServerError,
    UploadGone,
    describe,
    from_builtin,
    map_exceptions,
)
from dcp_volumes._volume._mapped import mapped, mapped_parts
from dcp_volumes._volume._obstore_options import RequestClass, StoreSettings
from dcp_volumes._volume._obstore_stores import Stores

logger = logging.getLogger("dcp_volumes._volume")

# The store class of requests the server works on, in proportion to what they ask,
# before it answers (a listing page, a server-side copy, a batch delete): the request
# timeout alone, no stall detection (there are few of them).
_SERVER_WORK = ("server", math.inf)

# The pid of this process once it did I/O through obstore; True in a child
# forked after that (its inherited runtime cannot run there).
_io_pid: int | None = None
_runtime_inherited = False


def _after_fork_in_child() -> None:
    global _runtime_inherited, _io_pid
    if _io_pid is not None:
        _runtime_inherited = True
    _io_pid = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def usable_here() -> bool:
    """Whether obstore can run in this process (not a child forked after obstore I/O)."""
    return not _runtime_inherited


def used_here() -> bool:
    """Whether this process has done I/O through obstore (a fork now would inherit it)."""
    return _io_pid == os.getpid()


def require() -> Any:
    """The obstore module, or a clear error naming what to install."""
    try:
        import obstore
        import obstore.exceptions
    except ImportError as exc:
        raise BackendNotInstalledError(
            "S3 and Azure volumes use obstore, which is not installed. Fix: "
            "pip install 'dcp_volumes[s3]' (or [azure]), or set DCP_VOLUMES_BACKEND=fsspec "
            "to use s3fs/adlfs."
        ) from exc
    return obstore


class ObstoreBackend:
    """S3 or Azure Blob locations (``bucket/key``) through obstore."""

    capabilities = Capabilities(
        local_files=False, atomic_create=True, buffers_uploads=False, survives_fork=False
    )

    def __init__(self, kind: str, settings: StoreSettings) -> None:
        self._kind = kind  # "s3" or "azure"
        self._settings = settings
        self.stores = Stores()  # bounded and reused (``_obstore_stores.py``)
        self._obs = require()

    # -- stores ---------------------------------------------------------------------------

    def _store(self, bucket: str, request: RequestClass | None = None) -> Any:
        """The bucket's store for a class of requests (``_stall.py``); by default reads."""
        stall = self._settings.stall
        if stall is None:
            request = None  # one deadline for every request: one store per bucket
        elif request is None:
            request = ("read", stall.read_timeout_s())
        store = self.stores.get((bucket, request), lambda: self._new_store(bucket, request))
        global _io_pid
        _io_pid = os.getpid()
        return store

    def _new_store(self, bucket: str, request: RequestClass | None) -> Any:
        from obstore.store import AzureStore, S3Store

        cls = S3Store if self._kind == "s3" else AzureStore
        with watch_client_start(self._kind.upper()):
            return cls(bucket, **self._settings.kwargs(request))

    def _split(self, path: str) -> tuple[Any, str]:
        bucket, _, key = path.partition("/")
        return self._store(bucket), key

    def _upload_split(self, path: str, request_bytes: int) -> tuple[Any, str]:
        """The store for uploads of ``request_bytes`` per request, and the key."""
        stall = self._settings.stall
        if stall is None:
            return self._split(path)
        bucket, _, key = path.partition("/")
        return self._store(bucket, ("upload", stall.upload_deadline_s(request_bytes))), key

    # -- errors ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _client_errors(self) -> Iterator[None]:
        """Raise obstore's exceptions as the neutral kinds (``_errors.py``); a request
        that timed out lengthens later requests' deadlines (``_stall.py``)."""
        with map_exceptions(self._neutral):
            stall = self._settings.stall
            level = stall.level if stall is not None else 0
            try:
                yield
            except self._obs.exceptions.GenericError as exc:
                if stall is not None and read_failure(exc).timed_out:
                    stall.saw_timeout(level)
                    logger.info(
                        "a request got no answer within its deadline (a stall, or a slow "
                        "store or link): later requests wait %dx as long",
                        2**stall.level,
                    )
                raise
            if stall is not None:
                stall.saw_success()

    def _neutral(self, exc: Exception) -> BackendError | None:
        """The neutral kind of one of obstore's exceptions (by its type), or ``None``."""
        errors = self._obs.exceptions
        gone = self._upload_gone(exc)
        if gone is not None:
            return gone
        if isinstance(exc, errors.GenericError):
            return self._generic(exc)
        detail = describe(exc)
        if isinstance(exc, (FileNotFoundError, errors.NotFoundError)):
            return NotFound(detail)
        if isinstance(exc, (errors.PermissionDeniedError, errors.UnauthenticatedError)):
            failure = read_failure(exc)
            return AccessDenied(detail, status=failure.status, code=failure.code)
        if isinstance(exc, (errors.AlreadyExistsError, errors.PreconditionError)):
            # obstore reads every 409 as "already exists": the server's words say which.
            return PreconditionFailed(detail, server_said=read_failure(exc).server_said)
        if isinstance(exc, errors.UnknownConfigurationKeyError):
            return Misconfigured(detail)
        if isinstance(exc, errors.InvalidPathError):
            return InvalidKey(detail)
        return from_builtin(exc)

    def _upload_gone(self, exc: Exception) -> UploadGone | None:
        """``UploadGone`` where the store says it has no such multipart upload, or ``None``.

        The upload's last request (its completion) can succeed on the store while
        its answer is lost; the client's retry then finds no such upload, aborts it
        (which finds none either) and reports "not found". Neither the object nor
        the bucket is missing: the bytes are still here, and a new try sends them
        again whole.
        """
        errors = self._obs.exceptions
        if not isinstance(exc, (FileNotFoundError, errors.NotFoundError, errors.GenericError)):
            return None
        failure = read_failure(exc)
        if failure.code != "NoSuchUpload":
            return None
        return UploadGone(
            f"the store no longer has the multipart upload of this write ({failure.server_said}): "
            "a try whose answer was lost on the way may have completed it, or it was aborted. "
            "Fix: retry the save; if this keeps happening, look for a lifecycle rule or another "
            "client that aborts incomplete multipart uploads in this bucket.",
            explained=True,
            status=failure.status,
            code=failure.code,
            server_said=failure.server_said,
        )

    def _generic(self, exc: Exception) -> BackendError:
        """The kind of obstore's untyped error, from what its message says (``read_failure``).

        A connection that could not be made was retried by the client itself
        (its ``retry_config``, set from the volume's policy): retrying it again
        above would multiply the wait, so it is final. A request the client
        cannot build is never sent, so no retry can help. A 4xx answer is the
        request's fault: final. The rest (a 5xx through the client's retries, a
        body cut mid-listing, a connection lost) is transient.
        """
        failure = read_failure(exc)
        if failure.unsendable:
            endpoint = self._endpoint(failure)
            if endpoint.startswith("http://") and not self._settings.client_options.get(
                "allow_http", True
            ):
                why = "the endpoint is plain http:// but client_options sets allow_http=False"
                fix = "use the store's https:// endpoint, or drop allow_http=False."
            else:
                why = f"the client's reason: {failure.cause}"
                fix = self._endpoint_fix()
            return Misconfigured(
                f"the object-store client cannot build a request to {endpoint} from these "
                f"settings ({why}); nothing was sent. Fix: {fix}",
                explained=True,
                endpoint=endpoint,
            )
        if failure.connect:
            endpoint = self._endpoint(failure)
            what = (
                "connection refused at"
                if failure.cause == "ConnectionRefused"
                else f"cannot connect ({failure.cause}) to"
            )
            return ConnectionFailed(
                f"{what} {endpoint} (tried {failure.retries + 1} times). Fix: "
                "check that the store is running and reachable at that address; "
                f"{self._endpoint_fix()}",
                explained=True,
                transient=False,
                endpoint=endpoint,
            )
        detail = describe(exc)
        if failure.status is not None and 400 <= failure.status < 500:
            return RequestFailed(detail, status=failure.status, code=failure.code,
                                 server_said=failure.server_said)
        if failure.status is not None and failure.status >= 500:
            return ServerError(detail, status=failure.status, server_said=failure.server_said)
        return ConnectionFailed(detail)

    def _endpoint(self, failure: _Failure) -> str:
        """The address the failed request went to (scheme, host and port only)."""
        url = failure.url or str(self._settings.config.get("endpoint") or "")
        try:
            parts = urlsplit(url)
        except ValueError:
            return "the configured endpoint"
        if not parts.scheme or not parts.hostname:
            return "the configured endpoint"
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}"

    def _endpoint_fix(self) -> str:
        """Where to correct the endpoint, by where it came from."""
        source = self._settings.endpoint_source
        if source == "storage_options":
            return "correct the endpoint in storage_options (endpoint_url / endpoint)."
        if source:
            return f"the endpoint comes from the environment ({source}): correct or unset it."
        return "pass the store's endpoint (storage_options endpoint_url, or AWS_ENDPOINT_URL)."

    # -- queries --------------------------------------------------------------------------

    def check_root(self, root: str, *, create: bool) -> Listing:
        return self.list(root, recursive=False)

    def _listing_error(self, store: Any, key: str, bucket: str, exc: Exception) -> BackendError:
        """The kind of a listing that failed with obstore's untyped error.

        obstore reports a failed listing (a missing bucket, refused credentials,
        a cut connection) only as an untyped error whose text carries the
        server's status: a 404 of the listing itself is a missing bucket. For
        the rest a HEAD in the bucket has typed errors (refused credentials);
        its "not found" says nothing (the probe key never exists), so the
        listing's own error stands.
        """
        kind = self._generic(exc)
        if kind.status == 404:
            return BucketNotFound(f"no bucket or container {bucket!r}", status=404)
        if kind.explained:  # never sent, or never connected: a probe would fail the same way
            return kind
        probe = f"{key}/.dcp-volumes-probe" if key else ".dcp-volumes-probe"
        try:
            self._obs.head(store, probe)
        except (FileNotFoundError, self._obs.exceptions.GenericError):
            return kind
        except Exception as typed:  # permission, credentials: more precise than the listing's
            return self._neutral(typed) or kind
        return kind

    def head(self, path: str) -> FileInfo:
        with self._client_errors():
            store, key = self._split(path)
            return _info(path, self._obs.head(store, key))

    def list(self, prefix: str, *, recursive: bool) -> Listing:
        with self._client_errors():
            bucket, _, key = prefix.partition("/")
            store = self._store(bucket, _SERVER_WORK)
            try:
                if recursive:
                    files = [
                        _info(f"{bucket}/{meta['path']}", meta)
                        for chunk in self._obs.list(store, prefix=key or None)
                        for meta in chunk
                        if not meta["path"].endswith("/")
                    ]
                    return Listing(files=files, dirs=[])
                found = self._obs.list_with_delimiter(store, prefix=key or None)
            except self._obs.exceptions.GenericError as exc:
                raise self._listing_error(store, key, bucket, exc) from exc
        files = [_info(f"{bucket}/{meta['path']}", meta) for meta in found["objects"]]
        dirs = [f"{bucket}/{p.rstrip('/')}" for p in found["common_prefixes"]]
        return Listing(files=files, dirs=dirs)

    # -- reads ----------------------------------------------------------------------------

    def read(self, path: str, start: int, end: int | None) -> Data:
        if end is not None and end <= start:
            return b""
        with self._client_errors():
            store, key = self._split(path)
            try:
                if end is None:
                    if start == 0:
                        return self._obs.get(store, key).bytes()
                    return self._obs.get(store, key, options={"range": {"offset": start}}).bytes()
                return self._obs.get_range(store, key, start=start, end=end)
            except self._obs.exceptions.GenericError as exc:
                kind = self._generic(exc)
                # A range that starts at or past the end is refused (416) as an untyped
                # error; like a file read, it holds no bytes.
                if not kind.explained and start > 0 and self._obs.head(store, key)["size"] <= start:
                    return b""
                raise kind from exc

    def read_whole(self, path: str, expect: int) -> Data:
        with self._client_errors():
            store, key = self._split(path)
            return self._obs.get(store, key).bytes()

    def read_into(self, path: str, start: int, outs: Sequence[memoryview]) -> int:
        length = sum(len(o) for o in outs)
        if not length:
            return 0
        data = memoryview(self.read(path, start, start + length))
        return scatter(data, outs)

    # -- writes ---------------------------------------------------------------------------

    def upload(
        self, local_path: str, path: str, *, size: int, part_size: int, concurrency: int,
        move: bool,
    ) -> None:
        # The file is mapped and handed over as buffers, which obstore sends
        # without a copy (see _mapped): read from a path, every part would be a
        # fresh allocation in one of its runtime's threads, and glibc keeps such
        # memory in per-thread arenas (an async save's peak RSS grew to 2.1x
        # the state that way instead of 1.1x). Each try (the volume's retries call
        # this again) maps the file afresh: a buffer that an abandoned request may
        # still hold is never handed to the next one, nor unmapped under it.
        with self._client_errors(), open(local_path, "rb") as f:
            store, key = self._upload_split(path, min(size, part_size))
            if size > part_size:
                self._obs.put(
                    store,
                    key,
                    mapped_parts(f, size, part_size),
                    use_multipart=True,
                    chunk_size=part_size,
                    max_concurrency=max(1, concurrency),
                )
            else:
                with mapped(f, size) as body:
                    self._obs.put(store, key, body, use_multipart=False)
        if move:
            os.remove(local_path)

    def put(self, path: str, data: Data, *, create_only: bool) -> None:
        with self._client_errors():
            store, key = self._upload_split(path, _nbytes(data))
            self._obs.put(store, key, data, mode="create" if create_only else "overwrite")

    def delete(self, paths: Sequence[str]) -> None:
        for bucket, keys in keys_by_bucket(paths).items():
            with self._client_errors():
                store = self._store(bucket, _SERVER_WORK)
                try:
                    self._obs.delete(store, keys)
                except FileNotFoundError:
                    # Some stores report a missing one and stop: delete the rest one by one.
                    for key in keys:
                        with contextlib.suppress(FileNotFoundError):
                            self._obs.delete(store, key)

    def copy(self, src: str, dst: str) -> None:
        dst_bucket, _, dst_key = dst.partition("/")
        if dst_bucket != src.partition("/")[0]:
            raise ValueError(f"copy across buckets ({src} -> {dst}) is not supported")
        with self._client_errors():
            store, src_key = self._store(dst_bucket, _SERVER_WORK), src.partition("/")[2]
            self._obs.copy(store, src_key, dst_key, overwrite=True)


@dataclass(frozen=True)
class _Failure:
    """What obstore's client says about a request that failed (see ``read_failure``)."""

    connect: bool  # the connection was never made (refused, no route, DNS): retried already
    timed_out: bool  # the client gave up waiting (its timeout or read timeout)
    unsendable: bool  # the request could not be built from the settings: never sent
    cause: str  # the innermost reason the client names: "ConnectionRefused", "dns error", ...
    retries: int  # how often the client retried the request
    url: str | None  # where the request went
    status: int | None  # the HTTP status the server answered, if it answered
    server_said: str | None  # that status, and the error code and message of its body
    code: str | None  # the error code of its body ("NoSuchUpload", "SlowDown", ...)


# The fields of obstore's "Debug source" (Rust's {:?} of object_store's error) read below.
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_REQWEST_KIND = re.compile(r"reqwest::Error \{\s*kind: (\w+)")
_OS_KIND = re.compile(r"Os \{\s*code: -?\d+,\s*kind: (\w+)")
_CONNECT_STEP = re.compile(r'ConnectError\(\s*"([^"]+)"')
_INNER_SOURCE = re.compile(r"source: (\w+),?\s*\}")
_RETRIES = re.compile(r"\bretries: (\d+),")
_URI = re.compile(r"\buri: Some\(\s*([^\s,()]+)")
# The status the server answered, and the code and message of an XML error body
# (obstore's first line names its own reading of the status, not the server's).
_STATUS = re.compile(r"status code: (\d{3})\b")
_TIMED_OUT = re.compile(r"\bTimedOut\b|operation timed out")
_BODY_FIELDS = {tag: re.compile(rf"<{tag}>([^<\n]*)") for tag in ("Code", "Message")}


def read_failure(exc: BaseException) -> _Failure:
    """What obstore's error says about its request, read from its message.

    obstore raises every failure of its HTTP client as one ``GenericError`` with
    no attributes and no ``__cause__`` (and its typed errors carry no status
    either); the structure (the kind of failure, how often the client retried,
    the URL, the status and body the server answered) is only in the text: the
    "Debug source" its message ends with. This is the one place in the package
    that reads an error's text, for the one client that offers nothing else.
    """
    text = str(exc)
    status_found = _STATUS.search(text)
    status = int(status_found.group(1)) if status_found else None
    said = [f"status {status}"] if status else []
    fields = {}
    for tag, pattern in _BODY_FIELDS.items():
        field = pattern.search(text)
        if field:
            fields[tag] = field.group(1).strip()[:300]
            said.append(fields[tag])
    http_kind = _HTTP_KIND.search(text)
    reqwest_kind = _REQWEST_KIND.search(text)
    os_kind = _OS_KIND.search(text)
    step = _CONNECT_STEP.search(text)
    inner = _INNER_SOURCE.search(text)
    retries = _RETRIES.search(text)
    uri = _URI.search(text)
    unsendable = reqwest_kind is not None and reqwest_kind.group(1) == "Builder"
    if os_kind:
        cause = os_kind.group(1)
    elif step:
        cause = step.group(1)
    elif unsendable and inner:
        cause = inner.group(1)
    else:
        cause = "unknown"
    return _Failure(
        connect=http_kind is not None and http_kind.group(1) == "Connect",
        timed_out=(http_kind is not None and http_kind.group(1) == "Timeout")
        or _TIMED_OUT.search(text) is not None,
        unsendable=unsendable,
        cause=cause,
        retries=int(retries.group(1)) if retries else 0,
        url=uri.group(1) if uri else None,
        status=status,
        server_said=": ".join(said) if said else None,
        code=fields.get("Code") or None,
    )


def _nbytes(data: Data) -> int:
    """The size of a body ``put`` sends (bytes-like, or a sequence of them)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).nbytes
    try:
        return sum(memoryview(part).nbytes for part in data)
    except TypeError:
        return len(data)


def _info(path: str, meta: Mapping[str, Any]) -> FileInfo:
    modified = meta.get("last_modified")
    etag = meta.get("e_tag")
    return FileInfo(
        path=path,
        size=int(meta["size"]),
        etag=str(etag).strip('"') if etag else None,
        mtime=modified.timestamp() if isinstance(modified, datetime) else None,
    )

