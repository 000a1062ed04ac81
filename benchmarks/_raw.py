"""Raw object-store transfers with each store's own SDK: the link floors of the benchmarks.

No serialisation, no framework: the same bytes moved over the same endpoint
with parallel streams, in the ways that are fastest on the server at hand.
Two shapes each way, because servers differ in which they do best (moto, for
one, joins multipart parts and slices ranged GETs in Python, reading the whole
object for every range):

* upload: parallel PUTs of chunk objects, or one object uploaded in parallel
  parts (S3 multipart upload; Azure ``stage_block`` + ``commit_block_list``);
* download: parallel whole-object GETs of the chunks, or parallel ranged GETs
  of the one object.

S3 goes through boto3 (``S3Raw``), Azure Blob through azure-storage-blob
(``AzureRaw``), GCS through gcsfs (``GcsRaw``: the emulator speaks only the
JSON API, and gcsfs has no parallel-parts upload, so GCS has the single-PUT
shape only) and a local directory through plain files (``LocalRaw``); all
stand behind ``RawStore``, so the loops here run unchanged on any of them
(``raw_store`` picks one by URL scheme).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from benchmarks._common import MiB

S3_MIN_PART = 5 * MiB
# One request per GET on Azure too (its SDK splits larger reads into chunks).
AZURE_SINGLE_GET = 64 * MiB
# Bytes per read of a response body (azure-core reads 4 KiB at a time by default).
AZURE_READ_BLOCK = 256 * 1024
AZURE_DELETE_BATCH = 256  # the most blobs one Blob Batch request may delete


class Multipart(Protocol):
    """One object uploaded in parts: ``part`` may run on several threads at once."""

    def part(self, index: int, body: bytes) -> Any: ...

    def complete(self, parts: list[Any]) -> None: ...


class RawStore(Protocol):
    """One bucket or container, through the store's own SDK (thread-safe)."""

    def connect(self) -> None:
        """One cheap request, so connecting and signing happen outside a timing."""

    def put(self, key: str, body: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def multipart(self, key: str) -> Multipart: ...

    def delete_prefix(self, prefix: str, keep: str | None = None) -> None:
        """Delete every object under ``prefix`` + "/", except those under ``keep``."""


# ---------------------------------------------------------------------------
# S3: boto3
# ---------------------------------------------------------------------------


def boto3_client(
    endpoint: str | None, pool: int, *, key: str | None = "testing", secret: str | None = "testing"
) -> Any:
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
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=config,
    )


class _S3Multipart:
    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self.upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def part(self, index: int, body: bytes) -> dict[str, Any]:
        number = index + 1
        etag = self.client.upload_part(
            Bucket=self.bucket, Key=self.key, PartNumber=number, UploadId=self.upload_id, Body=body
        )["ETag"]
        return {"PartNumber": number, "ETag": etag}

    def complete(self, parts: list[Any]) -> None:
        self.client.complete_multipart_upload(
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )


class S3Raw:
    """A bucket through boto3."""

    def __init__(self, client: Any, bucket: str) -> None:
        self.client, self.bucket = client, bucket

    def connect(self) -> None:
        self.client.head_bucket(Bucket=self.bucket)

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body)

    def get(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def get_range(self, key: str, start: int, length: int) -> bytes:
        rng = f"bytes={start}-{start + length - 1}"
        return bytes(self.client.get_object(Bucket=self.bucket, Key=key, Range=rng)["Body"].read())

    def multipart(self, key: str) -> Multipart:
        return _S3Multipart(self.client, self.bucket, key)

    def delete_prefix(self, prefix: str, keep: str | None = None) -> None:
        token: dict[str, Any] = {}
        while True:
            page = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix + "/", **token)
            keys = [o["Key"] for o in page.get("Contents", [])]
            doomed = [{"Key": k} for k in keys if keep is None or not k.startswith(keep)]
            for i in range(0, len(doomed), 1000):
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": doomed[i : i + 1000]}
                )
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}


# ---------------------------------------------------------------------------
# Azure Blob: azure-storage-blob
# ---------------------------------------------------------------------------


