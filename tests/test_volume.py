"""Volume conformance suite: every backend (local, file://, moto S3, Ceph radosgw, Azure, GCS,
the in-memory store) runs the same tests."""

from __future__ import annotations

import logging
import math
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import Counter
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
from dcp_volumes._volume import RetryPolicy, Volume, despite_lag, redact_url
from dcp_volumes.testing import MemoryStore
from testkit.emulators import Azurite, Emulator, LatencyProxy
from tests.conftest import EMULATOR_FIXTURE, unique_bucket_name


def payload(size: int) -> bytes:
    """``size`` random bytes that do not end in CR: gcp-storage-emulator drops a trailing
    CR of an upload's body, which these tests (about our code) must not trip on."""
    return os.urandom(size - 1) + b"\0"


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
    data = payload(6 * 2**20 + 123)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    assert volume.put_file(src, "big/file.bin", part_size=5 * 2**20, concurrency=4) == len(data)
    assert src.exists(), "put_file must not consume its source unless move=True"
    dst = tmp_path / "dst.bin"
    assert volume.get_file("big/file.bin", dst, part_size=2**20, concurrency=4) == len(data)
    assert dst.read_bytes() == data
    assert not [p for p in os.listdir(tmp_path) if ".part-" in p], "temp files left behind"
    ranges = [volume.read_bytes("big/file.bin", s, e) for s, e in ((0, 10), (2**20, 2**20 + 7))]
    assert ranges == [data[:10], data[2**20 : 2**20 + 7]]


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
    src.write_bytes(payload(12 * 2**20))
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


def test_multipart_upload_and_parallel_ranged_download(
    volume: Volume, tmp_path, request: pytest.FixtureRequest
) -> None:
    data = payload(12 * 2**20 + 123)
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
    if volume.protocol == "dcp-memory":
        store: MemoryStore = request.getfixturevalue("memory_store")
        assert store.pending_uploads() == []
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
    if volume.protocol == "dcp-memory":  # as obstore's S3, but a forked child reads a copy
        assert caps.atomic_create and caps.survives_fork and not caps.buffers_uploads
        assert not caps.listing_lags and not caps.ranged_reads_cost_whole_object


# -- retries through a faulty link, on every object store ------------------------------------


class StoreFaults:
    """The proxy's fault calls, stated to a ``MemoryStore``: the same tests then prove that
    its injected answers are retried and translated as a server's through the proxy."""

    # Which requests of the store an HTTP method stands for.
    METHODS = {
        "GET": ("head", "list", "read", "read_whole", "read_into"),
        "PUT": ("put", "upload", "upload_part"),
        None: ("check_root", "head", "list", "read", "read_whole", "read_into", "put",
               "upload", "upload_part", "complete_upload", "delete", "copy"),
    }
    STATUS = {500: "server_error", 503: "throttled"}

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.answers: list[tuple[int, Any]] = []
        self.drops: list[Any] = []

    def answer_next(self, n: int = 1, *, status: int = 503, method: str | None = None) -> None:
        rule = self.store.fail(self.METHODS[method], self.STATUS[status], times=n)  # type: ignore[arg-type]
        self.answers.append((status, rule))

    def drop_next(self, n: int = 1, *, method: str | None = None, after_bytes: int = 0) -> None:
        self.drops.append(self.store.fail(self.METHODS[method], "connection_reset", times=n))

    @property
    def answered(self) -> Counter[int]:
        counts: Counter[int] = Counter()
        for status, rule in self.answers:
            counts[status] += rule.hits
        return counts

    @property
    def pending_drops(self) -> int:
        return sum(int(rule.times - rule.hits) for rule in self.drops)


@pytest.fixture(params=["s3", "radosgw", "azure", "gcs", "memory"])
def faulty_volume(request: pytest.FixtureRequest) -> Iterator[tuple[Volume, LatencyProxy]]:
    """A volume on a fresh bucket of an emulator, reached through a fault-injecting proxy
    (the in-memory store: with the same faults stated to the store)."""
    policy = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)
    if request.param == "memory":
        with MemoryStore() as store:
            url = store.create_bucket(unique_bucket_name(request))
            yield Volume(url, retry=policy), StoreFaults(store)  # type: ignore[misc]
        return
    emulator: Emulator = request.getfixturevalue(EMULATOR_FIXTURE[request.param])
    url = emulator.create_bucket(unique_bucket_name(request))
    try:
        with LatencyProxy.in_front_of(emulator) as proxy:
            yield Volume(url, storage_options=emulator.storage_options(proxy.endpoint),
                         retry=policy), proxy
    finally:
        emulator.reset()


