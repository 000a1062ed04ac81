"""Finding checkpoints under a root and deciding which ones are complete.

Layout (documented in ``CheckpointManager``)::

    <root>/step-00000100/.metadata                    commit marker, written last
    <root>/step-00000100/.dcp_volumes.manifest.json   sizes + checksums of the data files
    <root>/step-00000100/<data files>

Directories written by other tools are recognised too when their name carries
a step number in a common form (``step-100``, ``step_100``, ``100``,
``checkpoint-100``, ``ckpt_100``, ``global_step100``, ``iter-100``). Listings
for people (``dcp-volumes ls``, a reader's diagnosis) also show checkpoint
directories whose name carries no step (``scan(..., unnumbered=True)``; their
step is ``NO_STEP``); ``CheckpointManager`` keeps to step-named ones.

A checkpoint is *complete* when ``.metadata`` exists and, when it has a
manifest, every file of the manifest is on the volume with the recorded size
(checksums are compared only when asked: ``verify_checkpoint``). Stock DCP
checkpoints have no manifest: ``.metadata`` alone makes them complete.

A *rank-local* checkpoint (``dcp.save(..., use_collectives=False)``: no
``.metadata``, one ``__<rank>.metadata`` per rank) is complete when every rank
from 0 to the last one has its marker and each rank's manifest, if any,
matches the listing. The ranks expected are those the files name (markers,
manifests, data files ``__<rank>_*.distcp``) and, from our manifests, the
world size of the save: a rank that died before writing anything is noticed
too, unless no rank wrote a manifest (a stock rank-local save).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

from dcp_volumes._exceptions import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from dcp_volumes._exit_safe import map_all
from dcp_volumes._volume import FileInfo, Volume, redact_url
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._layout import (
    MANIFEST_NAME,
    METADATA_NAME,
    manifest_rank,
    marker_rank,
    rank_manifest_name,
    rank_metadata_name,
)
from dcp_volumes.checkpoint._manifest import Manifest, check_listing, verify_checksums
from dcp_volumes.checkpoint._metadata_pickle import loads_metadata
from dcp_volumes.goodput._records import GOODPUT_DIR

logger = logging.getLogger(__name__)

#: Directory name of the checkpoint of ``step`` written by ``CheckpointManager``.
STEP_DIR_FORMAT = "step-{step:08d}"
#: ``CheckpointInfo.step`` of a checkpoint whose directory name carries no step number.
NO_STEP = -1

_CANONICAL = re.compile(r"^step-(\d{8,})$")
_STEP_NAME = re.compile(
    r"^(?:(?:step|steps|checkpoint|ckpt|global_step|global-step|iter|iteration)[-_]?)?(\d+)$",
    re.IGNORECASE,
)
# Reading many manifests is latency-bound on object stores.
_LIST_CONCURRENCY = 16
# A rank's data file as stock DCP (``__3_0.distcp``) or VolumeWriter (``__3_9c1e07aa_0.distcp``)
# names it, possibly below a spread prefix.
_RANK_DATA = re.compile(r"^__(\d+)_(?:[0-9a-f]+_)?\d+" + re.escape(_layout.DATA_SUFFIX) + "$")
# VolumeWriter's own data file (with a save tag), the only kind below a spread prefix.
_TAGGED_DATA = re.compile(r"^__\d+_[0-9a-f]+_\d+" + re.escape(_layout.DATA_SUFFIX) + "$")
# A hashed spread prefix (``_layout.spread_prefix``): two or more hex digits.
_SPREAD_DIR = re.compile(r"^[0-9a-f]{2,}$")


#: Manifests already read, by (directory, size, etag, mtime, file name) of the manifest file.
ManifestCache = dict[tuple[str, int, str | None, float | None, str], Manifest]


def step_dir(step: int) -> str:
    """The directory name for ``step`` (``step-00000100``)."""
    return STEP_DIR_FORMAT.format(step=step)


def parse_step(name: str) -> int | None:
    """The step number a checkpoint directory name carries, or ``None``."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def is_canonical(name: str) -> bool:
    """Whether ``name`` is in the manager's own ``step-00000100`` form (8+ digits)."""
    return _CANONICAL.match(name) is not None


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory under a root, complete or not.

    Attributes:
        step: training step, parsed from the directory name; ``NO_STEP`` (-1) when the
            name carries none (only listings for people hold those: ``CheckpointManager``
            lists and restores step-named checkpoints only).
        url: URL (plain path for local volumes) of the checkpoint directory.
        complete: ``.metadata`` exists and the files match the manifest.
        name: the directory name below the root (``step-00000100``).
        size: bytes of all files in the directory.
        num_files: number of files in the directory.
        created: creation time (Unix seconds) where known: the manifest's, else
            the newest file's modification time.
        managed: it carries a dcp_volumes manifest (``False`` for stock DCP ones).
        problems: why it is not complete (empty when complete).
        modified: the newest modification time of its files (Unix seconds), where
            known: how recently a save wrote to it.
        newer_format: its manifest is in a newer format than this version reads
            (a newer dcp_volumes wrote it): not complete here, and never deleted.
        rank_local: saved with ``use_collectives=False``: one ``__<rank>.metadata``
            per rank instead of ``.metadata``; it loads only on the same ranks.
        ranks: for a rank-local checkpoint, the number of ranks it needs.
    """

    step: int
    url: str
    complete: bool
    name: str = ""
    size: int | None = None
    num_files: int | None = None
    created: float | None = None
    managed: bool = False
    problems: tuple[str, ...] = ()
    modified: float | None = None
    newer_format: bool = False
    rank_local: bool = False
    ranks: int | None = None

    def __repr__(self) -> str:
        # The dataclass repr, with the URL as messages show it (a signed URL's
        # ?sig=, a user:password@ removed): url itself stays loadable.
        shown = []
        for f in fields(self):
            value = redact_url(self.url) if f.name == "url" else getattr(self, f.name)
            shown.append(f"{f.name}={value!r}")
        return f"CheckpointInfo({', '.join(shown)})"


def sort_key(info: CheckpointInfo) -> tuple[int, int, str]:
    # Oldest first; of two directories with one step, the canonical one counts as newer.
    return (info.step, 1 if is_canonical(info.name) else 0, info.name)


def inspect_dir(
    volume: Volume,
    name: str,
    step: int,
    listing: Sequence[FileInfo] | None = None,
    *,
    manifests: ManifestCache | None = None,
) -> CheckpointInfo | None:
    """Describe the checkpoint directory ``name``; ``None`` if it is not a checkpoint.

    ``listing``: the files below ``name`` (paths relative to the volume root),
    when the caller listed them already; ``manifests``: manifests read before
    (a listing entry with the same size, etag and mtime is the same manifest).
    A directory without ``.metadata`` counts as a (partial) checkpoint only if
    it is in the canonical form or holds DCP or manifest files, so that
    unrelated directories that happen to be named by a number are left alone.
    """
    if listing is None:
        listing = volume.list(name)
    prefix = f"{name}/"
    files = [
        FileInfo(path=f.path[len(prefix) :], size=f.size, etag=f.etag, mtime=f.mtime)
        for f in listing
        if f.path.startswith(prefix)
    ]
    names = {f.path for f in files}
    rank_local = is_rank_local(names)
    if not _looks_like_checkpoint(name, names, rank_local):
        return None
    found = _ManifestFindings.of(volume, name, files, rank_local, manifests)
    problems = list(found.problems)
    ranks: int | None = None
    if rank_local:
        ranks, missing = expected_ranks(names, found.world)
        if missing:
            problems.insert(0, missing_ranks_problem(ranks, missing))
    elif METADATA_NAME not in names:
        problems.insert(0, f"{METADATA_NAME} missing (never committed, or being written/deleted)")
    times = [f.mtime for f in files if f.mtime is not None]
    modified = max(times) if times else None
    return CheckpointInfo(
        step=step,
        url=volume.url_of(name),
        complete=not problems,
        name=name,
        size=sum(f.size for f in files),
        num_files=len(files),
        created=found.created if found.created is not None else modified,
        managed=bool(found.names),
        problems=tuple(problems),
        modified=modified,
        newer_format=found.newer_format,
        rank_local=rank_local,
        ranks=ranks,
    )


def _looks_like_checkpoint(name: str, names: Collection[str], rank_local: bool) -> bool:
    """Whether a directory with these file names is a checkpoint, complete or not."""
    return (
        METADATA_NAME in names or MANIFEST_NAME in names or rank_local or is_canonical(name)
        or any(n.endswith(".distcp") for n in names)
    )


@dataclass(frozen=True)
class _ManifestFindings:
    """What a checkpoint directory's manifests say (one, or one per rank if rank-local).

    Attributes:
        names: the manifest files read (none: a stock DCP checkpoint).
        created: the newest save time they record.
        world: the largest world size they record (0: none does).
        newer_format: one is in a format newer than this version reads.
        problems: what they find wrong with the directory's files, or with themselves.
    """

    names: tuple[str, ...] = ()
    created: float | None = None
    world: int = 0
    newer_format: bool = False
    problems: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        volume: Volume,
        name: str,
        files: Sequence[FileInfo],
        rank_local: bool,
        manifests: ManifestCache | None,
    ) -> _ManifestFindings:
        paths = {f.path for f in files}
        if rank_local:
            ranks = {r for r in map(manifest_rank, paths) if r is not None}
            manifest_names = [rank_manifest_name(r) for r in sorted(ranks)]
        else:
            manifest_names = [MANIFEST_NAME] if MANIFEST_NAME in paths else []
        problems: list[str] = []
        created: float | None = None
        newer_format = False
        world = 0
        for manifest_name in manifest_names:
            entry = next(f for f in files if f.path == manifest_name)
            try:
                manifest = _read_manifest(volume, name, entry, manifests)
            except CheckpointVersionError as exc:
                newer_format = True
                problems.append(f"{manifest_name}: {exc}")
            except CheckpointCorruptError as exc:
                problems.append(f"{manifest_name}: unreadable ({exc})")
            else:
                created = max(created or 0.0, manifest.created) or None
                problems.extend(check_listing(manifest, files))
                recorded = manifest.extra.get("world_size")
                if isinstance(recorded, int):
                    world = max(world, recorded)
        return cls(tuple(manifest_names), created, world, newer_format, tuple(problems))


def _read_manifest(
    volume: Volume, name: str, entry: FileInfo, manifests: ManifestCache | None
) -> Manifest:
    """The manifest ``entry`` of directory ``name``: from ``manifests`` when read before."""
    key = (name, entry.size, entry.etag, entry.mtime, entry.path)
    manifest = manifests.get(key) if manifests is not None else None
    if manifest is None:
        manifest = Manifest.from_json(
            volume.read_bytes(f"{name}/{entry.path}"),
            where=volume.url_of(f"{name}/{entry.path}"),
        )
        if manifests is not None:
            manifests[key] = manifest
    return manifest


def expected_ranks(names: set[str], world_size: int = 0) -> tuple[int, list[int]]:
    """A rank-local checkpoint's rank count and the ranks whose marker is missing.

    ``names``: the checkpoint's files; ``world_size``: the largest one its
    manifests recorded (0: none). Ranks named by any file count too.
    """
    markers = {r for r in map(marker_rank, names) if r is not None}
    seen = markers | {r for r in map(manifest_rank, names) if r is not None}
    seen |= {
        int(m.group(1))
        for m in (_RANK_DATA.match(n.rsplit("/", 1)[-1]) for n in names)
        if m is not None
    }
    ranks = max(world_size, max(seen) + 1 if seen else 0)
    return ranks, [r for r in range(ranks) if r not in markers]


def missing_ranks_problem(ranks: int, missing: Sequence[int]) -> str:
    """The problem line for rank-local markers that are missing."""
    shown = ", ".join(rank_metadata_name(r) for r in missing[:8])
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    return (f"{shown}{more} missing (rank-local save of {ranks} ranks: those ranks never "
            "committed, or are being written/deleted)")


def is_rank_local(names: set[str]) -> bool:
    """Whether a checkpoint's files are those of a rank-local save (no ``.metadata``)."""
    if METADATA_NAME in names or MANIFEST_NAME in names:
        return False
    return any(marker_rank(n) is not None or manifest_rank(n) is not None for n in names)


