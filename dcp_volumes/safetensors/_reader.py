"""``SafetensorsReader``: DCP loads from Hugging Face safetensors files on any volume.

The headers are read with ranged reads (every rank reads them: they are small),
checked (``_format.parse_header``), and turned into DCP ``Metadata`` in which
each tensor is one whole chunk; DCP's planner then reshards onto any number of
ranks. Each rank reads only the byte spans its read items need, in parallel
ranged reads: the rows ``[o, o + n)`` of the tensor's first dimension (the whole
rows, when an item narrows a later dimension), and copies them into its
targets (``copy_`` casts where the target's dtype differs).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from dcp_volumes._exceptions import (
    CheckpointNotFoundError,
    ConfigurationError,
    VolumeNotFoundError,
)
from dcp_volumes._sizes import parse_size
from dcp_volumes._volume import RetryPolicy, Volume, redact_url
from dcp_volumes.safetensors._format import (
    FIRST_READ_BYTES,
    LENGTH_BYTES,
    Header,
    SafetensorsError,
    header_length,
    parse_header,
)
from dcp_volumes.safetensors._index import INDEX_NAME, SINGLE_NAME, parse_index

logger = logging.getLogger("dcp_volumes.safetensors")

# Largest single ranged read; a larger span is read in parts of this size, in parallel.
_PART_BYTES = 16 * 2**20
# Bytes of spans in flight (read, not yet copied into their targets).
_WINDOW_BYTES = 512 * 2**20
# Where ranges cost the whole object: the most of a file's rows one GET reads, and how
# many such GETs are in flight (each costs the server a read of the whole object; more
# in parallel keep a link busy, and overload the server).
_RUN_BYTES = 64 * 2**20
_RUNS_IN_FLIGHT = 4


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes lie: its file, byte span, dtype and shape."""

    file: str
    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    where: str = ""  # the file's URL as messages show it


@dataclass
class ReadStats:
    """The requests and bytes of the last ``read_metadata`` and ``read_data`` of a reader."""

    header_requests: int = 0
    header_bytes: int = 0
    data_requests: int = 0
    data_bytes: int = 0


def read_headers(volume: Volume, concurrency: int = 16,
                 stats: ReadStats | None = None) -> dict[str, Header]:
    """The parsed header of every file of the model at ``volume`` (by file name), from the
    index (or the one ``model.safetensors``), each checked against the file's size."""
    stats = stats if stats is not None else ReadStats()
    weight_map = _weight_map(volume, stats)
    wanted: dict[str, list[str]] = {}
    for tensor, file in weight_map.items():
        wanted.setdefault(file, []).append(tensor)
    lock = threading.Lock()

    def one(file: str) -> Header:
        where = redact_url(volume.url_of(file))
        try:
            size = volume.info(file).size
            first = volume.read_bytes(file, 0, FIRST_READ_BYTES)
        except VolumeNotFoundError:
            raise SafetensorsError(
                f"{where} is missing, but {INDEX_NAME} maps {len(wanted[file])} tensor(s) to it "
                f"(e.g. {wanted[file][0]!r}). Fix: upload the file, or re-export the model."
            ) from None
        length = header_length(first, where)
        requests, got = 2, len(first)
        if LENGTH_BYTES + length > size:
            raise SafetensorsError(
                f"{where}: its header length {length} runs past the file's {size} bytes.")
        raw = first[LENGTH_BYTES:LENGTH_BYTES + length]
        if len(raw) < length:
            raw += volume.read_bytes(file, len(first), LENGTH_BYTES + length)
            requests, got = 3, LENGTH_BYTES + length
        with lock:
            stats.header_requests += requests
            stats.header_bytes += got
        return parse_header(raw, size, where)

    files = sorted(wanted)
    with ThreadPoolExecutor(max(1, min(concurrency, len(files))),
                            thread_name_prefix="dcpv-st-header") as pool:
        headers = dict(zip(files, pool.map(one, files), strict=True))
    for tensor, file in weight_map.items():
        if tensor and tensor not in headers[file].tensors:
            raise SafetensorsError(
                f"{INDEX_NAME} of {volume.display_url} maps tensor {tensor!r} to {file}, whose "
                "header does not hold it. Fix: re-export the model (the index and files differ)."
            )
    return headers


