"""``dcp-volumes``: list, verify, prune and inspect checkpoints on a volume.

Subcommands are small functions registered in one table (``COMMANDS``) with
``@command``; adding one (``demo``, ``bench``) takes a function and a decorator::

    @command("ls", "list the checkpoints under a root")
    def _ls(args, out): ...              # returns the exit code
    _ls.configure = lambda p: p.add_argument("url")

Exit codes: 0 success, 1 failure (a checksum mismatch, an unreachable
volume, nothing to verify...), 2 usage or configuration error, 141 (as a
process killed by SIGPIPE) when stdout is closed early (``... | head``), quietly.
Errors are one line on stderr, never a traceback. ``--json`` prints one JSON
document on stdout for scripts. Progress bars go to stderr, on a terminal only.
Storage options (endpoint, credentials) come from ``--storage-options JSON``
or the ``DCP_VOLUMES_STORAGE_OPTIONS`` environment variable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from dcp_volumes import _env
from dcp_volumes._exceptions import (
    BackendNotInstalledError,
    CheckpointNotFoundError,
    ConfigurationError,
    DcpVolumesError,
)
from dcp_volumes._extras import BENCH_MODULES, require
from dcp_volumes._progress import progress_bar
from dcp_volumes._sizes import format_size
from dcp_volumes._volume import Volume, redact_url
from dcp_volumes.checkpoint._discovery import (
    NO_STEP,
    CheckpointInfo,
    inspect_dir,
    parse_step,
    read_metadata,
    scan,
    verify_checkpoint,
)
from dcp_volumes.checkpoint._layout import (
    MANIFEST_NAME,
    METADATA_NAME,
    manifest_rank,
    rank_manifest_name,
    rank_metadata_name,
)
from dcp_volumes.checkpoint._local_tier import LocalTier
from dcp_volumes.checkpoint._manifest import Manifest
from dcp_volumes.checkpoint._retention import (
    DEFAULT_PARTIAL_GRACE_S,
    delete_checkpoint,
    retention_victims,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
#: Exit code when stdout was closed early: a shell's code for a process killed by SIGPIPE.
EXIT_CLOSED_STDOUT = 128 + signal.SIGPIPE.value

Handler = Callable[[argparse.Namespace, "Output"], int]


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, argument setup and handler."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Handler


#: Every subcommand, by name, in the order ``--help`` shows them.
COMMANDS: dict[str, Command] = {}


def command(
    name: str, help: str, configure: Callable[[argparse.ArgumentParser], None] | None = None
) -> Callable[[Handler], Handler]:
    """Register ``fn(args, out) -> exit code`` as the subcommand ``name``."""

    def register(fn: Handler) -> Handler:
        COMMANDS[name] = Command(name, help, configure or (lambda p: None), fn)
        return fn

    return register


class Output:
    """Where results go: text or one JSON document on stdout, progress on stderr.

    ``progress``: bars are wanted (no ``--no-progress``); they are drawn only when
    stderr is a terminal.
    """

    def __init__(self, *, as_json: bool, progress: bool, stream: IO[str] | None = None) -> None:
        self.as_json = as_json
        self.progress = progress
        self.stream = stream or sys.stdout

    def line(self, text: str = "") -> None:
        if not self.as_json:
            print(text, file=self.stream)

    def json(self, doc: Any) -> None:
        if self.as_json:
            json.dump(doc, self.stream, indent=1, sort_keys=True)
            self.stream.write("\n")

    def bar(self, *, total: int, desc: str, unit: str = "B") -> Any:
        return progress_bar(total=total, desc=desc, unit=unit, enabled=self.progress)


# -- helpers --------------------------------------------------------------------------------


def _storage_options(text: str | None) -> dict[str, Any]:
    if text is None:
        return _env.storage_options()
    return _env.parse_options(text, "--storage-options") if text else {}


def _volume(args: argparse.Namespace, url: str) -> Volume:
    return Volume(url, storage_options=_storage_options(args.storage_options))


def human_age(created: float | None, now: float | None = None) -> str:
    """Seconds since ``created`` as ``42s``, ``5m``, ``3h``, ``2d``."""
    if created is None:
        return "-"
    age = max(0.0, (now if now is not None else time.time()) - created)
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if age < limit:
            return f"{age / div:.0f}{unit}"
    return f"{age / 86400:.0f}d"


def _step(info: CheckpointInfo | None) -> int | None:
    """The step for JSON: ``None`` when the directory name carries none."""
    return None if info is None or info.step == NO_STEP else info.step


def _step_text(info: CheckpointInfo | None) -> str:
    step = _step(info)
    return "-" if step is None else str(step)


def _info_doc(info: CheckpointInfo) -> dict[str, Any]:
    return {
        "step": _step(info),
        "name": info.name,
        "url": redact_url(info.url),
        "complete": info.complete,
        "size": info.size,
        "files": info.num_files,
        "created": info.created,
        "managed": info.managed,
        "rank_local": info.rank_local,
        "ranks": info.ranks,
        "problems": list(info.problems),
    }


def _table(rows: Sequence[Sequence[str]], out: Output, *, right: Sequence[int] = ()) -> None:
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.line("  ".join(cells).rstrip())


def _split(vol: Volume) -> tuple[Volume | None, str]:
    """The parent volume of ``vol`` and ``vol``'s last path component."""
    parent_url, _, last = vol.url.rstrip("/").rpartition("/")
    if not parent_url or (vol.bucket is not None and "/" not in vol.root):
        return None, last  # a bucket root has no parent to list
    return Volume(parent_url, storage_options=vol.storage_options, retry=vol.retry), last


