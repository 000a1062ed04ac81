"""Raw S3 transfers with boto3: the link floors the benchmarks compare against.

No serialisation, no framework: the same bytes moved over the same endpoint
with parallel streams, in the ways that are fastest on the server at hand.
Two shapes each way, because servers differ in which they do best (moto, for
one, joins multipart parts and slices ranged GETs in Python, reading the whole
object for every range):

* upload: parallel PUTs of chunk objects, or one parallel multipart upload;
* download: parallel whole-object GETs of the chunks, or parallel ranged GETs
  of the one multipart object.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _common import MiB

S3_MIN_PART = 5 * MiB


def boto3_client(endpoint: str, pool: int) -> Any:
    """A boto3 S3 client for the emulator at ``endpoint`` with ``pool`` connections."""
    import boto3
    from botocore.config import Config

    # The floor should be the link, not client CPU: skip optional body checksums.
    config = Config(
        max_pool_connections=pool,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"max_attempts": 5, "mode": "standard"},
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        config=config,
    )


def spans(total: int, size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces of ``size`` bytes covering ``total``."""
    return [(off, min(size, total - off)) for off in range(0, total, size)]


def chunk_size(total: int, streams: int) -> int:
    """Pieces of at least 5 MiB (S3's minimum part), at most 16 MiB, one per stream or more."""
    return max(S3_MIN_PART, min(16 * MiB, math.ceil(total / streams)))


class ByteSource:
    """The concatenation of several buffers (a state dict's tensors), read by range."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = list(views)
        self.offsets: list[int] = []
        pos = 0
        for v in self.views:
            self.offsets.append(pos)
            pos += len(v)
        self.total = pos

    def read(self, start: int, length: int) -> bytearray:
        # One copy into a bytearray, which boto3 sends as it is.
        out = bytearray(length)
        pos = 0
        for view, base in zip(self.views, self.offsets, strict=True):
            lo, hi = max(start, base), min(start + length, base + len(view))
            if lo < hi:
                out[pos : pos + hi - lo] = view[lo - base : hi - base]
                pos += hi - lo
        return out

    def equals(self, buf: bytearray) -> bool:
        if len(buf) != self.total:
            return False
        view = memoryview(buf)
        pairs = zip(self.views, self.offsets, strict=True)
        return all(view[base : base + len(v)] == v for v, base in pairs)


def chunk_key(prefix: str, index: int) -> str:
    return f"{prefix}/chunk{index:05d}"


def put_chunks(
    client: Any, pool: ThreadPoolExecutor, bucket: str, prefix: str, src: ByteSource, size: int
) -> None:
    """Upload ``src`` as chunk objects under ``prefix``, several PUTs at once."""

    def put(item: tuple[int, tuple[int, int]]) -> None:
        index, (start, length) = item
        client.put_object(Bucket=bucket, Key=chunk_key(prefix, index), Body=src.read(start, length))

    list(pool.map(put, enumerate(spans(src.total, size))))


def put_multipart(
    client: Any, pool: ThreadPoolExecutor, bucket: str, key: str, src: ByteSource, size: int
) -> None:
    """Upload ``src`` as one object, its parts several at once."""
    parts = spans(src.total, size)
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def put(number: int) -> dict[str, Any]:
        start, length = parts[number - 1]
        etag = client.upload_part(
            Bucket=bucket,
            Key=key,
            PartNumber=number,
            UploadId=upload_id,
            Body=src.read(start, length),
        )["ETag"]
        return {"PartNumber": number, "ETag": etag}

    done = list(pool.map(put, range(1, len(parts) + 1)))
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
    )


def get_chunks(
    client: Any, pool: ThreadPoolExecutor, bucket: str, prefix: str, out: bytearray, size: int
) -> None:
    """Download the chunk objects under ``prefix`` into ``out``, several GETs at once."""
    view = memoryview(out)

    def get(item: tuple[int, tuple[int, int]]) -> None:
        index, (start, length) = item
        data = client.get_object(Bucket=bucket, Key=chunk_key(prefix, index))["Body"].read()
        if len(data) != length:
            raise OSError(f"chunk {index}: got {len(data)} bytes, expected {length}")
        view[start : start + length] = data

    list(pool.map(get, enumerate(spans(len(out), size))))


def get_ranges(
    client: Any, pool: ThreadPoolExecutor, bucket: str, key: str, out: bytearray, size: int
) -> None:
    """Download object ``key`` into ``out`` as ranged GETs of ``size`` bytes, several at once."""
    view = memoryview(out)

    def get(span: tuple[int, int]) -> None:
        start, length = span
        data = client.get_object(
            Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
        )["Body"].read()
        if len(data) != length:
            raise OSError(f"range at {start}: got {len(data)} bytes, expected {length}")
        view[start : start + length] = data

    list(pool.map(get, spans(len(out), size)))