def is_save_file(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint directory) is a file a DCP save writes.

    A commit marker, a manifest, or a data file of DCP's naming (``__0_0.distcp``)
    at the directory's top, or one of VolumeWriter's tagged data files below a
    hashed spread prefix (``3f/__0_9c1e07aa_0.distcp``).
    """
    top, sep, rest = name.partition("/")
    if not sep:
        return (name in (METADATA_NAME, MANIFEST_NAME) or marker_rank(name) is not None
                or manifest_rank(name) is not None or _RANK_DATA.match(name) is not None)
    return ("/" not in rest and _SPREAD_DIR.match(top) is not None
            and _TAGGED_DATA.match(rest) is not None)


def holds_save(names: Collection[str]) -> bool:
    """Whether files (paths relative to one directory) are those of a DCP save there.

    Some at the top are a save's (a marker, a manifest, a data file), or all of
    them are VolumeWriter data files below spread prefixes. Files of
    checkpoints in sub-directories (a run root) do not count.
    """
    if any(is_save_file(n) for n in names if "/" not in n):
        return True
    return bool(names) and all(is_save_file(n) for n in names)


def _is_unnumbered_checkpoint(name: str, files: Sequence[FileInfo]) -> bool:
    """Whether the directory ``name`` (no step in it) below a root holds a DCP save.

    A spread prefix of a checkpoint (``3f/`` holding only tagged data files: the
    root given is itself a checkpoint) is not one.
    """
    names = [f.path[len(name) + 1 :] for f in files]
    if _SPREAD_DIR.match(name) and all(_TAGGED_DATA.match(n) for n in names):
        return False
    return holds_save(names)


def scan(
    volume: Volume,
    *,
    manifests: ManifestCache | None = None,
    unnumbered: bool = False,
    listing: Sequence[FileInfo] | None = None,
) -> list[CheckpointInfo]:
    """All checkpoints under ``volume``'s root, complete or not, oldest first.

    One recursive listing of the root (a consistent snapshot, and few requests
    on object stores), then one read per manifest. Raises the volume's error
    when the root cannot be listed: callers that delete must never act on a
    listing that failed.

    Args:
        volume: the run root.
        manifests: manifests read before (see ``inspect_dir``).
        unnumbered: also directories whose name carries no step number but that
            hold a save's files (their ``step`` is ``NO_STEP``; they sort first),
            for listings shown to people. ``CheckpointManager`` leaves them out:
            it restores and prunes by step.
        listing: the root's recursive listing, when the caller has it already.
    """
    by_dir: dict[str, list[FileInfo]] = {}
    for f in volume.list("") if listing is None else listing:
        top, sep, _ = f.path.partition("/")
        # goodput/ holds the job's goodput records (dcp_volumes.goodput), never a checkpoint.
        if sep and top != GOODPUT_DIR and (unnumbered or parse_step(top) is not None):
            by_dir.setdefault(top, []).append(f)
    by_dir = {
        name: files for name, files in by_dir.items()
        if parse_step(name) is not None or _is_unnumbered_checkpoint(name, files)
    }
    if not by_dir:
        return []

    def one(name: str) -> CheckpointInfo | None:
        step = parse_step(name)
        return inspect_dir(volume, name, NO_STEP if step is None else step, by_dir[name],
                           manifests=manifests)

    if len(by_dir) == 1 or volume.capabilities.local_files:
        found = [one(name) for name in by_dir]
    else:  # manifest reads are latency-bound: overlap them
        with ThreadPoolExecutor(max_workers=min(_LIST_CONCURRENCY, len(by_dir))) as pool:
            found = map_all(pool, one, by_dir)
    return sorted((f for f in found if f is not None), key=sort_key)


def newest_complete(infos: Sequence[CheckpointInfo]) -> CheckpointInfo | None:
    """The newest complete checkpoint of a ``scan`` result."""
    complete = [i for i in infos if i.complete]
    return max(complete, key=sort_key) if complete else None


def choose_checkpoint(
    volume: Volume, infos: Sequence[CheckpointInfo], *, step: int | None, verify: bool
) -> CheckpointInfo | None:
    """The checkpoint to restore: the newest complete one (or ``step``'s), or ``None``.

    With ``verify``, candidates whose checksums fail are skipped (newest first).
    Partial checkpoints newer than the choice are named in a warning.
    """
    if step is not None:
        matches = [i for i in infos if i.step == step]
        candidates = [i for i in reversed(matches) if i.complete]
        if not candidates:
            why = "; ".join(p for i in matches for p in i.problems) or "no such directory"
            raise CheckpointNotFoundError(
                f"There is no complete checkpoint of step {step} under {volume.display_url} "
                f"({why}). Fix: pick a step from `dcp-volumes ls`, or pass step=None for the "
                "newest complete one."
            )
    else:
        candidates = [i for i in reversed(infos) if i.complete]
    for info in candidates:
        if verify:
            problems = verify_checkpoint(volume.child(info.name))
            if problems:
                logger.warning("skipping checkpoint %s: it fails verification (%s)",
                               info.url, "; ".join(problems[:5]))
                continue
        for partial in (i for i in infos if not i.complete and i.step > info.step):
            logger.warning("skipping partial checkpoint %s: %s", partial.url,
                           "; ".join(partial.problems[:3]))
        return info
    if step is not None:
        raise CheckpointCorruptError(
            f"The checkpoint of step {step} under {volume.display_url} fails verification "
            "(see the warnings above). Fix: restore another step, or run `dcp-volumes verify`."
        )
    return None


def read_metadata(volume: Volume, name: str = METADATA_NAME) -> Any:
    """The DCP ``Metadata`` object of the checkpoint at ``volume`` (``name``: a rank's marker).

    ``.metadata`` is a pickle, as DCP writes it; it is unpickled with an
    allow-list of DCP's metadata types (``_metadata_pickle.py``), so a hostile
    checkpoint cannot run code when it is listed or inspected.
    """
    if not volume.exists(name):
        raise CheckpointNotFoundError(
            f"{volume.display_url} has no {name}: it is not a committed DCP "
            "checkpoint. Fix: pass the URL of a checkpoint directory (see `dcp-volumes ls`)."
        )
    data = volume.read_bytes(name)
    return loads_metadata(data, redact_url(volume.url_of(name)))


def check_storage_refs(
    volume: Volume, metadata: Any, listing: Sequence[FileInfo], marker: str = METADATA_NAME
) -> list[str]:
    """Problems with the files ``marker`` (``.metadata``) points into (missing, or too short)."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return []
    sizes = {f.path: f.size for f in listing}
    needed: dict[str, int] = {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        rel = _layout.inside(str(rel), f"{volume.display_url}/{marker}")
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[rel] = max(needed.get(rel, 0), end)
    problems = []
    for rel, end in sorted(needed.items()):
        if rel not in sizes:
            problems.append(f"{rel}: missing (referenced by {marker})")
        elif sizes[rel] < end:
            problems.append(f"{rel}: {sizes[rel]} bytes, {marker} needs {end}")
    return problems


def verify_checkpoint(
    volume: Volume,
    *,
    checksums: bool = True,
    progress: Callable[[int], None] | None = None,
    concurrency: int = 8,
) -> list[str]:
    """Problems found in the checkpoint at ``volume`` (empty list: it is sound).

    Checks the commit marker, that every file ``.metadata`` references is
    there and long enough, the manifest's file set and sizes and, with
    ``checksums``, every file's checksum (downloading it).
    """
    listing = volume.list("")
    names = {f.path for f in listing}
    problems: list[str] = []
    rank_local = is_rank_local(names)
    if rank_local:
        markers = sorted(n for n in names if marker_rank(n) is not None)
        manifest_names = sorted(n for n in names if manifest_rank(n) is not None)
    else:
        markers = [METADATA_NAME] if METADATA_NAME in names else []
        manifest_names = [MANIFEST_NAME] if MANIFEST_NAME in names else []
        if not markers:
            problems.append(f"{METADATA_NAME}: missing (the checkpoint was never committed)")
    for marker in markers:
        try:
            metadata = read_metadata(volume, marker)
            problems.extend(check_storage_refs(volume, metadata, listing, marker))
        except CheckpointCorruptError as exc:
            problems.append(f"{marker}: {exc}")
    world = 0
    for manifest_name in manifest_names:
        try:
            manifest = Manifest.from_json(
                volume.read_bytes(manifest_name), where=volume.url_of(manifest_name)
            )
        except (CheckpointCorruptError, CheckpointVersionError) as exc:
            problems.append(f"{manifest_name}: {exc}")
            continue
        recorded = manifest.extra.get("world_size")
        if isinstance(recorded, int):
            world = max(world, recorded)
        listed = check_listing(manifest, listing)
        problems.extend(listed)
        if checksums:
            bad = {p.split(":", 1)[0] for p in listed}
            present = [n for n in manifest.files if n not in bad]
            problems.extend(
                verify_checksums(
                    volume, manifest, names=present, concurrency=concurrency,
                    progress=progress,
                )
            )
    if rank_local:
        ranks, missing = expected_ranks(names, world)
        if missing:
            problems.insert(0, missing_ranks_problem(ranks, missing))
    if not manifest_names:
        logger.debug("%s has no manifest: checksums not verified", volume.display_url)
    return problems
