"""The S3 data path: GETs, PUTs, multipart uploads, HEADs and listings on one botocore client.

s3fs funnels every call of a process through one asyncio loop and costs
5-7 ms of client CPU per small GET (2-3 ms for a plain botocore client), and
its ``put_file`` reads each whole file into memory before sending it. Bulk
bytes (checkpoint shards, training files) therefore go through a thread-safe
botocore client here, with upload bodies streamed from the staged file in
small chunks, and so do the recursive listings, the bucket check and small
(conditional) publishes, so a save or a load never builds an s3fs client.
Deletes and directory-style listings stay on s3fs.

``S3Transport.for_options`` returns ``None`` for storage options it does not
map faithfully, and the volume then keeps using s3fs for everything.
Retries are the volume's (``_retry.py``): botocore's own are turned off so
an attempt is never retried twice over.
"""

from __future__ import annotations

import contextlib
import http.client
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dcp_volumes._streams import FileSlice

# s3fs options with no effect on the data path (caching, async plumbing).
_IGNORED_OPTIONS = frozenset(
    {
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "skip_instance_cache",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "asynchronous",
        "loop",
        "max_concurrency",
        "fixed_upload_size",
        "cache_regions",
    }
)
# Options mapped onto the botocore client; any other option keeps s3fs.
_MAPPED_OPTIONS = frozenset(
    {
        "key",
        "secret",
        "token",
        "anon",
        "endpoint_url",
        "client_kwargs",
        "config_kwargs",
        "profile",
        "use_ssl",
    }
)
_CLIENT_KWARGS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "verify",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "use_ssl",
    }
)


def _read_body_into(raw: Any, outs: Sequence[memoryview]) -> int:
    """Read a urllib3 response body into ``outs``, one after another, until full or it ends.

    urllib3's ``readinto`` reads into a new ``bytes`` and copies that: for a plain
    (not content-decoded) body this reads from the socket's file straight into
    the buffers instead, then hands the connection back to the pool as urllib3
    does at the end of a body. Connection errors surface as ``ConnectionError`` /
    ``TimeoutError`` / ``IncompleteRead``, all transient for the volume's retries.
    """
    fp: Any = getattr(raw, "_fp", None)
    headers = getattr(raw, "headers", {})
    plain = fp is not None and headers.get("content-encoding", "identity") == "identity"
    read = fp.readinto if plain else raw.readinto
    total = 0
    for out in outs:
        got = 0
        while got < len(out):
            n = read(out[got:])
            if not n:
                break
            got += n
        total += got
        if got < len(out):  # the body ended
            if plain and fp.length:  # closed before its length
                raise http.client.IncompleteRead(b"", fp.length)
            break
    if plain and fp.isclosed():
        raw.release_conn()  # the whole body was read: keep the connection
    return total


