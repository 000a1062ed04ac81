"""The radosgw launcher (testkit/radosgw.py) against the real S3 semantics tests rely on.

Skipped when the Ceph binaries are not installed (``sudo bash testkit/install_radosgw.sh``).
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.radosgw import INSTALL_COMMAND, RadosGW
from tests.conftest import unique_bucket_name

pytestmark = pytest.mark.emulator

_MiB = 1 << 20


@pytest.fixture(scope="module")
def rgw() -> Iterator[RadosGW]:
    if RadosGW.find_binaries() is None:
        pytest.skip(f"Ceph radosgw is not installed; run `{INSTALL_COMMAND}`")
    t0 = time.monotonic()
    server = RadosGW().start()
    print(f"radosgw start: {time.monotonic() - t0:.1f} s {server.timings}")
    try:
        yield server
    finally:
        t0 = time.monotonic()
        server.stop()
        print(f"radosgw stop: {time.monotonic() - t0:.1f} s")


@pytest.fixture
def bucket(rgw: RadosGW, request: pytest.FixtureRequest) -> Iterator[str]:
    name = unique_bucket_name(request)
    rgw.create_bucket(name)
    try:
        yield name
    finally:
        rgw.reset()


def test_multipart_put_get_and_ranged_get(rgw: RadosGW, bucket: str) -> None:
    from boto3.s3.transfer import TransferConfig

    s3: Any = rgw.boto3_client()
    data = os.urandom(20 * _MiB)
    # 8 MiB parts: three parts, the last one short.
    config = TransferConfig(multipart_threshold=8 * _MiB, multipart_chunksize=8 * _MiB)
    s3.upload_fileobj(io.BytesIO(data), bucket, "big", Config=config)

    head = s3.head_object(Bucket=bucket, Key="big")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-3")  # a real multipart upload
    body = s3.get_object(Bucket=bucket, Key="big")["Body"].read()
    assert hashlib.sha256(body).digest() == hashlib.sha256(data).digest()

    start, end = 8 * _MiB - 5, 8 * _MiB + 5  # across a part boundary
    part = s3.get_object(Bucket=bucket, Key="big", Range=f"bytes={start}-{end}")
    assert part["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert part["Body"].read() == data[start : end + 1]
    tail = s3.get_object(Bucket=bucket, Key="big", Range="bytes=-7")
    assert tail["Body"].read() == data[-7:]


def test_list_with_prefix(rgw: RadosGW, bucket: str) -> None:
    s3: Any = rgw.boto3_client()
    for key in ("a/1", "a/2", "a/sub/3", "b/1"):
        s3.put_object(Bucket=bucket, Key=key, Body=key.encode())
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="a/")
    assert [o["Key"] for o in listed["Contents"]] == ["a/1", "a/2", "a/sub/3"]
    shallow = s3.list_objects_v2(Bucket=bucket, Prefix="a/", Delimiter="/")
    assert [o["Key"] for o in shallow["Contents"]] == ["a/1", "a/2"]
    assert [p["Prefix"] for p in shallow["CommonPrefixes"]] == ["a/sub/"]


def test_small_requests_do_not_wait_for_a_delayed_ack(rgw: RadosGW, bucket: str) -> None:
    """A small GET takes about a millisecond, not the ~40 ms of Nagle meeting a delayed ACK.

    Without ``tcp_nodelay`` on beast every small response stalled until the
    client's delayed ACK (median 44 ms per GET on loopback, measured).
    """
    s3: Any = rgw.boto3_client()
    s3.put_object(Bucket=bucket, Key="small", Body=b"x" * 100)
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        s3.get_object(Bucket=bucket, Key="small")["Body"].read()
        times.append(time.perf_counter() - t0)
    assert sorted(times)[len(times) // 2] < 0.02, times


def test_conditional_put_if_none_match(rgw: RadosGW, bucket: str) -> None:
    from botocore.exceptions import ClientError

    s3: Any = rgw.boto3_client()
    s3.put_object(Bucket=bucket, Key="once", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as excinfo:
        s3.put_object(Bucket=bucket, Key="once", Body=b"second", IfNoneMatch="*")
    assert excinfo.value.response["Error"]["Code"] == "PreconditionFailed"
    assert excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3.get_object(Bucket=bucket, Key="once")["Body"].read() == b"first"


def test_batch_delete(rgw: RadosGW, bucket: str) -> None:
    s3: Any = rgw.boto3_client()
    keys = [f"d/{i}" for i in range(25)]
    for key in keys:
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    res = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[:20]]})
    assert sorted(d["Key"] for d in res["Deleted"]) == sorted(keys[:20])
    assert not res.get("Errors")
    left = s3.list_objects_v2(Bucket=bucket, Prefix="d/")["Contents"]
    assert sorted(o["Key"] for o in left) == sorted(keys[20:])


def test_reset_removes_buckets_objects_and_uploads(rgw: RadosGW) -> None:
    s3: Any = rgw.boto3_client()
    rgw.create_bucket("t-reset-a")
    assert rgw.create_bucket("t-reset-b") == "s3://t-reset-b"
    s3.put_object(Bucket="t-reset-a", Key="k", Body=b"x")
    s3.put_bucket_versioning(Bucket="t-reset-b", VersioningConfiguration={"Status": "Enabled"})
    s3.put_object(Bucket="t-reset-b", Key="v", Body=b"1")
    s3.put_object(Bucket="t-reset-b", Key="v", Body=b"2")
    s3.delete_object(Bucket="t-reset-b", Key="v")  # leaves a delete marker over 2 versions
    s3.create_multipart_upload(Bucket="t-reset-a", Key="unfinished")
    rgw.reset()
    assert s3.list_buckets()["Buckets"] == []


def test_storage_options_with_s3fs(rgw: RadosGW, bucket: str) -> None:
    fs = rgw.filesystem()
    fs.pipe(f"{bucket}/f", b"via s3fs")
    assert fs.cat(rgw.url(bucket, "f")) == b"via s3fs"
    assert "region_name" not in rgw.storage_options()["client_kwargs"]


def test_missing_binaries_error_names_the_install_command(tmp_path: Path) -> None:
    from testkit.emulators import EmulatorError

    with pytest.raises(EmulatorError, match=r"install_radosgw\.sh"):
        RadosGW(bin_dir=tmp_path).start()
    assert not list(tmp_path.iterdir())  # nothing started, nothing written
