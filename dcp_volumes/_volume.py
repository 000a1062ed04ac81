"""Volume: one URL (object store, mount path or any fsspec protocol) as a small file API.

Everything above this module speaks ``Volume``; backends differ only here and
in its helpers: ``_clients.py`` (shared per-process clients), ``_file_info.py``
(``FileInfo`` and listings) and ``_local_fs.py`` (local and mounted paths).
Clients are lazy and fork-safe: the fsspec filesystem is created on first use
in each process and never pickled, so a ``Volume`` survives fork and pickling.
Every backend call goes through ``_call``, which retries transient errors and
translates failures (``_retry.py``), so no caller handles backend exceptions.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.core import split_protocol

from dcp_volumes import _env
from dcp_volumes._clients import (
    S3_PROTOCOLS,
    filesystem_class,
    shared_filesystem,
    shared_s3_transport,
    upload_options,
)
from dcp_volumes._exceptions import (
    BucketNotFoundError,
    ConfigurationError,
    DcpVolumesError,
    VolumeError,
    VolumeExistsError,
    VolumeNotFoundError,
)
from dcp_volumes._file_info import (
    FileInfo,
    directory_names,
    file_info,
    files_below,
    files_of_keys,
    list_entries,
    list_fresh,
)
from dcp_volumes._local_fs import (
    check_dir,
    download_atomically,
    fill_in_parts,
    place_file,
    publish_bytes,
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

T = TypeVar("T")

LOCAL_PROTOCOLS = frozenset({"file", "local"})


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
            cls = filesystem_class(self.protocol)
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
            if os.sep == "/":  # one join: this runs once per file a cache process first sees
                return os.path.join(self.root, relpath)
            return os.path.join(self.root, *relpath.split("/"))
        return f"{self.root}/{relpath}"

    def url_of(self, relpath: str = "") -> str:
        """The URL of ``relpath`` below the root."""
        path = self.full_path(relpath)
        return path if self.is_local else f"{self.protocol}://{path}"

    # -- client ---------------------------------------------------------------------------

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem, created lazily in each process (fork- and pickle-safe).

        Volumes with the same protocol and options share one client per process:
        creating an object-store client costs 0.3-1 s (service models, sessions),
        and writers and readers make a Volume per checkpoint.
        """
        if self._fs is None or self._fs_pid != os.getpid():
            cls = filesystem_class(self.protocol)
            try:
                if self.is_local:
                    self._fs = fsspec.filesystem("file")
                else:
                    self._fs = shared_filesystem(cls, self.protocol, self.storage_options)
            except Exception as exc:
                raise self._translate(exc, "connect to", "") from exc
            self._fs_pid = os.getpid()
        return self._fs

    @property
    def s3(self) -> S3Transport | None:
        """The botocore data path for S3 volumes (``None``: use ``fs`` for everything)."""
        if self._s3_pid != os.getpid():
            transport = None
            if self.protocol in S3_PROTOCOLS and _env.s3_transport_enabled():
                try:
                    transport = shared_s3_transport(self.storage_options)
                except Exception as exc:
                    raise self._translate(exc, "connect to", "") from exc
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
            check_dir(self.root, writable=create)
            return
        bucket = self.root.split("/", 1)[0]
        # info(), not exists(): exists() turns "access denied" into False, and wrong
        # credentials must not read as a missing bucket.
        s3 = self.s3
        try:
            if s3 is not None:
                self._call("check", "", lambda: s3.check_bucket(bucket))
            else:
                self._call("check", "", lambda: self.fs.info(bucket))
            return
        except VolumeNotFoundError as exc:
            raise BucketNotFoundError(
                f"The bucket or container '{bucket}' of {self.display_url} does not exist or is "
                "not visible with these credentials. Fix: create it, correct the URL, or check "
                "the credentials."
            ) from exc

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
        return file_info(raw, relpath.strip("/"))

    def exists(self, relpath: str = "") -> bool:
        """Whether a file or prefix exists."""
        full = self.full_path(relpath)
        return bool(self._call("check", relpath, lambda: self.fs.exists(full)))

    def list(self, relpath: str = "", *, recursive: bool = True) -> list[FileInfo]:
        """Files below ``relpath`` (paths relative to the volume root), sorted by path.

        A missing prefix lists as empty; directories/prefixes are not returned.
        """
        s3 = self.s3
        if s3 is not None and recursive:
            bucket, key = self._bucket_key(relpath)
            prefix = f"{key}/" if key else ""
            found = self._call("list", relpath, lambda: s3.list(bucket, prefix))
            return files_of_keys(found, self._bucket_key("")[1])
        base = self.full_path(relpath)
        entries = self._call(
            "list", relpath, lambda: list_entries(self.fs, base, recursive=recursive)
        )
        return files_below(entries, self.root, None if self.is_local else self.fs._strip_protocol)

    def list_dirs(self, relpath: str = "") -> list[str]:
        """Names of the immediate sub-directories/prefixes of ``relpath``, sorted."""
        base = self.full_path(relpath)
        return directory_names(self._call("list", relpath, lambda: list_fresh(self.fs, base)))

    # -- reads ----------------------------------------------------------------------------

    def read_bytes(self, relpath: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of a file, or of ``[start, end)``."""
        s3 = self.s3
        if s3 is not None:
            bucket, key = self._bucket_key(relpath)
            return self._call("read", relpath, lambda: s3.get(bucket, key, start, end))
        full = self.full_path(relpath)
        return self._call("read", relpath, lambda: self.fs.cat_file(full, start=start, end=end))

    def read_into(
        self,
        relpath: str,
        start: int,
        out: memoryview | Sequence[memoryview],
        *,
        whole: bool = False,
    ) -> int:
        """Read the bytes from ``start`` into ``out`` (a buffer, or buffers filled in turn);
        returns how many arrived.

        ``whole``: the buffers are exactly the whole file (one plain GET, no range).
        """
        outs = [out] if isinstance(out, memoryview) else out
        s3 = self.s3
        if s3 is not None:
            bucket, key = self._bucket_key(relpath)
            return self._call(
                "read", relpath, lambda: s3.get_into(bucket, key, start, outs, whole=whole)
            )
        data = memoryview(self.read_bytes(relpath, start, start + sum(len(o) for o in outs)))
        got = 0
        for o in outs:
            n = min(len(o), len(data) - got)
            o[:n] = data[got : got + n]
            got += n
        return got

    def open_local(self, relpath: str) -> io.FileIO:
        """Open a file of a local volume for unbuffered reading (positioned reads, no copies)."""
        if not self.is_local:
            raise ValueError(f"{self.display_url} is not a local volume")
        full = self.full_path(relpath)
        return self._call("read", relpath, lambda: io.FileIO(full, "rb"))

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

        def fill(tmp: str) -> int | None:
            if self.is_local and size <= part_size * 4:
                self._call("read", relpath, lambda: shutil.copyfile(self.full_path(relpath), tmp))
                return None
            return fill_in_parts(
                tmp,
                size,
                lambda start, end: self.read_bytes(relpath, start, end),
                part_size=part_size,
                concurrency=concurrency,
            )

        return download_atomically(local_path, size, fill, what=redact_url(self.url_of(relpath)))

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
            self._call(
                "upload",
                os.path.relpath(dst, self.root),
                lambda: place_file(local_path, dst, move=move),
            )
            return size
        if self.s3 is not None:
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
        else:
            full = self.full_path(relpath)
            kwargs = upload_options(self.protocol, part_size, concurrency)
            self._call("upload", relpath, lambda: self.fs.put_file(local_path, full, **kwargs))
        remote = self.info(relpath).size if verify_size else size
        if remote != size:
            raise VolumeError(
                f"Uploaded {size} bytes to {redact_url(self.url_of(relpath))} but the "
                f"volume reports {remote}. The upload was cut short; retry the save."
            )
        if move:
            os.remove(local_path)
        return size

    def publish(self, relpath: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write a small file atomically: readers see all of it or nothing.

        POSIX: temp file + flush + fsync + rename + fsync of the directory.
        Object stores: one PUT (atomic by nature). ``exclusive=True`` refuses to
        replace an existing file (``VolumeExistsError``): a hard link on POSIX,
        a conditional PUT (``If-None-Match: *``) where the store honours it.
        """
        if self.is_local:
            dst = self.full_path(relpath)
            self._call("publish", relpath, lambda: publish_bytes(dst, data, exclusive=exclusive))
            return
        s3 = self.s3
        # A check first: stores that ignore If-None-Match still refuse here.
        if exclusive and (self._s3_has(relpath) if s3 is not None else self.exists(relpath)):
            raise VolumeExistsError(
                f"Cannot publish {redact_url(self.url_of(relpath))}: it already exists and this "
                "write must not replace it."
            )
        if s3 is not None:
            bucket, key = self._bucket_key(relpath)
            self._call(
                "publish", relpath, lambda: s3.put_bytes(bucket, key, data, exclusive=exclusive)
            )
            return
        full = self.full_path(relpath)
        mode = "create" if exclusive else "overwrite"
        self._call("publish", relpath, lambda: self.fs.pipe_file(full, data, mode=mode))

    def _s3_has(self, relpath: str) -> bool:
        try:
            self.info(relpath)
        except VolumeNotFoundError:
            return False
        return True

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
