"""Per-checkpoint manifest: every data file with its size and checksum.

A rank-local save (``dcp.save(..., use_collectives=False)``) has a manifest per
rank (``_layout`` names them), and is complete when every rank's marker is there.

The manifest sits beside the standard DCP files (stock readers ignore it) and
is written just before ``.metadata``. A checkpoint is *complete* when
``.metadata`` exists and the files on the volume match the manifest. Stock
checkpoints have no manifest: they are complete when ``.metadata`` exists,
and verification is skipped (logged at debug level).
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import xxhash

from dcp_volumes._exceptions import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointVersionError,
    VolumeNotFoundError,
)
from dcp_volumes._exit_safe import map_all
from dcp_volumes._volume import FileInfo, Volume, until_shown
from dcp_volumes.checkpoint import _layout

logger = logging.getLogger(__name__)

ALGORITHM = "xxh3_64"
FORMAT_NAME = "dcp_volumes.manifest"
FORMAT_VERSION = 1
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"
_CHUNK = 8 * 2**20
# Hashing a local file: small enough to stay in the CPU cache between read and hash.
_HASH_CHUNK = 2**20


class Checksum:
    """Streaming checksum (xxh3-64: faster than any disk or link, so it never limits a save)."""

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        if algorithm != ALGORITHM:
            raise CheckpointCorruptError(
                f"Unknown checksum algorithm {algorithm!r} in a manifest; this version of "
                f"dcp_volumes understands {ALGORITHM!r}. Upgrade dcp_volumes to read it."
            )
        self._h = xxhash.xxh3_64()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def checksum_bytes(data: bytes | bytearray | memoryview) -> str:
    """Checksum of an in-memory buffer."""
    h = Checksum()
    h.update(data)
    return h.hexdigest()


def checksum_file(file: str | os.PathLike[str] | io.RawIOBase) -> str:
    """Checksum of a local file (a path, or an open binary file read from its start).

    Reads in cache-sized chunks into one reused buffer: no allocation per chunk.
    """
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb", buffering=0) as f:
            return checksum_file(f)
    h = Checksum()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    file.seek(0)
    while n := file.readinto(buf):
        h.update(view[:n])
    return h.hexdigest()


@dataclass(frozen=True)
class FileRecord:
    """One checkpoint file: its size and checksum, the tensors' spans, and its path.

    The one record of a file from the save (``HashingFile`` makes it) through the
    commit (the manifest lists it) to the load and the copies (``_tiers``).
    ``tensors`` maps the offset of each tensor item whose ``torch.save`` bytes
    hold its data contiguously, in logical order, to that data's offset and
    length: a reader can fetch the data straight into the target tensor.
    ``path``: relative to the checkpoint (the manifest's key; ``""`` while the
    file has none yet).
    """

    size: int
    checksum: str
    tensors: Mapping[int, tuple[int, int]] = field(default_factory=dict, compare=False)
    path: str = ""


@dataclass(frozen=True)
class Manifest:
    """All data files of one checkpoint, keyed by path relative to the checkpoint."""

    files: Mapping[str, FileRecord]
    algorithm: str = ALGORITHM
    created: float = field(default_factory=time.time)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.files.values())

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "algorithm": self.algorithm,
            "created": self.created,
            "files": {name: _record_json(r) for name, r in sorted(self.files.items())},
            "extra": dict(self.extra),
        }
        # Compact: with an indent json encodes in Python, not C, and this is on
        # the commit's path (benchmarks/HISTORY.md); `python -m json.tool` prints it.
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError(f"a JSON {type(doc).__name__}, not an object")
            _check_format(doc.get("format"), where)
            files = {
                str(name): FileRecord(
                    size=int(rec["size"]),
                    checksum=str(rec["checksum"]),
                    tensors={
                        int(k): (int(at), int(n)) for k, (at, n) in rec.get("tensors", {}).items()
                    },
                    path=str(name),
                )
                for name, rec in doc["files"].items()
            }
            for name in files:
                _layout.inside(name, f"the manifest {where}")
            return cls(
                files=files,
                algorithm=str(doc.get("algorithm", ALGORITHM)),
                created=float(doc.get("created", 0.0)),
                extra=dict(doc.get("extra", {})),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointCorruptError(
                f"The manifest {where} is unreadable ({exc}). The checkpoint was written by an "
                "incompatible tool or damaged; verify it with `dcp-volumes verify` or restore "
                "an older one."
            ) from exc


def _check_format(found: Any, where: str) -> None:
    """Refuse a manifest of another format; a newer version of ours says so."""
    if found == FORMAT:
        return
    name, _, version = str(found).rpartition("/")
    if name == FORMAT_NAME and version.isdigit() and int(version) > FORMAT_VERSION:
        # Not damage: a newer dcp_volumes wrote it. Its own error, so that discovery
        # and retention can tell it from a damaged checkpoint and leave it alone.
        raise CheckpointVersionError(
            f"The manifest {where} is in format {found!r}, newer than {FORMAT!r}, the one "
            "this version of dcp_volumes reads: a newer dcp_volumes wrote the checkpoint. "
            "Fix: upgrade dcp_volumes (pip install -U dcp_volumes) to load it."
        )
    raise ValueError(f"format {found!r}, expected {FORMAT!r}")


def _record_json(record: FileRecord) -> dict[str, Any]:
    doc: dict[str, Any] = {"size": record.size, "checksum": record.checksum}
    if record.tensors:
        doc["tensors"] = {str(k): v for k, v in sorted(record.tensors.items())}  # tuples: arrays
    return doc


def read_manifest(volume: Volume, name: str = _layout.MANIFEST_NAME) -> Manifest | None:
    """The manifest ``name`` of the checkpoint at ``volume``, or ``None`` for a stock checkpoint.

    ``name``: a rank's manifest (``rank_manifest_name``) for a rank-local checkpoint.
    """
    try:  # one request, not exists() + read: a load pays every round trip
        data = volume.read_bytes(name)
    except BucketNotFoundError:
        raise
    except VolumeNotFoundError:
        logger.debug("%s has no %s: checksum verification skipped", volume, name)
        return None
    return Manifest.from_json(data, where=volume.url_of(name))


def check_listing(
    expected: Manifest | Mapping[str, FileRecord], listing: Iterable[FileInfo]
) -> list[str]:
    """Problems found comparing files (a manifest's, or some) with a listing (empty: consistent)."""
    files = expected.files if isinstance(expected, Manifest) else expected
    sizes = {f.path: f.size for f in listing}
    problems = []
    for name, rec in sorted(files.items()):
        if name not in sizes:
            problems.append(f"{name}: missing")
        elif sizes[name] != rec.size:
            problems.append(f"{name}: {sizes[name]} bytes on the volume, manifest says {rec.size}")
    return problems


def check_listing_settled(
    volume: Volume,
    expected: Manifest | Mapping[str, FileRecord],
    listing: Iterable[FileInfo] | None = None,
) -> tuple[list[str], list[FileInfo]]:
    """``check_listing``, re-listing a bounded number of times while problems remain.

    A briefly stale listing must not turn a good save into "files missing" (or
    a good checkpoint into "damaged"); one that stays wrong past ``LAG_TOTAL_S``
    is reported. Returns the problems and the last listing.
    """
    first = list(listing) if listing is not None else None

    def attempt() -> tuple[list[str], list[FileInfo]]:
        nonlocal first
        files, first = (first if first is not None else volume.list()), None
        return check_listing(expected, files), files

    return until_shown(attempt, lambda got: not got[0],
                       what=f"every expected file in the listing of {volume.display_url}")


def verify_checksums(
    volume: Volume,
    manifest: Manifest,
    *,
    names: Iterable[str] | None = None,
    concurrency: int = 8,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Download files and compare their checksums; returns the problems found.

    ``progress`` is called with the number of bytes hashed as they stream in.
    """
    wanted = sorted(names) if names is not None else sorted(manifest.files)

    def check(name: str) -> str | None:
        rec = manifest.files[name]
        h = Checksum(manifest.algorithm)
        done = 0
        try:
            while done < rec.size:
                end = min(rec.size, done + _CHUNK)
                chunk = volume.read_bytes(name, done, end)
                if not chunk:
                    break
                h.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(len(chunk))
        except FileNotFoundError:
            return f"{name}: missing"
        if done != rec.size:
            return f"{name}: only {done} of {rec.size} bytes readable"
        if h.hexdigest() != rec.checksum:
            return f"{name}: checksum {h.hexdigest()} != manifest {rec.checksum}"
        return None

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return [p for p in map_all(pool, check, wanted) if p]
