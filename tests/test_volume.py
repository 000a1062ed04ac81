"""Volume conformance suite: every backend (local, file://, S3, Azure, GCS) runs the same tests."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys

import pytest

from dcp_volumes._exceptions import (
    BackendNotInstalledError,
    BucketNotFoundError,
    ConfigurationError,
    DcpVolumesError,
    VolumeAccessError,
    VolumeExistsError,
    VolumeNotFoundError,
)
from dcp_volumes._volume import RetryPolicy, Volume, redact_url


@pytest.fixture
def volume(volume_url) -> Volume:
    url, options = volume_url
    vol = Volume(url, storage_options=options)
    vol.check_root(create=True)
    return vol


def test_publish_read_list_delete(volume: Volume) -> None:
    volume.publish("a/one.bin", b"0123456789")
    volume.publish("a/b/two.bin", b"xy")
    assert volume.read_bytes("a/one.bin") == b"0123456789"
    assert volume.read_bytes("a/one.bin", 2, 5) == b"234"
    assert volume.exists("a/one.bin")
    assert not volume.exists("a/missing.bin")
    listing = volume.list()
    assert [(f.path, f.size) for f in listing] == [("a/b/two.bin", 2), ("a/one.bin", 10)]
    assert [f.path for f in volume.list("a/b")] == ["a/b/two.bin"]
    assert volume.list("nothing/here") == []
    assert volume.list_dirs() == ["a"]
    assert volume.list_dirs("a") == ["b"]
    assert volume.info("a/one.bin").size == 10
    volume.delete("a/one.bin")
    assert not volume.exists("a/one.bin")
    volume.delete("a/one.bin")  # missing is fine
    volume.delete_prefix("a")
    assert volume.list() == []


def test_publish_replaces_and_exclusive_refuses(volume: Volume) -> None:
    volume.publish("marker", b"first")
    volume.publish("marker", b"second")
    assert volume.read_bytes("marker") == b"second"
    with pytest.raises(VolumeExistsError) as err:
        volume.publish("marker", b"third", exclusive=True)
    assert isinstance(err.value, FileExistsError)
    assert volume.read_bytes("marker") == b"second"
    volume.publish("fresh", b"x", exclusive=True)
    assert volume.read_bytes("fresh") == b"x"


def test_put_and_get_large_file_in_parts(volume: Volume, tmp_path) -> None:
    payload = os.urandom(6 * 2**20 + 123)
    src = tmp_path / "src.bin"
    src.write_bytes(payload)
    assert volume.put_file(src, "big/file.bin", part_size=5 * 2**20, concurrency=4) == len(payload)
    assert src.exists(), "put_file must not consume its source unless move=True"
    dst = tmp_path / "dst.bin"
    assert volume.get_file("big/file.bin", dst, part_size=2**20, concurrency=4) == len(payload)
    assert dst.read_bytes() == payload
    assert not [p for p in os.listdir(tmp_path) if ".part-" in p], "temp files left behind"
    ranges = [volume.read_bytes("big/file.bin", s, e) for s, e in ((0, 10), (2**20, 2**20 + 7))]
    assert ranges == [payload[:10], payload[2**20 : 2**20 + 7]]


def test_put_file_move(volume: Volume, tmp_path) -> None:
    src = tmp_path / "moved.bin"
    src.write_bytes(b"abc" * 1000)
    volume.put_file(src, "m/moved.bin", move=True)
    assert not src.exists()
    assert volume.read_bytes("m/moved.bin") == b"abc" * 1000


def test_missing_file_is_file_not_found(volume: Volume, tmp_path) -> None:
    with pytest.raises(VolumeNotFoundError) as err:
        volume.read_bytes("no/such/file")
    assert isinstance(err.value, FileNotFoundError)
    assert isinstance(err.value, DcpVolumesError)
    assert "no/such/file" in str(err.value)
    with pytest.raises(FileNotFoundError):
        volume.get_file("no/such/file", tmp_path / "x")


def test_check_root_names_a_missing_bucket(volume: Volume) -> None:
    volume.check_root()  # the fixture's location exists
    if volume.is_local:
        missing = Volume(volume.url_of("no-such-dir"))
        with pytest.raises(VolumeNotFoundError):
            missing.check_root()
        return
    bucket = volume.root.split("/", 1)[0]
    missing = Volume(volume.url.replace(bucket, "nobucket" + bucket[-8:], 1),
                     storage_options=volume.storage_options)
    with pytest.raises(BucketNotFoundError, match="nobucket"):
        missing.check_root()


def test_volume_pickles_without_client(volume: Volume) -> None:
    volume.publish("p.txt", b"pickled")
    _ = volume.fs  # create the client, then make sure it is not pickled
    clone = pickle.loads(pickle.dumps(volume))
    assert clone._fs is None
    assert clone.read_bytes("p.txt") == b"pickled"


def test_child_volume_is_rooted_below(volume: Volume) -> None:
    child = volume.child("sub/dir")
    child.publish("f", b"1")
    assert volume.read_bytes("sub/dir/f") == b"1"
    assert [f.path for f in child.list()] == ["f"]


def test_volume_survives_fork(volume: Volume) -> None:
    volume.publish("fork.txt", b"before fork")
    _ = volume.fs
    pid = os.fork()
    if pid == 0:  # child: must build its own client and read through it
        try:
            ok = volume.read_bytes("fork.txt") == b"before fork"
            os._exit(0 if ok else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- bad input ------------------------------------------------------------------------------


def test_unknown_protocol() -> None:
    with pytest.raises(ConfigurationError, match="Unknown URL protocol 'nosuchproto://'"):
        Volume("nosuchproto://bucket/x")


def test_missing_backend_names_what_to_install() -> None:
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from dcp_volumes._volume import Volume\n"
        "from dcp_volumes._exceptions import BackendNotInstalledError\n"
        "try:\n    Volume('s3://bucket/x')\n"
        "except BackendNotInstalledError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'dcp_volumes[s3]'" in out.stdout
    assert issubclass(BackendNotInstalledError, ImportError)


def test_bucketless_url_and_empty_url() -> None:
    with pytest.raises(ConfigurationError):
        Volume("")
    with pytest.raises(ConfigurationError, match="names no bucket"):
        Volume("s3://")


def test_missing_bucket(s3_bucket) -> None:
    _, options = s3_bucket
    vol = Volume("s3://bucket-that-does-not-exist/run", storage_options=options)
    with pytest.raises(BucketNotFoundError, match="bucket-that-does-not-exist"):
        vol.check_root()
    with pytest.raises(BucketNotFoundError):
        vol.read_bytes("x")


def test_wrong_credentials_never_echo_the_secret(azurite, caplog) -> None:
    import base64

    azurite.create_bucket("locked")
    secret = base64.b64encode(b"definitely-not-the-devstore-key-0123456789").decode()
    endpoint = azurite.endpoint
    options = {
        "account_name": "devstoreaccount1",
        "account_key": secret,
        "connection_string": (
            "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            f"AccountKey={secret};BlobEndpoint={endpoint}/devstoreaccount1;"
        ),
    }
    vol = Volume("az://locked/run", storage_options=options,
                 retry=RetryPolicy(attempts=2, base_delay_s=0.0))
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(VolumeAccessError):
            vol.check_root()  # wrong credentials are not reported as a missing container
        with pytest.raises(VolumeAccessError) as err:
            vol.publish("file", b"data")
        assert isinstance(err.value, PermissionError)
        assert "credentials" in str(err.value)
    assert secret not in str(err.value)
    assert secret not in repr(vol) and secret not in vol.display_url
    assert all(secret not in r.getMessage() for r in caplog.records)


def test_local_root_not_writable(read_only_dir) -> None:
    with pytest.raises(VolumeAccessError) as err:
        Volume(str(read_only_dir / "sub")).check_root(create=True)
    assert isinstance(err.value, PermissionError)


def test_local_root_missing(tmp_path) -> None:
    with pytest.raises(VolumeNotFoundError, match="does not exist"):
        Volume(str(tmp_path / "absent")).check_root()


def test_redact_url_strips_userinfo_and_query() -> None:
    assert redact_url("s3://AKIA:secret@bucket/x?sig=abc") == "s3://bucket/x"
    assert redact_url("/plain/path") == "/plain/path"


def test_secret_from_storage_options_is_scrubbed(tmp_path) -> None:
    secret = "another-very-secret-token"
    vol = Volume(str(tmp_path), storage_options={"token": secret})
    err = vol._translate(OSError(f"server said: bad token {secret}"), "read", "x")
    assert secret not in str(err)
    assert "***" in str(err)


def test_transient_connection_drops_are_retried(moto_server, s3_bucket, caplog) -> None:
    from tests.proxy import LatencyProxy

    url, options = s3_bucket
    Volume(url, storage_options=options).publish("r/obj", b"payload" * 100)
    with LatencyProxy.in_front_of(moto_server) as proxy:
        flaky = Volume(
            url,
            storage_options=moto_server.storage_options(proxy.endpoint),
            retry=RetryPolicy(attempts=5, base_delay_s=0.01),
        )
        # Warm the client, then cut the next two connections mid-request.
        assert flaky.read_bytes("r/obj", 0, 7) == b"payload"
        proxy.drop_next(2, method="GET")
        with caplog.at_level(logging.WARNING, logger="dcp_volumes._volume"):
            assert flaky.read_bytes("r/obj") == b"payload" * 100
    assert proxy.pending_drops == 0, "the faults were never hit"


def test_retry_policy_validates_and_backs_off() -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(attempts=0)
    policy = RetryPolicy(attempts=5, base_delay_s=0.1, max_delay_s=0.3)
    assert all(0.0 <= policy.delay(n) <= 0.3 for n in range(1, 10))
