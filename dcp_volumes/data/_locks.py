"""File locks for the cache: per-entry ``flock`` locks whose files may be deleted safely.

``flock`` locks belong to an open file description and the kernel drops them
when the holder dies (even on SIGKILL), so a killed filler never leaves a lock
behind. Two roles share one lock file per cache entry:

* exclusive: held while the entry is filled, repaired or evicted;
* shared: a *pin*, held while a process uses the cached file, so that no
  other process (or job) on the node evicts it meanwhile.

Lock files of evicted entries are deleted, or they would pile up one per file
ever cached. Deleting a lock file is only safe with the classic protocol used
here: only the exclusive holder unlinks it, and every locker checks after
acquiring that the inode it locked is still the one at the path; if not, it
locked a deleted file and tries again on the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os


class EntryLock:
    """A ``flock`` on ``path``, created on demand, robust to the file being deleted."""

    __slots__ = ("exclusive", "fd", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self.exclusive = False

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self.fd is not None

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

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases it); a no-op when not held."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def release_and_delete(self) -> None:
        """Delete the lock file, then release; only valid while holding it exclusively."""
        if self.fd is None or not self.exclusive:
            raise RuntimeError("only the exclusive holder may delete a lock file")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.release()

    def __enter__(self) -> EntryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # A forgotten pin must not outlive its owner object.
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