def _weight_map(volume: Volume, stats: ReadStats) -> dict[str, str]:
    try:
        data = volume.read_bytes(INDEX_NAME)
    except VolumeNotFoundError:
        data = None
    stats.header_requests += 1
    if data is not None:
        stats.header_bytes += len(data)
        return parse_index(data, redact_url(volume.url_of(INDEX_NAME)))
    if volume.exists(SINGLE_NAME):
        stats.header_requests += 1
        return {"": SINGLE_NAME}  # every tensor of the one file (see to_metadata)
    raise CheckpointNotFoundError(
        f"No {INDEX_NAME} or {SINGLE_NAME} at {volume.display_url}: it is not a Hugging Face "
        "safetensors model, or its export did not finish (the index is written last). Fix: "
        "point at the model's directory, or export it again."
    )


def to_metadata(headers: Mapping[str, Header], model_url: str = "") -> Metadata:
    """DCP metadata of these files: each tensor one whole chunk, located by a ``TensorSpan``."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, TensorSpan] = {}
    owner: dict[str, str] = {}
    for file, header in headers.items():
        for name, entry in header.tensors.items():
            if name in owner:
                raise SafetensorsError(
                    f"Tensor {name!r} is in both {owner[name]} and {file}; the model is refused "
                    "(which one is meant cannot be told)."
                )
            owner[name] = file
            zeros = torch.Size([0] * len(entry.shape))
            size = torch.Size(entry.shape)
            state[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=entry.dtype), size=size,
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=size)],
            )
            storage[MetadataIndex(name, zeros)] = TensorSpan(
                file, entry.start, entry.end, entry.dtype, entry.shape,
                f"{model_url.rstrip('/')}/{file}" if model_url else file)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def check_targets(state_dict: Mapping[str, Any], metadata: Metadata,
                  allow_partial_load: bool = False) -> None:
    """Refuse a (flat) state dict that the safetensors files cannot fill: a tensor whose
    shape differs from its file's (``SafetensorsError`` naming file, tensor, both shapes),
    or, unless ``allow_partial_load``, tensors no file holds. A dtype that differs is fine:
    the read casts."""
    spans = {idx.fqn: span for idx, span in (metadata.storage_data or {}).items()
             if isinstance(span, TensorSpan)}
    missing = []
    for fqn, target in state_dict.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            missing.append(fqn)
            continue
        if not isinstance(target, torch.Tensor) or not isinstance(md, TensorStorageMetadata):
            continue
        if tuple(target.shape) != tuple(md.size):
            span = spans.get(fqn)
            raise SafetensorsError(
                f"{span.where if span else 'the model'}: tensor {fqn!r} has shape "
                f"{list(md.size)} ({md.properties.dtype}), the target's is {list(target.shape)}. "
                "Fix: build the model from the config the files were saved with (config.json "
                "beside them), or load into a tensor of the file's shape."
            )
    if missing and not allow_partial_load:
        where = next(iter(spans.values())).where.rsplit("/", 1)[0] if spans else "the model"
        raise SafetensorsError(
            f"{len(missing)} tensor(s) of the state dict are in no file of {where}: "
            f"{sorted(missing)[:5]} (its files hold e.g. "
            f"{sorted(metadata.state_dict_metadata)[:3]}). Fix: give the state dict the "
            "files' names (e.g. model.state_dict(), not a prefixed dict), or pass "
            "SafetensorsLoadPlanner(allow_partial_load=True) to load only those present."
        )


class SafetensorsLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that first checks the targets against the safetensors
    headers (``check_targets``): a shape that differs, or a tensor no file holds, gives a
    ``SafetensorsError`` naming the file and the tensor.

    DCP's planner plans before the storage reader sees the state dict, so the reader
    alone cannot name the file; pass this planner for that
    (``dcp.load(sd, storage_reader=SafetensorsReader(url), planner=SafetensorsLoadPlanner())``).
    Without it, DCP's own planner refuses the same targets with a ``ValueError`` or
    ``RuntimeError`` that names the tensor only.
    """

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is not None:
            check_targets(self.state_dict, metadata, self.allow_partial_load)


