"""Local staging area on fast disk (NVMe): placement, free-space checks, cleanup.

Checkpoint shards are serialised here before upload, and cache fills land
here before they are renamed into place. Where the area lives is decided once:
an explicit directory, else ``DCP_VOLUMES_STAGING``, else a private temp dir.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import uuid

from dcp_volumes import _env
from dcp_volumes._exceptions import ConfigurationError, StagingError

logger = logging.getLogger(__name__)

# Keep this much free on the staging disk beyond what a save needs, so that a
# checkpoint never fills the disk other processes on the node rely on.
DEFAULT_HEADROOM_BYTES = 256 * 2**20

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(value: int | str | None, *, what: str = "size") -> int | None:
    """Bytes from an int or a string like ``"100GB"``, ``"512MiB"``, ``"1.5g"``.

    ``None`` stays ``None`` (no limit). Binary units: ``GB`` and ``GiB`` both
    mean 2**30, as disk tools on Linux report them.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigurationError(f"{what}={value!r} is not a size; use bytes or e.g. '100GB'.")
    if isinstance(value, int):
        if value < 0:
            raise ConfigurationError(f"{what}={value} must be >= 0 bytes.")
        return value
    text = str(value).strip().lower().replace(" ", "")
    for suffix in ("ib", "b"):
        if text.endswith(suffix) and text[: -len(suffix)][-1:].isalpha():
            text = text[: -len(suffix)]
            break
    unit = text[-1:] if text[-1:].isalpha() else ""
    number = text[: -1] if unit else text
    if unit == "b":
        unit = ""
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _UNITS or amount < 0:
        raise ConfigurationError(
            f"{what}={value!r} is not a size. Use a byte count or a string such as "
            "'512MB', '100GB' or '1.5TB'."
        )
    return int(amount * _UNITS[unit])


def probe_writable(directory: str) -> None:
    """Create and remove a file in ``directory``; raises ``OSError`` when it cannot."""
    probe = os.path.join(directory, f".probe-{uuid.uuid4().hex[:8]}")
    with open(probe, "wb"):
        pass
    os.remove(probe)


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem holding ``path``."""
    return shutil.disk_usage(path).free


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
        if configured is None:
            self.path = tempfile.mkdtemp(prefix="dcp_volumes-staging-")
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

    def __getstate__(self) -> dict[str, object]:
        # A pickled copy (PROCESS async checkpointer) must not delete the owner's dir.
        state = self.__dict__.copy()
        state["_owned"] = False
        return state
