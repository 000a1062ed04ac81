"""``export_safetensors``: a committed DCP checkpoint to the Hugging Face layout on a volume.

The checkpoint is read with ``VolumeReader`` (ours or stock DCP, any number of
ranks: its ``.metadata`` through the restricted unpickler, each item's bytes by
ranged reads in parallel, DTensor/ShardedTensor chunks assembled by DCP's
planner); nothing here parses DCP's byte format. Each output file is built in
the staging area (at most two at once: one assembled while the previous one
uploads), from loads of at most ``window`` bytes of whole tensors, and handed
to ``Volume.put_file`` (multipart, from the file). The index is published last,
create-only: a crashed export leaves no index, and an existing one is replaced
only with ``overwrite=True`` (it is deleted first, so a crash then leaves none).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_volumes._exceptions import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
)
from dcp_volumes._sizes import parse_size
from dcp_volumes._staging_disk import StagingArea
from dcp_volumes._volume import Volume, redact_url, write_all
from dcp_volumes.safetensors._format import SafetensorsError, layout
from dcp_volumes.safetensors._index import (
    INDEX_NAME,
    Planned,
    file_name,
    index_document,
    split_into_files,
)

logger = logging.getLogger("dcp_volumes.safetensors")

#: The default largest output file (transformers' own default is 50GB; 5GB is the Hub's habit).
DEFAULT_MAX_SHARD_SIZE = "5GB"
# How many bytes of source tensors one load asks the reader for (a tensor larger
# than this is loaded alone): with one output file on disk, what the export holds.
_WINDOW_BYTES = 128 * 2**20
_METADATA = {"format": "pt"}

#: The output head and the input embeddings it is tied to in transformers' models
#: (``_tied_weights_keys`` under ``tie_word_embeddings=True``): Llama/Mistral/Qwen, GPT-2.
TIED_HEAD = "lm_head.weight"
TIED_EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight")

_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The floating dtype to cast floating tensors to (``None``: keep each tensor's)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and not dtype.is_floating_point:
            raise ConfigurationError(f"dtype={dtype}: only a floating dtype can be cast to.")
        return dtype
    found = _DTYPE_NAMES.get(str(dtype).lower().removeprefix("torch."))
    if found is None or str(dtype).lower() in ("none", "keep"):
        if str(dtype).lower() in ("none", "keep"):
            return None
        raise ConfigurationError(
            f"dtype={dtype!r} is not a floating dtype. Fix: use one of "
            f"{', '.join(sorted(_DTYPE_NAMES))}, or None to keep each tensor's dtype."
        )
    return found


def out_dtype(saved: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """A tensor's dtype in the output: ``cast`` for floating tensors, else its own."""
    return cast if cast is not None and saved.is_floating_point else saved


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: the files (name -> tensors), total tensor bytes, the index URL."""

    files: dict[str, list[str]]
    total_size: int
    index_url: str


@dataclass(frozen=True)
class _Source:
    fqn: str  # the checkpoint's name
    name: str  # the output's name
    saved: torch.dtype
    dtype: torch.dtype
    shape: tuple[int, ...]


def _select(metadata: Metadata, prefix: str, cast: torch.dtype | None, where: str) -> list[_Source]:
    chosen = []
    skipped = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        if not isinstance(md, TensorStorageMetadata):
            skipped += 1
            logger.debug("export: %s is not a tensor (bytes or an object): skipped", fqn)
            continue
        saved = md.properties.dtype
        chosen.append(_Source(fqn, fqn[len(prefix):], saved, out_dtype(saved, cast),
                              tuple(int(d) for d in md.size)))
    if not chosen:
        names = sorted(metadata.state_dict_metadata)[:5]
        raise ConfigurationError(
            f"No tensor of {where} has a name starting with prefix={prefix!r} (its names "
            f"begin {names}). Fix: pass the prefix the model's keys carry (e.g. 'model.' for "
            "a state saved as {'model': model.state_dict()}), or prefix='' for every tensor."
        )
    if skipped:
        logger.debug("export: %d non-tensor item(s) under %r skipped", skipped, prefix)
    return chosen


def _drop_tied(sources: list[_Source], loader: _Loader) -> list[_Source]:
    """``sources`` without the tied head, as ``save_pretrained`` writes a tied model:
    ``lm_head.weight`` is dropped when an input embedding of ``TIED_EMBEDDINGS`` is
    exported too, with the same shape and dtype and bit-identical values."""
    by_name = {s.name: s for s in sources}
    head = by_name.get(TIED_HEAD)
    if head is None:
        return sources
    for name in TIED_EMBEDDINGS:
        emb = by_name.get(name)
        if emb is None or (emb.shape, emb.saved) != (head.shape, head.saved):
            continue
        loaded = loader.load([head, emb])
        if torch.equal(loaded[head.fqn], loaded[emb.fqn]):
            logger.info("export: %s is tied to %s (identical): written once, as "
                        "save_pretrained does", head.name, emb.name)
            return [s for s in sources if s is not head]
    return sources


def _groups(tensors: Sequence[_Source], window: int) -> Iterator[list[_Source]]:
    group: list[_Source] = []
    size = 0
    for t in tensors:
        nbytes = _numel(t.shape) * t.saved.itemsize
        if group and size + nbytes > window:
            yield group
            group, size = [], 0
        group.append(t)
        size += nbytes
    if group:
        yield group


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Loader:
    """Whole tensors from a checkpoint through ``VolumeReader`` and DCP's load planner,
    one process, each reader set up once (no second read of ``.metadata``).

    A checkpoint committed with ``.metadata`` has one reader; a rank-local one
    (``use_collectives=False``) one per rank, each with that rank's
    ``__<rank>.metadata`` and manifest: every load asks each of them for the
    chunks its rank saved, into the same whole tensors."""

    def __init__(self, parts: Sequence[tuple[Any, Metadata, int | None]]) -> None:
        self._parts = parts
        for reader, metadata, rank in parts:
            if rank is None:
                reader.set_up_storage_reader(metadata, True)
            else:
                reader.set_up_storage_reader(metadata, True, rank=rank, use_collectives=False)

    def load(self, tensors: Sequence[_Source]) -> dict[str, torch.Tensor]:
        state = {t.fqn: torch.empty(t.shape, dtype=t.saved) for t in tensors}
        partial = len(self._parts) > 1  # a rank's marker may lack a tensor others hold
        for reader, metadata, _ in self._parts:
            planner = DefaultLoadPlanner(allow_partial_load=partial)
            planner.set_up_planner(state, metadata, True)
            plan = reader.prepare_local_plan(planner.create_local_plan())
            plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
            reader.read_data(planner.finish_plan(plan), planner).wait()
        return state


def _open(src: str | os.PathLike[str], storage_options: Mapping[str, Any] | None,
          ) -> tuple[list[tuple[Any, Metadata, int | None]], Metadata, str]:
    """The checkpoint's readers (one, or one per rank of a rank-local checkpoint), the
    metadata of all its tensors, and its URL as messages show it."""
    from dcp_volumes.checkpoint._discovery import expected_ranks, is_rank_local
    from dcp_volumes.checkpoint._reader import VolumeReader

    reader = VolumeReader(src, storage_options=storage_options)
    where = reader.volume.display_url
    try:
        metadata = reader.read_metadata()
    except CheckpointNotFoundError:
        names = {f.path for f in reader.volume.list("", recursive=False)}
        if not is_rank_local(names):
            raise
    else:
        return [(reader, metadata, None)], metadata, where
    count, missing = expected_ranks(names)
    if missing:
        raise CheckpointNotFoundError(
            f"{where} is a rank-local checkpoint (saved with use_collectives=False) of "
            f"{count} ranks, but ranks {missing} committed no __<rank>.metadata: their "
            "shards are missing, so whole tensors cannot be assembled. Fix: export an older "
            "checkpoint, or save again (with use_collectives=True, the default, one "
            ".metadata commits every rank's shards)."
        )
    parts: list[tuple[Any, Metadata, int | None]] = []
    for rank in range(count):
        one = VolumeReader(src, storage_options=storage_options)
        parts.append((one, one.read_metadata(rank=rank), rank))
    return parts, _merged([md for _, md, _ in parts], where), where


def _merged(metadatas: Sequence[Metadata], where: str) -> Metadata:
    """One metadata of every rank's tensors (each with the chunks of all ranks), refused
    where the chunks do not cover a tensor (assembling it would leave holes)."""
    state: dict[str, Any] = {}
    seen: dict[str, set[tuple[int, ...]]] = {}
    for md in metadatas:
        for fqn, item in md.state_dict_metadata.items():
            if not isinstance(item, TensorStorageMetadata):
                state.setdefault(fqn, item)
                continue
            mine = state.setdefault(fqn, TensorStorageMetadata(item.properties, item.size, []))
            for chunk in item.chunks:
                key = tuple(int(o) for o in chunk.offsets)
                if key not in seen.setdefault(fqn, set()):
                    seen[fqn].add(key)
                    mine.chunks.append(chunk)
    for fqn, item in state.items():
        if isinstance(item, TensorStorageMetadata):
            held = sum(_numel(c.sizes) for c in item.chunks)
            if held != _numel(item.size):
                raise CheckpointCorruptError(
                    f"{where} is a rank-local checkpoint whose ranks' chunks of {fqn!r} hold "
                    f"{held} of its {_numel(item.size)} elements: a rank's shards are missing "
                    "or overlap, so it cannot be assembled whole. Fix: export a checkpoint "
                    "saved with use_collectives=True (the default), or an older one."
                )
    return Metadata(state_dict_metadata=state)


def export_safetensors(
    src_ckpt_url: str | os.PathLike[str],
    dest_url: str | os.PathLike[str],
    *,
    prefix: str = "model.",
    dtype: str | torch.dtype | None = "bfloat16",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    storage_options: Mapping[str, Any] | None = None,
    dest_storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    staging_dir: str | os.PathLike[str] | None = None,
    extra_files: Mapping[str, bytes | str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    drop_tied: bool = True,
) -> ExportResult:
    """Write a committed DCP checkpoint's tensors as Hugging Face safetensors files.

    Whole tensors, assembled from the shards of every rank that saved them, go
    into ``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_size``
    (a larger tensor gets a file of its own) and ``model.safetensors.index.json``,
    written last, as ``save_pretrained`` writes them. No local copy of the
    checkpoint: ranged reads of the items needed, and at most two output files
    in the staging area.

    Args:
        src_ckpt_url: a committed checkpoint (``VolumeWriter`` or stock DCP), or a
            rank-local one (``use_collectives=False``: each rank's ``__<rank>.metadata``
            read, refused with ``CheckpointNotFoundError`` if a rank's is missing).
        dest_url: the model's directory (any volume URL or path).
        prefix: only tensors whose names start with it are exported, without it
            (``"model."``: a state saved as ``{"model": model.state_dict(), ...}``
            gives the model's own names); ``""`` exports every tensor.
            Non-tensor items (step counters, bytes) are skipped.
        dtype: floating tensors are cast to it (``"bfloat16"``, ``"float16"``,
            ``"float32"``, a ``torch.dtype``); ``None`` keeps each tensor's.
            Integer and bool tensors keep theirs.
        max_shard_size: the largest file (bytes or e.g. ``"5GB"``; GB = GiB here).
        storage_options: client options for both URLs (``None``:
            ``DCP_VOLUMES_STORAGE_OPTIONS``).
        dest_storage_options: the destination's, when they differ.
        overwrite: replace an existing export at ``dest_url`` (otherwise its
            index makes this raise ``CheckpointExistsError``).
        staging_dir: local directory for the output files on their way out.
        extra_files: small files to write beside the model before the index, by
            name (``{"config.json": model.config.to_json_string()}``, tokenizer
            files): what ``from_pretrained`` needs besides the weights.
        progress: called as ``progress(bytes_just_written, total_bytes)`` after each
            group of tensors is in place (a progress bar's update).
        drop_tied: write tied weights once, as ``save_pretrained`` does for a model
            with ``tie_word_embeddings=True`` (GPT-2's default): ``lm_head.weight`` is
            left out when the export also holds ``model.embed_tokens.weight`` or
            ``transformer.wte.weight`` and the two are bit-identical in the
            checkpoint (both read once more to compare). An export has no model
            object to ask, and a DCP checkpoint holds a tied tensor under both names,
            so the decision is made from the names transformers ties and the data.
            Pass ``False`` for a model whose config says ``tie_word_embeddings=False``
            but whose head happens to equal its embedding (``from_pretrained`` would
            then initialise the missing head instead of loading it).

    Returns:
        ``ExportResult``: the files and their tensors, the total tensor bytes.
    """
    cast = parse_dtype(dtype)
    for extra in extra_files or {}:
        if not extra or "/" in extra or extra in (".", "..", INDEX_NAME):
            raise ConfigurationError(
                f"extra_files: {extra!r} is not a plain file name beside the model (and not "
                f"{INDEX_NAME}, which the export writes)."
            )
    limit = parse_size(max_shard_size, what="max_shard_size")
    if not limit or limit <= 0:
        raise ConfigurationError(f"max_shard_size={max_shard_size!r} must be a positive size.")
    parts, metadata, where = _open(src_ckpt_url, storage_options)
    dest = Volume(dest_url, storage_options=dest_storage_options
                  if dest_storage_options is not None else storage_options)
    sources = _select(metadata, prefix, cast, where)
    _claim(dest, overwrite)
    loader = _Loader(parts)
    if drop_tied:
        sources = _drop_tied(sources, loader)
    by_name = {s.name: s for s in sources}
    plan = split_into_files(
        [Planned(s.name, _numel(s.shape) * s.dtype.itemsize, _numel(s.shape)) for s in sources],
        int(limit),
    )
    total = sum(m.nbytes for ms in plan for m in ms)
    report = (lambda n: progress(n, total)) if progress is not None else None
    staging = StagingArea(staging_dir)
    uploads = ThreadPoolExecutor(1, thread_name_prefix="dcpv-export-upload")
    pending: Future[None] | None = None
    files: dict[str, list[str]] = {}
    try:
        staged_dir = staging.new_dir("export")
        for i, members in enumerate(plan):
            name = file_name(i, len(plan))
            files[name] = [m.name for m in members]
            path = os.path.join(staged_dir, name)
            _assemble(path, [by_name[m.name] for m in members], loader, report)
            if pending is not None:
                pending.result()  # at most one file uploading while the next is built
            pending = uploads.submit(_upload, dest, path, name)
        if pending is not None:
            pending.result()
        for extra, content in (extra_files or {}).items():
            dest.publish(extra, content.encode() if isinstance(content, str) else content)
        _commit(dest, plan)
    finally:
        uploads.shutdown(wait=True, cancel_futures=True)
        staging.close()
    logger.info("exported %d tensors (%d bytes) in %d file(s) to %s", len(sources), total,
                len(plan), dest.display_url)
    return ExportResult(files, total, dest.url_of(INDEX_NAME))


def _claim(dest: Volume, overwrite: bool) -> None:
    """Refuse to replace a complete export unless ``overwrite``; then drop its index first,
    so that from here until the new commit nothing loads the mix of old and new files."""
    dest.check_root(create=True)
    if not dest.exists(INDEX_NAME):
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{redact_url(dest.url_of(INDEX_NAME))} exists: {dest.display_url} holds a complete "
            "export. Fix: pick another destination, or pass overwrite=True (--overwrite) to "
            "replace it."
        )
    dest.delete(INDEX_NAME)


def _assemble(path: str, members: Sequence[_Source], loader: _Loader,
              progress: Callable[[int], None] | None) -> None:
    """Build one output file at ``path``: the header, then each tensor's bytes in place."""
    header, entries = layout([(m.name, m.dtype, m.shape) for m in members], _METADATA)
    where = {e.name: e for e in entries}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_all(fd, header, 0)
        os.ftruncate(fd, entries[-1].end if entries else len(header))
        for group in _groups(members, _WINDOW_BYTES):
            loaded = loader.load(group)
            written = 0
            for m in group:
                tensor = loaded.pop(m.fqn).to(m.dtype).contiguous().reshape(-1)
                entry = where[m.name]
                if entry.nbytes != tensor.numel() * tensor.element_size():
                    raise SafetensorsError(f"{m.fqn}: loaded {tensor.numel()} elements, "
                                           f"expected {entry.nbytes // m.dtype.itemsize}.")
                if entry.nbytes:
                    write_all(fd, tensor.view(torch.uint8).numpy().data, entry.start)
                written += entry.nbytes
            if progress is not None:
                progress(written)
    finally:
        os.close(fd)


def _upload(dest: Volume, path: str, name: str) -> None:
    dest.put_file(path, name, concurrency=8, move=True)
    StagingArea.remove(path)


def _commit(dest: Volume, plan: Sequence[Sequence[Planned]]) -> None:
    """Publish the index (create-only), then remove files of an earlier export that the
    new index does not name."""
    dest.publish(INDEX_NAME, index_document(plan), exclusive=True)
    names = {file_name(i, len(plan)) for i in range(len(plan))}
    stale = [f.path for f in dest.list("", recursive=False)
             if f.path.endswith(".safetensors") and f.path not in names
             and (f.path.startswith("model-") or f.path == "model.safetensors")]
    if stale:
        dest.delete_many(stale)
