"""FileRead: the reads of one checkpoint data file, from its byte ranges to the load planner.

``VolumeReader`` plans one read per data file a rank needs and schedules their
fetches; a read merges its items' byte ranges into spans (neighbours within
``coalesce_gap`` become one), fetches them as ranged GETs into buffers (or
opens a local file in place), then deserialises its items and hands them to
DCP's planner.

A file may come from a copy instead of the checkpoint's volume (``Supply``, from
a source of ``_tiers``): it is then read whole and checked against the manifest's
checksum, and read from the volume after all when it fails that check or does
not arrive.

Where the manifest says where a saved tensor's data lies in the file and the
planner's target is a plain CPU tensor of the same dtype and shape, the data
is read straight into the target: one copy from the socket (or page cache)
instead of three, and no fresh memory. Only the zip headers around it go to a
scratch buffer. A transformed item whose transform says where its decoded bytes
hold the tensor's data (``ReaderTransforms.placement``) is decoded straight into
its target likewise; fetched from a remote volume, it is decoded piece by piece
as its GETs return (``ReaderTransforms.piece_decoder``: the GETs are cut where
the decoder can take them), from the client's own buffer, with no scratch
buffer of ours at all. Such items authenticate their bytes themselves, so a
file whose items are streamed this way and that is fetched in several GETs
is not hashed for its checksum (``verify=True`` keeps every file hashed).
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_volumes._exceptions import (
    BucketNotFoundError,
    CheckpointCorruptError,
    VolumeNotFoundError,
)
from dcp_volumes._streams import FileSlice, MemoryReader
from dcp_volumes._torch.checkpoint import load_tensor_in_place
from dcp_volumes._volume import LAG_TOTAL_S, Volume, despite_lag, redact_url
from dcp_volumes.checkpoint._extensions import PieceDecoder, ReaderTransforms
from dcp_volumes.checkpoint._manifest import (
    Checksum,
    FileRecord,
    checksum_bytes,
    checksum_file,
)
from dcp_volumes.checkpoint._reader_options import DEFAULT_COALESCE_GAP
from dcp_volumes.checkpoint._supply import Arrived, PutBytes, Supply


@dataclass
class FileRead:
    """The reads of one data file: its items, merged spans and where the bytes come from.

    Files on a local volume (or a local copy) are not fetched into buffers:
    ``file`` is opened when the job is finished and items are deserialised
    straight from it, as stock DCP does. Fetched bytes land in ``pieces``,
    ``(file offset, buffer)`` in file order covering every span: targets of
    direct reads and scratch buffers between them.
    """

    rel: str
    reqs: list[tuple[ReadItem, Any]]
    spans: list[tuple[int, int]]
    record: FileRecord | None
    whole: bool
    source: Volume
    supplier: str = "volume"  # the name of the source the bytes come from
    transforms: ReaderTransforms = field(default_factory=ReaderTransforms)
    pieces: list[tuple[int, memoryview]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # the pieces' file offsets
    futures: list[ThreadFuture[None]] = field(default_factory=list)
    digest: str | None = None  # checksum taken by the fetch thread (one-GET whole files)
    file: io.FileIO | None = None
    targets: dict[int, torch.Tensor] = field(default_factory=dict)  # req index -> target
    direct: dict[int, tuple[int, memoryview]] = field(default_factory=dict)  # -> data at, bytes
    # Transformed items decoded straight into their target: req index -> the target's bytes.
    placed: dict[int, memoryview] = field(default_factory=dict)
    # Of those, the ones decoded piece by piece as the GETs return: req index -> decoder.
    streamed: dict[int, PieceDecoder] = field(default_factory=dict)
    # Their stored bytes, (file offset, length, decoder) by offset.
    sealed: list[tuple[int, int, PieceDecoder]] = field(default_factory=list)
    verify: bool = False  # every whole file's checksum is checked (no streamed items)
    arrival: ThreadFuture[Arrived] | None = None  # the whole file, sent by a source

    @classmethod
    def planned(
        cls,
        rel: str,
        reqs: list[tuple[ReadItem, Any]],
        record: FileRecord | None,
        source: Volume,
        *,
        gap: int,
        verify: bool,
        transforms: ReaderTransforms,
    ) -> FileRead:
        """The read of ``reqs`` of the file ``rel``: their ranges merged within ``gap``
        bytes; the whole file when that covers it anyway or ``verify`` (with a record)."""
        spans = coalesce(((info.offset, info.offset + info.length) for _, info in reqs), gap=gap)
        whole = record is not None and spans == [(0, record.size)]
        if record is not None and verify:
            spans, whole = [(0, record.size)], True
        return cls(rel, reqs, spans, record, whole, source, transforms=transforms,
                   verify=verify)

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in self.spans)

    @property
    def from_copy(self) -> bool:
        """Whether the bytes come from a copy, not from the checkpoint's volume."""
        return self.supplier != "volume"

    def read_copy(self, supply: Supply, supplier: str) -> None:
        """Read the whole file from ``supply`` (of the source named ``supplier``) instead,
        so that its checksum is checked before use. ``supply.arrival`` says when its
        bytes are in this read's buffers (``lay_out_whole``) or in ``supply.volume``,
        or raises ``CopyMissing`` (the caller reads the file from the volume instead)."""
        assert self.record is not None  # only a file the manifest lists has copies
        self.source, self.arrival, self.supplier = supply.volume, supply.arrival, supplier
        self.spans, self.whole = [(0, self.record.size)], True

    def lay_out_whole(self, planner: LoadPlanner, saved_dtype: Callable[[str], Any]) -> PutBytes:
        """Lay out the whole file's buffers now (its target tensors, scratch between
        them) for bytes that arrive in pieces: returns ``put``."""
        assert self.record is not None
        self.spans, self.whole = [(0, self.record.size)], True
        self.plan_direct(planner, saved_dtype)
        self.allocate()
        return self.put

    def put(self, start: int, data: memoryview) -> None:
        """Copy ``data``, the file's bytes from ``start`` on, into the buffers; the bytes of
        streamed items go to their decoders."""
        end = start + len(data)
        for at, view in self.overlaps(start, end):
            view[:] = data[at - start:at - start + len(view)]
        sealed = self.sealed
        i = max(0, bisect.bisect_right(sealed, start, key=lambda item: item[0]) - 1)
        for at, length, decoder in sealed[i:]:
            if at >= end:
                break
            lo, hi = max(start, at), min(end, at + length)
            if lo < hi:
                decoder.feed(lo - at, data[lo - start:hi - start])

    def fall_back_to(self, source: Volume) -> None:
        """Read the file from ``source``, the checkpoint's volume, after its copy failed
        (still whole)."""
        self.close()
        self.source, self.supplier, self.arrival = source, "volume", None

    def start(
        self,
        pool: ThreadPoolExecutor,
        planner: LoadPlanner,
        saved_dtype: Callable[[str], Any],
        split: tuple[int, bool],
    ) -> None:
        """Start the reads: a local file is asked ahead from the kernel; otherwise the
        spans are cut into GETs of ``split`` (bytes per GET, whether that is a cap:
        ``split_range``) fetched by ``pool``."""
        if self.arrival is not None:
            if not self.pieces:  # not copied into buffers: read from the file it is written to
                self.plan_direct(planner, saved_dtype)
                self.allocate()
            self.digest = None
            self.futures = [pool.submit(self.take_arrival, self.arrival)]
            return
        self.plan_direct(planner, saved_dtype)
        if self.source.capabilities.local_files:
            advise_willneed(self.source.full_path(self.rel), self.spans)
            return
        self.plan_streamed()
        self.allocate()
        self.futures, self.digest = [], None
        part_size, at_most = split
        parts = [
            (s, e)
            for start, end in self.spans
            for s, e in itertools.pairwise(
                [self.cut_at(c) for c, _ in split_range(start, end, part_size, at_most=at_most)]
                + [end])
            if e > s
        ]
        # A whole file in one GET is hashed by its fetch thread, off the thread
        # that deserialises.
        hash_here = self.whole and len(parts) == 1
        for s, e in parts:
            self.futures.append(pool.submit(self.fetch, s, e, hash_here))

    def wait(self) -> None:
        """Wait for the fetched bytes (a local file: open it and check its size)."""
        if self.source.capabilities.local_files and not self.pieces:
            self.open_local()
        for f in self.futures:
            f.result()

    @property
    def checkable(self) -> bool:
        """Whether the bytes read are checked against the manifest's checksum: a whole
        file, held in buffers or hashed on arrival (streamed items authenticate their
        own bytes: a file of them fetched in several GETs is not hashed)."""
        return self.whole and self.record is not None and (
            not self.sealed or self.digest is not None)

    def actual_checksum(self) -> str:
        """The checksum of the bytes read (of the whole file when ``whole``)."""
        if self.file is not None:
            return checksum_file(self.file)
        return self.digest or self.checksum()

    def release(self) -> None:
        """Drop the buffers and targets once delivered, and close a local file."""
        self.pieces.clear()
        self.starts.clear()
        self.targets.clear()
        self.streamed.clear()
        self.sealed.clear()
        self.close()

    def cancel(self) -> None:
        """Cancel the fetches not yet started and close a local file (a failed load)."""
        for f in self.futures:
            f.cancel()
        self.close()

    def plan_direct(self, planner: LoadPlanner, saved_dtype: Callable[[str], Any]) -> None:
        """Pick the tensor items whose data can be read straight into their target.

        ``saved_dtype(fqn)``: the dtype the checkpoint holds. A target must be a
        contiguous CPU tensor of that dtype and exactly the saved piece's shape
        (no resharding cut, no conversion); the rest are deserialised as usual.
        """
        self.direct = {}
        self.plan_placed(planner)
        tensors = self.record.tensors if self.record is not None else {}
        if not tensors:
            return
        taken: set[int] = set()
        for i, (req, info) in enumerate(self.reqs):
            data = tensors.get(info.offset)
            if (
                data is None
                or req.type != LoadItemType.TENSOR
                or getattr(info, "transform_descriptors", None)
                or any(req.storage_offsets)
                or data[0] in taken
                or data[0] + data[1] > info.offset + info.length
            ):
                continue
            target = self.target(planner, i)
            view = _memory_of(target, target.dtype == saved_dtype(req.storage_index.fqn),
                              tuple(req.lengths), data[1])
            if view is not None:
                self.direct[i] = (data[0], view)
                taken.add(data[0])

    def plan_placed(self, planner: LoadPlanner) -> None:
        """Pick the transformed tensor items that can be decoded straight into their target:
        their transform says where the data lies in the decoded item, with its dtype and
        shape (``ReaderTransforms.placement``); the target must be a contiguous CPU tensor
        of that dtype and exactly that shape (the whole piece)."""
        self.placed = {}
        for i, (req, info) in enumerate(self.reqs):
            if req.type != LoadItemType.TENSOR or any(req.storage_offsets):
                continue
            placement = self.transforms.placement(getattr(info, "transform_descriptors", None))
            if placement is None or tuple(req.lengths) != placement.shape:
                continue
            target = self.target(planner, i)
            view = _memory_of(target, target.dtype == placement.dtype, placement.shape,
                              placement.nbytes)
            if view is not None:
                self.placed[i] = view

    def plan_streamed(self) -> None:
        """Of the placed items, those decoded piece by piece as their GETs return
        (``ReaderTransforms.piece_decoder``); not where every whole file is hashed
        (``verify``): their bytes are never held."""
        self.streamed, self.sealed = {}, []
        if self.verify:
            return
        where = redact_url(self.source.url_of(self.rel))
        for i, target in self.placed.items():
            req, info = self.reqs[i]
            decoder = self.transforms.piece_decoder(
                req, info.transform_descriptors, info.length, target, where)
            if decoder is not None:
                self.streamed[i] = decoder
                self.sealed.append((info.offset, info.length, decoder))
        self.sealed.sort(key=lambda item: item[0])

    def cut_at(self, pos: int) -> int:
        """``pos``, or the nearest place a streamed item it falls inside may be cut at."""
        i = bisect.bisect_right(self.sealed, pos, key=lambda item: item[0]) - 1
        if i < 0:
            return pos
        at, length, decoder = self.sealed[i]
        if not at < pos < at + length:
            return pos
        cuts = decoder.cuts
        j = bisect.bisect_left(cuts, pos - at)
        near = min(cuts[j - 1], cuts[j], key=lambda c: abs(c - (pos - at)))
        return at + near

    def target(self, planner: LoadPlanner, i: int) -> torch.Tensor:
        """The planner's target tensor for item ``i`` (resolved once per job)."""
        if i not in self.targets:
            self.targets[i] = planner.resolve_tensor(self.reqs[i][0]).detach()
        return self.targets[i]

    def allocate(self) -> None:
        """Lay out ``pieces`` over the spans: direct targets, scratch buffers between them;
        none for the stored bytes of streamed items (their decoders take them)."""
        taken: list[tuple[int, int, memoryview | None]] = sorted(
            [(at, len(view), view) for at, view in self.direct.values()]
            + [(at, length, None) for at, length, _ in self.sealed],
            key=lambda t: t[0])
        pieces: list[tuple[int, memoryview]] = []
        for start, end in self.spans:
            pos = start
            for at, length, view in taken:
                if start <= at < end:
                    if at > pos:
                        pieces.append((pos, _scratch(at - pos)))
                    if view is not None:
                        pieces.append((at, view))
                    pos = at + length
            if end > pos:
                pieces.append((pos, _scratch(end - pos)))
        self.pieces = pieces
        self.starts = [at for at, _ in pieces]

    def views(self, start: int, end: int) -> list[memoryview]:
        """The buffers that ``[start, end)`` of the file is read into, in order."""
        return [view for _, view in self.overlaps(start, end)]

    def overlaps(self, start: int, end: int) -> Iterator[tuple[int, memoryview]]:
        """The parts of the buffers that hold bytes of ``[start, end)`` of the file, in
        order, each with its file offset (none for streamed items' bytes)."""
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        for at, buf in self.pieces[i:]:
            if at >= end:
                break
            lo, hi = max(start, at), min(end, at + len(buf))
            if lo < hi:
                yield lo, buf[lo - at : hi - at]

    def fetch(self, start: int, end: int, hash_it: bool) -> None:
        """Read ``[start, end)`` into its pieces; ``hash_it``: that is the whole file
        (fetched with one plain GET), checksum it here."""
        source, rel = self.source, self.rel
        # A file the manifest lists was committed: "not found" may be a store that
        # lags (a replica behind, a gateway's cache), so ask again for a moment
        # before calling it missing. Without a manifest nothing says it should exist.
        listed = self.record is not None
        read: Callable[[], int | memoryview]
        if self.sealed:  # the client's buffer goes to the pieces and the decoders
            read = lambda: source.read_span(rel, start, end, whole=hash_it)  # noqa: E731
        else:
            read = lambda: source.read_into(rel, start, self.views(start, end),  # noqa: E731
                                            whole=hash_it)
        try:
            result = despite_lag(read, what=redact_url(source.url_of(rel)), expected=listed)
        except BucketNotFoundError:
            raise
        except VolumeNotFoundError:
            looked = LAG_TOTAL_S if listed else 0.0
            raise missing_file_error(source, rel, looked_s=looked) from None
        data = result if isinstance(result, memoryview) else None
        got = len(data) if data is not None else cast(int, result)
        if got != end - start:
            raise truncated_file_error(source, rel, start, end, got)
        if data is not None:
            self.put(start, data)
        if hash_it:
            self.digest = checksum_bytes(data) if data is not None else self.checksum()

    def take_arrival(self, arrival: ThreadFuture[Arrived]) -> None:
        """Wait for the sent file: in the pieces already, its checksum the one taken
        of those bytes on arrival; or written to disk, then read and hashed from there."""
        received = arrival.result()  # bounded: the transfer settles every arrival
        self.arrival = None
        if received.in_buffers:
            self.digest = received.checksum
        else:
            self.fetch(0, self.spans[0][1], hash_it=True)

    def checksum(self) -> str:
        """Checksum of the fetched pieces (the whole file when ``whole``)."""
        h = Checksum()
        for _, buf in self.pieces:
            h.update(buf)
        return h.hexdigest()

    def open_local(self) -> None:
        """Open the file of a local source and check that it holds every span."""
        source = self.source
        try:
            self.file = source.open_local(self.rel)
        except BucketNotFoundError:
            raise
        except VolumeNotFoundError:
            raise missing_file_error(source, self.rel) from None
        size = os.fstat(self.file.fileno()).st_size
        for start, end in self.spans:
            if end > size:
                raise truncated_file_error(source, self.rel, start, end, max(0, size - start))

    def close(self) -> None:
        """Close the local file, if one is open."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def deliver(self, planner: LoadPlanner, decoders: Decoders | None = None) -> None:
        """Deserialise every item from the fetched bytes and hand it to ``planner``.

        ``decoders``: threads that undo the stream transforms (decompress) of the
        next items while this thread deserialises the current one.
        """
        starts = self.starts
        bounds = [(at, at + len(buf)) for at, buf in self.pieces]
        where = redact_url(self.source.url_of(self.rel))

        def raw(info: Any) -> tuple[IO[bytes], memoryview | None]:
            if self.file is not None:
                return cast(IO[bytes], FileSlice(self.file, info.offset, info.length)), None
            view = _slice(self.pieces, starts, bounds, info.offset, info.length)
            return cast(IO[bytes], MemoryReader(view)), view

        def decode(i: int) -> IO[bytes] | None:
            """Item ``i`` undone into memory; None: decoded into its target already."""
            req, info = self.reqs[i]
            stream, _ = raw(info)
            if i in self.placed and self.transforms.decode_into(
                req, info.transform_descriptors, stream, self.placed[i], where
            ):
                return None
            return self.transforms.untransform(req, info.transform_descriptors, stream, where)

        coded = [
            i
            for i, (_, info) in enumerate(self.reqs)
            if i not in self.direct and i not in self.streamed
            and getattr(info, "transform_descriptors", None)
        ]
        ahead: dict[int, ThreadFuture[IO[bytes] | None]] = {}
        try:
            self._deliver(planner, raw, decode, coded, ahead, decoders, where)
        finally:
            for f in ahead.values():
                f.cancel()

    def _deliver(
        self,
        planner: LoadPlanner,
        raw: Callable[[Any], tuple[IO[bytes], memoryview | None]],
        decode: Callable[[int], IO[bytes] | None],
        coded: list[int],
        ahead: dict[int, ThreadFuture[IO[bytes] | None]],
        decoders: Decoders | None,
        where: str,
    ) -> None:
        queued = 0  # coded[:queued] are submitted
        for i, (req, info) in enumerate(self.reqs):
            if i in self.streamed:  # decoded into its target as its bytes arrived
                self.streamed[i].finish()
                planner.commit_tensor(req, self.targets[i])
                continue
            if i in self.direct:
                if self.file is not None:  # local: one positioned read into the target
                    at, dest = self.direct[i]
                    FileSlice(self.file, at, len(dest)).readinto(dest)
                planner.commit_tensor(req, self.targets[i])
                continue
            stream: IO[bytes]
            view: memoryview | None = None
            if getattr(info, "transform_descriptors", None):
                # A transformed item is undone whole (as stock does), into memory,
                # by the decoder threads a few items ahead of this one.
                if decoders is None:
                    undone = decode(i)
                else:
                    queued = self._decode_ahead(decoders, decode, coded, queued, ahead)
                    undone = ahead.pop(i).result()
                if undone is None:  # decoded straight into its target
                    planner.commit_tensor(req, self.targets[i])
                    continue
                stream = undone
                if isinstance(stream, (io.BytesIO, MemoryReader)) and (
                    req.type != LoadItemType.BYTE_IO
                ):
                    view = stream.getbuffer()  # deserialised in place: no copy
            else:
                stream, view = raw(info)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(stream.read()))
                continue
            tensor = _deserialise(stream, view, req.storage_index.fqn, where)
            tensor = narrow(tensor, req.storage_offsets, req.lengths)
            target = self.target(planner, i)
            if target.size() != tensor.size():
                raise CheckpointCorruptError(
                    f"{req.storage_index.fqn}: the checkpoint holds a {tuple(tensor.size())} "
                    f"piece where {tuple(target.size())} is expected."
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)

    def _decode_ahead(
        self,
        decoders: Decoders,
        decode: Callable[[int], IO[bytes] | None],
        coded: list[int],
        queued: int,
        ahead: dict[int, ThreadFuture[IO[bytes] | None]],
    ) -> int:
        """Hand the next transformed items (``coded[queued:]``) to the decoder threads;
        returns how many of ``coded`` are handed over now.

        Ahead: at most ``window`` items and ``budget`` stored bytes (always the
        current one), so big tensors are not all decoded at once.
        """
        held = sum(self.reqs[j][1].length for j in ahead)
        while queued < len(coded) and len(ahead) < decoders.window:
            nxt = coded[queued]
            size = self.reqs[nxt][1].length
            if ahead and held + size > decoders.budget:
                break
            ahead[nxt] = decoders.pool.submit(decode, nxt)
            held += size
            queued += 1
        return queued


def _deserialise(stream: IO[bytes], view: memoryview | None, fqn: str, where: str) -> torch.Tensor:
    """A saved tensor from its bytes (``view``: fetched into memory, read in place)."""
    if not stream.seekable():
        stream = io.BytesIO(stream.read())
    try:
        if view is not None:  # fetched bytes: deserialise in place
            return load_tensor_in_place(view)
        tensor: torch.Tensor = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointCorruptError(
            f"{fqn} in {where} "
            f"cannot be deserialised ({type(exc).__name__}: {exc}). The file is damaged; "
            "load with verify=True to check it, or load an older checkpoint."
        ) from exc
    return tensor


@dataclass(frozen=True)
class Decoders:
    """Threads that undo items' stream transforms, and how far they may run ahead:
    ``window`` items and ``budget`` stored bytes at most."""

    pool: ThreadPoolExecutor
    window: int
    budget: int


def _scratch(nbytes: int) -> memoryview:
    # Uninitialised: zero-filling (bytearray) costs as much as the copy it precedes.
    return memoryview(np.empty(nbytes, dtype=np.uint8))  # type: ignore[arg-type]


def _slice(
    pieces: Sequence[tuple[int, memoryview]],
    starts: Sequence[int],
    bounds: Sequence[tuple[int, int]],
    offset: int,
    length: int,
) -> memoryview:
    """``[offset, offset + length)`` of the file, from the one piece that holds it."""
    if not length:
        return memoryview(b"")
    at, buf = pieces[find_span(starts, bounds, offset, offset + length)]
    return buf[offset - at : offset - at + length]


def coalesce(
    ranges: Iterable[tuple[int, int]], *, gap: int = DEFAULT_COALESCE_GAP
) -> list[tuple[int, int]]:
    """Merge ``[start, end)`` ranges that overlap or lie within ``gap`` bytes of each other.

    Returns sorted, disjoint ranges that together cover every input range.
    Empty ranges (``start == end``) are kept covered but never widen a merge
    on their own beyond their position.
    """
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end})")
        if out and start <= out[-1][1] + gap:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def split_range(
    start: int, end: int, part_size: int, *, at_most: bool = False
) -> list[tuple[int, int]]:
    """``[start, end)`` cut into equal parts of about ``part_size`` bytes (at most 1.5x).

    Equal parts, rounded, not full parts and a remainder: a file a few KiB over
    the part size (its headers) would otherwise cost a second request for its tail.
    ``at_most``: no part above ``part_size`` (the count rounded up).
    """
    if end <= start:
        return [(start, start)]
    length = end - start
    count = max(1, -(-length // part_size) if at_most else round(length / part_size))
    cuts = [start + i * length // count for i in range(count + 1)]
    return list(itertools.pairwise(cuts))


def find_span(
    starts: Sequence[int], spans: Sequence[tuple[int, int]], start: int, end: int
) -> int:
    """Index of the span in sorted, disjoint ``spans`` that holds ``[start, end)``.

    ``starts`` are the spans' start offsets (for bisection).
    """
    i = bisect.bisect_right(starts, start) - 1
    if i < 0 or end > spans[i][1]:
        raise KeyError(f"no span contains [{start}, {end})")
    return i


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The part of a saved tensor a read item asks for (resharding)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def advise_willneed(path: str, spans: Sequence[tuple[int, int]]) -> None:
    """Ask the kernel to read a local file's spans ahead (best effort; a no-op off Linux)."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # reported when the file is opened for reading
    try:
        with contextlib.suppress(OSError):
            for start, end in spans:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def missing_file_error(
    source: Volume, rel: str, *, looked_s: float = 0.0
) -> CheckpointCorruptError:
    """The error for a data file that is not there (``looked_s``: asked again that long)."""
    again = f" (not found, also when asked again for {looked_s:.0f} s)" if looked_s else ""
    return CheckpointCorruptError(
        f"The checkpoint file {redact_url(source.url_of(rel))} is missing{again}. The "
        "checkpoint is damaged; load an older one."
    )


def truncated_file_error(
    source: Volume, rel: str, start: int, end: int, got: int
) -> CheckpointCorruptError:
    """The error for a data file that ends before ``end`` (``got`` bytes from ``start``)."""
    return CheckpointCorruptError(
        f"The checkpoint file {redact_url(source.url_of(rel))} ends before byte {end} "
        f"that .metadata points to (got {got} of {end - start} bytes from "
        f"{start}). The file was truncated; load an older checkpoint."
    )


def _memory_of(target: torch.Tensor, dtype_matches: bool, shape: tuple[int, ...],
               nbytes: int) -> memoryview | None:
    """``target``'s memory as writable bytes, where the stored piece can land in it whole:
    a contiguous CPU tensor of the stored dtype, ``shape`` and ``nbytes`` (else None)."""
    if (
        target.device.type != "cpu"
        or not dtype_matches
        or tuple(target.size()) != tuple(shape)
        or not target.is_contiguous()
        or target.numel() * target.element_size() != nbytes
    ):
        return None
    try:
        array = target.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # e.g. a tensor subclass without plain memory
        return None
    return memoryview(array) if array.flags.writeable else None  # type: ignore[arg-type]
