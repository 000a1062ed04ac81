"""The store's own encryption (S3 SSE-C, SSE-KMS) through ``storage_options``, on every request.

moto does not honour SSE-C: there a recording proxy shows that every object request of a
save, a load, retention, the CLI and the data side carries the headers. Ceph radosgw
(with its testing KMS backend, ``testkit.radosgw.TEST_KMS_KEYS``) is the real store:
SSE-C and SSE-KMS saves, loads, resharded loads, ``ls``/``verify``/``gc``, a cached
dataset epoch, and reads without the key refused with a typed error.
"""

from __future__ import annotations

import base64
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import (
    CheckpointManager,
    ConfigurationError,
    Encryption,
    VolumeDataset,
    VolumeEncryptionError,
    VolumeReader,
    VolumeWriter,
    storage_error,
)
from dcp_volumes._volume import Volume
from dcp_volumes._volume._options import spell
from testkit.proxy import LatencyProxy
from testkit.radosgw import TEST_KMS_KEYS
from testkit.ranks import run_ranks
from tests.test_cli import run_cli

pytestmark = [pytest.mark.emulator, pytest.mark.filterwarnings("ignore::UserWarning")]

CUSTOMER_KEY = bytes(range(7, 39))
CUSTOMER_KEY_B64 = base64.b64encode(CUSTOMER_KEY).decode()
SSE_C = {"server_side_encryption": "sse-c", "sse_customer_key_base64": CUSTOMER_KEY_B64}
# The same, as s3fs users write it.
SSE_C_S3FS = {"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256",
                                       "SSECustomerKey": CUSTOMER_KEY}}
SSE_KMS = {"s3_additional_kwargs": {"ServerSideEncryption": "aws:kms",
                                    "SSEKMSKeyId": "testkey-1"}}


def _state(n: int = 3 * 2**20) -> dict[str, Any]:
    return {"w": torch.arange(n, dtype=torch.float32), "step": 3}


def _blank(n: int = 3 * 2**20) -> dict[str, Any]:
    return {"w": torch.zeros(n), "step": 0}


def test_both_spellings_give_both_clients_the_same_encryption() -> None:
    for options in (SSE_C, SSE_C_S3FS):
        spelling = spell("s3", options)
        assert spelling.obstore.config == SSE_C
        assert spelling.fsspec["s3_additional_kwargs"] == {
            "SSECustomerAlgorithm": "AES256", "SSECustomerKey": CUSTOMER_KEY}
        assert not spelling.beyond_obstore and not spelling.beyond_fsspec
    kms = spell("s3", SSE_KMS)
    assert kms.obstore.config == {"server_side_encryption": "aws:kms",
                                  "sse_kms_key_id": "testkey-1"}
    assert spell("s3", {"sse_kms_key_id": "k"}).obstore.config["server_side_encryption"] == (
        "aws:kms")
    assert spell("s3", {"server_side_encryption": "aws:kms:dsse"}).fsspec == {
        "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms:dsse"}}
    for bad, says in (({"server_side_encryption": "sse-c"}, "without the customer key"),
                      ({"server_side_encryption": "rot13"}, "no server-side encryption"),
                      ({"sse_customer_key_base64": "c2hvcnQ="}, "32 bytes"),
                      ({**SSE_C, "sse_kms_key_id": "k"}, "KMS key goes with"),
                      ({"s3_additional_kwargs": {"SSECustomerAlgorithm": "DES"}}, "AES256")):
        with pytest.raises(ConfigurationError, match=says) as info:
            spell("s3", bad)
        assert CUSTOMER_KEY_B64 not in str(info.value)
    # The key is a secret: no repr shows it.
    volume = Volume("s3://bucket/run", storage_options={"key": "k", "secret": "s", **SSE_C})
    assert CUSTOMER_KEY_B64 not in repr(volume) + repr(spell("s3", SSE_C))


# -- moto: every request carries the headers ------------------------------------------------

_SSE_C_HEADERS = {"x-amz-server-side-encryption-customer-algorithm",
                  "x-amz-server-side-encryption-customer-key",
                  "x-amz-server-side-encryption-customer-key-md5"}


