"""The local backend (paths, ``file://``, network mounts) and the local-file writes it needs.

A local disk or network mount has no atomic PUT, so every file lands under a
temporary name and is renamed into place, with the fsyncs that make the rename
durable; a download lands the same way. File operations raise plain
``OSError``s; the backend's methods raise them as the neutral kinds
(``_errors.from_builtin``), which ``Volume`` retries and translates. ``write_all`` is also
how the cache and the checkpoint writer write their local files.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from dcp_volumes._exceptions import VolumeAccessError, VolumeError, VolumeNotFoundError
from dcp_volumes._volume._backend import Capabilities, Data, FileInfo, Listing
from dcp_volumes._volume._errors import from_builtin, map_exceptions

P = ParamSpec("P")
R = TypeVar("R")

# Largest single write(). Linux sizes a file's page-cache folios by the write
# that creates them. On this project's VMs the guest hands free blocks of 2 MiB
# and more back to the host (free page reporting), so a 2 MiB folio always
# lands on memory the host must fault in again, while 1 MiB folios can reuse
# the smaller free blocks the guest keeps: 64 x 8 MiB files cost 0.13-0.22
# CPU-s in 1 MiB writes against 0.85-1.56 in larger ones when such blocks were
# there, and the same ~1.2 when they were not. Elsewhere 1 MiB pieces cost
# only a few more system calls.
WRITE_PIECE = 1 << 20


def pieces(data: bytes | bytearray | memoryview) -> Iterator[memoryview]:
    """``data`` as views of at most ``WRITE_PIECE`` bytes (no copies)."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), WRITE_PIECE):
        yield view[start : start + WRITE_PIECE]


def write_all(fd: int, data: bytes | bytearray | memoryview, offset: int | None = None) -> None:
    """Write all of ``data`` to ``fd`` (at ``offset`` with ``pwrite``), in ``pieces``."""
    for piece in pieces(data):
        while piece:
            done = os.write(fd, piece) if offset is None else os.pwrite(fd, piece, offset)
            piece = piece[done:]
            if offset is not None:
                offset += done


def fsync_dir(path: str) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_dir(path: str, *, writable: bool) -> None:
    """Raise a clear error unless ``path`` is a directory (``writable``: this process may write)."""
    if not os.path.isdir(path):
        existing = _existing_ancestor(path)
        if not os.path.isdir(existing):
            where = "it" if existing == os.path.abspath(path) else existing
            raise VolumeError(
                f"{path} is not a directory: {where} is a file. Fix: correct the path (a "
                "local volume is a directory)."
            )
        raise VolumeNotFoundError(
            f"The directory {path} does not exist. Fix: create it or mount the volume."
        )
    if writable and not os.access(path, os.W_OK | os.X_OK):
        raise VolumeAccessError(
            f"The directory {path} is not writable by this process. Fix: change its "
            "permissions or choose another path."
        )


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``; where the path cannot be created, an error that
    says which part of it stops it and what to do (other errors, e.g. a full disk, as raised)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        error = _uncreatable(path, exc)
        if error is None:
            raise
        raise error from exc


