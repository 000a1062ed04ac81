"""Local staging area on fast disk (NVMe): placement, free-space checks, cleanup.

Checkpoint shards are serialised here before upload, and cache fills land
here before they are renamed into place. Where the area lives is decided once:
an explicit directory, else ``DCP_VOLUMES_STAGING``, else a private temp dir.
A private temp dir holds a lock while its process lives: a process killed
mid-save (SIGKILL skips every cleanup) leaves its shards there, and the next
process to make one removes them (``sweep_abandoned``).
A local disk that fills up part-way through a write (staging or cache) is
reported by ``disk_full_error``, the one place that translates ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
import uuid

from dcp_volumes import _env
from dcp_volumes._exceptions import DiskFullError, StagingError
from dcp_volumes._sizes import format_size

logger = logging.getLogger(__name__)

# Keep this much free on the staging disk beyond what a save needs, so that a
# checkpoint never fills the disk other processes on the node rely on.
DEFAULT_HEADROOM_BYTES = 256 * 2**20

# A private temp staging dir: its name's prefix, and the file its process holds a
# flock on for as long as it lives (the kernel drops the lock when it dies).
_TEMP_PREFIX = "dcp_volumes-staging-"
_OWNER_LOCK = ".owner.lock"
_swept: set[str] = set()  # temp folders swept by this process (once each)


def _hold_owner_lock(directory: str) -> int:
    """Lock ``directory``'s owner file for this process; returns the descriptor to keep."""
    new = os.path.join(directory, _OWNER_LOCK + ".new")
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    # Under its name only once held: a sweeper never finds it unlocked while we live.
    os.rename(new, os.path.join(directory, _OWNER_LOCK))
    return fd


def sweep_abandoned(parent: str) -> list[str]:
    """Remove the private staging dirs in ``parent`` whose process has died; returns them.

    A dir whose owner file is locked belongs to a live process (of any pid
    namespace on this kernel); one without an owner file is being set up, or
    is older than the lock, and is left alone.
    """
    removed = []
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        candidates = [e.path for e in entries
                      if e.name.startswith(_TEMP_PREFIX) and e.is_dir(follow_symlinks=False)]
    for path in candidates:
        try:
            fd = os.open(os.path.join(path, _OWNER_LOCK), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its process lives
        finally:
            os.close(fd)  # (a lock taken is released with it: the dir goes next)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d staging director%s left by processes that ended without "
                    "cleaning up (killed mid-save): %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed[:3])
                    + (", ..." if len(removed) > 3 else ""))
    return removed


def probe_writable(directory: str) -> None:
    """Create and remove a file in ``directory``; raises ``OSError`` when it cannot."""
    probe = os.path.join(directory, f".probe-{uuid.uuid4().hex[:8]}")
    with open(probe, "wb"):
        pass
    os.remove(probe)


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem holding ``path``."""
    return shutil.disk_usage(path).free


# errno values of a write that found no room: the disk, or this user's quota on it, is full.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def _out_of_space(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _FULL_ERRNOS:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def disk_full_error(
    exc: BaseException, directory: str, *, doing: str, needed: int | None, fix: str
) -> DiskFullError | None:
    """The ``DiskFullError`` for ``exc`` if it, or an error behind it, is a full local disk.

    The one place where ENOSPC/EDQUOT of a local write (staging, cache) becomes
    a clear error: callers pass what their local writes raised and raise the
    result ``from exc``. The out-of-space ``OSError`` is looked for along
    ``__cause__``/``__context__`` because wrappers hide it: torch's serializer
    reports it only as ``unexpected pos``, the volume layer as a failed read.
    ``doing``: what was being written; ``needed``: bytes it needed, if known.
    """
    if isinstance(exc, DiskFullError):
        return exc
    full = _out_of_space(exc)
    if full is None:
        return None
    try:
        free: int | None = free_bytes(directory)
    except OSError:
        free = None
    need = f", needing {format_size(needed)}" if needed is not None else ""
    have = f"; {format_size(free)} free now" if free is not None else ""
    return DiskFullError(
        f"The disk holding {directory} is full: {doing} failed ({full.strerror}){need}{have}. "
        f"Another process may have filled it after the free-space check. {fix}",
        directory,
        needed,
        free,
    )


class StagingArea:
    """A local directory for temporary files, checked before use.

    Args:
        directory: where to stage; ``None`` uses ``DCP_VOLUMES_STAGING`` or a
            new private temp dir (removed by ``close``).
        headroom_bytes: free space to leave on the disk beyond each reservation.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> None:
        configured = os.fspath(directory) if directory is not None else _env.staging_dir()
        self._owned = configured is None
        self._owner_fd: int | None = None
        if configured is None:
            self.path = tempfile.mkdtemp(prefix=_TEMP_PREFIX)
            self._owner_fd = _hold_owner_lock(self.path)
            parent = os.path.dirname(self.path)
            if parent not in _swept:
                _swept.add(parent)
                sweep_abandoned(parent)
        else:
            self.path = os.path.abspath(os.path.expanduser(configured))
        self.headroom_bytes = headroom_bytes
        self.check()

    def check(self) -> None:
        """Raise ``StagingError`` unless the directory exists and is writable."""
        if not os.path.isdir(self.path):
            raise StagingError(
                f"The staging directory {self.path} does not exist. Fix: create it (ideally on "
                "local NVMe), pass another staging_dir=, or unset DCP_VOLUMES_STAGING to use a "
                "temporary directory."
            )
        try:
            probe_writable(self.path)
        except OSError as exc:
            raise StagingError(
                f"The staging directory {self.path} is not writable ({exc.strerror}). Fix: make "
                "it writable by this process or choose another staging_dir=."
            ) from exc

    def ensure_space(self, nbytes: int) -> None:
        """Raise ``StagingError`` if ``nbytes`` (plus headroom) do not fit on the disk."""
        free = free_bytes(self.path)
        if nbytes + self.headroom_bytes > free:
            raise StagingError(
                f"The staging directory {self.path} has {free / 2**20:.1f} MiB free but this "
                f"save needs {nbytes / 2**20:.1f} MiB (+{self.headroom_bytes / 2**20:.0f} MiB "
                "headroom). Fix: free space there, or point staging_dir= / DCP_VOLUMES_STAGING "
                "at a larger local disk."
            )

    def new_dir(self, label: str) -> str:
        """A fresh, empty sub-directory for one operation."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[-80:]
        path = os.path.join(self.path, f"{safe}-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(path)
        except OSError as exc:
            raise StagingError(
                f"Cannot create {path} in the staging directory ({exc.strerror}). Fix: check "
                "its permissions and free space."
            ) from exc
        return path

    @staticmethod
    def remove(path: str) -> None:
        """Remove a staged file or directory; missing is fine."""
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def close(self) -> None:
        """Remove the directory if this object created it."""
        if self._owned:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    def __getstate__(self) -> dict[str, object]:
        # A pickled copy (PROCESS async checkpointer) must not delete the owner's dir.
        state = self.__dict__.copy()
        state["_owned"] = False
        state["_owner_fd"] = None
        return state
