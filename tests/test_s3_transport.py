"""The botocore data path for S3 volumes (``_s3_transport.py``), against moto's HTTP server.

What it must keep from the s3fs path it replaces: byte-exact reads and
writes, retries that resend a body from its start, typed errors, no
multipart leftovers, and a fallback to s3fs for options it does not map.
What it adds: upload bodies streamed from disk (memory stays flat).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from dcp_volumes._exceptions import VolumeAccessError, VolumeNotFoundError
from dcp_volumes._volume import Volume
from tests.emulators import LatencyProxy, MotoServer

MiB = 2**20


def _file(path: Path, size: int, seed: int = 0) -> bytes:
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    data = bytes((b + seed) % 256 for b in data[:4096]) + data[4096:]
    path.write_bytes(data)
    return data


def test_s3_volume_uses_transport_and_reads_exact_ranges(s3_bucket, tmp_path):
    url, options = s3_bucket
    vol = Volume(url, storage_options=options)
    assert vol.s3 is not None
    data = _file(tmp_path / "a", 3 * MiB + 17)
    vol.put_file(tmp_path / "a", "dir/a.bin")
    assert vol.read_bytes("dir/a.bin") == data
    assert vol.read_bytes("dir/a.bin", 5, 4000) == data[5:4000]
    assert vol.read_bytes("dir/a.bin", len(data) - 3, len(data) + 100) == data[-3:]
    assert vol.read_bytes("dir/a.bin", len(data) + 10, len(data) + 20) == b""
    out = bytearray(1000)
    assert vol.read_into("dir/a.bin", 100, memoryview(out)) == 1000
    assert bytes(out) == data[100:1100]
    with pytest.raises(VolumeNotFoundError, match="dir/missing"):
        vol.read_bytes("dir/missing")


def test_multipart_upload_streams_parts_and_leaves_no_upload_behind(
    s3_bucket, tmp_path, moto_server: MotoServer
):
    url, options = s3_bucket
    vol = Volume(url, storage_options=options)
    data = _file(tmp_path / "big", 12 * MiB + 5, seed=3)
    vol.put_file(tmp_path / "big", "big.bin", part_size=5 * MiB, concurrency=3)
    assert vol.info("big.bin").size == len(data)
    assert vol.read_bytes("big.bin") == data
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    uploads = moto_server.boto3_client().list_multipart_uploads(Bucket=bucket)
    assert not uploads.get("Uploads")


def test_retried_upload_resends_the_body_from_its_start(moto_server: MotoServer, tmp_path):
    bucket = "transport-retry"
    moto_server.create_bucket(bucket)
    with LatencyProxy.in_front_of(moto_server) as proxy:
        vol = Volume(
            f"s3://{bucket}/x", storage_options=moto_server.storage_options(proxy.endpoint)
        )
        data = _file(tmp_path / "f", 2 * MiB + 1, seed=7)
        # Cut the first PUT after part of its body went through: the retry must
        # send the whole body again, not the rest of a half-read stream.
        proxy.drop_next(1, method="PUT")
        vol.put_file(tmp_path / "f", "f.bin")
        assert proxy.count("PUT", f"/{bucket}/x/f.bin") == 2
        assert vol.read_bytes("f.bin") == data


def test_body_cut_mid_stream_is_retried(moto_server: MotoServer):
    # Bodies are read off the socket straight into the caller's buffer: a cut in
    # the middle must surface as a transient error (retried, whole GET again).
    bucket = "transport-cut"
    moto_server.create_bucket(bucket)
    data = os.urandom(3 * MiB + 17)
    moto_server.boto3_client().put_object(Bucket=bucket, Key="x/f.bin", Body=data)
    with LatencyProxy.in_front_of(moto_server) as proxy:
        vol = Volume(
            f"s3://{bucket}/x", storage_options=moto_server.storage_options(proxy.endpoint)
        )
        out = memoryview(bytearray(len(data)))
        assert vol.read_into("f.bin", 0, out, whole=True) == len(data)
        proxy.drop_next(1, after_bytes=MiB, method="GET")
        out[:] = bytes(len(data))
        assert vol.read_into("f.bin", 0, out, whole=True) == len(data)
        assert bytes(out) == data
        assert proxy.count("GET", f"/{bucket}/x/f.bin") == 3
        for _ in range(5):
            assert vol.read_into("f.bin", 5, out[:1000]) == 1000
        assert bytes(out[:1000]) == data[5:1005]
        # A read into bytes, cut the same way: retried, never the first MiB alone.
        before = proxy.count("GET", f"/{bucket}/x/f.bin")
        proxy.drop_next(1, after_bytes=MiB, method="GET")
        assert vol.read_bytes("f.bin") == data
        assert proxy.count("GET", f"/{bucket}/x/f.bin") == before + 2


def test_botocore_error_codes_become_typed_errors():
    # End-to-end wrong-credential cases run in test_checkpoint_errors.py; here
    # the codes only the botocore path produces (s3fs raised built-ins).
    from botocore.exceptions import ClientError

    from dcp_volumes._retry import translate_error

    err = ClientError(
        {"Error": {"Code": "SignatureDoesNotMatch"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
        "GetObject",
    )
    out = translate_error(err, "read", "s3://b/k", lambda t: t.replace("sekrit", "***"))
    assert isinstance(out, VolumeAccessError)
    missing = ClientError(
        {"Error": {"Code": "NoSuchKey"}, "ResponseMetadata": {"HTTPStatusCode": 404}}, "GetObject"
    )
    assert isinstance(translate_error(missing, "read", "s3://b/k", str), VolumeNotFoundError)


def test_unmapped_options_and_env_switch_keep_s3fs(s3_bucket, monkeypatch, tmp_path):
    url, options = s3_bucket
    assert Volume(url, storage_options={**options, "requester_pays": True}).s3 is None
    monkeypatch.setenv("DCP_VOLUMES_S3_TRANSPORT", "0")
    vol = Volume(url, storage_options=options)
    assert vol.s3 is None
    data = _file(tmp_path / "g", 100_000)
    vol.put_file(tmp_path / "g", "g.bin")
    assert vol.read_bytes("g.bin", 10, 20) == data[10:20]


def test_upload_memory_stays_flat(moto_server: MotoServer, tmp_path):
    """A 128 MiB single PUT must not read the file into memory (s3fs's put_file does)."""
    bucket = "transport-memory"
    moto_server.create_bucket(bucket)
    src = tmp_path / "state.bin"
    with open(src, "wb") as f:
        f.write(os.urandom(MiB) * 128)
    script = textwrap.dedent(
        f"""
        import resource, json, sys
        from dcp_volumes._volume import Volume
        vol = Volume("s3://{bucket}/m", storage_options={moto_server.storage_options()!r})
        vol.put_file({str(src)!r}, "warm.bin", part_size=256 * 2**20, verify_size=False)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        vol.put_file({str(src)!r}, "state.bin", part_size=256 * 2**20)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"grew_kib": after - before}}))
        """
    )
    # Warm-up with a small file first so client start-up is not counted.
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 1000)
    script = script.replace(repr(str(src)) + ', "warm.bin"', repr(str(small)) + ', "warm.bin"')
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    grew_mib = int(out.stdout.strip().splitlines()[-1].split(":")[1].rstrip("}")) / 1024
    assert grew_mib < 32, f"peak RSS grew {grew_mib:.0f} MiB uploading 128 MiB"