class S3Transport:
    """Bulk GET/PUT for one set of storage options (create one per process)."""

    def __init__(self, client: Any, signed_get: Any = None) -> None:
        self._client = client
        self._signed_get = signed_get  # a SignedGet, or None: every GET through botocore

    @classmethod
    def for_options(
        cls, options: Mapping[str, Any], *, max_connections: int = 64, session: Any = None
    ) -> S3Transport | None:
        """A transport for these s3fs-style options, or ``None`` to keep s3fs.

        ``session``: a botocore session to create the client from (a new one if
        None); see ``_clients.shared_s3_transport`` for why it is shared.
        """
        try:
            import botocore.session
            from botocore import UNSIGNED
            from botocore.config import Config
        except ImportError:
            return None
        unknown = set(options) - _IGNORED_OPTIONS - _MAPPED_OPTIONS
        client_kwargs = dict(options.get("client_kwargs") or {})
        if unknown or set(client_kwargs) - _CLIENT_KWARGS:
            return None
        config_kwargs: dict[str, Any] = {
            "max_pool_connections": max_connections,
            "retries": {"total_max_attempts": 1},  # the volume retries (_retry.py)
            # Our manifest checksums every file; skip botocore's per-request CRCs.
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            **dict(options.get("config_kwargs") or {}),
        }
        if options.get("anon"):
            config_kwargs["signature_version"] = UNSIGNED
        if session is None:
            session = botocore.session.Session(profile=options.get("profile"))
        kwargs: dict[str, Any] = {
            "aws_access_key_id": options.get("key"),
            "aws_secret_access_key": options.get("secret"),
            "aws_session_token": options.get("token"),
            "endpoint_url": options.get("endpoint_url"),
        }
        if "use_ssl" in options:
            kwargs["use_ssl"] = bool(options["use_ssl"])
        kwargs.update(client_kwargs)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if not kwargs.get("region_name") and not session.get_config_variable("region"):
            kwargs["region_name"] = "us-east-1"  # botocore must sign for some region
        client = session.create_client("s3", config=Config(**config_kwargs), **kwargs)
        from dcp_volumes._s3_signed_get import SignedGet

        return cls(client, SignedGet.for_client(client))

    # -- reads ----------------------------------------------------------------------------

    def get(self, bucket: str, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or ``[start, end)`` of them (clipped at its end)."""
        range_header = None
        if start is not None or end is not None:
            first = start or 0
            if end is not None and end <= first:
                return b""
            range_header = f"bytes={first}-" + ("" if end is None else str(end - 1))
        opened = self._open(bucket, key, range_header)
        if opened is None:
            return b""  # the range starts at or past the end: no bytes, as s3fs says
        raw, size = opened
        try:
            data = bytes(raw.read())
        finally:
            raw.close()
        if size >= 0 and len(data) != size:  # cut off: transient, retried
            raise http.client.IncompleteRead(data[:0], size - len(data))
        return data

    def get_into(
        self, bucket: str, key: str, start: int, outs: Sequence[memoryview], *, whole: bool = False
    ) -> int:
        """Read the bytes from ``start`` into the buffers ``outs`` in turn; returns how many
        arrived.

        No ``bytes`` of the whole range is built: the body is read piece by piece
        into the caller's buffers (a load's are hundreds of MiB per rank, often
        the target tensors themselves). ``whole``: the object is exactly as
        long as the buffers, so ask for it without a Range header (some servers
        read the whole object per range); another length comes back as the
        count, unread.
        """
        length = sum(len(out) for out in outs)
        if not length:
            return 0
        range_header = None if whole and start == 0 else f"bytes={start}-{start + length - 1}"
        opened = self._open(bucket, key, range_header)
        if opened is None:
            return 0
        raw, size = opened
        try:
            if range_header is None and size != length:
                return max(0, size)
            return _read_body_into(raw, outs)
        finally:
            raw.close()

    def _open(self, bucket: str, key: str, range_header: str | None) -> tuple[Any, int] | None:
        """A GET's urllib3 response and Content-Length; ``None`` for a range past the end.

        Signed by hand where possible (``_s3_signed_get.py``); botocore sends
        the rest and interprets every answer that is not a success.
        """
        signed = self._signed_get
        raw = signed.open(bucket, key, range_header) if signed is not None else None
        if raw is not None:
            return raw, int(raw.headers.get("content-length", -1))
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if range_header is not None:
            kwargs["Range"] = range_header
        try:
            response = self._client.get_object(**kwargs)
        except Exception as exc:
            if _code(exc) in ("InvalidRange", "416"):
                return None
            raise
        if signed is not None:
            signed.botocore_succeeded(bucket)
        body = response["Body"]
        return getattr(body, "_raw_stream", body), int(response.get("ContentLength", -1))

    def head(self, bucket: str, key: str) -> tuple[int, str | None, float | None]:
        """``(size, etag, mtime)`` of an object, in one HEAD request."""
        response = self._client.head_object(Bucket=bucket, Key=key)
        modified = response.get("LastModified")
        etag = response.get("ETag")
        return (
            int(response["ContentLength"]),
            str(etag).strip('"') if etag else None,
            modified.timestamp() if modified is not None else None,
        )

    def check_bucket(self, bucket: str) -> None:
        """Raise unless the bucket exists and these credentials may use it."""
        self._client.head_bucket(Bucket=bucket)

    def list(self, bucket: str, prefix: str) -> list[tuple[str, int, str | None, float | None]]:
        """``(key, size, etag, mtime)`` of every object under ``prefix`` (pages followed)."""
        found = []
        for page in self._client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix
        ):
            for obj in page.get("Contents", ()):
                key = obj["Key"]
                if key.endswith("/"):
                    continue  # a "directory" marker, not a file
                etag = obj.get("ETag")
                modified = obj.get("LastModified")
                found.append(
                    (
                        key,
                        int(obj["Size"]),
                        str(etag).strip('"') if etag else None,
                        modified.timestamp() if modified is not None else None,
                    )
                )
        return found

    # -- writes ---------------------------------------------------------------------------

    def put_bytes(self, bucket: str, key: str, data: bytes, *, exclusive: bool) -> None:
        """One PUT of a small object; ``exclusive`` adds ``If-None-Match: *``."""
        extra = {"IfNoneMatch": "*"} if exclusive else {}
        self._client.put_object(Bucket=bucket, Key=key, Body=data, **extra)

    def put(
        self,
        local_path: str,
        bucket: str,
        key: str,
        *,
        size: int,
        part_size: int,
        concurrency: int,
        retry: Callable[[str, Callable[[], Any]], Any],
    ) -> None:
        """Upload a local file: one streamed PUT, or a multipart upload of streamed parts.

        ``retry(op, fn)`` runs one request with the volume's retry policy, so a
        failed part is retried alone, not the whole file.
        """
        if size <= part_size:
            retry(
                "upload",
                lambda: self._send(
                    self._client.put_object, local_path, 0, size, Bucket=bucket, Key=key
                ),
            )
            return
        upload_id = retry(
            "upload", lambda: self._client.create_multipart_upload(Bucket=bucket, Key=key)
        )["UploadId"]
        try:
            offsets = list(range(0, size, part_size))

            def send(number: int) -> dict[str, Any]:
                offset = offsets[number - 1]
                length = min(part_size, size - offset)
                etag = retry(
                    "upload",
                    lambda: self._send(
                        self._client.upload_part,
                        local_path,
                        offset,
                        length,
                        Bucket=bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                    ),
                )["ETag"]
                return {"PartNumber": number, "ETag": etag}

            numbers = range(1, len(offsets) + 1)
            if concurrency <= 1:
                parts = [send(n) for n in numbers]
            else:
                with ThreadPoolExecutor(max_workers=min(concurrency, len(offsets))) as pool:
                    parts = list(pool.map(send, numbers))
            retry(
                "upload",
                lambda: self._client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
        except BaseException:
            # Never leave billed, invisible parts behind; the error that matters is the first.
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            raise

    @staticmethod
    def _send(call: Callable[..., Any], path: str, offset: int, length: int, **kwargs: Any) -> Any:
        # A fresh body per attempt: a retry must send from the slice's start.
        with FileSlice(path, offset, length) as body:
            return call(Body=body, ContentLength=length, **kwargs)


def _code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        return str(response.get("Error", {}).get("Code") or "") or None
    return None
