"""An object store in this process's memory, for tests: ``dcp-memory://bucket/prefix``.

``MemoryStore`` holds buckets of objects and answers the backend protocol
(``_backend.py``) as S3 does through obstore: create-only puts refused with a
412, ranged reads clipped at the object's end, listings below a prefix in key
order (one level with its sub-prefixes, or all of them), multipart uploads of
parts that a completion makes visible at once, batch deletes that ignore
missing keys. It raises the neutral kinds of ``_errors.py`` that the obstore
backend maps S3's answers to, so ``Volume`` retries and translates them
exactly as a real server's.

A test states what the store does to which request (httpx's ``MockTransport``
in spirit): ``fail`` answers with an error, ``stall`` holds a request until its
deadline, ``lag`` keeps new objects out of listings (and reads) for a while;
``calls`` counts the requests by operation. Every volume in this process whose
URL names one of a store's buckets reaches it (``MemoryBackend`` routes by
bucket), so the writer, reader, manager and dataset run on it unchanged.

One process only: a forked child (a DataLoader worker) reads a copy of the
store as it was at the fork, and its writes stay in the child.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, get_args

from dcp_volumes._volume._backend import (
    Capabilities,
    Data,
    FileInfo,
    Listing,
    keys_by_bucket,
    scatter,
)
from dcp_volumes._volume._errors import (
    AccessDenied,
    BackendError,
    BucketNotFound,
    ConnectionFailed,
    NotFound,
    PreconditionFailed,
    ServerError,
    Throttled,
    Timeout,
    UploadGone,
)

MEMORY_PROTOCOL = "dcp-memory"

# The requests a test can aim a fault at: the protocol's operations, and the two
# steps of a multipart upload besides its start (``upload`` is the whole upload).
Operation = Literal[
    "check_root", "head", "list", "read", "read_whole", "read_into", "upload", "upload_part",
    "complete_upload", "put", "delete", "copy",
]
OPERATIONS: frozenset[str] = frozenset(get_args(Operation))

# What ``fail`` answers, as the neutral kind obstore maps an S3 answer to.
FailureKind = Literal[
    "server_error", "throttled", "not_found", "access_denied", "timeout", "connection_reset",
    "upload_gone",
]


def _failure(kind: str, location: str) -> BackendError:
    what = f"injected by MemoryStore for {location}"
    if kind == "server_error":
        return ServerError(f"{what}: 500 InternalError", status=500, code="InternalError",
                           server_said="status 500: InternalError")
    if kind == "throttled":
        return Throttled(f"{what}: 503 SlowDown", status=503, code="SlowDown",
                         server_said="status 503: SlowDown")
    if kind == "not_found":
        return NotFound(f"{what}: 404 NoSuchKey", status=404, code="NoSuchKey")
    if kind == "access_denied":
        return AccessDenied(f"{what}: 403 AccessDenied", status=403, code="AccessDenied")
    if kind == "timeout":
        return Timeout(f"{what}: no answer before the deadline")
    if kind == "connection_reset":
        return ConnectionFailed(f"{what}: connection reset by peer")
    if kind == "upload_gone":
        return _upload_gone(location)
    raise ValueError(f"unknown failure kind {kind!r}; one of {get_args(FailureKind)}")


def _upload_gone(location: str) -> UploadGone:
    return UploadGone(
        f"the store no longer has the multipart upload of {location} (NoSuchUpload)",
        status=404, code="NoSuchUpload", server_said="status 404: NoSuchUpload",
    )


@dataclass(eq=False)
class Rule:
    """One fault a test stated: which requests it meets, what it does, and how often it did.

    ``release()`` lets the requests a stall holds go on as if nothing happened
    (and ends the rule); ``cancel()`` ends it for the requests still to come.
    """

    ops: frozenset[str]
    match: str
    times: float
    action: Callable[[str, float], None]
    hits: int = 0
    released: threading.Event = field(default_factory=threading.Event)

    def meets(self, op: str, location: str) -> bool:
        return op in self.ops and self.match in location and self.hits < self.times

    def release(self) -> None:
        self.released.set()
        self.cancel()

    def cancel(self) -> None:
        self.times = self.hits


@dataclass
class _Object:
    data: bytes
    etag: str
    mtime: float
    unlisted: int = 0  # listings still to leave it out (``lag``)
    unfound: int = 0  # reads and heads still to say "not found" (``lag``)


@dataclass(eq=False)
class _Lag:
    match: str
    listings: int
    reads: int


@dataclass
class _Upload:
    location: str
    parts: dict[int, bytes] = field(default_factory=dict)


class MemoryStore:
    """Buckets of objects in memory, reached by volumes at ``dcp-memory://BUCKET/...``.

    Use it as a context manager (or call ``close``): its buckets are known to
    this process's volumes until then. Thread-safe; one process only (see the
    module docstring).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, dict[str, _Object]] = {}
        self._uploads: dict[str, _Upload] = {}
        self._rules: list[Rule] = []
        self._lags: list[_Lag] = []
        self.calls: Counter[str] = Counter()

    # -- buckets --------------------------------------------------------------------------

    def create_bucket(self, name: str | None = None) -> str:
        """Make a bucket (a fresh name by default) and return its URL."""
        name = name or f"bucket-{uuid.uuid4().hex[:12]}"
        if not name or "/" in name:
            raise ValueError(f"a bucket name has no '/' and is not empty: {name!r}")
        with _REGISTRY_LOCK:
            if name in _STORES:
                raise ValueError(f"bucket {name!r} exists in this process already")
            _STORES[name] = self
        with self._lock:
            self._buckets[name] = {}
        return f"{MEMORY_PROTOCOL}://{name}"

    def close(self) -> None:
        """Forget the buckets: volumes no longer find them, and their bytes are freed."""
        with _REGISTRY_LOCK:
            for name in [n for n, store in _STORES.items() if store is self]:
                del _STORES[name]
        with self._lock:
            self._buckets.clear()
            self._uploads.clear()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- what a test may look at ----------------------------------------------------------

    def keys(self, bucket: str) -> list[str]:
        """The keys of a bucket, as a listing without lag would show them."""
        with self._lock:
            return sorted(self._buckets[bucket])

    def pending_uploads(self) -> list[str]:
        """Locations of multipart uploads started and neither completed nor aborted."""
        with self._lock:
            return sorted(u.location for u in self._uploads.values())

    def abort_uploads(self) -> int:
        """Abort every multipart upload in flight (as a lifecycle rule does); returns how many."""
        with self._lock:
            count = len(self._uploads)
            self._uploads.clear()
        return count

    # -- faults ---------------------------------------------------------------------------

    def fail(
        self, ops: str | Sequence[str], kind: FailureKind = "server_error", *, match: str = "",
        times: float = 1,
    ) -> Rule:
        """The next ``times`` requests of ``ops`` (an operation or several) whose location
        contains ``match`` fail with ``kind`` (``math.inf``: every one). ``upload_gone`` on
        ``complete_upload`` completes the upload first: its answer was lost, and the
        client's retry of the completion found no such upload."""
        _failure(kind, "")  # an unknown kind fails here, not in the request

        def act(location: str, deadline_s: float) -> None:
            raise _failure(kind, location)

        return self._add(ops, match, times, act)

    def stall(
        self, ops: str | Sequence[str], *, match: str = "", times: float = 1,
        seconds: float | None = None,
    ) -> Rule:
        """The next ``times`` requests of ``ops`` whose location contains ``match`` get no
        answer until their deadline (``seconds``, else the volume's ``RetryPolicy.stall_s``,
        else its ``timeout_s``, else 30 s), then time out; ``Rule.release()`` lets them go
        on before it."""

        def act(location: str, deadline_s: float) -> None:
            wait = deadline_s if seconds is None else seconds
            if not rule.released.wait(wait):
                raise Timeout(f"injected by MemoryStore for {location}: no answer in {wait} s")

        rule = self._add(ops, match, times, act)
        return rule

    def lag(self, *, match: str = "", listings: int = 1, reads: int = 0) -> Callable[[], None]:
        """Objects written from now on (whose location contains ``match``) are left out of
        the next ``listings`` listings that would show them, and the next ``reads`` heads
        and reads of them say "not found"; returns a function that ends it for later writes."""
        lag = _Lag(match, listings, reads)
        with self._lock:
            self._lags.append(lag)

        def end() -> None:
            with self._lock:
                if lag in self._lags:
                    self._lags.remove(lag)

        return end

    def clear_faults(self) -> None:
        """End every rule and lag (the requests a stall holds are released)."""
        with self._lock:
            rules, self._rules, self._lags = self._rules, [], []
        for rule in rules:
            rule.release()

    def _add(
        self, ops: str | Sequence[str], match: str, times: float, act: Callable[[str, float], None]
    ) -> Rule:
        wanted = frozenset([ops] if isinstance(ops, str) else ops)
        unknown = wanted - OPERATIONS
        if unknown:
            raise ValueError(f"unknown operations {sorted(unknown)}; one of {sorted(OPERATIONS)}")
        rule = Rule(wanted, match, times, act)
        with self._lock:
            self._rules.append(rule)
        return rule

    def _request(self, op: str, location: str, deadline_s: float) -> None:
        """Count one request and apply the first rule that meets it."""
        with self._lock:
            self.calls[op] += 1
            rule = next((r for r in self._rules if r.meets(op, location)), None)
            if rule is not None:
                rule.hits += 1
        if rule is not None:
            rule.action(location, deadline_s)

    # -- objects (under the lock) ---------------------------------------------------------

    def _bucket(self, bucket: str, missing: type[BackendError]) -> dict[str, _Object]:
        objects = self._buckets.get(bucket)
        if objects is None:
            raise missing(f"no bucket {bucket!r} (NoSuchBucket)", status=404, code="NoSuchBucket")
        return objects

    def _get(self, location: str) -> _Object:
        bucket, _, key = _split(location)
        # A GET or HEAD cannot tell a missing bucket from a missing key (S3 says 404 to both).
        obj = self._bucket(bucket, NotFound).get(key)
        if obj is None or not key:
            raise NotFound(f"no object {location} (NoSuchKey)", status=404, code="NoSuchKey")
        if obj.unfound > 0:
            obj.unfound -= 1
            raise NotFound(f"no object {location} yet (NoSuchKey; lag)", status=404,
                           code="NoSuchKey")
        return obj

    def _store(self, location: str, data: bytes, *, create_only: bool) -> None:
        bucket, _, key = _split(location)
        objects = self._bucket(bucket, BucketNotFound)
        if create_only and key in objects:
            raise PreconditionFailed(
                f"{location} exists (PreconditionFailed)", status=412, code="PreconditionFailed",
                server_said="status 412: PreconditionFailed",
            )
        lag = next((g for g in self._lags if g.match in location), None)
        objects[key] = _Object(
            data, hashlib.md5(data, usedforsecurity=False).hexdigest(), time.time(),
            unlisted=lag.listings if lag else 0, unfound=lag.reads if lag else 0,
        )

    def _list(self, prefix: str, *, recursive: bool) -> Listing:
        bucket, _, key = prefix.partition("/")
        objects = self._bucket(bucket, BucketNotFound)
        below = f"{key.rstrip('/')}/" if key else ""  # a prefix is a path: "a" lists "a/..."
        files: list[FileInfo] = []
        dirs: dict[str, None] = {}
        for name in sorted(objects):
            if not name.startswith(below) or name.endswith("/"):
                continue
            obj = objects[name]
            if obj.unlisted > 0:
                obj.unlisted -= 1
                continue
            rest = name[len(below):]
            if not recursive and "/" in rest:
                dirs[f"{bucket}/{below}{rest.split('/', 1)[0]}"] = None
            else:
                files.append(_info(f"{bucket}/{name}", obj))
        return Listing(files=files, dirs=list(dirs))


