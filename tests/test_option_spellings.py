"""One set of ``storage_options`` means the same on every client and in every process.

S3 and Azure volumes go through obstore, and through s3fs / adlfs in a process
forked after obstore I/O (the DataLoader's workers on a rank with one CPU) or
under ``DCP_VOLUMES_BACKEND=fsspec``. Every name the docs accept, in obstore's
spelling or s3fs's/adlfs's, reaches both clients (issue 47: ``region`` reached
s3fs's session as a keyword and every read in the workers failed); a name one
client cannot honour is refused when the volume is built, with the reason.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes._volume import RetryPolicy, Volume, obstore_used_here
from dcp_volumes._volume._obstore_options import azure_settings, s3_settings
from dcp_volumes._volume._options import (
    AZURE_NAMES,
    S3_NAMES,
    fsspec_kwargs,
    seconds_of,
    spell,
)
from testkit.emulators import Azurite, MotoServer
from tests.test_data_support import write_samples

POLICY = RetryPolicy(attempts=2, base_delay_s=0.05, max_delay_s=0.2)
SECRET = "s3cr3t-do-not-print"


def _obstore_names(moto: MotoServer) -> dict[str, Any]:
    return {"access_key_id": moto.access_key, "secret_access_key": moto.secret_key,
            "endpoint": moto.endpoint, "region": "us-east-1"}


def _s3fs_names(moto: MotoServer) -> dict[str, Any]:
    return {"key": moto.access_key, "secret": moto.secret_key,
            "client_kwargs": {"endpoint_url": moto.endpoint, "region_name": "us-east-1"}}


def _mixed_names(moto: MotoServer) -> dict[str, Any]:
    # The issue's own: s3fs's names with obstore's ``region``.
    return {"endpoint_url": moto.endpoint, "key": moto.access_key,
            "secret": moto.secret_key, "region": "us-east-1"}


SPELLINGS = {"obstore": _obstore_names, "s3fs": _s3fs_names, "mixed": _mixed_names}


@pytest.fixture(autouse=True)
def _no_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "AWS_PROFILE",
                 "AWS_UNSIGNED_PAYLOAD", "DCP_VOLUMES_BACKEND", "DCP_VOLUMES_STORAGE_OPTIONS"):
        monkeypatch.delenv(name, raising=False)


# -- each name, both clients ------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"access_key_id": "AKID", "secret_access_key": SECRET, "session_token": "tok",
         "endpoint": "http://127.0.0.1:9000", "region": "eu-west-1"},
        {"key": "AKID", "secret": SECRET, "token": "tok",
         "endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
        {"aws_access_key_id": "AKID", "aws_secret_access_key": SECRET, "aws_session_token": "tok",
         "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}},
        {"username": "AKID", "password": SECRET, "token": "tok", "endpoint": "http://127.0.0.1:9000",
         "client_kwargs": {"region_name": "eu-west-1"}},
    ],
    ids=["obstore", "s3fs", "botocore-in-client_kwargs", "s3fs-username"],
)
def test_the_credentials_endpoint_and_region_reach_both_clients_in_their_spelling(
    options: dict[str, Any],
) -> None:
    out = s3_settings(options, POLICY)
    assert out.config["access_key_id"] == "AKID"
    assert out.config["secret_access_key"] == SECRET
    assert out.config["session_token"] == "tok"
    assert out.config["endpoint"] == "http://127.0.0.1:9000"
    assert out.config["region"] == "eu-west-1"
    assert fsspec_kwargs("s3", options, "") == {
        "key": "AKID", "secret": SECRET, "token": "tok", "endpoint_url": "http://127.0.0.1:9000",
        "client_kwargs": {"region_name": "eu-west-1"},
    }


def test_obstore_settings_reach_s3fs_as_its_own_options() -> None:
    options = {
        "virtual_hosted_style_request": True, "unsigned_payload": False,
        "server_side_encryption": "aws:kms", "sse_kms_key_id": "kms-1",
        "sse_bucket_key_enabled": True, "checksum_algorithm": "sha256",
        "request_payer": True, "skip_signature": True, "default_region": "eu-central-1",
        "allow_invalid_certificates": True, "connect_timeout": "2s",
        "client_options": {"read_timeout": timedelta(seconds=3), "user_agent": "me/1"},
        "proxy_url": "http://proxy:3128", "retry_config": {"max_retries": 1},
        "pool_max_idle_per_host": "4", "conditional_put": "etag",
    }
    out = s3_settings(options, POLICY)
    assert out.config["server_side_encryption"] == "aws:kms"
    assert out.client_options["read_timeout"] == timedelta(seconds=3)
    assert out.retry_config == {"max_retries": 1} and not out.own_retry_config
    assert fsspec_kwargs("s3", options, "") == {
        "config_kwargs": {
            "s3": {"addressing_style": "virtual", "payload_signing_enabled": True},
            "connect_timeout": 2.0, "read_timeout": 3.0, "user_agent": "me/1",
            "proxies": {"http": "http://proxy:3128", "https": "http://proxy:3128"},
        },
        "s3_additional_kwargs": {
            "ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "kms-1", "BucketKeyEnabled": True,
            "ChecksumAlgorithm": "SHA256",
        },
        "requester_pays": True, "anon": True,
        "client_kwargs": {"region_name": "eu-central-1", "verify": False},
    }


def test_s3fs_options_reach_obstore_and_stay_s3fs_own_for_s3fs() -> None:
    options = {
        "key": "AKID", "secret": SECRET, "anon": False, "requester_pays": True,
        "client_kwargs": {"endpoint_url": "https://minio:9000", "verify": "/etc/ca.pem"},
        "config_kwargs": {"s3": {"addressing_style": "path"}, "connect_timeout": 5,
                          "read_timeout": 7, "retries": {"max_attempts": 2},
                          "proxies": {"http": "http://p:3128", "https": "http://p:3128"},
                          "user_agent": "me/2"},
        "use_listings_cache": False, "default_block_size": 2**20, "max_concurrency": 4,
        "skip_instance_cache": True, "asynchronous": False,  # the volume decides those
    }
    out = s3_settings(options, POLICY)
    assert out.config["endpoint"] == "https://minio:9000"
    assert out.config["virtual_hosted_style_request"] is False
    assert out.config["request_payer"] is True
    assert out.client_options["root_certificate"] == "/etc/ca.pem"
    assert out.client_options["connect_timeout"] == timedelta(seconds=5)
    assert out.client_options["timeout"] == timedelta(seconds=7)
    assert out.client_options["proxy_url"] == "http://p:3128"
    assert out.client_options["user_agent"] == "me/2"
    assert fsspec_kwargs("s3", options, "") == {
        "key": "AKID", "secret": SECRET, "requester_pays": True,
        "endpoint_url": "https://minio:9000",
        "client_kwargs": {"verify": "/etc/ca.pem"},
        "config_kwargs": options["config_kwargs"],
        "use_listings_cache": False, "default_block_size": 2**20, "max_concurrency": 4,
    }


def test_adlfs_and_obstore_names_reach_both_azure_clients() -> None:
    endpoint = "http://127.0.0.1:10000/acct"
    obstore_names = {"account_name": "acct", "account_key": "a2V5", "endpoint": endpoint,
                     "timeout": 20}
    out = azure_settings(obstore_names, POLICY)
    assert out.config == {"account_name": "acct", "account_key": "a2V5", "endpoint": endpoint}
    assert out.client_options["timeout"] == timedelta(seconds=20)
    # adlfs reaches a plain-http endpoint only through a connection string.
    assert fsspec_kwargs("azure", obstore_names, "") == {
        "account_name": "acct", "account_key": "a2V5", "timeout": 20,
        "connection_string": "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=a2V5;"
                             f"BlobEndpoint={endpoint};",
    }
    adlfs_names = {"account_name": "acct", "sas_token": "sv=1&sig=x",
                   "account_host": "acct.blob.core.windows.net", "connection_timeout": 3}
    out = azure_settings(adlfs_names, POLICY)
    assert out.config == {"account_name": "acct", "sas_key": "sv=1&sig=x",
                          "endpoint": "https://acct.blob.core.windows.net"}
    assert out.client_options["connect_timeout"] == timedelta(seconds=3)
    assert fsspec_kwargs("azure", adlfs_names, "") == adlfs_names
    https = {"account_name": "acct", "sas_key": "sv=1", "endpoint": "https://gw.example/acct"}
    assert fsspec_kwargs("azure", https, "")["account_host"] == "gw.example/acct"


# Values of the right kind for every accepted name (the rest take a string).
_SAMPLES: dict[str, Any] = {
    "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1",
                      "verify": False, "use_ssl": False, "api_version": "2006-03-01"},
    "config_kwargs": {"s3": {"addressing_style": "path"}, "connect_timeout": 5,
                      "read_timeout": 7, "max_pool_connections": 4, "proxies": {}},
    "client_options": {"timeout": "9s", "allow_http": True},
    "retry_config": {"max_retries": 2},
    "credential_provider": lambda: {"access_key_id": "k", "secret_access_key": "s",
                                    "expires_at": None},
    "credential": object(),
    "s3_additional_kwargs": {"ACL": "private"},
    "default_headers": {"x-a": "b"},
    "session": None,
    "loop": None,
    **dict.fromkeys(("connect_timeout", "read_timeout", "timeout", "pool_idle_timeout",
                     "http2_keep_alive_timeout"), "5s"),
    "connection_timeout": 5,
    **dict.fromkeys(("default_block_size", "blocksize", "max_concurrency", "max_paths",
                     "listings_expiry_time"), 4),
    **dict.fromkeys(
        ("anon", "use_ssl", "requester_pays", "allow_http", "allow_invalid_certificates",
         "skip_signature", "virtual_hosted_style_request", "unsigned_payload",
         "sse_bucket_key_enabled", "imdsv1_fallback", "disable_tagging",
         "disable_bulk_delete", "s3_express", "use_emulator", "use_fabric_endpoint",
         "use_azure_cli", "http1_only", "http2_only", "randomize_addresses",
         "ranged_reads_cost_whole_object", "listing_lags", "use_listings_cache",
         "default_fill_cache", "version_aware", "cache_regions", "fixed_upload_size",
         "local_expiry_check", "asynchronous", "skip_instance_cache",
         "assume_container_exists"),
        False,
    ),
    "default_cache_type": "readahead",
    "account_name": "acct",
    "account_key": "a2V5",
    "connection_string": "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=a2V5;"
                         "BlobEndpoint=http://127.0.0.1:9/acct;",
    "location_mode": "primary",
    "endpoint": "http://127.0.0.1:9",
    "endpoint_url": "http://127.0.0.1:9",
    "account_host": "acct.blob.core.windows.net",
    "profile": None,  # s3fs would look the profile up in ~/.aws when it connects
    "server_side_encryption": "AES256",
    "sse_customer_key_base64": "MDEyMzQ1Njc4OWFiY2RlZmdoaWprbG1ub3BxcnN0dXY=",
}


@pytest.mark.parametrize("name", sorted(S3_NAMES))
def test_every_accepted_s3_name_gives_s3fs_options_it_takes(name: str) -> None:
    """No accepted name is a ``TypeError`` inside s3fs: the options each name gives s3fs
    build a real client (its session and botocore client, no request)."""
    import s3fs

    spelling = spell("s3", {name: _SAMPLES.get(name, "v1")})
    kwargs = spelling.fsspec
    if "key" in kwargs or "secret" in kwargs:  # botocore refuses half a key pair
        kwargs = {"key": "k", "secret": "s", **kwargs}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **kwargs)
    fs.connect()  # AioSession(**kwargs), AioConfig(**config_kwargs), create_client(...)


@pytest.mark.parametrize("name", sorted(AZURE_NAMES))
def test_every_accepted_azure_name_gives_adlfs_options_it_takes(name: str) -> None:
    import adlfs

    base = {"account_name": "acct", "account_key": "a2V5"}
    if name == "credential":
        pytest.skip("an azure-identity object: adlfs's own option, passed as given")
    spelling = spell("azure", {**base, name: _SAMPLES.get(name, "v1")})
    adlfs.AzureBlobFileSystem(skip_instance_cache=True, **spelling.fsspec)  # connects


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10s", 10.0), ("500ms", 0.5), ("1m 30s", 90.0), ("2", 2.0), (timedelta(minutes=1), 60.0),
     (7, 7.0)],
)
def test_durations_read_as_obstore_and_the_fsspec_clients_write_them(
    text: Any, seconds: float
) -> None:
    assert seconds_of(text, "timeout") == seconds


def test_a_value_that_is_no_duration_is_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match=r"'timeout'.*not a duration"):
        Volume("s3://bucket/run", storage_options={"key": "k", "secret": "s",
                                                   "timeout": "soon"})


# -- refused when the volume is built, with the reason -----------------------------------------


@pytest.mark.parametrize(
    ("options", "named", "meant"),
    [
        ({"acl": "private"}, "'acl'", None),
        ({"client_kwargs": {"verify_ssl": False}}, "'verify_ssl'", None),
        ({"regoin": "eu-west-1"}, "'regoin'", "'region'"),
        ({"secret_acess_key": SECRET}, "'secret_acess_key'", "'secret_access_key'"),
        ({"client_options": {"time_out": "5s"}}, "'time_out'", "'timeout'"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "fsspec"])
def test_a_name_no_client_takes_is_refused_when_the_volume_is_built(
    options: dict[str, Any], named: str, meant: str | None, backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DCP_VOLUMES_BACKEND", backend)
    with pytest.raises(ConfigurationError, match=named) as err:
        Volume("s3://bucket/run", storage_options={"key": "k", "secret": SECRET, **options})
    message = str(err.value)
    assert SECRET not in message and "Fix:" in message
    if meant:
        assert f"did you mean {meant}?" in message


def test_a_name_the_serving_client_cannot_honour_is_refused_when_the_volume_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = {"key": "k", "secret": SECRET}
    # obstore serves: an s3fs option it has no setting for.
    with pytest.raises(ConfigurationError, match=r"s3_additional_kwargs\['ACL'\].*obstore") as err:
        Volume("s3://bucket/run", storage_options={**base, "s3_additional_kwargs": {"ACL": "x"}})
    assert "DCP_VOLUMES_BACKEND=fsspec" in str(err.value)
    # s3fs serves: obstore's credential-chain settings, which botocore reads elsewhere.
    monkeypatch.setenv("DCP_VOLUMES_BACKEND", "fsspec")
    with pytest.raises(ConfigurationError, match=r"'role_arn'.*s3fs") as err:
        Volume("s3://bucket/run", storage_options={**base, "role_arn": "arn:aws:iam::1:role/r"})
    assert "AWS_ROLE_ARN" in str(err.value) and SECRET not in str(err.value)
    with pytest.raises(ConfigurationError, match=r"'credential_provider'.*s3fs"):
        Volume("s3://bucket/run", storage_options={**base, "credential_provider": lambda: {}})
    with pytest.raises(ConfigurationError, match=r"'token'.*adlfs"):
        Volume("az://container/run", storage_options={"account_name": "a", "token": "t"})
    # Two spellings of one setting that disagree: which would each client take?
    with pytest.raises(ConfigurationError, match="'key' and 'access_key_id'"):
        Volume("s3://bucket/run", storage_options={**base, "access_key_id": "other"})


def test_a_name_beyond_only_the_fallback_turns_the_fallback_off() -> None:
    plain = Volume("s3://bucket/run", storage_options={"region": "eu-west-1", "key": "k",
                                                       "secret": SECRET})
    assert plain.fsspec_fallback_usable()
    chained = Volume("s3://bucket/run", storage_options={"key": "k", "secret": SECRET,
                                                         "role_arn": "arn:aws:iam::1:role/r"})
    assert not chained.fsspec_fallback_usable()  # the loader then keeps obstore (forkserver)


# -- reads through each client from moto ---------------------------------------------------------


@pytest.mark.emulator
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
@pytest.mark.parametrize("backend", ["auto", "fsspec"])
def test_each_spelling_reads_through_each_client(
    spelling: str, backend: str, moto_server: MotoServer, s3_bucket: tuple[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, direct = s3_bucket
    files = write_samples(url + "/data", direct, 2)
    monkeypatch.setenv("DCP_VOLUMES_BACKEND", backend)
    volume = Volume(url + "/data", storage_options=SPELLINGS[spelling](moto_server))
    assert type(volume.backend).__name__ == ("FsspecBackend" if backend == "fsspec"
                                             else "ObstoreBackend")
    assert {f.path for f in volume.list()} == set(files)
    for rel, data in files.items():
        assert volume.read_bytes(rel) == data
        assert volume.read_bytes(rel, 1, 5) == data[1:5]


@pytest.mark.emulator
@pytest.mark.parametrize("spelling", ["obstore", "adlfs"])
@pytest.mark.parametrize("backend", ["auto", "fsspec"])
def test_each_azure_spelling_reads_through_each_client(
    spelling: str, backend: str, azurite: Azurite, monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = azurite.create_bucket(f"t-spelling-{uuid.uuid4().hex[:12]}")
    try:
        options = azurite.storage_options()
        files = write_samples(url + "/data", options, 2)
        if spelling == "obstore":
            key = options["account_key"]
            options = {"account_name": options["account_name"], "account_key": key,
                       "endpoint": f"{azurite.endpoint}/{options['account_name']}"}
        monkeypatch.setenv("DCP_VOLUMES_BACKEND", backend)
        volume = Volume(url + "/data", storage_options=options)
        for rel, data in files.items():
            assert volume.read_bytes(rel) == data
    finally:
        azurite.reset()


# -- the fallback in forked processes -----------------------------------------------------------


def _read_in_child(volume: Volume, names: list[str], conn: Any) -> None:
    out: list[Any] = []
    for name in names:
        try:
            out.append((type(volume.backend).__name__, volume.read_bytes(name)))
        except Exception as exc:  # reported to the parent, which asserts on it
            out.append(("error", f"{type(exc).__name__}: {exc}"))
    conn.send(out)
    conn.close()


def _forked_reads(volume: Volume, names: list[str]) -> list[Any]:
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_read_in_child, args=(volume, names, child_end))
    child.start()
    child_end.close()
    try:
        assert parent_end.poll(60), "the forked child sent nothing in 60 s"
        result: list[Any] = parent_end.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return result


@pytest.mark.emulator
@pytest.mark.timeout(120)
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_read_in_a_forked_child_works_through_the_fsspec_fallback(
    spelling: str, moto_server: MotoServer, s3_bucket: tuple[str, Any],
) -> None:
    url, direct = s3_bucket
    files = write_samples(url + "/data", direct, 3)
    volume = Volume(url + "/data", storage_options=SPELLINGS[spelling](moto_server))
    assert volume.list()  # obstore I/O here: a forked child cannot use obstore after it
    assert obstore_used_here() and type(volume.backend).__name__ == "ObstoreBackend"
    assert volume.fsspec_fallback_usable()
    got = _forked_reads(volume, sorted(files))
    assert got == [("FsspecBackend", files[name]) for name in sorted(files)], got


@pytest.mark.emulator
@pytest.mark.timeout(120)
def test_a_forked_child_whose_fallback_cannot_honour_an_option_says_which(
    moto_server: MotoServer, s3_bucket: tuple[str, Any],
) -> None:
    url, direct = s3_bucket
    files = write_samples(url + "/data", direct, 1)
    moto = moto_server

    def provider() -> dict[str, Any]:
        return {"access_key_id": moto.access_key, "secret_access_key": moto.secret_key,
                "expires_at": None}

    volume = Volume(url + "/data", storage_options={"endpoint": moto.endpoint,
                                                    "credential_provider": provider})
    assert volume.read_bytes(next(iter(files)))  # obstore, with the provider's credentials
    assert not volume.fsspec_fallback_usable()
    [(kind, message)] = _forked_reads(volume, list(files))
    assert kind == "error" and "ConfigurationError" in message, message
    assert "'credential_provider'" in message and "forkserver" in message
    assert "TypeError" not in message


@pytest.mark.emulator
@pytest.mark.timeout(180)
@pytest.mark.parametrize("spelling", ["obstore", "mixed"])
def test_a_one_cpu_ranks_forked_loader_workers_read_with_obstores_names(
    spelling: str, moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path
) -> None:
    """The issue's job: the DataLoader on a rank with one CPU forks its workers after its
    obstore I/O, and they fetch every cache miss through s3fs. (s3fs's own names:
    ``test_loader.py``'s ``test_a_rank_with_one_cpu_forks_its_workers_and_they_fetch_through
    _fsspec``.)"""
    url, direct = s3_bucket
    write_samples(url + "/data", direct, 6)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripts.forkserver_workers", url + "/data",
         json.dumps(SPELLINGS[spelling](moto_server)), str(tmp_path / "c"), "1"],
        capture_output=True, text=True, timeout=150, cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["start_method"] == "fork", found
    assert found["ids"] == list(range(6))  # fetched by the forked workers: the cache was empty
    assert "WARNING" not in proc.stderr and "Error" not in proc.stderr, proc.stderr[-3000:]
