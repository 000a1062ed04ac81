"""Test infrastructure: emulators serve real fsspec clients; the proxy shapes traffic."""

from __future__ import annotations

import http.client
import os
import resource
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from testkit.emulators import Emulator, LatencyProxy, MotoServer

pytestmark = pytest.mark.emulator

_EMULATORS = ["moto_server", "azurite", "gcs_emulator"]


@pytest.fixture(params=_EMULATORS)
def emulator(request: pytest.FixtureRequest) -> Emulator:
    emu: Emulator = request.getfixturevalue(request.param)
    return emu


@pytest.fixture
def bucket(emulator: Emulator, request: pytest.FixtureRequest) -> Iterator[str]:
    from tests.conftest import unique_bucket_name

    name = unique_bucket_name(request)
    emulator.create_bucket(name)
    yield name
    emulator.reset()


def test_fsspec_roundtrip(emulator: Emulator, bucket: str) -> None:
    fs = emulator.filesystem()
    data = bytes(range(256)) * 64
    fs.pipe(f"{bucket}/dir/obj.bin", data)
    fs.pipe(f"{bucket}/dir/other.bin", b"x")

    assert fs.cat_file(f"{bucket}/dir/obj.bin") == data
    assert fs.cat_file(f"{bucket}/dir/obj.bin", start=100, end=356) == data[100:356]
    assert sorted(fs.find(bucket)) == [f"{bucket}/dir/obj.bin", f"{bucket}/dir/other.bin"]
    assert fs.info(f"{bucket}/dir/obj.bin")["size"] == len(data)

    fs.rm(f"{bucket}/dir/obj.bin")
    fs.invalidate_cache()
    assert fs.find(bucket) == [f"{bucket}/dir/other.bin"]
    assert emulator.url(bucket, "dir/", "/other.bin") == (
        f"{emulator.scheme}://{bucket}/dir/other.bin"
    )


def test_reset_empties_everything(emulator: Emulator, bucket: str) -> None:
    fs = emulator.filesystem()
    fs.pipe(f"{bucket}/a", b"1")
    emulator.reset()
    # A fresh client: the old one may answer from its listing cache.
    fresh = emulator.filesystem()
    assert not fresh.exists(f"{bucket}/a")
    assert bucket not in {p.rstrip("/") for p in fresh.ls("", detail=False)}
    emulator.create_bucket(bucket)  # usable again after a reset


def test_volume_url_is_fresh_and_writable(volume_url: tuple[str, dict[str, Any]]) -> None:
    import fsspec

    url, options = volume_url
    fs, root = fsspec.core.url_to_fs(url, **options)
    assert fs.ls(root, detail=False) == []
    fs.makedirs(f"{root}/x", exist_ok=True)  # local needs it; a no-op on object stores
    fs.pipe(f"{root}/x/y", b"hello")
    assert fs.cat_file(f"{root}/x/y") == b"hello"


def test_moto_recorder_counts_gets() -> None:
    # A private process-mode server: exercises the subprocess launcher and moto's recorder.
    with MotoServer(mode="process", record_requests=True) as s3:
        s3.create_bucket("bkt")
        fs = s3.filesystem()
        fs.pipe("bkt/k/one", b"1" * 10)
        s3.reset_requests()
        for _ in range(3):
            fs.cat_file("bkt/k/one", start=0, end=4)
        counts = s3.request_counts()
        assert counts["GET", "/bkt/k/one"] == 3
        s3.reset()
        assert s3.request_log() == []
    assert not s3.running


def _get(endpoint: str, path: str) -> tuple[int, bytes]:
    # Plain http.client: no retries, so injected faults are visible.
    host, port = endpoint.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture
def s3_object(s3_bucket: tuple[str, dict[str, Any]], moto_server: MotoServer) -> tuple[str, bytes]:
    """Path (``/bucket/key``) of a 1 MiB public object on moto."""
    url, _ = s3_bucket
    bucket = url.removeprefix("s3://")
    data = bytes(range(256)) * 4096
    moto_server.boto3_client().put_object(Bucket=bucket, Key="blob", Body=data, ACL="public-read")
    return f"/{bucket}/blob", data


def test_proxy_forwards_and_counts(moto_server: MotoServer, s3_object: tuple[str, bytes]) -> None:
    path, data = s3_object
    with LatencyProxy.in_front_of(moto_server) as proxy:
        fs = moto_server.filesystem(proxy.endpoint)
        key = path.lstrip("/")
        assert fs.cat_file(key) == data
        assert fs.cat_file(key, start=10, end=20) == data[10:20]
        assert proxy.count("GET", path) == 2
        proxy.reset_counts()
        assert proxy.count("GET", path) == 0
    assert proxy.port == 0  # stopped


def test_proxy_serves_connections_past_descriptor_1023(
    moto_server: MotoServer, s3_object: tuple[str, bytes]
) -> None:
    # A simulation of many ranks holds thousands of connections open; select()
    # refuses a descriptor past 1023 (its connection thread died, the request hung).
    path, data = s3_object
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("this process may not open 1200 files")
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with LatencyProxy.in_front_of(moto_server) as proxy:
            assert _get(proxy.endpoint, path) == (200, data)
    finally:
        for fd in spare:
            os.close(fd)


def test_proxy_adds_latency_per_request(
    moto_server: MotoServer, s3_object: tuple[str, bytes]
) -> None:
    path, data = s3_object
    latency = 0.1
    with LatencyProxy.in_front_of(moto_server, latency_s=latency) as proxy:
        for _ in range(2):
            start = time.monotonic()
            assert _get(proxy.endpoint, path) == (200, data)
            assert time.monotonic() - start >= latency
        assert proxy.count("GET", path) == 2