@pytest.fixture
def recorded(moto_server: Any) -> Iterator[tuple[str, dict[str, Any], LatencyProxy]]:
    with LatencyProxy.in_front_of(moto_server) as proxy:
        bucket = moto_server.create_bucket(f"sse-{os.urandom(4).hex()}")
        yield bucket, moto_server.storage_options(proxy.endpoint), proxy


def _object_requests(proxy: LatencyProxy) -> list[tuple[str, str, frozenset[str]]]:
    """The requests that read or write an object's data: not listings (of the bucket),
    not batch deletes, aborts or the completion of a multipart upload (which carry no
    object data and take no encryption headers)."""
    out = []
    for method, target, names in proxy.headers:
        path, _, query = target.partition("?")
        if len(path.strip("/").split("/")) < 2 or method == "DELETE":
            continue
        if method == "POST" and ("delete" in query or "uploadId=" in query):
            continue
        out.append((method, target, names))
    return out


def test_every_object_request_of_saves_loads_retention_cli_and_data_carries_sse_c(
        recorded: tuple[str, dict[str, Any], LatencyProxy], tmp_path: Path) -> None:
    bucket, plain, proxy = recorded
    options = {**plain, **SSE_C_S3FS}
    root = f"{bucket}/run"
    with CheckpointManager(root, keep_last=1, storage_options=options, keep_local=True,
                           local_dir=tmp_path / "local", staging_dir=tmp_path,
                           writer_options={"part_size": "5MiB", "file_size": "8MiB"}) as mgr:
        mgr.save(1, _state(4 * 2**20))  # 16 MiB: multipart uploads, several files
        mgr.save(2, _state(4 * 2**20))  # retention deletes step 1 once step 2 is committed
    with CheckpointManager(root, storage_options=options) as mgr:  # no local tier: the volume
        state = _blank(4 * 2**20)
        assert mgr.restore(state) == 2 and torch.equal(state["w"], _state(4 * 2**20)["w"])
    for args in (("ls", root), ("verify", f"{root}/2"), ("inspect", f"{root}/2")):
        result = run_cli(*args, options={**plain, **SSE_C})  # JSON: the key as base64
        assert result.returncode == 0, result
    Volume(f"{bucket}/data", storage_options=options).publish("a.bin", b"x" * 100)
    ds = VolumeDataset(f"{bucket}/data", storage_options=options, cache_dir=tmp_path / "cache",
                       shuffle=False, transform=lambda p: Path(p).read_bytes())
    assert [len(x) for x in ds] == [100]
    requests = _object_requests(proxy)
    methods = {m for m, _, _ in requests}
    assert {"PUT", "GET", "HEAD", "POST"} <= methods, methods  # POST: multipart starts
    missing = [(m, t) for m, t, names in requests if not names >= _SSE_C_HEADERS]
    assert not missing, missing[:5]


# -- radosgw: the real store ------------------------------------------------------------------


