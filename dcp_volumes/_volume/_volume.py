"""Volume: one URL (object store, mount path or any fsspec protocol) as a small file API.

Everything above this package speaks ``Volume``; backends differ only behind
it (``_backend.py`` has the protocol, ``_select.py`` picks one). The backend is
created lazily in each process and never pickled, so a ``Volume`` survives
fork and pickling. Every backend call goes through ``_call``, which retries
transient errors (``_retry.py``) and translates failures (``_errors.py``), so
no caller handles backend exceptions.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from fsspec.core import split_protocol

from dcp_volumes import _env
from dcp_volumes._exceptions import (
    BucketNotFoundError,
    ConfigurationError,
    DcpVolumesError,
    VolumeError,
    VolumeExistsError,
    VolumeNotFoundError,
)
from dcp_volumes._volume._backend import (
    Backend,
    Capabilities,
    Data,
    FileInfo,
    Listing,
    scatter,
)
from dcp_volumes._volume._errors import translate_error
from dcp_volumes._volume._fsspec import strip_protocol
from dcp_volumes._volume._local import LocalBackend, download_atomically, fill_in_parts
from dcp_volumes._volume._memory import MEMORY_PROTOCOL
from dcp_volumes._volume._obstore import used_here as obstore_used_here
from dcp_volumes._volume._obstore_options import azure_account_from_url
from dcp_volumes._volume._options import endpoint_of, server_side_encryption
from dcp_volumes._volume._retry import RetryPolicy, call_with_retries
from dcp_volumes._volume._secrets import secret_values, url_secrets
from dcp_volumes._volume._select import (
    LOCAL_PROTOCOLS,
    OBSTORE_PROTOCOLS,
    backend_for,
    check_options,
    fallback_usable,
)
from dcp_volumes._volume._urls import redact_url

T = TypeVar("T")

# Files up to this size are fetched with one GET; larger ones in parallel ranges.
_PART_SIZE = 16 * 2**20


class Volume:
    """A remote or local location addressed by URL, with retries and clear errors.

    Args:
        url: ``s3://bucket/prefix``, ``gs://...``, ``az://container/...``,
            ``file:///path``, a plain path (a local disk or network mount), or
            any fsspec URL.
        storage_options: client options: s3fs/adlfs-style names (``key``,
            ``secret``, ``client_kwargs={"endpoint_url": ...}``, ``account_name``,
            ``connection_string``...) or obstore's own; any fsspec option for
            other protocols; and ours, ``ranged_reads_cost_whole_object=True``
            for a server that reads the whole object per ranged read (moto),
            ``listing_lags=True`` for one whose listings lag its writes.
            ``None`` (not given): the options in ``DCP_VOLUMES_STORAGE_OPTIONS``
            for a remote URL (local paths take none); given options, ``{}``
            included, are used alone (never merged with the variable's).
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
        if storage_options is None and self.protocol not in LOCAL_PROTOCOLS:
            # The one place every entry point (writer, reader, manager, dataset,
            # cache, routing, CLI) takes the environment's default options from.
            storage_options = _env.storage_options()
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        refuse_url_credentials(self.protocol, url)
        self.retry = retry or RetryPolicy(attempts=_env.max_retries(5))
        if self.protocol in LOCAL_PROTOCOLS:
            self.root = os.path.abspath(os.path.expanduser(path)).rstrip(os.sep) or os.sep
        else:
            self.root = self._remote_root(url, path)
            if not self.root:
                raise ConfigurationError(
                    f"The URL {redact_url(url)!r} names no bucket or container; use "
                    f"'{self.protocol}://BUCKET/PREFIX'."
                )
            # Every option in each client's spelling now: a name a client cannot take
            # is refused here, not in a worker that falls back on another client.
            check_options(self.protocol, self.storage_options)
        self._backend: Backend | None = None
        self._backend_pid = -1
        # The store's own encryption asked for (names only): it tells a refused key apart.
        kind = OBSTORE_PROTOCOLS.get(self.protocol)
        self._server_side_encryption = (
            server_side_encryption(kind, self.storage_options) if kind else None
        )
        # Values of a signed URL's query (``?sig=``) and its ``user:password@`` are secrets too.
        self._secrets = secret_values(self.storage_options) + url_secrets(url)

    def _remote_root(self, url: str, path: str) -> str:
        kind = OBSTORE_PROTOCOLS.get(self.protocol)
        if self.protocol == MEMORY_PROTOCOL:
            return path.strip("/")
        if kind is None:
            return strip_protocol(self.protocol, url)
        path = path.strip("/")
        if kind == "azure":  # abfs://container@account.dfs.core.windows.net/path
            netloc, sep, rest = path.partition("/")
            container, account = azure_account_from_url(netloc)
            if account and "account_name" not in self.storage_options:
                self.storage_options["account_name"] = account
            path = container + sep + rest
        return path.rstrip("/")

    # -- identity -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Canonical URL of the root (plain path for local volumes)."""
        return self.root if self._bare_root else f"{self.protocol}://{self.root}"

    @property
    def _bare_root(self) -> bool:
        # Local paths, and fsspec protocols whose paths keep their scheme (http, https).
        return self.protocol in LOCAL_PROTOCOLS or "://" in self.root

    @property
    def display_url(self) -> str:
        """The URL as it may appear in messages and logs."""
        return redact_url(self.url)

    @property
    def bucket(self) -> str | None:
        """The bucket or container of an object-store volume (``None`` for local paths)."""
        return None if self.protocol in LOCAL_PROTOCOLS else self.root.split("/", 1)[0]

    def __repr__(self) -> str:
        return f"Volume({self.display_url!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Clients hold sockets, runtimes and locks: never pickle them.
        state = self.__dict__.copy()
        state["_backend"] = None
        state["_backend_pid"] = -1
        return state

    def child(self, relpath: str) -> Volume:
        """A volume rooted at ``relpath`` below this one, sharing options."""
        new = Volume.__new__(Volume)
        new.__dict__.update(self.__getstate__())
        new.root = self.full_path(relpath)
        return new

    def full_path(self, relpath: str = "") -> str:
        """The backend location (no protocol) of ``relpath`` below the root."""
        relpath = relpath.strip("/")
        if not relpath:
            return self.root
        if self.protocol in LOCAL_PROTOCOLS:
            if os.sep == "/":  # one join: this runs once per file a cache process first sees
                return os.path.join(self.root, relpath)
            return os.path.join(self.root, *relpath.split("/"))
        return f"{self.root}/{relpath}"

    def url_of(self, relpath: str = "") -> str:
        """The URL of ``relpath`` below the root."""
        path = self.full_path(relpath)
        return path if self._bare_root else f"{self.protocol}://{path}"

    def _relative(self, location: str) -> str:
        rel = location[len(self.root) :] if location.startswith(self.root) else location
        rel = rel.lstrip("/" + os.sep)
        return rel.replace(os.sep, "/") if os.sep != "/" else rel

    # -- backend --------------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The backend, created lazily in each process (fork- and pickle-safe)."""
        if self._backend is None or self._backend_pid != os.getpid():
            try:
                self._backend = backend_for(self.protocol, self.storage_options, self.retry)
            except DcpVolumesError:
                raise
            except Exception as exc:
                raise self._translate(exc, "connect to", "") from exc
            self._backend_pid = os.getpid()
        return self._backend

    @property
    def capabilities(self) -> Capabilities:
        """What this volume's store does (see ``Capabilities``)."""
        if self.protocol in LOCAL_PROTOCOLS:
            return LocalBackend.capabilities  # no client needed to know
        return self.backend.capabilities

    def forks_cleanly(self) -> bool:
        """Whether a process forked now can use this volume's client (DataLoader workers):
        a client that does not survive a fork breaks only once this process did I/O."""
        return self.capabilities.survives_fork or not obstore_used_here()

    def fsspec_fallback_usable(self) -> bool:
        """Whether a child forked after this process's obstore I/O can still reach this
        store: through its fsspec client, which is installed and honours every one of
        this volume's options (``_options.py``)."""
        return fallback_usable(self.protocol, self.storage_options)

    @property
    def identity(self) -> str:
        """Which store this is, for cache keys: the protocol and the endpoint (the same
        bucket name on two endpoints is two stores); a connection string, which holds a
        secret, only as a hash."""
        opts = self.storage_options
        endpoint = endpoint_of(opts)  # whichever client's spelling names it
        conn = opts.get("connection_string")
        if conn:
            endpoint += "#" + hashlib.sha256(str(conn).encode()).hexdigest()[:16]
        return f"{self.protocol}|{endpoint}"

    # -- retries and error translation -----------------------------------------------------

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _scrubber(self, relpath: str) -> Callable[[str], str]:
        """``_scrub``, plus the secrets of a signed file URL (``?sig=`` after the file name):
        clients repeat the URL they were given in their errors."""
        if "?" not in relpath and "@" not in relpath:
            return self._scrub
        extra = url_secrets(self.url_of(relpath))

        def scrub(text: str) -> str:
            text = self._scrub(text)
            for secret in extra:
                text = text.replace(secret, "***")
            return text

        return scrub

    def _translate(self, exc: BaseException, op: str, relpath: str) -> DcpVolumesError:
        scrub = self._scrubber(relpath)
        where = self.display_url if not relpath else redact_url(self.url_of(relpath))
        return translate_error(exc, op, where, scrub, encryption=self._server_side_encryption)

    def _call(
        self, op: str, relpath: str, fn: Callable[[Backend], T], *, create_only: bool = False
    ) -> T:
        """Run ``fn(backend)`` with retries on transient errors; translate the final failure."""
        backend = self.backend
        return call_with_retries(
            lambda: fn(backend),
            policy=self.retry,
            op=op,
            where=lambda: redact_url(self.url_of(relpath)),
            scrub=self._scrubber(relpath),
            create_only=create_only,
            encryption=self._server_side_encryption,
        )

    # -- queries --------------------------------------------------------------------------

    def check_root(self, *, create: bool = False) -> list[FileInfo]:
        """Raise a clear error unless the root can be used (bucket exists, dir writable).

        Returns the files directly in the root (as ``list(recursive=False)``): on
        object stores the check is that one listing, so a caller that needs both
        pays one round trip.
        """
        try:
            listing = self._call("check", "", lambda b: b.check_root(self.root, create=create))
        except VolumeNotFoundError as exc:
            if self.protocol in LOCAL_PROTOCOLS:
                raise
            raise BucketNotFoundError(
                f"The bucket or container '{self.bucket}' of {self.display_url} does not exist "
                "or is not visible with these credentials. Fix: create it, correct the URL, or "
                "check the credentials."
            ) from exc
        return self._files(listing)

    def info(self, relpath: str) -> FileInfo:
        """Size, etag and mtime of one file."""
        # A directory or prefix there is "not found" as a file (see translate_error).
        found = self._call("stat", relpath, lambda b: b.head(self.full_path(relpath)))
        return FileInfo(relpath.strip("/"), found.size, found.etag, found.mtime)

    def exists(self, relpath: str = "") -> bool:
        """Whether a file, or anything below a prefix, exists."""
        try:
            self.info(relpath)
            return True
        except VolumeNotFoundError:
            pass
        if self.protocol in LOCAL_PROTOCOLS:
            return os.path.isdir(self.full_path(relpath))
        listing = self._call(
            "check", relpath, lambda b: b.list(self.full_path(relpath), recursive=False)
        )
        return bool(listing.files or listing.dirs)

    def list(self, relpath: str = "", *, recursive: bool = True) -> list[FileInfo]:
        """Files below ``relpath`` (paths relative to the volume root), sorted by path.

        A missing prefix lists as empty; directories/prefixes are not returned.
        """
        base = self.full_path(relpath)
        listing = self._call("list", relpath, lambda b: b.list(base, recursive=recursive))
        return self._files(listing)

    def _files(self, listing: Listing) -> builtins.list[FileInfo]:
        """A backend listing's files, relative to the root and sorted by path."""
        files = [
            FileInfo(self._relative(f.path), f.size, f.etag, f.mtime) for f in listing.files
        ]
        return sorted(files, key=lambda f: f.path)

    def list_dirs(self, relpath: str = "") -> builtins.list[str]:
        """Names of the immediate sub-directories/prefixes of ``relpath``, sorted."""
        base = self.full_path(relpath)
        listing = self._call("list", relpath, lambda b: b.list(base, recursive=False))
        return sorted({d.rstrip("/" + os.sep).replace(os.sep, "/").rsplit("/", 1)[-1]
                       for d in listing.dirs})

    # -- reads ----------------------------------------------------------------------------

    def read_bytes(self, relpath: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of a file, or of ``[start, end)`` (clipped at its end)."""
        full = self.full_path(relpath)
        data = self._call("read", relpath, lambda b: b.read(full, start or 0, end))
        return data if isinstance(data, bytes) else bytes(data)

    def read_whole(self, relpath: str, expect: int) -> Data:
        """The whole file in one request, as a buffer; its length may differ from ``expect``
        when the file changed (callers compare)."""
        full = self.full_path(relpath)
        return self._call("read", relpath, lambda b: b.read_whole(full, expect))

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

        ``whole``: the buffers are exactly the whole file, so ask for it without a
        range (some servers read the whole object for every ranged GET); a file of
        another length comes back as that length, unread.
        """
        outs = [out] if isinstance(out, memoryview) else list(out)
        if whole and start == 0:
            length = sum(len(o) for o in outs)
            data = self.read_span(relpath, 0, length, whole=True)
            return len(data) if len(data) != length else scatter(data, outs)
        full = self.full_path(relpath)
        return self._call("read", relpath, lambda b: b.read_into(full, start, outs))

    def read_span(self, relpath: str, start: int, end: int, *, whole: bool = False) -> memoryview:
        """The bytes ``[start, end)`` in the buffer the store's client returns them in (no
        copy of ours); shorter where the file ends sooner. ``whole``: that is the whole
        file, asked for without a range (as ``read_into``; a file of another length comes
        back as that length)."""
        full = self.full_path(relpath)
        if whole and start == 0:
            return memoryview(self._call("read", relpath, lambda b: b.read_whole(full, end)))
        return memoryview(self._call("read", relpath, lambda b: b.read(full, start, end)))

    def open_local(self, relpath: str) -> io.FileIO:
        """Open a file of a local volume for unbuffered reading (positioned reads, no copies)."""
        if not self.capabilities.local_files:
            raise ValueError(f"{self.display_url} is not a local volume")
        full = self.full_path(relpath)
        return self._call("read", relpath, lambda b: io.FileIO(full, "rb"))

    def get_file(
        self,
        relpath: str,
        local_path: str | os.PathLike[str],
        *,
        size: int | None = None,
        part_size: int = _PART_SIZE,
        concurrency: int = 8,
    ) -> int:
        """Download a file to ``local_path`` atomically (temp name, then rename).

        Large files are fetched as parallel byte ranges. Returns the size written;
        raises ``VolumeError`` when fewer bytes arrived than the volume reported.
        """
        local_path = os.fspath(local_path)
        if size is None:
            size = self.info(relpath).size
        full = self.full_path(relpath)

        def fill(tmp: str) -> int | None:
            if self.capabilities.local_files and size <= part_size * 4:
                self._call("read", relpath, lambda b: shutil.copyfile(full, tmp))
                return None
            return fill_in_parts(
                tmp,
                size,
                lambda start, end: self._call("read", relpath, lambda b: b.read(full, start, end)),
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
        """Upload a local file; large files go multipart, ``concurrency`` parts at once.

        On local volumes the copy lands under a temporary name and is renamed, so a
        reader never sees it half written; ``move=True`` renames instead of copying
        when the source is on the same filesystem (elsewhere it removes the local
        file after the upload). Returns the size uploaded and, with
        ``verify_size``, checks the volume reports that size.
        """
        local_path = os.fspath(local_path)
        size = os.path.getsize(local_path)
        full = self.full_path(relpath)
        self._call(
            "upload",
            relpath,
            lambda b: b.upload(
                local_path,
                full,
                size=size,
                part_size=part_size or 32 * 2**20,
                concurrency=concurrency or 1,
                move=move,
            ),
        )
        if verify_size and not self.capabilities.local_files:
            remote = self.info(relpath).size
            if remote != size:
                raise VolumeError(
                    f"Uploaded {size} bytes to {redact_url(self.url_of(relpath))} but the "
                    f"volume reports {remote}. The upload was cut short; retry the save."
                )
        return size

    def publish(self, relpath: str, data: Data, *, exclusive: bool = False) -> None:
        """Write a small file atomically: readers see all of it or nothing.

        POSIX: temp file + flush + fsync + rename + fsync of the directory.
        Object stores: one PUT (atomic by nature). ``exclusive=True`` refuses to
        replace an existing file (``VolumeExistsError``): a hard link on POSIX, a
        create-only PUT (``If-None-Match: *``) on object stores. Where the store
        does not decide that atomically (``capabilities.atomic_create``), the
        volume checks first, which leaves a short window for a racing writer.
        """
        full = self.full_path(relpath)
        if exclusive and not self.capabilities.atomic_create and self._has_file(relpath):
            raise VolumeExistsError(
                f"Cannot publish {redact_url(self.url_of(relpath))}: it already exists and this "
                "write must not replace it."
            )
        self._call(
            "publish",
            relpath,
            lambda b: b.put(full, data, create_only=exclusive),
            create_only=exclusive,
        )

    def _has_file(self, relpath: str) -> bool:
        try:
            self.info(relpath)
        except VolumeNotFoundError:
            return False
        return True

    def copy(self, src: str, dst: str) -> None:
        """Copy ``src`` to ``dst`` (both below the root) on the store itself."""
        self._call("copy", src, lambda b: b.copy(self.full_path(src), self.full_path(dst)))

    # -- deletes --------------------------------------------------------------------------

    def delete(self, relpath: str, *, missing_ok: bool = True) -> None:
        """Delete one file."""
        if not missing_ok and not self._has_file(relpath):
            raise VolumeNotFoundError(
                f"Cannot delete {redact_url(self.url_of(relpath))}: not found."
            )
        self.delete_many([relpath])

    def delete_many(self, relpaths: Iterable[str]) -> None:
        """Delete many files (batched where the backend can); missing ones are ignored."""
        paths = [self.full_path(p) for p in relpaths]
        if paths:
            self._call("delete", "", lambda b: b.delete(paths))

    def delete_prefix(self, relpath: str) -> None:
        """Delete everything below ``relpath`` (a directory or key prefix)."""
        backend = self.backend
        if isinstance(backend, LocalBackend):
            full = self.full_path(relpath)
            self._call("delete", relpath, lambda b: backend.delete_tree(full))
            return
        self.delete_many(f.path for f in self.list(relpath))


def refuse_url_credentials(protocol: str, url: str) -> None:
    """Refuse credentials or a query string in an S3/Azure URL: obstore would take them as
    part of the bucket or key (writing the secret into key names), never as credentials."""
    if protocol not in OBSTORE_PROTOCOLS:
        return
    netloc = split_protocol(url)[1].partition("/")[0]
    userinfo = OBSTORE_PROTOCOLS[protocol] == "s3" and "@" in netloc  # az: container@account
    if userinfo or "?" in url:
        what = "credentials (user:password@)" if userinfo else "a query string (?...)"
        raise ConfigurationError(
            f"The URL {redact_url(url)!r} carries {what}, which {protocol}:// URLs do not "
            "take. Fix: pass credentials, tokens and SAS signatures in storage_options "
            "(key=/secret=/token=, account_key=/sas_token=), and the URL without them."
        )