def _row_span(span: TensorSpan, item: ReadItem) -> tuple[int, int, int]:
    """The byte span of the rows an item needs, and the first row's index."""
    if not span.shape:
        return span.start, span.end, 0
    row_bytes = span.dtype.itemsize
    for d in span.shape[1:]:
        row_bytes *= d
    first = int(item.storage_offsets[0])
    rows = int(item.lengths[0])
    return span.start + first * row_bytes, span.start + (first + rows) * row_bytes, first


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, int(offset), int(length))
    return tensor


@dataclass
class _Run:
    """Where ranges cost the whole object: one GET of a file's bytes [start, end) and the
    items (with their rows' byte spans) copied out of it."""

    file: str
    start: int
    end: int
    members: list[tuple[ReadItem, int, int]] = field(default_factory=list)


@dataclass
class _Pending:
    """One read item in flight: its target, and its bytes when they need a copy."""

    item: ReadItem
    target: torch.Tensor
    buf: bytearray | None = None
    parts: list[Future[int]] = field(default_factory=list)


def _fits(target: torch.Tensor, span: TensorSpan, item: ReadItem, nbytes: int) -> bool:
    """Whether the span's bytes can go straight into ``target``: whole rows, same dtype,
    a contiguous CPU tensor of exactly that many bytes."""
    whole_rows = all(int(o) == 0 for o in item.storage_offsets[1:]) and tuple(
        int(n) for n in item.lengths[1:]) == span.shape[1:]
    return (whole_rows and target.dtype == span.dtype and target.device.type == "cpu"
            and target.is_contiguous() and target.numel() * target.element_size() == nbytes
            and tuple(target.shape) == tuple(int(n) for n in item.lengths))