def _split(location: str) -> tuple[str, str, str]:
    """``location`` as (bucket, "/", key); a key obstore's client cannot address (an
    empty, ``.`` or ``..`` segment) is refused as it refuses it: a ``ValueError``."""
    bucket, sep, key = location.partition("/")
    if key and any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"Could not parse path: {key!r} has an empty, '.' or '..' segment")
    return bucket, sep, key


def _info(location: str, obj: _Object) -> FileInfo:
    return FileInfo(path=location, size=len(obj.data), etag=obj.etag, mtime=obj.mtime)


# Which store holds each bucket of this process.
_STORES: dict[str, MemoryStore] = {}
_REGISTRY_LOCK = threading.Lock()
# Where a bucket is in no store: every request finds no bucket.
_NOWHERE = MemoryStore()


def _new_locks_in_child() -> None:
    global _REGISTRY_LOCK  # another thread may have held them at the fork
    _REGISTRY_LOCK = threading.Lock()
    for store in {*_STORES.values(), _NOWHERE}:
        store._lock = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_in_child)


class MemoryBackend:
    """The backend of ``dcp-memory://`` volumes: each request goes to the store of its bucket."""

    capabilities = Capabilities(local_files=False, atomic_create=True, buffers_uploads=False)

    def __init__(self, deadline_s: float | None) -> None:
        # How long a stalled request waits for its answer (``MemoryStore.stall``).
        self._deadline_s = 30.0 if deadline_s is None else deadline_s

    def _serve(self, op: str, location: str) -> MemoryStore:
        """The store of ``location``'s bucket, once the request passed its faults."""
        store = _STORES.get(location.partition("/")[0], _NOWHERE)
        store._request(op, location, self._deadline_s)
        return store

    def check_root(self, root: str, *, create: bool) -> Listing:
        store = self._serve("check_root", root)
        with store._lock:
            return store._list(root, recursive=False)

    def head(self, path: str) -> FileInfo:
        store = self._serve("head", path)
        with store._lock:
            return _info(path, store._get(path))

    def list(self, prefix: str, *, recursive: bool) -> Listing:
        store = self._serve("list", prefix)
        with store._lock:
            return store._list(prefix, recursive=recursive)

    def read(self, path: str, start: int, end: int | None) -> Data:
        store = self._serve("read", path)
        with store._lock:
            data = store._get(path).data
        if end is not None and end <= start:
            return b""
        return memoryview(data)[start:end]  # clipped at the end; past it, empty

    def read_whole(self, path: str, expect: int) -> Data:
        store = self._serve("read_whole", path)
        with store._lock:
            return store._get(path).data

    def read_into(self, path: str, start: int, outs: Sequence[memoryview]) -> int:
        length = sum(len(o) for o in outs)
        if not length:
            return 0
        store = self._serve("read_into", path)
        with store._lock:
            data = store._get(path).data
        return scatter(memoryview(data)[start : start + length], outs)

    def upload(
        self, local_path: str, path: str, *, size: int, part_size: int, concurrency: int,
        move: bool,
    ) -> None:
        store = self._serve("upload", path)
        with open(local_path, "rb") as f:
            data = f.read(size)
        if size <= part_size:
            with store._lock:
                store._store(path, data, create_only=False)
        else:
            self._multipart(store, path, data, part_size, concurrency)
        if move:
            os.remove(local_path)

    def _multipart(
        self, store: MemoryStore, path: str, data: bytes, part_size: int, concurrency: int
    ) -> None:
        """Start an upload, send its parts ``concurrency`` at a time, complete it; a failed
        part aborts it (the client does), and the whole upload fails."""
        with store._lock:
            store._bucket(path.partition("/")[0], BucketNotFound)
            upload_id = uuid.uuid4().hex
            store._uploads[upload_id] = _Upload(path)

        def send(number: int) -> None:
            store._request("upload_part", path, self._deadline_s)
            with store._lock:
                upload = store._uploads.get(upload_id)
                if upload is None:
                    raise _upload_gone(path)
                start = number * part_size
                upload.parts[number] = data[start : start + part_size]

        try:
            with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
                list(pool.map(send, range(math.ceil(len(data) / part_size))))
            lost: UploadGone | None = None
            try:
                store._request("complete_upload", path, self._deadline_s)
            except UploadGone as gone:  # injected: completed, but the answer was lost
                lost = gone
            with store._lock:
                upload = store._uploads.pop(upload_id, None)
                if upload is None:
                    raise _upload_gone(path)
                store._store(path, b"".join(upload.parts[n] for n in sorted(upload.parts)),
                             create_only=False)
            if lost is not None:
                raise lost
        finally:
            with store._lock:
                store._uploads.pop(upload_id, None)

    def put(self, path: str, data: Data, *, create_only: bool) -> None:
        store = self._serve("put", path)
        body = bytes(memoryview(data).cast("B")) if not isinstance(data, bytes) else data
        with store._lock:
            store._store(path, body, create_only=create_only)

    def delete(self, paths: Sequence[str]) -> None:
        for bucket, keys in keys_by_bucket(paths).items():
            # One request per bucket (a batch): a fault aimed at any of its keys meets it.
            store = self._serve("delete", " ".join(f"{bucket}/{key}" for key in keys))
            with store._lock:
                objects = store._bucket(bucket, BucketNotFound)
                for key in keys:
                    objects.pop(key, None)

    def copy(self, src: str, dst: str) -> None:
        if dst.partition("/")[0] != src.partition("/")[0]:
            raise ValueError(f"copy across buckets ({src} -> {dst}) is not supported")
        store = self._serve("copy", src)
        with store._lock:
            store._store(dst, store._get(src).data, create_only=False)