def _checkpoints_at(vol: Volume) -> tuple[list[tuple[Volume, CheckpointInfo | None]], bool]:
    """The checkpoint(s) a URL names: itself, ``root/<step>``, or every one in a root.

    Returns ``([(volume, info)], single)``; ``single`` is True when the URL named one
    checkpoint (a directory, or a step number under a root).
    """
    parent, last = _split(vol)
    step = parse_step(last)
    is_checkpoint = any(vol.exists(n) for n in (
        METADATA_NAME, MANIFEST_NAME, rank_metadata_name(0), rank_manifest_name(0)))
    if is_checkpoint or (step is not None and parent is not None and vol.list("")):
        # A checkpoint directory, committed or not (its name may not carry a step).
        info = (inspect_dir(parent, last, NO_STEP if step is None else step)
                if parent is not None else None)
        return [(vol, info)], True
    if step is not None and parent is not None:
        matches = [i for i in scan(parent) if i.step == step]
        if matches:
            best = sorted(matches, key=lambda i: (i.complete, i.name.startswith("step-")))[-1]
            return [(parent.child(best.name), best)], True
        raise CheckpointNotFoundError(
            f"No checkpoint of step {step} under {parent.display_url}. Fix: pick one from "
            f"`dcp-volumes ls {parent.display_url}`."
        )
    vol.check_root()
    return [(vol.child(i.name), i) for i in scan(vol, unnumbered=True)], False


def _single(vol: Volume) -> tuple[Volume, CheckpointInfo | None]:
    found, single = _checkpoints_at(vol)
    if not single:
        raise CheckpointNotFoundError(
            f"{vol.display_url} is not a checkpoint (no {METADATA_NAME}). Fix: name one "
            f"checkpoint, e.g. {vol.display_url}/<step> (see `dcp-volumes ls`)."
        )
    return found[0]


# -- ls -------------------------------------------------------------------------------------


def _add_local_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local-dir", metavar="DIR", default=None,
                   help="this node's local tier (CheckpointManager's local_dir, or its "
                        "`local_dir` property): also show which checkpoints it holds on local "
                        "disk and which other nodes' replicas (local_replicas) it keeps")


def _local_tier(args: argparse.Namespace) -> LocalTier | None:
    if args.local_dir is None:
        return None
    directory = os.path.abspath(os.path.expanduser(args.local_dir))
    if not os.path.isdir(directory):
        raise ConfigurationError(
            f"--local-dir {args.local_dir}: no such directory. Fix: pass the local tier's "
            "directory (CheckpointManager(local_dir=...), or its local_dir property)."
        )
    return LocalTier(directory, owner=False)