class SafetensorsReader(StorageReader):
    """DCP storage reader of a Hugging Face safetensors model on any volume.

    Pass it to ``dcp.load``: the state dict's keys are the model's tensor names
    (``model.embed_tokens.weight``...), its tensors plain, DTensor or sharded,
    on any number of ranks; each rank reads only the byte ranges of its shards.

    DCP calls, in this order (see ``torch.distributed.checkpoint.storage``):

    0. (all ranks) ``reset(checkpoint_id)`` when ``dcp.load`` gets a checkpoint_id.
    1. (all ranks) ``read_metadata()``: the index, then each file's header by
       ranged reads, in parallel; checked (``SafetensorsError`` names file and
       tensor: overlapping offsets, offsets past the file, unknown dtype, a
       missing file); each tensor becomes one whole chunk.
    2. (all ranks) ``set_up_storage_reader(metadata, is_coordinator)``.
    3. (all ranks) ``prepare_local_plan``, 4. (coordinator) ``prepare_global_plan``:
       passed through.
    5. (all ranks) ``read_data(plan, planner)``: the spans of this rank's items,
       ranged reads in parallel, copied into the targets (casting the dtype).

    A target whose shape differs from the file's, or a tensor no file holds, is
    refused by DCP's planner (its message names the tensor); with
    ``planner=SafetensorsLoadPlanner()`` by a ``SafetensorsError`` naming the file,
    the tensor, both shapes and the fix. A dtype that differs is cast.

    Args:
        path: the model's directory (URL or local path/mount).
        storage_options: client options (``None``: ``DCP_VOLUMES_STORAGE_OPTIONS``).
        read_concurrency: ranged reads in flight (lower it for a server that times
            out under many concurrent GETs; a timeout is retried as transient).
        retry: retry policy for transient volume errors (timeouts, throttling, 5xx).
        part_size: largest single ranged read (bytes or e.g. ``"16MiB"``), as
            ``VolumeReader``'s; ``None``: 16 MiB. Where the server reads the whole
            object for every range (``ranged_reads_cost_whole_object``) it does not
            apply: the rows a rank needs of each file are read in runs of up to
            64 MiB, one GET each, at most 4 in flight.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        read_concurrency: int = 16,
        retry: RetryPolicy | None = None,
        part_size: int | str | None = None,
    ) -> None:
        super().__init__()
        if read_concurrency < 1:
            raise ConfigurationError(f"read_concurrency={read_concurrency} must be >= 1.")
        part = parse_size(part_size, what="part_size") if part_size is not None else None
        if part is not None and part < 1:
            raise ConfigurationError(f"part_size={part_size!r} must be a positive size.")
        self.part_size: int | None = int(part) if part is not None else None
        self.volume = Volume(path, storage_options=storage_options, retry=retry)
        self.read_concurrency = read_concurrency
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()
        self._spans: dict[Any, TensorSpan] = {}

    def __repr__(self) -> str:
        return f"SafetensorsReader({self.volume.display_url!r})"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load; ``checkpoint_id`` (a URL or path) replaces the location."""
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.volume.url:
            self.volume = Volume(checkpoint_id, storage_options=self.volume.storage_options,
                                 retry=self.volume.retry)
        self._spans = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The index and every file's header, as DCP metadata (all ranks)."""
        self.stats = ReadStats()
        return to_metadata(read_headers(self.volume, self.read_concurrency, self.stats),
                           self.volume.display_url)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the spans of ``metadata`` (all ranks)."""
        self._spans = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Passed through (all ranks)."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Passed through (coordinator)."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Read this rank's spans in parallel and copy them into its targets (all ranks)."""
        self.stats.data_requests = self.stats.data_bytes = 0
        items = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
        if len(items) != len(plan.items):
            raise SafetensorsError("A safetensors model holds tensors only; the load plan asks "
                                   "for a non-tensor item.")
        if self.volume.capabilities.ranged_reads_cost_whole_object:
            self._read_runs(items, planner)
        else:
            self._read_parts(items, planner)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_parts(self, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        """Each item's rows in parts of ``part_size``, ``read_concurrency`` at a time, into
        the target where its bytes fit it."""
        with ThreadPoolExecutor(self.read_concurrency, thread_name_prefix="dcpv-st-read") as pool:
            batch: list[_Pending] = []
            held = 0
            part = self.part_size or _PART_BYTES
            for item in items:
                span = self._spans[item.storage_index]
                start, end, _ = _row_span(span, item)
                target = _narrow(planner.resolve_tensor(item).detach(), item.dest_offsets,
                                 item.lengths)
                pending = _Pending(item, target)
                if _fits(target, span, item, end - start):
                    # The file's bytes are the target's: read them into it, no copy.
                    view = target.reshape(-1).view(torch.uint8).numpy().data
                else:
                    pending.buf = bytearray(end - start)
                    view = memoryview(pending.buf)
                    held += end - start
                pending.parts = [pool.submit(self._read_part, span, start + o,
                                             view[o:min(o + part, end - start)])
                                 for o in range(0, end - start, part)]
                batch.append(pending)
                if held >= _WINDOW_BYTES:
                    self._deliver(batch, planner)
                    batch, held = [], 0
            self._deliver(batch, planner)

    def _read_runs(self, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        """Where the server reads the whole object for every ranged read: a file's rows
        that this rank needs are read in runs of at most ``_RUN_BYTES`` (or one item's
        rows), one GET each, at most ``_RUNS_IN_FLIGHT`` (and ``read_concurrency``) at a
        time within ``_WINDOW_BYTES``, and each item is copied out of its run."""
        runs: list[_Run] = []
        by_file: dict[str, list[tuple[int, int, ReadItem]]] = {}
        for item in items:
            span = self._spans[item.storage_index]
            start, end, _ = _row_span(span, item)
            by_file.setdefault(span.file, []).append((start, end, item))
        for file, entries in by_file.items():
            run: _Run | None = None
            for start, end, item in sorted(entries, key=lambda e: e[0]):
                if run is None or end - run.start > _RUN_BYTES:
                    run = _Run(file, start, end)
                    runs.append(run)
                run.end = max(run.end, end)
                run.members.append((item, start, end))
        in_flight = min(self.read_concurrency, _RUNS_IN_FLIGHT)
        with ThreadPoolExecutor(in_flight, thread_name_prefix="dcpv-st-read") as pool:
            batch: list[tuple[_Run, Future[memoryview]]] = []
            held = 0
            for run in runs:
                batch.append((run, pool.submit(self.volume.read_span, run.file, run.start,
                                               run.end)))
                held += run.end - run.start
                if held >= _WINDOW_BYTES:
                    self._place_runs(batch, planner)
                    batch, held = [], 0
            self._place_runs(batch, planner)

    def _place_runs(self, batch: Sequence[tuple[_Run, Future[memoryview]]],
                    planner: LoadPlanner) -> None:
        for run, reading in batch:
            data = reading.result()
            self._count(run.file, run.start, run.end - run.start, len(data))
            for item, first, last in run.members:
                target = _narrow(planner.resolve_tensor(item).detach(), item.dest_offsets,
                                 item.lengths)
                rows = data[first - run.start:last - run.start]
                if _fits(target, self._spans[item.storage_index], item, last - first):
                    target.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(rows, np.uint8)
                else:  # a cast or a narrowing: torch reads from a buffer of its own
                    self._copy(item, bytearray(rows), target)
                planner.commit_tensor(item, target)

    def _read_part(self, span: TensorSpan, start: int, out: memoryview) -> int:
        got = self.volume.read_into(span.file, start, out)
        self._count(span.file, start, len(out), got)
        return got

    def _count(self, file: str, start: int, expected: int, got: int) -> None:
        """One read's bytes in the stats; a short read is a file shorter than its header."""
        if got != expected:
            raise SafetensorsError(
                f"{redact_url(self.volume.url_of(file))}: {expected} bytes expected at "
                f"byte {start}, {got} arrived; the file is shorter than its header says "
                "(changed or truncated). Fix: re-upload or re-export the model."
            )
        with self._stats_lock:
            self.stats.data_requests += 1
            self.stats.data_bytes += got

    def _deliver(self, batch: Sequence[_Pending], planner: LoadPlanner) -> None:
        for pending in batch:
            for part in pending.parts:
                part.result()
            item, target = pending.item, pending.target
            if pending.buf is not None:
                self._copy(item, pending.buf, target)
            planner.commit_tensor(item, target)

    def _copy(self, item: ReadItem, buf: bytearray, target: torch.Tensor) -> None:
        """The rows read (``buf``) narrowed to the item and copied into ``target``
        (``copy_`` casts the dtype)."""
        span = self._spans[item.storage_index]
        rows = int(item.lengths[0]) if span.shape else 0
        src = (torch.frombuffer(buf, dtype=span.dtype) if buf
               else torch.empty(0, dtype=span.dtype))
        src = src.reshape((rows, *span.shape[1:]) if span.shape else ())
        src = _narrow(src, [0, *item.storage_offsets[1:]] if span.shape else [],
                      list(item.lengths))
        if target.shape != src.shape:
            raise SafetensorsError(
                f"{redact_url(self.volume.url_of(span.file))}: tensor "
                f"{item.storage_index.fqn!r} has shape {list(span.shape)}; the target's part "
                f"{list(target.shape)} does not match the file's {list(src.shape)}."
            )
        target.copy_(src)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any URL or path may hold a model."""
        return True
