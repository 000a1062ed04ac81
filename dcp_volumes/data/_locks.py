"""File locks for the cache: per-entry locks, a count of inodes that does not grow.

Every entry has a lock with two roles:

* exclusive: held while the entry is filled, repaired or evicted;
* shared: a *pin*, held while a process uses the cached file, so that no
  other process (or job) on the node evicts it meanwhile.

``ByteLock`` (Linux): one byte of one lock file per entry, the byte at an
offset drawn from the entry's key, locked with an open-file-description
(``F_OFD_SETLKW``) record lock. Like ``flock`` it belongs to its open file
description (threads of one process exclude each other; closing releases
it) and the kernel drops it when the holder dies, even on SIGKILL; unlike a
lock file per entry it costs no inode. Chosen over a fixed set of striped
lock files: a stripe shared by two entries would let a pin held on one
block the fill of the other, and a prefetcher that holds pins while it
waits for a fill would deadlock on itself.

``EntryLock`` (where OFD locks are missing): a ``flock`` on a lock file per
entry, deleted with the entry by the classic protocol: only the exclusive
holder unlinks it, and every locker checks after acquiring that the inode it
locked is still the one at the path; if not, it locked a deleted file and
tries again on the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from typing import TypeVar

# ``struct flock`` (l_type, l_whence, l_start, l_len, l_pid) as the kernel reads it.
_FLOCK = struct.Struct("hhqqi")
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
_OFD_SETLKW: int | None = getattr(fcntl, "F_OFD_SETLKW", None)
# Lock offsets are drawn below this (a lock needs no file bytes there).
_OFFSET_SPAN = 1 << 62
_L = TypeVar("_L", bound="_HeldLock")


def byte_locks_supported() -> bool:
    """Whether this platform has open-file-description record locks (Linux)."""
    return _OFD_SETLK is not None and _OFD_SETLKW is not None


class _HeldLock:
    """What both kinds of lock share: a descriptor while held; closing it releases."""

    __slots__ = ("exclusive", "fd")

    def __init__(self) -> None:
        self.fd: int | None = None
        self.exclusive = False

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self.fd is not None

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases it); a no-op when not held."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self: _L) -> _L:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # A forgotten pin must not outlive its owner object.
        self.release()


class EntryLock(_HeldLock):
    """A ``flock`` on ``path``, created on demand, robust to the file being deleted."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def acquire(self, *, exclusive: bool, blocking: bool = True) -> bool:
        """Take the lock; returns False only when ``blocking`` is False and it is busy."""
        if self.fd is not None:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if not blocking:
            op |= fcntl.LOCK_NB
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                # The entry's directory is created lazily (or was removed by a reset).
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                continue
            try:
                try:
                    fcntl.flock(fd, op)
                except BlockingIOError:
                    os.close(fd)
                    return False
                locked = os.fstat(fd)
                try:
                    current = os.stat(self.path)
                except FileNotFoundError:
                    current = None
            except BaseException:
                os.close(fd)
                raise
            if current is not None and (current.st_ino, current.st_dev) == (
                locked.st_ino,
                locked.st_dev,
            ):
                self.fd = fd
                self.exclusive = exclusive
                return True
            # We waited on a lock file that its exclusive holder deleted: retry on the new one.
            os.close(fd)

    def downgrade(self) -> bool:
        """False: a ``flock`` is not turned shared in one step (another process may take
        it between), so the caller releases and takes it shared again."""
        return False

    def release_and_delete(self) -> None:
        """Delete the lock file, then release; only valid while holding it exclusively."""
        if self.fd is None or not self.exclusive:
            raise RuntimeError("only the exclusive holder may delete a lock file")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.release()


class ByteLock(_HeldLock):
    """An OFD record lock on one byte (``offset``) of the shared lock file ``path``.

    The same interface as ``EntryLock``; the lock file is never deleted, so
    ``release_and_delete`` only releases.
    """

    __slots__ = ("offset", "path")

    def __init__(self, path: str, key: str) -> None:
        super().__init__()
        self.path = path
        self.offset = int(key[:16], 16) % _OFFSET_SPAN

    def acquire(self, *, exclusive: bool, blocking: bool = True) -> bool:
        """Take the lock; returns False only when ``blocking`` is False and it is busy."""
        if self.fd is not None:
            raise RuntimeError(f"lock {self.path}@{self.offset} is already held by this object")
        cmd = _OFD_SETLKW if blocking else _OFD_SETLK
        if cmd is None:
            raise RuntimeError("ByteLock needs open-file-description locks (Linux)")
        kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, self.offset, 1, 0))
        except BaseException as exc:
            os.close(fd)
            if not blocking and isinstance(exc, (BlockingIOError, PermissionError)):
                return False  # EAGAIN / EACCES: someone else holds it
            raise
        self.fd = fd
        self.exclusive = exclusive
        return True

    def downgrade(self) -> bool:
        """Turn the exclusive lock held into a shared one in one step: a record lock is
        converted in place, so no other process takes it between. Returns True."""
        if self.fd is None or not self.exclusive or _OFD_SETLK is None:
            raise RuntimeError("only the exclusive holder may downgrade an entry's lock")
        fcntl.fcntl(self.fd, _OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, self.offset, 1, 0))
        self.exclusive = False
        return True

    def release_and_delete(self) -> None:
        """Release (the shared lock file stays); only valid while holding it exclusively."""
        if self.fd is None or not self.exclusive:
            raise RuntimeError("only the exclusive holder may delete an entry's lock")
        self.release()


class CounterLock:
    """An exclusive lock on one never-deleted file that also stores one integer.

    The cache keeps its byte count here: every update happens under the lock,
    so concurrent processes never lose one (unlike a shared JSON index that
    each process rewrites from its own stale copy).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> CounterLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def read(self) -> int | None:
        """The stored integer, or None when the file is empty or unreadable."""
        if self._fd is None:
            raise RuntimeError("read() needs the lock held")
        raw = os.pread(self._fd, 64, 0)
        try:
            return int(raw.decode().strip())
        except ValueError:
            return None

    def write(self, value: int) -> None:
        """Store ``value`` (under the lock)."""
        if self._fd is None:
            raise RuntimeError("write() needs the lock held")
        data = f"{int(value)}\n".encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