def _held_doc(tier: LocalTier, name: str) -> dict[str, Any]:
    held = tier.held(name)
    return {what: {"files": files, "bytes": size} for what, (files, size) in held.items()}


def _held_text(held: dict[str, Any]) -> tuple[str, str]:
    """(LOCAL, REPLICAS) cells: this node's own copy, and the nodes whose replicas it keeps."""
    own = held.get("own")
    local = f"{own['files']} files, {format_size(own['bytes'])}" if own else "-"
    replicas = ", ".join(f"{what} ({d['files']} files)" for what, d in held.items()
                         if what != "own")
    return local, replicas or "-"


def _configure_ls(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="root URL of a run (s3://bucket/run1, /mnt/ckpt/run1, ...)")
    _add_local_dir(p)


@command("ls", "list the checkpoints under a root: step, complete or partial, size, age",
         _configure_ls)
def _ls(args: argparse.Namespace, out: Output) -> int:
    vol = _volume(args, args.url)
    vol.check_root()
    # With the checkpoints whose directory name carries no step (STEP "-", JSON null):
    # they load and verify like any other; only the manager's retention skips them.
    infos = scan(vol, unnumbered=True)
    tier = _local_tier(args)
    held = {i.name: _held_doc(tier, i.name) for i in infos} if tier is not None else {}
    doc: dict[str, Any] = {"url": vol.display_url, "checkpoints": [
        {**_info_doc(i), **({"held": held[i.name]} if tier is not None else {})} for i in infos
    ]}
    if tier is not None:
        doc["local_dir"] = tier.directory
    out.json(doc)
    if not infos:
        out.line(f"no checkpoints under {vol.display_url}")
        return EXIT_OK
    now = time.time()
    rows = [["STEP", "STATUS", "SIZE", "FILES", "AGE",
             *(["LOCAL", "REPLICAS"] if tier is not None else []), "NAME"]]
    for i in infos:
        rows.append([
            _step_text(i),
            "complete" if i.complete else "partial",
            format_size(i.size),
            str(i.num_files if i.num_files is not None else "-"),
            human_age(i.created, now),
            *(_held_text(held[i.name]) if tier is not None else ()),
            i.name + ("" if i.managed else "  (stock DCP)" if i.complete else "")
            + (f"  (rank-local, {i.ranks} ranks)" if i.rank_local else ""),
        ])
    _table(rows, out, right=(0, 2, 3, 4))
    if tier is not None:
        out.line(f"LOCAL: this node's copy in {tier.directory}; REPLICAS: other nodes' "
                 "files it keeps (a restore after their loss reads them from here)")
    return EXIT_OK


# -- verify ---------------------------------------------------------------------------------


def _configure_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="a checkpoint (ROOT/step-00000100, ROOT/100) or a root "
                               "(verifies every complete checkpoint in it)")
    p.add_argument("--concurrency", type=int, default=8, help="parallel downloads (default 8)")
    p.add_argument("--allow-empty", action="store_true",
                   help="exit 0 when there is no complete checkpoint to verify (default: exit 1, "
                        "so that a wrong path fails a CI job)")
    _add_encryption_key(p)


def _add_encryption_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encryption-key-file", metavar="FILE", default=None,
                   help="the key of a checkpoint saved with encryption= (32 bytes, or their "
                        "base64); default: DCP_VOLUMES_ENCRYPTION_KEY, if set")


def _encryption_lines(args: argparse.Namespace, cvol: Volume, metadata: Any | None,
                      *, check: bool, progress: Callable[[int], Any] | None = None
                      ) -> tuple[list[str], str, list[str]]:
    """For an encrypted checkpoint: (its key ids, a line saying so, the problems found by
    authenticating every item when a key was given and ``check``); nothing otherwise."""
    if metadata is None:
        return [], "", []
    from dcp_volumes.checkpoint._encryption_check import authenticate, encryption_for, key_ids

    ids = key_ids(metadata)
    if not ids:
        return [], "", []
    enc = encryption_for(args.encryption_key_file, ids)
    named = f"encrypted, key id {', '.join(ids)}"
    if enc is None:
        return ids, (f"{named} (no key given: pass --encryption-key-file or set "
                     f"{_env.ENCRYPTION_KEY} to read or authenticate it)"), []
    if not check:
        return ids, f"{named} (key given)", []
    problems = authenticate(cvol, metadata, enc, progress)
    return ids, f"{named}: {'every item authenticated' if not problems else 'FAILED'}", problems