def azure_container_client(connection_string: str, container: str, pool: int) -> Any:
    """A container client with ``pool`` pooled connections (requests keeps 10 by default)."""
    import requests
    from azure.core.pipeline.transport import RequestsTransport
    from azure.storage.blob import BlobServiceClient
    from urllib3.util.retry import Retry

    session = requests.Session()
    session.trust_env = False  # no proxy from the environment between us and the emulator
    # The SDK's own retry policy retries; urllib3 must not retry underneath it.
    no_retries = Retry(total=False, redirect=False, raise_on_status=False)
    adapter = requests.adapters.HTTPAdapter(
        pool_connections=2, pool_maxsize=pool, max_retries=no_retries
    )
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    transport = RequestsTransport(
        session=session, session_owner=True, connection_data_block_size=AZURE_READ_BLOCK
    )
    service = BlobServiceClient.from_connection_string(
        connection_string, transport=transport, max_single_get_size=AZURE_SINGLE_GET
    )
    return service.get_container_client(container)


class _AzureBlocks:
    def __init__(self, blob: Any) -> None:
        self.blob = blob

    def part(self, index: int, body: bytes) -> Any:
        from azure.storage.blob import BlobBlock

        block_id = f"{index:06d}"  # one length for all: Azure requires it
        self.blob.stage_block(block_id, body, length=len(body))
        return BlobBlock(block_id=block_id)

    def complete(self, parts: list[Any]) -> None:
        self.blob.commit_block_list(parts)


class AzureRaw:
    """A container through azure-storage-blob."""

    def __init__(self, container: Any) -> None:
        self.container = container

    def connect(self) -> None:
        self.container.get_container_properties()

    def put(self, key: str, body: bytes) -> None:
        self.container.upload_blob(key, body, length=len(body), overwrite=True)

    def get(self, key: str) -> bytes:
        return bytes(self.container.download_blob(key).readall())

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return bytes(self.container.download_blob(key, offset=start, length=length).readall())

    def multipart(self, key: str) -> Multipart:
        return _AzureBlocks(self.container.get_blob_client(key))

    def delete_prefix(self, prefix: str, keep: str | None = None) -> None:
        names = [
            b.name
            for b in self.container.list_blobs(name_starts_with=prefix + "/")
            if keep is None or not b.name.startswith(keep)
        ]
        for i in range(0, len(names), AZURE_DELETE_BATCH):
            self.container.delete_blobs(*names[i : i + AZURE_DELETE_BATCH])


# ---------------------------------------------------------------------------
# GCS: gcsfs; a local directory: files
# ---------------------------------------------------------------------------


class GcsRaw:
    """A bucket through gcsfs (thread-safe: its sync calls run on one event loop)."""

    def __init__(self, storage_options: Mapping[str, Any], bucket: str) -> None:
        import gcsfs

        self.fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **storage_options)
        self.bucket = bucket

    def _path(self, key: str) -> str:
        return f"{self.bucket}/{key}"

    def connect(self) -> None:
        self.fs.ls(self.bucket)

    def put(self, key: str, body: bytes) -> None:
        self.fs.pipe_file(self._path(key), body)

    def get(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(key)))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return bytes(self.fs.cat_file(self._path(key), start=start, end=start + length))

    def multipart(self, key: str) -> Multipart:
        raise NotImplementedError("gcsfs uploads no parts in parallel: GCS has single PUTs here")

    def delete_prefix(self, prefix: str, keep: str | None = None) -> None:
        names = [
            n
            for n in self.fs.find(self._path(prefix) + "/")
            if keep is None or not n.startswith(self._path(keep))
        ]
        if names:
            self.fs.rm(names)


class LocalRaw:
    """A local directory (a mount path): each key a file below ``root``."""

    def __init__(self, root: str) -> None:
        self.root = root

    def _path(self, key: str) -> str:
        import os

        return os.path.join(self.root, key)

    def connect(self) -> None:
        import os

        os.makedirs(self.root, exist_ok=True)

    def put(self, key: str, body: bytes) -> None:
        import os

        from dcp_volumes._volume import write_all

        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, body)  # 1 MiB pieces, as the library writes its local files
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        import os

        fd = os.open(self._path(key), os.O_RDONLY)
        try:
            return os.pread(fd, length, start)
        finally:
            os.close(fd)

    def multipart(self, key: str) -> Multipart:
        raise NotImplementedError("a directory has no parts: the single-file shape only")

    def delete_prefix(self, prefix: str, keep: str | None = None) -> None:
        import os
        import shutil

        top = self._path(prefix)
        if keep is None:
            shutil.rmtree(top, ignore_errors=True)
            return
        kept = self._path(keep).rstrip("/")
        for entry in os.scandir(top) if os.path.isdir(top) else ():
            if not (entry.path == kept or entry.path.startswith(kept + "/")):
                shutil.rmtree(entry.path, ignore_errors=True)


