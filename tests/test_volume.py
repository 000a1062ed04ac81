"""Volume conformance suite: every backend (local, file://, moto S3, Ceph radosgw, Azure, GCS)
runs the same tests."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from dcp_volumes._exceptions import (
    BackendNotInstalledError,
    BucketNotFoundError,
    ConfigurationError,
    DcpVolumesError,
    VolumeAccessError,
    VolumeError,
    VolumeExistsError,
    VolumeNotFoundError,
)
from dcp_volumes._volume import RetryPolicy, Volume, redact_url
from testkit.emulators import Azurite, Emulator, LatencyProxy
from tests.conftest import EMULATOR_FIXTURE, unique_bucket_name


@pytest.fixture
def volume(conformance_url) -> Volume:
    url, options = conformance_url
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
    if volume.capabilities.local_files:
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
    _ = volume.backend  # create the client, then make sure it is not pickled
    clone = pickle.loads(pickle.dumps(volume))
    assert clone._backend is None
    assert clone.read_bytes("p.txt") == b"pickled"


def test_child_volume_is_rooted_below(volume: Volume) -> None:
    child = volume.child("sub/dir")
    child.publish("f", b"1")
    assert volume.read_bytes("sub/dir/f") == b"1"
    assert [f.path for f in child.list()] == ["f"]


def test_volume_survives_fork(volume: Volume) -> None:
    volume.publish("fork.txt", b"before fork")
    _ = volume.backend
    survives = volume.capabilities.survives_fork
    pid = os.fork()
    if pid == 0:  # child: must build its own client and read through it
        try:
            ok = volume.read_bytes("fork.txt") == b"before fork"
            # obstore cannot run in a child forked after its I/O: fsspec serves it.
            fell_back = type(volume.backend).__name__ == "FsspecBackend"
            os._exit(0 if ok and (survives or fell_back) else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_fork_fallback_without_fsspec_clients_names_the_extra_that_has_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child forked after obstore I/O falls back to s3fs/adlfs; without them installed the
    fix names the extra that holds them ([fsspec-clients]), not [s3]/[azure] (obstore)."""
    from dcp_volumes._exceptions import BackendNotInstalledError
    from dcp_volumes._volume import _obstore, _select

    def not_installed(*args: Any, **kwargs: Any) -> None:
        raise BackendNotInstalledError("no s3fs")

    monkeypatch.setattr(_obstore, "usable_here", lambda: False)
    monkeypatch.setattr(_select, "FsspecBackend", not_installed)
    with pytest.raises(ConfigurationError) as err:
        _select._client_backend("s3", {}, RetryPolicy())
    assert "pip install 'dcp_volumes[fsspec-clients]'" in str(err.value)
    assert "[s3]" not in str(err.value)


# -- bad input ------------------------------------------------------------------------------


def test_unknown_protocol() -> None:
    with pytest.raises(ConfigurationError, match="Unknown URL protocol 'nosuchproto://'"):
        Volume("nosuchproto://bucket/x")


def test_missing_backend_names_what_to_install() -> None:
    code = (
        "import sys; sys.modules['obstore'] = None\n"
        "from dcp_volumes._volume import Volume\n"
        "from dcp_volumes._exceptions import BackendNotInstalledError\n"
        "try:\n    Volume('s3://bucket/x').read_bytes('k')\n"
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
    # A GET cannot tell a missing bucket from a missing key (obstore says "not
    # found" for both); it names the object, and check_root names the bucket.
    with pytest.raises(VolumeNotFoundError, match="bucket-that-does-not-exist/run/x"):
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


def test_a_conflict_on_a_plain_write_is_not_taken_for_an_existing_file(tmp_path) -> None:
    """Azure answers 409 for more than "blob exists" (here: Azurite's in-memory store is
    full), and obstore reads every 409 as AlreadyExists: only a create-only write may say so."""
    if Azurite.find_binary() is None:
        pytest.fail("Azurite is not installed: run `make test` (it installs it into .tools/).")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 * 2**20))
    with Azurite(memory_limit_mib=8) as server:
        vol = Volume(server.create_bucket("full"), storage_options=server.storage_options(),
                     retry=RetryPolicy(attempts=1))
        vol.publish("marker", b"x", exclusive=True)
        with pytest.raises(VolumeExistsError):
            vol.publish("marker", b"y", exclusive=True)  # a real "exists"
        for write in (
            lambda: vol.put_file(src, "a.bin", part_size=4 * 2**20, concurrency=2),
            lambda: vol.publish("b.bin", src.read_bytes()),
        ):
            with pytest.raises(VolumeError) as err:
                write()
            assert not isinstance(err.value, FileExistsError)
            assert "MemoryExtentStoreAtSizeLimit" in str(err.value)
            assert "already exists" not in str(err.value)
        assert vol.read_bytes("marker") == b"x"