@command("verify", "download a checkpoint and check every file's checksum", _configure_verify)
def _verify(args: argparse.Namespace, out: Output) -> int:
    if args.concurrency < 1:
        raise ConfigurationError("--concurrency must be >= 1.")
    vol = _volume(args, args.url)
    targets, single = _checkpoints_at(vol)
    results = []
    failed = 0
    for cvol, info in targets:
        if not single and info is not None and not info.complete:
            results.append({"url": cvol.display_url, "step": _step(info), "status": "skipped",
                            "problems": list(info.problems)})
            out.line(f"SKIPPED  {cvol.display_url}  (partial: {'; '.join(info.problems[:2])})")
            continue
        listing = cvol.list("")
        total = sum(f.size for f in listing)
        hashed = 0
        checksummed = False
        for f in listing:
            if f.path == MANIFEST_NAME or manifest_rank(f.path) is not None:
                try:  # a rank-local checkpoint has one manifest per rank
                    hashed += Manifest.from_json(cvol.read_bytes(f.path)).total_bytes
                    checksummed = True
                except DcpVolumesError:
                    pass  # verify_checkpoint reports the unreadable manifest
        with out.bar(total=hashed, desc=cvol.display_url.rsplit("/", 1)[-1]) as bar:
            problems = verify_checkpoint(cvol, concurrency=args.concurrency, progress=bar.update)
        encrypted: list[str] = []
        sealed_note = ""
        if not problems and cvol.exists(METADATA_NAME):
            encrypted, sealed_note, sealed = _encryption_lines(
                args, cvol, read_metadata(cvol, METADATA_NAME), check=True)
            problems = problems + sealed
        status = "failed" if problems else "ok"
        failed += bool(problems)
        results.append({"url": cvol.display_url, "step": _step(info),
                        "status": status, "checksums": checksummed, "bytes": total,
                        "problems": problems, "encryption_key_ids": encrypted})
        note = "" if checksummed else "  (no manifest: structure checked, no checksums)"
        out.line(f"{status.upper():8} {cvol.display_url}  {format_size(total)}{note}")
        if sealed_note:
            out.line(f"    {sealed_note}")
        for problem in problems:
            out.line(f"    {problem}")
    verified = sum(r["status"] != "skipped" for r in results)
    empty = verified == 0 and not args.allow_empty
    out.json({"url": vol.display_url, "ok": failed == 0 and not empty, "checkpoints": results})
    if verified == 0:
        skipped = len(results)
        why = (f"no complete checkpoint under {vol.display_url} ({skipped} partial skipped)"
               if skipped else f"no checkpoints under {vol.display_url}")
        if args.allow_empty:
            out.line(why)
            return EXIT_OK
        _error(args.command, f"nothing verified: {why}. Fix: pass a checkpoint or a run root "
                             "(`dcp-volumes ls` lists them), or --allow-empty when an empty "
                             "root is fine.")
        return EXIT_FAILURE
    return EXIT_FAILURE if failed else EXIT_OK


# -- gc -------------------------------------------------------------------------------------


def _configure_gc(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="root URL of a run")
    p.add_argument("--keep-last", type=int, required=True, metavar="N",
                   help="keep the newest N complete checkpoints (N >= 1)")
    p.add_argument("--dry-run", action="store_true", help="show what would be deleted")
    p.add_argument("--partial-grace", type=float, default=DEFAULT_PARTIAL_GRACE_S,
                   metavar="SECONDS",
                   help="keep partial checkpoints written to within this many seconds: a "
                        "job may still be saving them (default: %(default)s)")


