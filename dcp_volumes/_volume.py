"""Volume: one URL (object store, mount path or any fsspec protocol) as a small file API.

Everything above this module speaks ``Volume``; backends differ only here.
Clients are lazy and fork-safe: the fsspec filesystem is created on first use
in each process and never pickled, so a ``Volume`` survives fork and pickling.
Every backend call goes through ``_call``, which retries transient errors and
translates failures (``_retry.py``), so no caller handles backend exceptions.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
from fsspec.core import split_protocol

from dcp_volumes import _env
from dcp_volumes._exceptions import (
    BackendNotInstalledError,
    BucketNotFoundError,
    ConfigurationError,
    DcpVolumesError,
    VolumeAccessError,
    VolumeError,
    VolumeExistsError,
    VolumeNotFoundError,
)
from dcp_volumes._retry import (
    RetryPolicy,
    call_with_retries,
    redact_url,
    secret_values,
    translate_error,
)
from dcp_volumes._s3_transport import S3Transport

logger = logging.getLogger(__name__)

# One client per (process, protocol, options): see Volume.fs and Volume.s3.
_CLIENTS: dict[tuple[int, str, str], fsspec.AbstractFileSystem] = {}
_TRANSPORTS: dict[tuple[int, str], S3Transport | None] = {}
_CLIENTS_LOCK = threading.Lock()

T = TypeVar("T")

LOCAL_PROTOCOLS = frozenset({"file", "local"})
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


@dataclass(frozen=True)
class FileInfo:
    """One file on a volume; ``path`` is relative to the volume's root, ``/``-separated."""

    path: str
    size: int
    etag: str | None = None
    mtime: float | None = None