def test_local_root_not_writable(read_only_dir) -> None:
    with pytest.raises(VolumeAccessError) as err:
        Volume(str(read_only_dir / "sub")).check_root(create=True)
    assert isinstance(err.value, PermissionError)


def test_local_root_missing(tmp_path) -> None:
    with pytest.raises(VolumeNotFoundError, match="does not exist"):
        Volume(str(tmp_path / "absent")).check_root()


def test_a_local_volume_below_a_file_says_which_file_and_how_to_fix(tmp_path) -> None:
    blocker = tmp_path / "hostname"  # as /etc/hostname: a file where a directory must be
    blocker.write_text("x")
    vol = Volume(str(blocker / "vol"))
    for attempt in (lambda: vol.check_root(create=True), lambda: vol.publish("f", b"1"),
                    vol.check_root):
        with pytest.raises(VolumeError) as err:
            attempt()
        message = str(err.value)
        assert f"{blocker} is a file" in message, message
        assert "Fix:" in message, message


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_local_volume_on_a_virtual_filesystem_says_why_and_how_to_fix() -> None:
    vol = Volume("/proc/nope/vol")
    for attempt in (lambda: vol.check_root(create=True), lambda: vol.publish("f", b"1")):
        with pytest.raises(VolumeError) as err:
            attempt()
        message = str(err.value)
        assert "/proc/nope/vol" in message and "/proc does not take new directories" in message
        assert "Fix:" in message, message


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
    from testkit.proxy import LatencyProxy

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


def test_a_listing_that_keeps_failing_is_not_taken_for_a_missing_bucket(
    moto_server, s3_bucket
) -> None:
    """Cut listings are a transient failure: never "the bucket does not exist"."""
    from testkit.proxy import LatencyProxy

    url, _ = s3_bucket
    with LatencyProxy.in_front_of(moto_server) as proxy:
        flaky = Volume(
            url,
            storage_options=moto_server.storage_options(proxy.endpoint),
            retry=RetryPolicy(attempts=2, base_delay_s=0.01),
        )
        flaky.publish("r/obj", b"x")
        # Every listing response is cut mid-body; the HEAD probe gets through.
        proxy.drop_next(100, after_bytes=200, method="GET")
        with pytest.raises(DcpVolumesError) as caught:
            flaky.list("r")
    assert not isinstance(caught.value, (BucketNotFoundError, VolumeNotFoundError)), caught.value
    assert "does not exist" not in str(caught.value)


def test_retry_policy_validates_and_backs_off() -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(attempts=0)
    policy = RetryPolicy(attempts=5, base_delay_s=0.1, max_delay_s=0.3)
    assert all(0.0 <= policy.delay(n) <= 0.3 for n in range(1, 10))


# -- the backend protocol, on every backend ------------------------------------------------