@command("gc", "delete old checkpoints, keeping the newest N complete ones", _configure_gc)
def _gc(args: argparse.Namespace, out: Output) -> int:
    if args.keep_last < 1:
        raise ConfigurationError(
            f"--keep-last {args.keep_last}: must be >= 1 (the newest complete checkpoint is "
            "always kept)."
        )
    vol = _volume(args, args.url)
    vol.check_root()
    infos = scan(vol)
    if args.partial_grace < 0:
        raise ConfigurationError(f"--partial-grace {args.partial_grace}: must be >= 0 seconds.")
    victims = retention_victims(infos, keep_last=args.keep_last,
                                partial_grace_s=args.partial_grace)
    gone = {v.name for v in victims}
    kept = [i for i in infos if i.name not in gone]
    verb = "would delete" if args.dry_run else "deleted"
    done: list[CheckpointInfo] = []
    if not args.dry_run:
        with out.bar(total=len(victims), desc="deleting", unit="ckpt") as bar:
            for info in victims:
                delete_checkpoint(vol, info.name)
                done.append(info)
                bar.update(1)
    for info in victims:
        out.line(f"{verb}  {info.name}  ({'complete' if info.complete else 'partial'}, "
                 f"{format_size(info.size)})")
    out.line(f"{verb} {len(victims)}, kept {len(kept)} under {vol.display_url}")
    out.json({
        "url": vol.display_url,
        "dry_run": bool(args.dry_run),
        "deleted": [] if args.dry_run else [_info_doc(i) for i in done],
        "would_delete": [_info_doc(i) for i in victims] if args.dry_run else [],
        "kept": [_info_doc(i) for i in kept],
    })
    return EXIT_OK


# -- inspect --------------------------------------------------------------------------------


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="a checkpoint: ROOT/step-00000100 or ROOT/100")
    p.add_argument("--rank", type=int, default=None,
                   help="for a rank-local checkpoint (use_collectives=False): the rank whose "
                        "__<rank>.metadata to show (default 0)")
    _add_local_dir(p)
    _add_encryption_key(p)


def _entries(metadata: Any) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = []
    for name, meta in sorted(getattr(metadata, "state_dict_metadata", {}).items()):
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            shape = [int(d) for d in meta.size]
            numel = 1
            for d in shape:
                numel *= d
            entries.append({
                "name": name, "kind": "tensor", "dtype": str(dtype).removeprefix("torch."),
                "shape": shape, "chunks": len(meta.chunks),
                "nbytes": numel * dtype.itemsize,
            })
        else:
            entries.append({"name": name, "kind": "bytes", "dtype": None, "shape": None,
                            "chunks": None, "nbytes": None})
    return entries