def test_transient_errors_are_retried_and_bytes_stay_exact(faulty_volume) -> None:
    volume, proxy = faulty_volume
    data = payload(3 * 2**20)
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
    data = payload(2 * 2**20 + 1)
    src = tmp_path / "f.bin"
    src.write_bytes(data)
    proxy.drop_next(1, method=upload)  # reset while the body is on its way
    volume.put_file(src, "f.bin")
    assert volume.read_bytes("f.bin") == data
    big = tmp_path / "big.bin"
    big.write_bytes(payload(11 * 2**20))
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


# -- the in-memory store's own faults ------------------------------------------------------


@pytest.fixture
def memory_volume(memory_store: MemoryStore) -> Volume:
    policy = RetryPolicy(attempts=3, base_delay_s=0.0, max_delay_s=0.0, stall_s=0.2)
    return Volume(memory_store.create_bucket() + "/run", retry=policy)


@pytest.mark.parametrize(
    ("kind", "error", "tries"),
    [
        ("server_error", None, 2),  # transient: the second try answers
        ("throttled", None, 2),
        ("timeout", None, 2),
        ("connection_reset", None, 2),
        ("not_found", VolumeNotFoundError, 1),  # final at once, as the server's 404
        ("access_denied", VolumeAccessError, 1),
    ],
)
def test_an_injected_error_is_retried_or_translated_as_a_servers(
    memory_store: MemoryStore, memory_volume: Volume, kind: Any, error: Any, tries: int
) -> None:
    memory_volume.publish("obj", b"present")
    memory_store.calls.clear()
    rule = memory_store.fail("read", kind, match="obj")
    if error is None:
        assert memory_volume.read_bytes("obj") == b"present"
    else:
        with pytest.raises(error) as caught:
            memory_volume.read_bytes("obj")
        assert "dcp-memory://" in str(caught.value) and "obj" in str(caught.value)
    assert memory_store.calls["read"] == tries and rule.hits == 1


def test_an_injected_error_meets_only_the_requests_it_names(
    memory_store: MemoryStore, memory_volume: Volume
) -> None:
    memory_volume.publish("a/obj", b"1")
    memory_volume.publish("b/obj", b"2")
    memory_store.fail(("read", "head"), "access_denied", match="b/", times=math.inf)
    assert memory_volume.read_bytes("a/obj") == b"1"
    assert [f.path for f in memory_volume.list()] == ["a/obj", "b/obj"]  # lists still answer
    for attempt in (lambda: memory_volume.read_bytes("b/obj"), lambda: memory_volume.info("b/obj")):
        with pytest.raises(VolumeAccessError):
            attempt()
    memory_store.clear_faults()
    assert memory_volume.read_bytes("b/obj") == b"2"
    with pytest.raises(ValueError, match="unknown operations"):
        memory_store.fail("get", "server_error")
    with pytest.raises(ValueError, match="unknown failure kind"):
        memory_store.fail("read", "teapot")  # type: ignore[arg-type]


def test_a_failed_part_aborts_the_upload_and_the_volume_sends_it_again_whole(
    memory_store: MemoryStore, memory_volume: Volume, tmp_path
) -> None:
    data = payload(5 * 1000 + 7)
    src = tmp_path / "f.bin"
    src.write_bytes(data)
    part = memory_store.fail("upload_part", "server_error")
    memory_volume.put_file(src, "f.bin", part_size=1000, concurrency=3)
    assert part.hits == 1 and memory_store.calls["upload"] == 2
    assert memory_volume.read_bytes("f.bin") == data
    assert memory_store.pending_uploads() == []  # the failed one was aborted, not left