def test_ranged_reads_into_memory_and_buffers(volume: Volume) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    volume.publish("r.bin", data)
    assert volume.read_bytes("r.bin", 1000, 1010) == data[1000:1010]
    assert volume.read_bytes("r.bin", len(data) - 5) == data[-5:]
    assert volume.read_bytes("r.bin", 10, len(data) + 100) == data[10:]  # clipped at the end
    assert volume.read_bytes("r.bin", 7, 7) == b""
    assert volume.read_bytes("r.bin", len(data), len(data) + 10) == b""  # past the end
    assert volume.read_bytes("r.bin", len(data) + 5) == b""
    first, second = bytearray(100), bytearray(300)
    got = volume.read_into("r.bin", 5000, [memoryview(first), memoryview(second)])
    assert got == 400 and bytes(first) + bytes(second) == data[5000:5400]
    whole = bytearray(len(data))
    assert volume.read_into("r.bin", 0, memoryview(whole), whole=True) == len(data)
    assert whole == data
    # A file of another length than the buffers is reported by its length, not read.
    assert volume.read_into("r.bin", 0, memoryview(bytearray(10)), whole=True) != 10
    assert bytes(volume.read_whole("r.bin", len(data))) == data


def test_multipart_upload_and_parallel_ranged_download(volume: Volume, tmp_path) -> None:
    data = os.urandom(12 * 2**20 + 123)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    assert volume.put_file(src, "ckpt/big.bin", part_size=5 * 2**20, concurrency=3) == len(data)
    assert src.exists()  # not moved
    assert volume.info("ckpt/big.bin").size == len(data)
    out = tmp_path / "out.bin"
    assert volume.get_file("ckpt/big.bin", out, part_size=4 * 2**20, concurrency=4) == len(data)
    assert out.read_bytes() == data
    if volume.protocol == "s3":  # no invisible (billed) parts left behind
        client = boto3.client("s3", **_boto3_args(volume))
        assert not client.list_multipart_uploads(Bucket=volume.bucket).get("Uploads")
    moved = tmp_path / "moved.bin"
    moved.write_bytes(b"m" * 1000)
    volume.put_file(moved, "ckpt/moved.bin", move=True)
    assert not moved.exists() and volume.read_bytes("ckpt/moved.bin") == b"m" * 1000


def _boto3_args(volume: Volume) -> dict[str, Any]:
    opts = volume.storage_options
    return {"endpoint_url": opts["client_kwargs"]["endpoint_url"], "region_name": "us-east-1",
            "aws_access_key_id": opts["key"], "aws_secret_access_key": opts["secret"]}


def test_server_side_copy(volume: Volume) -> None:
    volume.publish("src/a", b"payload")
    volume.copy("src/a", "dst/a")
    assert volume.read_bytes("dst/a") == b"payload"
    assert volume.read_bytes("src/a") == b"payload"


def test_batch_delete_ignores_missing(volume: Volume) -> None:
    names = [f"d/{i:02d}" for i in range(30)]
    for name in names:
        volume.publish(name, b"x")
    volume.delete_many([*names[:20], "d/missing"])
    assert [f.path for f in volume.list("d")] == names[20:]