@command("inspect", "show tensor names, shapes and dtypes of a checkpoint", _configure_inspect)
def _inspect(args: argparse.Namespace, out: Output) -> int:
    cvol, info = _single(_volume(args, args.url))
    rank_local = info is not None and info.rank_local
    if args.rank is not None and not rank_local:
        raise ConfigurationError(
            f"--rank {args.rank}: {cvol.display_url} was saved with collectives (one "
            f"{METADATA_NAME} for all ranks); --rank applies to rank-local checkpoints only. "
            "Fix: leave --rank out."
        )
    rank = (args.rank or 0) if rank_local else None
    if rank is not None and info is not None and not 0 <= rank < (info.ranks or 0):
        raise ConfigurationError(
            f"--rank {rank}: {cvol.display_url} is a rank-local checkpoint of {info.ranks} "
            f"ranks. Fix: pass --rank between 0 and {(info.ranks or 1) - 1}."
        )
    marker = METADATA_NAME if rank is None else rank_metadata_name(rank)
    metadata = read_metadata(cvol, marker)
    entries = _entries(metadata)
    tensor_bytes = sum(e["nbytes"] or 0 for e in entries)
    # What the data files hold: items' stored lengths, and the stream transforms
    # (e.g. stream.zstd/1 for compression) they were written with.
    stored = list((getattr(metadata, "storage_data", None) or {}).values())
    stored_bytes = sum(int(getattr(i, "length", 0) or 0) for i in stored)
    from dcp_volumes.checkpoint._encryption_check import transform_name

    transforms = sorted(
        {"+".join(map(transform_name, getattr(i, "transform_descriptors", None) or ()))
         for i in stored} - {""}
    )
    key_ids, sealed_note, _ = _encryption_lines(args, cvol, metadata, check=False)
    tier = _local_tier(args)
    name = cvol.url.rstrip("/").rsplit("/", 1)[-1]
    held = _held_doc(tier, name) if tier is not None else None
    out.json({"url": cvol.display_url, "step": _step(info),
              "complete": info.complete if info else None,
              "rank_local": rank_local, "rank": rank, "ranks": info.ranks if info else None,
              "tensor_bytes": tensor_bytes, "stored_bytes": stored_bytes,
              "transforms": transforms, "encryption_key_ids": key_ids, "entries": entries,
              **({"local_dir": tier.directory, "held": held} if tier is not None else {})})
    how = f" ({', '.join(transforms)})" if transforms else ""
    scope = f"  rank {rank} of {info.ranks} (rank-local)" if rank is not None and info else ""
    out.line(f"{cvol.display_url}  step {_step_text(info)}  "
             f"{'complete' if info is None or info.complete else 'PARTIAL'}{scope}  "
             f"{len(entries)} entries, {format_size(tensor_bytes)} of tensors, "
             f"{format_size(stored_bytes)} stored{how}")
    if sealed_note:
        out.line(sealed_note)
    if tier is not None and held is not None:
        local, replicas = _held_text(held)
        out.line(f"local tier {tier.directory}: own copy {local}; replicas kept: {replicas}")
    rows = [["NAME", "DTYPE", "SHAPE", "CHUNKS"]]
    for e in entries:
        if e["kind"] == "tensor":
            rows.append([e["name"], e["dtype"], "x".join(map(str, e["shape"])) or "scalar",
                         str(e["chunks"])])
        else:
            rows.append([e["name"], "(object)", "-", "-"])
    _table(rows, out, right=(3,))
    return EXIT_OK


# -- export (Hugging Face safetensors) -------------------------------------------------------


def _configure_export(p: argparse.ArgumentParser) -> None:
    from dcp_volumes.safetensors._cli import configure

    configure(p)


@command("export", "write a checkpoint's model as Hugging Face safetensors files (no local copy)",
         _configure_export)
def _export(args: argparse.Namespace, out: Output) -> int:
    from dcp_volumes.safetensors._cli import run

    doc = run(args, _storage_options(args.storage_options), out.bar)
    out.json(doc)
    out.line(f"exported {doc['summary']} to {redact_url(args.dest)}")
    return EXIT_OK


# -- entry point ----------------------------------------------------------------------------


def _configure_demo(p: argparse.ArgumentParser) -> None:
    from dcp_volumes.demo import add_arguments

    add_arguments(p)


@command("demo", "goodput demo: training through repeated crashes, before/after, measured",
         _configure_demo)