# -- GETs signed by hand (_s3_signed_get.py) ---------------------------------------------------

_AWKWARD_KEYS = ["plain.bin", "dir a/ü~x+y=z&(1).bin", "deep/ 'quote'/%41;,.bin"]


@pytest.mark.parametrize("token", [None, "session/token+with=odd"])
@pytest.mark.parametrize("key", _AWKWARD_KEYS)
def test_signed_get_signature_equals_botocores(key: str, token: str | None) -> None:
    from urllib.parse import quote

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from dcp_volumes._s3_signed_get import sign_get, signing_key

    amz_date, host, region = "20261129T120000Z", "127.0.0.1:9000", "eu-west-1"
    path = "/bucket-a/" + quote(key, safe="/~")
    request = AWSRequest(method="GET", url=f"http://{host}{path}")
    auth = S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret/key+1", token), "s3", region)
    at = datetime.datetime(2026, 11, 29, 12, 0, 0)
    with mock.patch("botocore.auth.get_current_datetime", return_value=at):
        auth.add_auth(request)
    ours = sign_get(
        host=host,
        path=path,
        region=region,
        access_key="AKIDEXAMPLE",
        key=signing_key("secret/key+1", amz_date[:8], region),
        amz_date=amz_date,
        token=token,
    )
    assert ours["Authorization"] == request.headers["Authorization"]
    assert ours["x-amz-date"] == request.headers["X-Amz-Date"]