def raw_store(scheme: str, storage_options: Mapping[str, Any], bucket: str, pool: int) -> RawStore:
    """The raw client of ``bucket`` for a URL scheme, from the emulator's ``storage_options``.

    The credentials are the ones every other method gets (explicit, never a
    lookup that could end at an instance-metadata address).
    """
    if scheme == "s3":
        endpoint = storage_options.get("client_kwargs", {}).get("endpoint_url")
        client = boto3_client(
            endpoint, pool, key=storage_options.get("key"), secret=storage_options.get("secret")
        )
        return S3Raw(client, bucket)
    if scheme == "az":
        return AzureRaw(azure_container_client(storage_options["connection_string"], bucket, pool))
    if scheme == "gs":
        return GcsRaw(storage_options, bucket)
    if scheme == "file":
        return LocalRaw(bucket)
    raise ValueError(f"no raw client for {scheme}://")


# ---------------------------------------------------------------------------
# The transfers
# ---------------------------------------------------------------------------


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

    def read(self, start: int, length: int) -> bytes:
        # One copy, into bytes: both SDKs send bytes as they are (Azure's takes nothing else).
        pieces = []
        for view, base in zip(self.views, self.offsets, strict=True):
            lo, hi = max(start, base), min(start + length, base + len(view))
            if lo < hi:
                pieces.append(view[lo - base : hi - base])
        return b"".join(pieces)

    def equals(self, buf: bytearray) -> bool:
        if len(buf) != self.total:
            return False
        view = memoryview(buf)
        pairs = zip(self.views, self.offsets, strict=True)
        return all(view[base : base + len(v)] == v for v, base in pairs)


def chunk_key(prefix: str, index: int) -> str:
    return f"{prefix}/chunk{index:05d}"


def put_chunks(
    store: RawStore, pool: ThreadPoolExecutor, prefix: str, src: ByteSource, size: int
) -> None:
    """Upload ``src`` as chunk objects under ``prefix``, several PUTs at once."""

    def put(item: tuple[int, tuple[int, int]]) -> None:
        index, (start, length) = item
        store.put(chunk_key(prefix, index), src.read(start, length))

    list(pool.map(put, enumerate(spans(src.total, size))))


def put_multipart(
    store: RawStore, pool: ThreadPoolExecutor, key: str, src: ByteSource, size: int
) -> None:
    """Upload ``src`` as one object, its parts several at once."""
    parts = spans(src.total, size)
    upload = store.multipart(key)

    def put(index: int) -> Any:
        start, length = parts[index]
        return upload.part(index, src.read(start, length))

    upload.complete(list(pool.map(put, range(len(parts)))))


def get_chunks(
    store: RawStore, pool: ThreadPoolExecutor, prefix: str, out: bytearray, size: int
) -> None:
    """Download the chunk objects under ``prefix`` into ``out``, several GETs at once."""
    view = memoryview(out)

    def get(item: tuple[int, tuple[int, int]]) -> None:
        index, (start, length) = item
        data = store.get(chunk_key(prefix, index))
        if len(data) != length:
            raise OSError(f"chunk {index}: got {len(data)} bytes, expected {length}")
        view[start : start + length] = data

    list(pool.map(get, enumerate(spans(len(out), size))))


def get_ranges(
    store: RawStore, pool: ThreadPoolExecutor, key: str, out: bytearray, size: int
) -> None:
    """Download object ``key`` into ``out`` as ranged GETs of ``size`` bytes, several at once."""
    get_objects(store, pool, [(key, out)], size)


def get_objects(
    store: RawStore, pool: ThreadPoolExecutor, objects: list[tuple[str, bytearray]], size: int
) -> None:
    """Download each ``(key, out)`` into its ``out`` as ranged GETs of ``size`` bytes, those of
    every object in flight together (object by object, a run of small objects would go one
    connection at a time)."""

    def get(task: tuple[str, memoryview, int, int]) -> None:
        key, view, start, length = task
        data = store.get_range(key, start, length)
        if len(data) != length:
            raise OSError(f"{key}: range at {start}: got {len(data)} bytes, expected {length}")
        view[start : start + length] = data

    tasks = [(key, memoryview(out), start, length)
             for key, out in objects for start, length in spans(len(out), size)]
    list(pool.map(get, tasks))