class _KeepAliveHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive server: moto and the GCS emulator close after each response."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._reply(b"g" * 5000)

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(b"")

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def keepalive_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeepAliveHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_proxy_keepalive_latency_and_counts(keepalive_server: ThreadingHTTPServer) -> None:
    latency = 0.05
    port = keepalive_server.server_address[1]
    with LatencyProxy("127.0.0.1", port, latency_s=latency) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        body = b"B" * 300_000  # spans many TCP reads: must not count as new requests
        for i in range(3):
            start = time.monotonic()
            conn.request("PUT", f"/obj/{i}?x=1", body=body)
            assert conn.getresponse().read() == b""
            conn.request("GET", f"/obj/{i}")
            assert conn.getresponse().read() == b"g" * 5000
            assert time.monotonic() - start >= 2 * latency
        conn.close()
    assert proxy.connections == 1
    assert proxy.requests == {
        (method, f"/obj/{i}"): 1 for i in range(3) for method in ("PUT", "GET")
    }
    assert proxy.log[0] == ("PUT", "/obj/0?x=1")


def test_proxy_caps_bandwidth(moto_server: MotoServer, s3_object: tuple[str, bytes]) -> None:
    path, data = s3_object
    bps = 40e6  # 1 MiB at 40 Mbit/s: >= ~0.2 s
    with LatencyProxy.in_front_of(moto_server, bandwidth_bps=bps) as proxy:
        start = time.monotonic()
        status, body = _get(proxy.endpoint, path)
        elapsed = time.monotonic() - start
    assert status == 200
    assert body == data
    # Allow the token bucket's initial burst (<= 256 KiB).
    assert elapsed >= (len(data) - 256 * 1024) * 8 / bps


def test_proxy_caps_all_connections_together(
    moto_server: MotoServer, s3_object: tuple[str, bytes]
) -> None:
    path, data = s3_object
    bps = 40e6  # 4 x 1 MiB in parallel, 40 Mbit/s for all: >= ~0.8 s (each alone: ~0.2 s)
    with LatencyProxy.in_front_of(moto_server, bandwidth_bps=1e9,
                                  total_bandwidth_bps=bps) as proxy:
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _get(proxy.endpoint, path), range(4)))
        elapsed = time.monotonic() - start
    assert answers == [(200, data)] * 4
    assert elapsed >= (4 * len(data) - 256 * 1024) * 8 / bps


def test_proxy_drop_next_fails_requests(
    moto_server: MotoServer, s3_object: tuple[str, bytes]
) -> None:
    path, data = s3_object
    with LatencyProxy.in_front_of(moto_server) as proxy:
        proxy.drop_next(1)
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            _get(proxy.endpoint, path)  # reset before it reached the server
        proxy.drop_next(1, after_bytes=1000)
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            _get(proxy.endpoint, path)  # reset mid-response
        assert proxy.pending_drops == 0
        assert _get(proxy.endpoint, path) == (200, data)
        assert proxy.dropped["GET", path] == 2
        assert proxy.count("GET", path) == 3

        # fsspec clients retry a reset connection: one failed GET, one good one.
        proxy.reset_counts()
        proxy.drop_next(1, method="GET")
        assert moto_server.filesystem(proxy.endpoint).cat_file(path.lstrip("/")) == data
        assert proxy.count("GET", path) == 2


def test_proxy_stall_next_never_answers_and_call_next_runs_first(
    moto_server: MotoServer, s3_object: tuple[str, bytes]
) -> None:
    path, data = s3_object
    host, port = "", 0
    with LatencyProxy.in_front_of(moto_server) as proxy:
        host, port = proxy.host, proxy.port
        seen: list[int] = []
        proxy.call_next(lambda: seen.append(proxy.count("GET", path)), method="GET")
        proxy.stall_next(1, method="GET")
        conn = http.client.HTTPConnection(host, port, timeout=0.5)
        try:
            conn.request("GET", path)
            with pytest.raises(TimeoutError):
                conn.getresponse()  # taken, never answered
        finally:
            conn.close()
        assert seen == [0]  # ran once, as the request arrived (before it was counted)
        assert proxy.stalled["GET", path] == 1 and proxy.pending_stalls == 0
        assert _get(proxy.endpoint, path) == (200, data)  # the next one goes through
        proxy.stall_next(5)
        proxy.clear_faults()
        assert _get(proxy.endpoint, path) == (200, data)


def test_proxy_fail_every(moto_server: MotoServer, s3_object: tuple[str, bytes]) -> None:
    path, _ = s3_object
    with LatencyProxy.in_front_of(moto_server, fail_every=2) as proxy:
        outcomes: list[int | str] = []
        for _ in range(4):
            try:
                outcomes.append(_get(proxy.endpoint, path)[0])
            except (ConnectionError, http.client.HTTPException):
                outcomes.append("reset")
    assert outcomes == [200, "reset", 200, "reset"]


@pytest.mark.parametrize("emu_fixture", ["azurite", "gcs_emulator"])
def test_proxy_in_front_of_other_emulators(
    emu_fixture: str, request: pytest.FixtureRequest
) -> None:
    emu: Emulator = request.getfixturevalue(emu_fixture)
    emu.create_bucket("proxied")
    try:
        with LatencyProxy.in_front_of(emu) as proxy:
            fs = emu.filesystem(proxy.endpoint)
            fs.pipe("proxied/obj", b"abc" * 1000)
            assert fs.cat_file("proxied/obj", start=3, end=6) == b"abc"
            gets = [k for k, n in proxy.requests.items() if k[0] == "GET" for _ in range(n)]
            assert len(gets) >= 1
            assert all("proxied" in p for _, p in gets)
    finally:
        emu.reset()