@pytest.fixture
def rgw_bucket(radosgw: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    url = radosgw.create_bucket(f"sse-{os.urandom(4).hex()}")
    try:
        yield url, radosgw.storage_options()
    finally:
        radosgw.reset()


def _save_two_ranks(rank: int, world: int, url: str, options: dict[str, Any]) -> None:
    warnings.simplefilter("ignore")
    state = {f"rank{rank}": torch.full((2**18,), float(rank)), "shared": torch.arange(8.0)}
    dcp.save(state, storage_writer=VolumeWriter(url, storage_options=options))


@pytest.mark.parametrize("sse", [pytest.param(SSE_C_S3FS, id="sse-c"),
                                 pytest.param(SSE_KMS, id="sse-kms")])
def test_radosgw_saves_loads_reshards_lists_verifies_collects_and_caches(
        rgw_bucket: tuple[str, dict[str, Any]], radosgw: Any, tmp_path: Path,
        sse: dict[str, Any]) -> None:
    bucket, plain = rgw_bucket
    options = {**plain, **sse}
    root = f"{bucket}/run"
    with CheckpointManager(root, keep_last=None, storage_options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, _state())
        state = _blank()
        assert mgr.restore(state) == 2 and torch.equal(state["w"], _state()["w"])
    # Two ranks save; one process loads both ranks' entries (a resharded load).
    run_ranks(_save_two_ranks, 2, f"{root}-ranks", options)
    both = {"rank0": torch.zeros(2**18), "rank1": torch.zeros(2**18), "shared": torch.zeros(8)}
    dcp.load(both, storage_reader=VolumeReader(f"{root}-ranks", storage_options=options))
    assert torch.equal(both["rank1"], torch.ones(2**18))
    json_options = {**plain, **(SSE_C if "SSECustomerKey" in str(sse) else sse)}
    assert run_cli("ls", root, options=json_options).returncode == 0
    assert run_cli("verify", f"{root}/2", options=json_options).returncode == 0
    gc = run_cli("gc", root, "--keep-last", "1", options=json_options)
    assert gc.returncode == 0, gc
    assert [i.step for i in CheckpointManager(root, storage_options=options).list()] == [2]
    # The data side: one epoch fills the cache, the next reads it locally.
    Volume(f"{bucket}/data", storage_options=options).publish("a.bin", b"y" * 1000)
    ds = VolumeDataset(f"{bucket}/data", storage_options=options, cache_dir=tmp_path / "c",
                       shuffle=False, transform=lambda p: Path(p).read_bytes())
    assert [x for x in ds] == [b"y" * 1000] == [x for x in ds]
    # The store really encrypted them: its HEAD names the encryption.
    s3 = radosgw.boto3_client()
    key = f"{root.split('/', 3)[3]}/step-00000002/.metadata"
    extra = ({"SSECustomerAlgorithm": "AES256", "SSECustomerKey": CUSTOMER_KEY}
             if "SSECustomerKey" in str(sse) else {})
    head = s3.head_object(Bucket=bucket.removeprefix("s3://"), Key=key, **extra)
    if extra:
        assert head["SSECustomerAlgorithm"] == "AES256"
    else:
        assert head["ServerSideEncryption"] == "aws:kms" and head["SSEKMSKeyId"] == "testkey-1"


def test_radosgw_refuses_an_sse_c_read_without_its_key_and_carries_client_side_encryption(
        rgw_bucket: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    bucket, plain = rgw_bucket
    url = f"{bucket}/ck"
    dcp.save(_state(), storage_writer=VolumeWriter(url, storage_options={**plain, **SSE_C}))
    other = base64.b64encode(os.urandom(32)).decode()
    for options, says in ((plain, "read without it"),
                          ({**plain, "sse_customer_key_base64": other}, "written with another")):
        with caplog.at_level(logging.DEBUG), pytest.raises(BaseException) as info:
            dcp.load(_blank(), storage_reader=VolumeReader(url, storage_options=options))
        err = storage_error(info.value)  # torch wraps the reader's error in its own
        assert isinstance(err, VolumeEncryptionError), repr(info.value)
        text = str(err) + caplog.text
        assert says in str(err) and "Fix:" in str(err)
        assert CUSTOMER_KEY_B64 not in text and other not in text
    assert TEST_KMS_KEYS  # the KMS keys radosgw was started with (SSE-KMS test above)
    # Client-side encryption over the store's own: both layers on a real S3 server.
    enc = Encryption(key=os.urandom(32), key_id="rgw")
    sealed = f"{bucket}/sealed"
    options = {**plain, **SSE_C}
    dcp.save(_state(), storage_writer=VolumeWriter(sealed, storage_options=options,
                                                   encryption=enc, compression="zstd"))
    out = _blank()
    dcp.load(out, storage_reader=VolumeReader(sealed, storage_options=options, encryption=enc))
    assert torch.equal(out["w"], _state()["w"])


def test_gcs_encryption_names_gcsfs_would_ignore_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="gcsfs sends no customer-supplied") as info:
        Volume("gs://bucket/run", storage_options={"token": "anon", "kms_key_name": "k"})
    assert "encryption=Encryption" in str(info.value)


def test_obstore_takes_the_aws_tools_encryption_variable(
        recorded: tuple[str, dict[str, Any], LatencyProxy],
        monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, plain, proxy = recorded
    monkeypatch.setenv("AWS_SERVER_SIDE_ENCRYPTION", "AES256")
    Volume(f"{bucket}/env", storage_options=plain).publish("a", b"x")
    puts = [names for method, _, names in proxy.headers if method == "PUT"]
    assert puts and all("x-amz-server-side-encryption" in names for names in puts)