def _fsync_dir(path: str) -> None:
    # Make a rename durable: the directory entry itself must reach the disk.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Volume:
    """A remote or local location addressed by URL, with retries and clear errors.

    Args:
        url: ``s3://bucket/prefix``, ``gs://...``, ``az://container/...``,
            ``file:///path``, a plain path (a local disk or network mount), or
            any fsspec URL.
        storage_options: passed to the fsspec filesystem (endpoint, credentials...).
        retry: retry policy for transient errors; defaults to 5 attempts
            (``DCP_VOLUMES_MAX_RETRIES`` overrides the count).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        url = os.fspath(url)
        if not isinstance(url, str) or not url.strip():
            raise ConfigurationError(
                "A volume URL must be a non-empty string such as 's3://bucket/prefix' or "
                "'/mnt/nfs/run1'."
            )
        protocol, path = split_protocol(url)
        self.protocol: str = (protocol or "file").lower()
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self.retry = retry or RetryPolicy(attempts=_env.max_retries(5))
        self.is_local = self.protocol in LOCAL_PROTOCOLS
        if self.is_local:
            self.root = os.path.abspath(os.path.expanduser(path)).rstrip(os.sep) or os.sep
        else:
            cls = self._filesystem_class()
            self.root = cls._strip_protocol(url).rstrip("/")
            if not self.root:
                raise ConfigurationError(
                    f"The URL {redact_url(url)!r} names no bucket or container; use "
                    f"'{self.protocol}://BUCKET/PREFIX'."
                )
        self._fs: fsspec.AbstractFileSystem | None = None
        self._fs_pid = -1
        self._s3: S3Transport | None = None
        self._s3_pid = -1
        self._secrets = secret_values(self.storage_options)

    # -- identity -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Canonical URL of the root (plain path for local volumes)."""
        return self.root if self.is_local else f"{self.protocol}://{self.root}"

    @property
    def display_url(self) -> str:
        """The URL as it may appear in messages and logs."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"Volume({self.display_url!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Clients hold sockets, event loops and locks: never pickle them.
        state = self.__dict__.copy()
        state["_fs"] = None
        state["_fs_pid"] = -1
        state["_s3"] = None
        state["_s3_pid"] = -1
        return state

    def child(self, relpath: str) -> Volume:
        """A volume rooted at ``relpath`` below this one, sharing options."""
        new = Volume.__new__(Volume)
        new.__dict__.update(self.__getstate__())
        new.root = self.full_path(relpath)
        return new

    def full_path(self, relpath: str = "") -> str:
        """The backend path (no protocol) of ``relpath`` below the root."""
        relpath = relpath.strip("/")
        if not relpath:
            return self.root
        if self.is_local:
            return os.path.join(self.root, *relpath.split("/"))
        return f"{self.root}/{relpath}"

    def url_of(self, relpath: str = "") -> str:
        """The URL of ``relpath`` below the root."""
        path = self.full_path(relpath)
        return path if self.is_local else f"{self.protocol}://{path}"

    # -- client ---------------------------------------------------------------------------

    def _filesystem_class(self) -> type[fsspec.AbstractFileSystem]:
        try:
            return fsspec.get_filesystem_class(self.protocol)
        except ImportError as exc:
            extra = _EXTRA_FOR_PROTOCOL.get(self.protocol)
            hint = (
                f"pip install 'dcp_volumes[{extra}]'"
                if extra
                else f"install the fsspec implementation for '{self.protocol}://'"
            )
            raise BackendNotInstalledError(
                f"No fsspec backend is installed for '{self.protocol}://' URLs, so this "
                f"volume cannot be opened. Fix: {hint}."
            ) from exc
        except ValueError as exc:
            raise ConfigurationError(
                f"Unknown URL protocol '{self.protocol}://'. Use s3://, gs://, az://, file://, "
                "a plain local or mounted path, or a protocol that fsspec knows "
                "(fsspec.available_protocols())."
            ) from exc

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem, created lazily in each process (fork- and pickle-safe).

        Volumes with the same protocol and options share one client per process:
        creating an object-store client costs 0.3-1 s (service models, sessions),
        and writers and readers make a Volume per checkpoint.
        """
        if self._fs is None or self._fs_pid != os.getpid():
            cls = self._filesystem_class()
            try:
                if self.is_local:
                    self._fs = fsspec.filesystem("file")
                else:
                    key = (os.getpid(), self.protocol, fsspec.utils.tokenize(self.storage_options))
                    with _CLIENTS_LOCK:
                        fs = _CLIENTS.get(key)
                        if fs is None:
                            # skip_instance_cache: a forked child must not reuse the parent's
                            # client (the pid in the key does the same for our cache).
                            # No listings cache: other ranks and jobs change the volume.
                            options = {"use_listings_cache": False, **self.storage_options}
                            fs = cls(skip_instance_cache=True, **options)
                            _CLIENTS[key] = fs
                    self._fs = fs
            except Exception as exc:
                raise self._translate(exc, "connect to", "") from exc
            self._fs_pid = os.getpid()
        return self._fs

    @property
    def s3(self) -> S3Transport | None:
        """The botocore data path for S3 volumes (``None``: use ``fs`` for everything)."""
        if self._s3_pid != os.getpid():
            transport = None
            if self.protocol in ("s3", "s3a") and _env.s3_transport_enabled():
                key = (os.getpid(), fsspec.utils.tokenize(self.storage_options))
                with _CLIENTS_LOCK:
                    if key not in _TRANSPORTS:
                        try:
                            _TRANSPORTS[key] = S3Transport.for_options(self.storage_options)
                        except Exception as exc:
                            raise self._translate(exc, "connect to", "") from exc
                    transport = _TRANSPORTS[key]
            self._s3, self._s3_pid = transport, os.getpid()
        return self._s3

    def _bucket_key(self, relpath: str) -> tuple[str, str]:
        bucket, _, key = self.full_path(relpath).partition("/")
        return bucket, key

    # -- retries and error translation -----------------------------------------------------

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _translate(self, exc: BaseException, op: str, relpath: str) -> DcpVolumesError:
        where = self.display_url if not relpath else redact_url(self.url_of(relpath))
        return translate_error(exc, op, where, self._scrub)

    def _call(self, op: str, relpath: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries on transient errors; translate the final failure."""
        return call_with_retries(
            fn,
            policy=self.retry,
            op=op,
            where=lambda: redact_url(self.url_of(relpath)),
            scrub=self._scrub,
        )

    # -- queries --------------------------------------------------------------------------

    def check_root(self, *, create: bool = False) -> None:
        """Raise a clear error unless the root can be used (bucket exists, dir writable)."""
        if self.is_local:
            if create:
                try:
                    os.makedirs(self.root, exist_ok=True)
                except PermissionError as exc:
                    raise self._translate(exc, "create", "") from exc
            if not os.path.isdir(self.root):
                raise VolumeNotFoundError(
                    f"The directory {self.root} does not exist. Fix: create it or mount the volume."
                )
            if create and not os.access(self.root, os.W_OK | os.X_OK):
                raise VolumeAccessError(
                    f"The directory {self.root} is not writable by this process. Fix: change its "
                    "permissions or choose another path."
                )
            return
        bucket = self.root.split("/", 1)[0]
        # info(), not exists(): exists() turns "access denied" into False, and wrong
        # credentials must not read as a missing bucket.
        try:
            self._call("check", "", lambda: self.fs.info(bucket))
            return
        except VolumeNotFoundError as exc:
            raise BucketNotFoundError(
                f"The bucket or container '{bucket}' of {self.display_url} does not exist or is "
                "not visible with these credentials. Fix: create it, correct the URL, or check "
                "the credentials."
            ) from exc

    def _info(self, raw: Mapping[str, Any], base: str) -> FileInfo:
        name = str(raw["name"])
        if not self.is_local:
            name = self.fs._strip_protocol(name)
        rel = name[len(base) :].lstrip("/") if name.startswith(base) else name
        if self.is_local:
            rel = rel.replace(os.sep, "/")
        etag = raw.get("ETag") or raw.get("etag") or raw.get("md5Hash") or raw.get("generation")
        mtime = raw.get("mtime") or raw.get("LastModified") or raw.get("last_modified")
        if hasattr(mtime, "timestamp"):
            mtime = mtime.timestamp()
        elif not isinstance(mtime, (int, float)):
            mtime = None
        return FileInfo(
            path=rel,
            size=int(raw.get("size") or 0),
            etag=str(etag).strip('"') if etag else None,
            mtime=float(mtime) if mtime is not None else None,
        )

    def info(self, relpath: str) -> FileInfo:
        """Size, etag and mtime of one file."""
        s3 = self.s3
        if s3 is not None:  # one HEAD; s3fs adds a LIST for a missing key
            bucket, key = self._bucket_key(relpath)
            size, etag, mtime = self._call("stat", relpath, lambda: s3.head(bucket, key))
            return FileInfo(path=relpath.strip("/"), size=size, etag=etag, mtime=mtime)
        full = self.full_path(relpath)
        raw = self._call("stat", relpath, lambda: self.fs.info(full))
        if raw.get("type") == "directory":
            raise VolumeNotFoundError(
                f"{redact_url(self.url_of(relpath))} is a directory/prefix, not a file."
            )
        return FileInfo(
            path=relpath.strip("/"),
            size=int(raw.get("size") or 0),
            etag=self._info(raw, full).etag,
            mtime=self._info(raw, full).mtime,
        )

    def exists(self, relpath: str = "") -> bool:
        """Whether a file or prefix exists."""
        full = self.full_path(relpath)
        return bool(self._call("check", relpath, lambda: self.fs.exists(full)))

    def list(self, relpath: str = "", *, recursive: bool = True) -> list[FileInfo]:
        """Files below ``relpath`` (paths relative to the volume root), sorted by path.

        A missing prefix lists as empty; directories/prefixes are not returned.
        """
        base = self.full_path(relpath)

        def run() -> list[Any]:
            if recursive:
                found = self.fs.find(base, detail=True)
                return list(found.values()) if isinstance(found, dict) else list(found)
            try:
                return list(self.fs.ls(base, detail=True))
            except FileNotFoundError:
                return []

        root = self.full_path()
        out = []
        for raw in self._call("list", relpath, run):
            if raw.get("type") == "directory":
                continue
            out.append(self._info(raw, root))
        return sorted(out, key=lambda f: f.path)

    def list_dirs(self, relpath: str = "") -> list[str]:
        """Names of the immediate sub-directories/prefixes of ``relpath``, sorted."""
        base = self.full_path(relpath)

        def run() -> list[Any]:
            try:
                return list(self.fs.ls(base, detail=True, refresh=True))
            except TypeError:  # backends without a refresh flag
                return list(self.fs.ls(base, detail=True))
            except FileNotFoundError:
                return []

        names = []
        for raw in self._call("list", relpath, run):
            if raw.get("type") == "directory":
                name = str(raw["name"]).rstrip("/").replace(os.sep, "/")
                names.append(name.rsplit("/", 1)[-1])
        return sorted(set(names))

    # -- reads ----------------------------------------------------------------------------

    def read_bytes(self, relpath: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of a file, or of ``[start, end)``."""
        s3 = self.s3
        if s3 is not None:
            bucket, key = self._bucket_key(relpath)
            return self._call("read", relpath, lambda: s3.get(bucket, key, start, end))
        full = self.full_path(relpath)
        return self._call("read", relpath, lambda: self.fs.cat_file(full, start=start, end=end))

    def read_into(self, relpath: str, start: int, out: memoryview) -> int:
        """Read ``len(out)`` bytes from ``start`` into ``out``; returns how many arrived."""
        s3 = self.s3
        if s3 is not None:
            bucket, key = self._bucket_key(relpath)
            return self._call("read", relpath, lambda: s3.get_into(bucket, key, start, out))
        data = self.read_bytes(relpath, start, start + len(out))
        out[: len(data)] = data
        return len(data)

    def open_local(self, relpath: str) -> io.FileIO:
        """Open a file of a local volume for unbuffered reading (positioned reads, no copies)."""
        if not self.is_local:
            raise ValueError(f"{self.display_url} is not a local volume")
        full = self.full_path(relpath)
        return self._call("read", relpath, lambda: io.FileIO(full, "rb"))

    def read_ranges(
        self, ranges: Sequence[tuple[str, int, int]], *, concurrency: int = 16
    ) -> list[bytes]:
        """Read many ``(relpath, start, end)`` ranges concurrently, results in input order."""
        if not ranges:
            return []
        if len(ranges) == 1 or concurrency <= 1:
            return [self.read_bytes(p, s, e) for p, s, e in ranges]
        with ThreadPoolExecutor(max_workers=min(concurrency, len(ranges))) as pool:
            return list(pool.map(lambda r: self.read_bytes(*r), ranges))

    def get_file(
        self,
        relpath: str,
        local_path: str | os.PathLike[str],
        *,
        size: int | None = None,
        part_size: int = 16 * 2**20,
        concurrency: int = 8,
    ) -> int:
        """Download a file to ``local_path`` atomically (temp name, then rename).

        Large files are fetched as parallel byte ranges. Returns the size written;
        raises ``VolumeError`` when fewer bytes arrived than the volume reported.
        """
        local_path = os.fspath(local_path)
        if size is None:
            size = self.info(relpath).size
        tmp = f"{local_path}.part-{uuid.uuid4().hex[:8]}"
        os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
        try:
            if self.is_local and size <= part_size * 4:
                self._call("read", relpath, lambda: shutil.copyfile(self.full_path(relpath), tmp))
            else:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    starts = list(range(0, size, part_size)) or [0]

                    def fetch(start: int) -> int:
                        end = min(size, start + part_size)
                        data = self.read_bytes(relpath, start, end) if end > start else b""
                        os.pwrite(fd, data, start)
                        return len(data)

                    if len(starts) == 1:
                        got = fetch(0)
                    else:
                        workers = max(1, min(concurrency, len(starts)))
                        with ThreadPoolExecutor(max_workers=workers) as pool:
                            got = sum(pool.map(fetch, starts))
                finally:
                    os.close(fd)
                if got != size:
                    raise VolumeError(
                        f"Short read of {redact_url(self.url_of(relpath))}: got {got} bytes, "
                        f"expected {size}. The object changed or the connection broke; retry."
                    )
            actual = os.path.getsize(tmp)
            if actual != size:
                raise VolumeError(
                    f"Downloaded {actual} bytes of {redact_url(self.url_of(relpath))}, expected "
                    f"{size}. The file changed while being read; retry."
                )
            os.replace(tmp, local_path)
            return size
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    # -- writes ---------------------------------------------------------------------------

    def put_file(
        self,
        local_path: str | os.PathLike[str],
        relpath: str,
        *,
        part_size: int | None = None,
        concurrency: int | None = None,
        move: bool = False,
        verify_size: bool = True,
    ) -> int:
        """Upload a local file; large files go multipart/in parallel where the backend can.

        On local volumes the copy lands under a temporary name and is renamed, so a
        reader never sees it half written; ``move=True`` renames instead of copying
        when the source is on the same filesystem. Returns the size uploaded and,
        with ``verify_size``, checks the volume reports that size.
        """
        local_path = os.fspath(local_path)
        size = os.path.getsize(local_path)
        if self.is_local:
            dst = self.full_path(relpath)
            self._local_place(local_path, dst, move=move)
        elif self.s3 is not None:
            bucket, key = self._bucket_key(relpath)
            self.s3.put(
                local_path,
                bucket,
                key,
                size=size,
                part_size=part_size or 32 * 2**20,
                concurrency=concurrency or 1,
                retry=lambda op, fn: self._call(op, relpath, fn),
            )
            if verify_size:
                self._verify_size(relpath, size)
            if move:
                os.remove(local_path)
        else:
            full = self.full_path(relpath)
            kwargs: dict[str, Any] = {}
            if self.protocol in ("s3", "s3a"):
                if part_size:
                    kwargs["chunksize"] = part_size
                if concurrency:
                    kwargs["max_concurrency"] = concurrency
            elif self.protocol in ("gs", "gcs") and part_size:
                kwargs["chunksize"] = part_size
            elif self.protocol in ("az", "abfs", "abfss") and concurrency:
                kwargs["max_concurrency"] = concurrency
            self._call("upload", relpath, lambda: self.fs.put_file(local_path, full, **kwargs))
            if verify_size:
                self._verify_size(relpath, size)
            if move:
                os.remove(local_path)
        return size

    def _verify_size(self, relpath: str, size: int) -> None:
        remote = self.info(relpath).size
        if remote != size:
            raise VolumeError(
                f"Uploaded {size} bytes to {redact_url(self.url_of(relpath))} but the "
                f"volume reports {remote}. The upload was cut short; retry the save."
            )

    def _local_place(self, src: str, dst: str, *, move: bool) -> None:
        def run() -> None:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if move:
                try:
                    os.replace(src, dst)
                    _fsync_dir(os.path.dirname(dst))
                    return
                except OSError as exc:
                    if exc.errno != errno.EXDEV:
                        raise
            tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                shutil.copyfile(src, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, dst)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
            _fsync_dir(os.path.dirname(dst))
            if move:
                os.remove(src)

        self._call("upload", os.path.relpath(dst, self.root), run)

    def publish(self, relpath: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write a small file atomically: readers see all of it or nothing.

        POSIX: temp file + flush + fsync + rename + fsync of the directory.
        Object stores: one PUT (atomic by nature). ``exclusive=True`` refuses to
        replace an existing file (``VolumeExistsError``): a hard link on POSIX,
        a conditional PUT (``If-None-Match: *``) where the store honours it.
        """
        if self.is_local:
            dst = self.full_path(relpath)

            def run_local() -> None:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    if exclusive:
                        os.link(tmp, dst)  # fails with EEXIST instead of replacing
                    else:
                        os.replace(tmp, dst)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(tmp)
                _fsync_dir(os.path.dirname(dst))

            self._call("publish", relpath, run_local)
            return
        full = self.full_path(relpath)
        if exclusive and self.exists(relpath):
            raise VolumeExistsError(
                f"Cannot publish {redact_url(self.url_of(relpath))}: it already exists and this "
                "write must not replace it."
            )
        mode = "create" if exclusive else "overwrite"
        self._call("publish", relpath, lambda: self.fs.pipe_file(full, data, mode=mode))

    def write_bytes(self, relpath: str, data: bytes) -> None:
        """Write a whole small file (atomically, like ``publish``)."""
        self.publish(relpath, data)

    # -- deletes --------------------------------------------------------------------------

    def delete(self, relpath: str, *, missing_ok: bool = True) -> None:
        """Delete one file."""
        full = self.full_path(relpath)
        try:
            self._call("delete", relpath, lambda: self.fs.rm_file(full))
        except VolumeNotFoundError:
            if not missing_ok:
                raise

    def delete_many(self, relpaths: Iterable[str]) -> None:
        """Delete many files (batched where the backend can); missing ones are ignored."""
        paths = [self.full_path(p) for p in relpaths]
        if not paths:
            return
        if self.is_local:
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    self._call("delete", os.path.relpath(p, self.root), lambda p=p: os.remove(p))
            return
        try:
            self._call("delete", "", lambda: self.fs.rm(paths))
        except VolumeNotFoundError:
            for p in paths:  # some were already gone: fall back to one by one
                self.delete(p[len(self.root) :].lstrip("/"))

    def delete_prefix(self, relpath: str) -> None:
        """Delete everything below ``relpath`` (a directory or key prefix)."""
        full = self.full_path(relpath)
        if self.is_local:
            self._call("delete", relpath, lambda: shutil.rmtree(full, ignore_errors=True))
            return
        files = self.list(relpath)
        self.delete_many(f.path for f in files)