def _existing_ancestor(path: str) -> str:
    """``path`` itself or its nearest ancestor that exists."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _uncreatable(path: str, exc: OSError) -> VolumeError | None:
    """The error for a directory ``path`` that ``os.makedirs`` could not create, or ``None``
    where the cause is not the path (a full disk, an I/O error: the caller's to name)."""
    existing = _existing_ancestor(path)
    reason = exc.strerror or type(exc).__name__
    if not os.path.isdir(existing):
        return VolumeError(
            f"Cannot create the directory {path}: {existing} is a file, not a directory. "
            "Fix: choose a path whose parents are directories, or move that file away."
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return VolumeAccessError(
            f"Cannot create the directory {path}: this process may not create directories "
            f"in {existing} ({reason}). Fix: choose a path on a disk or volume this process "
            f"can write, or change the permissions of {existing} (or mount it read-write)."
        )
    if exc.errno == errno.ENOENT:
        return VolumeNotFoundError(
            f"Cannot create the directory {path}: {existing} does not take new directories "
            f"({reason}); virtual filesystems such as /proc and /sys do not. Fix: choose a "
            "path on a local disk or a mounted volume."
        )
    return None


def place_file(src: str, dst: str, *, move: bool) -> None:
    """Put ``src`` at ``dst`` so that no reader sees it half written.

    ``move=True`` renames when both are on one filesystem and removes ``src``
    after a copy otherwise.
    """
    make_dirs(os.path.dirname(dst))
    if move:
        try:
            os.replace(src, dst)
            fsync_dir(os.path.dirname(dst))
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
    fsync_dir(os.path.dirname(dst))
    if move:
        os.remove(src)


def publish_bytes(dst: str, data: Data, *, exclusive: bool) -> None:
    """Write ``data`` to ``dst`` atomically: temp file, fsync, rename, fsync of the directory.

    ``exclusive=True`` links instead of renaming, so an existing ``dst`` fails
    with ``FileExistsError`` instead of being replaced.
    """
    make_dirs(os.path.dirname(dst))
    tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, dst)  # fails with EEXIST instead of replacing
        else:
            os.replace(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    fsync_dir(os.path.dirname(dst))


def fill_in_parts(
    path: str,
    size: int,
    read: Callable[[int, int], bytes],
    *,
    part_size: int,
    concurrency: int,
) -> int:
    """Write ``size`` bytes to ``path`` from ``read(start, end)`` calls, in parallel parts.

    Returns how many bytes arrived (fewer than ``size`` when a read came up short).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        starts = list(range(0, size, part_size)) or [0]

        def fetch(start: int) -> int:
            end = min(size, start + part_size)
            data = read(start, end) if end > start else b""
            write_all(fd, data, start)
            return len(data)

        if len(starts) == 1:
            return fetch(0)
        workers = max(1, min(concurrency, len(starts)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return sum(pool.map(fetch, starts))
    finally:
        os.close(fd)


def download_atomically(
    local_path: str, size: int, fill: Callable[[str], int | None], *, what: str
) -> int:
    """Land a ``size``-byte download at ``local_path`` whole or not at all.

    ``fill(tmp)`` writes the file under a temporary name beside ``local_path``
    and returns how many bytes arrived (``None``: not counted); the file is
    renamed into place only when it has ``size`` bytes. ``what`` names the
    source in errors. Returns ``size``.
    """
    tmp = f"{local_path}.part-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    try:
        got = fill(tmp)
        if got is not None and got != size:
            raise VolumeError(
                f"Short read of {what}: got {got} bytes, expected {size}. The object changed "
                "or the connection broke; retry."
            )
        actual = os.path.getsize(tmp)
        if actual != size:
            raise VolumeError(
                f"Downloaded {actual} bytes of {what}, expected {size}. The file changed while "
                "being read; retry."
            )
        os.replace(tmp, local_path)
        return size
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _os_errors(method: Callable[P, R]) -> Callable[P, R]:
    """Run a backend method with the OS's exceptions raised as the neutral kinds."""

    @functools.wraps(method)
    def mapped(*args: P.args, **kwargs: P.kwargs) -> R:
        with map_exceptions(from_builtin):
            return method(*args, **kwargs)

    return mapped


class LocalBackend:
    """Files on this machine: a local disk or a mounted network filesystem."""

    # A mount may be NFS, whose attribute caches show a file to other nodes late; a walk
    # costs no round trips, so the commit's listing check stays.
    capabilities = Capabilities(
        local_files=True, atomic_create=True, buffers_uploads=False, listing_lags=True
    )

    @_os_errors
    def check_root(self, root: str, *, create: bool) -> Listing:
        if create:
            make_dirs(root)
        check_dir(root, writable=create)
        return self.list(root, recursive=False)

    @_os_errors
    def head(self, path: str) -> FileInfo:
        st = os.stat(path)
        if not os.path.isfile(path):
            raise IsADirectoryError(errno.EISDIR, "a directory, not a file", path)
        return FileInfo(path=path, size=st.st_size, mtime=st.st_mtime)

    @_os_errors
    def list(self, prefix: str, *, recursive: bool) -> Listing:
        files: list[FileInfo] = []
        dirs: list[str] = []
        stack = [prefix]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except (FileNotFoundError, NotADirectoryError):
                continue  # a missing prefix lists as empty
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=True):
                        if recursive:
                            stack.append(entry.path)
                        else:
                            dirs.append(entry.path)
                    elif entry.is_file(follow_symlinks=True):
                        st = entry.stat()
                        files.append(
                            FileInfo(path=entry.path, size=st.st_size, mtime=st.st_mtime)
                        )
                except FileNotFoundError:
                    # Removed or renamed between the directory read and the stat (another
                    # job's temp file, a delete): it is not there, as an object store's
                    # listing would say.
                    continue
        return Listing(files=files, dirs=dirs)

    @_os_errors
    def read(self, path: str, start: int, end: int | None) -> bytes:
        with open(path, "rb", buffering=0) as f:
            if end is None:
                f.seek(start)
                return f.read()
            return os.pread(f.fileno(), max(0, end - start), start)

    @_os_errors
    def read_whole(self, path: str, expect: int) -> bytes:
        return self.read(path, 0, None)

    @_os_errors
    def read_into(self, path: str, start: int, outs: Sequence[memoryview]) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = os.preadv(fd, list(outs), start) if outs else 0
        finally:
            os.close(fd)
        return got

    @_os_errors
    def upload(
        self, local_path: str, path: str, *, size: int, part_size: int, concurrency: int,
        move: bool,
    ) -> None:
        place_file(local_path, path, move=move)
        actual = os.path.getsize(path)
        if actual != size:
            raise VolumeError(
                f"Wrote {size} bytes to {path} but it holds {actual}. The disk or mount "
                "dropped data; retry the save."
            )

    @_os_errors
    def put(self, path: str, data: Data, *, create_only: bool) -> None:
        publish_bytes(path, data, exclusive=create_only)

    @_os_errors
    def delete(self, paths: Sequence[str]) -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    @_os_errors
    def copy(self, src: str, dst: str) -> None:
        make_dirs(os.path.dirname(dst))
        tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    @_os_errors
    def delete_tree(self, path: str) -> None:
        """Remove a whole directory (one call where a store would list and delete)."""
        shutil.rmtree(path, ignore_errors=True)