def _demo(args: argparse.Namespace, out: Output) -> int:
    from dcp_volumes.demo import config_from_args
    from dcp_volumes.demo._launcher import run_demo

    cfg = config_from_args(args, _storage_options(args.storage_options))

    def say(text: str) -> None:
        if not out.as_json:
            from tqdm import tqdm  # type: ignore[import-untyped]

            tqdm.write(text, file=out.stream)  # keeps the progress bar below the lines

    report = run_demo(cfg, say, progress=out.progress)
    out.json(report.to_json())
    out.line()
    out.line(f"$ {report.command}")
    out.line(report.table)
    out.line()
    for check in report.checks:
        out.line(f"{'PASS' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    crashed = report.runs["dcp_volumes"]
    out.line(f"restart cost (new interpreters, torch import, rendezvous, restore), set apart "
             f"above: {crashed.restart:.1f} s over {len(crashed.crashes)} restart(s), "
             f"start-up {crashed.startup:.1f} s")
    out.line()
    out.line(f"report: {report.json_path}")
    out.line(f"timeline: {report.plot_path or '(not drawn: matplotlib is not installed)'}")
    out.line(f"logs: {report.workdir}/runs/*/node-*.log")
    out.line(f"demo {'PASSED' if report.ok else 'FAILED'} in {report.seconds:.0f}s")
    return EXIT_OK if report.ok else EXIT_FAILURE


def _configure_goodput(p: argparse.ArgumentParser) -> None:
    from dcp_volumes.goodput._cli import configure

    configure(p)


@command("goodput", "where a job's wall time went: compute, checkpoints, input, restarts, "
         "lost work (from the records the manager keeps in ROOT/goodput/)", _configure_goodput)
def _goodput(args: argparse.Namespace, out: Output) -> int:
    from dcp_volumes.goodput._cli import run

    report, doc = run(args, _storage_options(args.storage_options), out.line, out.as_json)
    out.json(doc)
    return EXIT_OK if report.attempts else EXIT_FAILURE


def _benchmarks_cli() -> Any:
    """``benchmarks.cli`` of the repository checkout, or None outside one.

    The suite is not in the wheel: it lives in ``benchmarks/`` of a checkout,
    beside ``testkit/`` (its emulator launchers). Found on ``sys.path``, in the
    working directory, or beside this package (an editable install).
    """
    import importlib
    from pathlib import Path

    roots = [Path.cwd(), Path(__file__).resolve().parent.parent]
    for root in roots:
        suite = root / "benchmarks" / "cli.py"
        if suite.is_file() and (root / "testkit" / "emulators.py").is_file():
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            break
    else:
        return None
    return importlib.import_module("benchmarks.cli")


def _configure_bench(p: argparse.ArgumentParser) -> None:
    try:
        bench = _benchmarks_cli()
    except ImportError:  # the [bench] extra is missing: `dcp-volumes bench` says so
        bench = None
    if bench is None:
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        return
    bench.add_arguments(p)


@command("bench", "benchmark suite: checkpoints and data against peers and floors "
         "(from a repository checkout)", _configure_bench)
def _bench(args: argparse.Namespace, out: Output) -> int:
    require("bench", BENCH_MODULES, needed_for="dcp-volumes bench")
    bench = _benchmarks_cli()
    if bench is None or not hasattr(args, "suite"):
        raise ConfigurationError(
            "dcp-volumes bench runs from a repository checkout: its benchmarks/ and testkit/ "
            "(the emulators) are not in the installed package; clone the repository and run "
            "`dcp-volumes bench ...` (or `python -m benchmarks ...`) in its root"
        )
    try:
        return int(bench.run(args, bench.to_argv(args), out.stream))
    except (bench.TargetError, ValueError) as exc:  # a target or matrix that cannot run
        raise ConfigurationError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-options", metavar="JSON", default=None,
                        help="fsspec options as a JSON object (endpoint, credentials); "
                             f"default: ${_env.STORAGE_OPTIONS}")
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument("--no-progress", action="store_true", help="no progress bars")
    common.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser = argparse.ArgumentParser(
        prog="dcp-volumes",
        description="Inspect and maintain torch.distributed.checkpoint checkpoints on "
                    "S3, GCS, Azure Blob, network mounts and any fsspec URL.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, parents=[common])
        cmd.configure(p)
        p.set_defaults(handler=cmd.run)
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 2000 else text[:2000] + "..."


def _error(command: str, text: str) -> None:
    print(f"dcp-volumes {command}: error: {text}", file=sys.stderr)


def _stdout_closed() -> int:
    """Leave quietly after the reader of stdout went away (``dcp-volumes ls | head``).

    As the Python docs recommend for SIGPIPE: point stdout at /dev/null, so that
    the interpreter's last flush at exit finds nowhere to fail, and exit with
    the code of a process killed by SIGPIPE, as other command-line tools do.
    """
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no real fd (a test's)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_CLOSED_STDOUT


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on usage errors, as argparse does
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    progress = not args.no_progress
    out = Output(as_json=args.json, progress=progress)
    try:
        code = int(args.handler(args, out))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        # The volume layer turns its own errors into DcpVolumesError: a bare
        # EPIPE reaching here is a write to stdout whose reader went away.
        return _stdout_closed()
    except (ConfigurationError, BackendNotInstalledError) as exc:
        _error(args.command, _one_line(exc))
        return EXIT_USAGE
    except (DcpVolumesError, OSError) as exc:
        _error(args.command, _one_line(exc))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"dcp-volumes {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