@pytest.mark.emulator
def test_signed_gets_pass_a_server_that_checks_signatures() -> None:
    import json
    import uuid

    import boto3

    # moto checks credentials and signatures after the first 3 requests (the IAM set-up).
    with MotoServer(mode="process", auth_after=3) as server:
        iam = boto3.client(
            "iam",
            endpoint_url=server.endpoint,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
            region_name="us-east-1",
        )
        iam.create_user(UserName="reader")
        policy = {"Version": "2012-10-17",
                  "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=json.dumps(policy))
        access = iam.create_access_key(UserName="reader")["AccessKey"]
        opts = {
            "key": access["AccessKeyId"],
            "secret": access["SecretAccessKey"],
            "client_kwargs": {"endpoint_url": server.endpoint},
        }
        s3 = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=access["AccessKeyId"],
            aws_secret_access_key=access["SecretAccessKey"],
            region_name="us-east-1",
        )
        s3.create_bucket(Bucket="signed")
        blobs = {name: os.urandom(50_000 + i) for i, name in enumerate(_AWKWARD_KEYS)}
        for name, blob in blobs.items():
            s3.put_object(Bucket="signed", Key="p/" + name, Body=blob)

        vol = Volume("s3://signed/p", storage_options=opts)
        assert vol.s3 is not None
        through_botocore: list[str] = []  # GETs that botocore itself sends

        def seen(request: Any, **_: Any) -> None:
            # Handlers all see the learning probe, which another one answers unsent.
            if not request.url.endswith("/dcp-volumes-probe"):
                through_botocore.append(request.url)

        vol.s3._client.meta.events.register("before-send.s3.GetObject", seen)
        for name, blob in blobs.items():
            out = memoryview(bytearray(len(blob)))
            assert vol.read_into(name, 0, out, whole=True) == len(blob)
            assert bytes(out) == blob
            parts = [memoryview(bytearray(10)), memoryview(bytearray(20))]
            assert vol.read_into(name, 7, parts) == 30
            assert bytes(parts[0]) + bytes(parts[1]) == blob[7:37]
        assert through_botocore == []  # every GET was signed here, and accepted

        # Errors come back through botocore, typed as before.
        with pytest.raises(VolumeNotFoundError):
            vol.read_into("missing.bin", 0, memoryview(bytearray(5)))
        assert len(through_botocore) == 1
        secret = "wrong-" + uuid.uuid4().hex
        bad = Volume("s3://signed/p", storage_options={**opts, "secret": secret})
        with pytest.raises(VolumeAccessError) as err:
            bad.read_into(_AWKWARD_KEYS[0], 0, memoryview(bytearray(5)), whole=False)
        assert secret not in str(err.value)


def test_signed_get_falls_back_when_botocore_session_refuses_it(s3_bucket, monkeypatch):
    url, options = s3_bucket
    vol = Volume(url, storage_options={**options, "config_kwargs": {"connect_timeout": 7}})
    vol.publish("f.bin", b"0123456789")
    signed = vol.s3._signed_get
    assert signed is not None

    def refuse(request: Any) -> None:
        raise AttributeError("'AWSPreparedRequest' object has no attribute 'something_new'")

    monkeypatch.setattr(signed, "_http", type("Session", (), {"send": staticmethod(refuse)})())
    out = memoryview(bytearray(4))
    assert vol.read_into("f.bin", 3, out) == 4 and bytes(out) == b"3456"  # through botocore
    assert vol.read_bytes("f.bin") == b"0123456789"
    assert signed._unavailable