def test_an_upload_completed_whose_answer_was_lost_is_sent_again(
    memory_store: MemoryStore, memory_volume: Volume, tmp_path
) -> None:
    # S3's NoSuchUpload on a completion's retry: the bytes are still here, the volume
    # retries (UploadGone is transient) and the next try lands the same object.
    data = payload(3000)
    src = tmp_path / "f.bin"
    src.write_bytes(data)
    memory_store.fail("complete_upload", "upload_gone")
    memory_volume.put_file(src, "f.bin", part_size=1000)
    assert memory_store.calls["upload"] == 2 and memory_store.calls["complete_upload"] == 2
    assert memory_volume.read_bytes("f.bin") == data and memory_store.pending_uploads() == []


def test_an_upload_aborted_under_it_is_gone_and_sent_again(
    memory_store: MemoryStore, memory_volume: Volume, tmp_path
) -> None:
    data = payload(4000)
    src = tmp_path / "f.bin"
    src.write_bytes(data)
    held = memory_store.stall("upload_part", seconds=30)
    aborted: list[int] = []

    def lifecycle_rule() -> None:  # aborts the upload while a part is held
        while not held.hits:
            time.sleep(0.01)
        aborted.append(memory_store.abort_uploads())
        held.release()

    thread = threading.Thread(target=lifecycle_rule)
    thread.start()
    memory_volume.put_file(src, "f.bin", part_size=1000, concurrency=1)
    thread.join()
    assert aborted == [1] and memory_store.calls["upload"] == 2
    assert memory_volume.read_bytes("f.bin") == data


def test_a_stalled_request_times_out_at_the_volumes_deadline_and_is_tried_again(
    memory_store: MemoryStore, memory_volume: Volume
) -> None:
    memory_volume.publish("obj", b"x")
    memory_store.stall("read")  # the policy's stall_s: 0.2 s
    started = time.monotonic()
    assert memory_volume.read_bytes("obj") == b"x"
    assert 0.2 <= time.monotonic() - started < 5 and memory_store.calls["read"] == 2
    memory_store.stall("read", times=math.inf)
    with pytest.raises(VolumeError) as caught:
        memory_volume.read_bytes("obj")
    assert not isinstance(caught.value, FileNotFoundError)  # it is there: never "missing"
    memory_store.clear_faults()
    held = memory_store.stall("read", seconds=30)
    threading.Timer(0.1, held.release).start()
    memory_store.calls.clear()
    assert memory_volume.read_bytes("obj") == b"x" and memory_store.calls["read"] == 1


def test_a_lagging_store_hides_new_objects_from_listings_and_reads_for_a_while(
    memory_store: MemoryStore, memory_volume: Volume
) -> None:
    memory_volume.publish("old", b"o")
    end = memory_store.lag(match="new", listings=2, reads=1)
    memory_volume.publish("dir/new", b"n")
    assert [f.path for f in memory_volume.list()] == ["old"]
    assert memory_volume.list_dirs() == []  # a prefix exists only through what it shows
    assert [f.path for f in memory_volume.list()] == ["dir/new", "old"]
    assert despite_lag(lambda: memory_volume.read_bytes("dir/new"), what="new") == b"n"
    end()
    memory_volume.publish("dir/new2", b"n")
    assert "dir/new2" in [f.path for f in memory_volume.list()]


def test_memory_buckets_belong_to_their_store_until_it_closes(memory_store: MemoryStore) -> None:
    url = memory_store.create_bucket("shared-name")
    with pytest.raises(ValueError, match="exists"), MemoryStore() as other:
        other.create_bucket("shared-name")
    Volume(url).publish("k", b"v")
    assert memory_store.keys("shared-name") == ["k"]
    memory_store.close()
    with pytest.raises(BucketNotFoundError):
        Volume(url).check_root()
    with pytest.raises(BucketNotFoundError):  # a write names its bucket, as on S3
        Volume(url).publish("k", b"v")


@pytest.mark.parametrize("kind", [pytest.param("s3", marks=pytest.mark.emulator), "memory"])
def test_a_key_with_dot_segments_is_refused_before_any_request(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """obstore cannot address such a key (S3 and Azure); the in-memory store refuses it alike."""
    url, options = request.getfixturevalue("s3_bucket" if kind == "s3" else "memory_bucket")
    volume = Volume(url, storage_options=options)
    for attempt in (lambda: volume.read_bytes("a/../b"), lambda: volume.publish("a/./b", b"x"),
                    lambda: volume.info("a//b")):
        with pytest.raises(VolumeError) as caught:
            attempt()
        assert type(caught.value) is VolumeError and "Could not parse path" in str(caught.value)
