"""FileJob: the reads of one checkpoint data file, from fetched bytes to the load planner.

``VolumeReader`` plans one job per data file a rank needs and schedules their
fetches; a job fetches its byte ranges into buffers (or opens a local file in
place), then deserialises its items and hands them to DCP's planner.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass, field
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_volumes._exceptions import (
    BucketNotFoundError,
    CheckpointCorruptError,
    VolumeNotFoundError,
)
from dcp_volumes._retry import redact_url
from dcp_volumes._streams import FileSlice, MemoryReader
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._manifest import FileRecord, checksum_bytes
from dcp_volumes.checkpoint._shards import (
    load_tensor,
    missing_file_error,
    narrow,
    truncated_file_error,
)

# Stream transforms (e.g. compression) of stock writers with extensions; the
# module is experimental in torch, so it may be missing.
try:
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
except ImportError:  # pragma: no cover - torch < 2.7
    _StorageReaderTransforms = None  # type: ignore[misc,assignment]


@dataclass
class FileJob:
    """The reads of one data file: its items, merged spans and where the bytes come from.

    Files on a local volume (or the local tier) are not fetched into buffers:
    ``file`` is opened when the job is finished and items are deserialised
    straight from it, as stock DCP does.
    """

    rel: str
    reqs: list[tuple[ReadItem, Any]]
    spans: list[tuple[int, int]]
    record: FileRecord | None
    whole: bool
    source: Volume
    from_local: bool = False
    buffers: list[memoryview] = field(default_factory=list)
    futures: list[ThreadFuture[None]] = field(default_factory=list)
    digest: str | None = None  # checksum taken by the fetch thread (one-GET whole files)
    file: io.FileIO | None = None

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in self.spans)

    def fetch(self, start: int, end: int, buf: memoryview, at: int, hash_it: bool) -> None:
        """Read ``[start, end)`` into ``buf`` at ``at``; ``hash_it``: the buffer is the whole
        file (fetched with one plain GET), checksum it here."""
        source, rel = self.source, self.rel
        try:
            got = source.read_into(rel, start, buf[at : at + end - start], whole=hash_it)
        except BucketNotFoundError:
            raise
        except VolumeNotFoundError:
            raise missing_file_error(source, rel) from None
        if got != end - start:
            raise truncated_file_error(source, rel, start, end, got)
        if hash_it:
            self.digest = checksum_bytes(buf)

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

    def deliver(self, planner: LoadPlanner) -> None:
        """Deserialise every item from the fetched bytes and hand it to ``planner``."""
        starts = [s for s, _ in self.spans]
        for req, info in self.reqs:
            i = _layout.find_span(starts, self.spans, info.offset, info.offset + info.length)
            stream: IO[bytes]
            view = None
            if self.file is not None:
                stream = cast(IO[bytes], FileSlice(self.file, info.offset, info.length))
            else:
                lo = info.offset - self.spans[i][0]
                view = self.buffers[i][lo : lo + info.length]
                stream = cast(IO[bytes], MemoryReader(view))
            descriptors = getattr(info, "transform_descriptors", None)
            if descriptors:
                stream, view = _untransform(req, descriptors, stream), None
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(stream.read()))
                continue
            if not stream.seekable():
                stream = io.BytesIO(stream.read())
            try:
                if view is not None:  # fetched bytes: deserialise in place
                    tensor = load_tensor(view)
                else:
                    tensor = torch.load(stream, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointCorruptError(
                    f"{req.storage_index.fqn} in {redact_url(self.source.url_of(self.rel))} "
                    f"cannot be deserialised ({type(exc).__name__}: {exc}). The file is damaged; "
                    "load with verify=True to check it, or load an older checkpoint."
                ) from exc
            tensor = narrow(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointCorruptError(
                    f"{req.storage_index.fqn}: the checkpoint holds a {tuple(tensor.size())} "
                    f"piece where {tuple(target.size())} is expected."
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)


def _untransform(req: ReadItem, descriptors: Sequence[str], stream: IO[bytes]) -> IO[bytes]:
    if _StorageReaderTransforms is None:  # pragma: no cover - torch < 2.7
        raise CheckpointCorruptError(
            f"{req.storage_index.fqn} was saved with stream transforms {list(descriptors)} "
            "that this torch version cannot undo; load with the torch that saved it."
        )
    return cast(
        IO[bytes],
        _StorageReaderTransforms().transform_load_stream(req, descriptors, stream),
    )