def test_create_only_race_has_exactly_one_winner(volume: Volume) -> None:
    if not volume.capabilities.atomic_create:
        # The documented fallback: the volume checks first (refusal after a commit
        # is tested above); two writers inside that window could both write.
        pytest.skip("this server does not decide create-only puts; the volume checks first")
    for trial in range(6):
        name = f"race/{trial}"
        barrier = threading.Barrier(4)
        outcomes: list[tuple[str, int]] = []
        threads = [
            threading.Thread(target=_race_to_create, args=(volume, name, i, barrier, outcomes))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        winners = [i for outcome, i in outcomes if outcome == "won"]
        assert len(outcomes) == 4 and len(winners) == 1, outcomes
        assert volume.read_bytes(name) == f"writer {winners[0]}".encode()


def _race_to_create(
    volume: Volume, name: str, i: int, barrier: threading.Barrier, outcomes: list[tuple[str, int]]
) -> None:
    barrier.wait()
    try:
        volume.publish(name, f"writer {i}".encode(), exclusive=True)
        outcomes.append(("won", i))
    except VolumeExistsError:
        outcomes.append(("lost", i))


def test_capabilities_say_what_the_store_does(volume: Volume) -> None:
    caps = volume.capabilities
    assert caps.local_files == (volume.protocol in ("file", "local"))
    if caps.local_files:
        assert caps.survives_fork and not caps.buffers_uploads
    if volume.protocol in ("s3", "az"):  # obstore: sent pages of its upload maps are dropped
        assert caps.atomic_create and not caps.survives_fork and not caps.buffers_uploads


# -- retries through a faulty link, on every object store ------------------------------------


@pytest.fixture(params=["s3", "radosgw", "azure", "gcs"])
def faulty_volume(request: pytest.FixtureRequest) -> Iterator[tuple[Volume, LatencyProxy]]:
    """A volume on a fresh bucket of an emulator, reached through a fault-injecting proxy."""
    emulator: Emulator = request.getfixturevalue(EMULATOR_FIXTURE[request.param])
    url = emulator.create_bucket(unique_bucket_name(request))
    try:
        with LatencyProxy.in_front_of(emulator) as proxy:
            policy = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)
            yield Volume(url, storage_options=emulator.storage_options(proxy.endpoint),
                         retry=policy), proxy
    finally:
        emulator.reset()


def test_transient_errors_are_retried_and_bytes_stay_exact(faulty_volume) -> None:
    volume, proxy = faulty_volume
    data = os.urandom(3 * 2**20)
    proxy.answer_next(2, status=503)
    volume.publish("obj.bin", data)  # two SlowDown answers, then it lands
    proxy.answer_next(1, status=500, method="GET")
    assert volume.read_bytes("obj.bin") == data
    proxy.drop_next(1, method="GET")  # connection reset before the answer
    assert volume.read_bytes("obj.bin", 100, 200) == data[100:200]
    proxy.drop_next(1, after_bytes=64 * 1024, method="GET")  # cut part-way through the body
    out = bytearray(len(data))
    assert volume.read_into("obj.bin", 0, memoryview(out), whole=True) == len(data)
    assert out == data
    assert proxy.answered[503] == 2 and proxy.answered[500] == 1
    assert proxy.pending_drops == 0


def test_a_cut_upload_is_sent_again_whole(faulty_volume, tmp_path) -> None:
    volume, proxy = faulty_volume
    upload = "POST" if volume.protocol == "gs" else "PUT"  # gcsfs uploads with POST
    data = os.urandom(2 * 2**20 + 1)
    src = tmp_path / "f.bin"
    src.write_bytes(data)
    proxy.drop_next(1, method=upload)  # reset while the body is on its way
    volume.put_file(src, "f.bin")
    assert volume.read_bytes("f.bin") == data
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(11 * 2**20))
    proxy.drop_next(1, method=upload)  # one request of a multipart upload
    volume.put_file(big, "big.bin", part_size=5 * 2**20, concurrency=2)
    assert volume.read_bytes("big.bin") == big.read_bytes()
    assert proxy.pending_drops == 0


def test_a_store_that_keeps_failing_is_an_error_not_a_missing_file(faulty_volume) -> None:
    volume, proxy = faulty_volume
    if volume.protocol == "gs":
        pytest.skip("gcsfs retries a 5xx itself (6 tries, backoff to 32 s) before ours: ~140 s")
    volume.publish("obj.bin", b"present")
    proxy.answer_next(1000, status=503)
    started = time.monotonic()
    with pytest.raises(VolumeError) as err:
        volume.read_bytes("obj.bin")
    assert not isinstance(err.value, FileNotFoundError)  # it is there: never "missing"
    assert "obj.bin" in str(err.value)
    with pytest.raises(VolumeError) as err:
        volume.publish("other.bin", b"x")
    assert not isinstance(err.value, FileNotFoundError)
    assert time.monotonic() - started < 120  # bounded by the retry policy
