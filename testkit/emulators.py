"""Object-store emulators and a fault/latency TCP proxy, for tests and benchmarks.

Every launcher binds 127.0.0.1 only, picks its own free port, polls until the
server answers, and fails with the tail of the server's log when it does not.
Shared surface (see `Emulator`): ``start()``, ``stop()``, context manager,
``endpoint``, ``storage_options()``, ``url(bucket, *parts)``,
``create_bucket(name)``, ``reset()`` and ``filesystem()``.

``reset()`` wipes everything, buckets/containers included, on every backend.

Usable outside pytest: benchmarks do ``sys.path.insert(0, repo_root)`` and then
``from testkit.emulators import MotoServer, LatencyProxy``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from .ports import free_port
from .proxy import LatencyProxy

if TYPE_CHECKING:
    import fsspec

# gcsfs probes for hierarchical-namespace buckets unless this is off, and the
# emulator does not answer that probe: every call would then wait ~60 s. It is
# read when gcsfs is imported, so it must be set before anything imports it.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

# Cloud clients without credentials fall back to an instance-metadata address
# (169.254.169.254), which is never a target here: every such setting points
# at a closed loopback port (9, discard: nothing listens), and botocore's own
# switch is on. Tests and benchmarks always pass explicit credentials besides.
_CLOSED = "127.0.0.1:9"
for _name, _value in {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_METADATA_ENDPOINT": f"http://{_CLOSED}",
    "AZURE_MSI_ENDPOINT": f"http://{_CLOSED}/metadata/identity/oauth2/token",
    "MSI_ENDPOINT": f"http://{_CLOSED}/metadata/identity/oauth2/token",
    "IDENTITY_ENDPOINT": f"http://{_CLOSED}/metadata/identity/oauth2/token",
    "GCE_METADATA_HOST": _CLOSED,
    "GCE_METADATA_IP": _CLOSED,
}.items():
    os.environ.setdefault(_name, _value)

__all__ = [
    "Azurite",
    "Emulator",
    "EmulatorError",
    "GcsEmulator",
    "LatencyProxy",
    "MotoServer",
    "S3Api",
    "repo_root",
]


# Credentials of the emulators: fake for moto, the published development-storage
# account for Azurite. Neither grants access to anything real.
_AWS_KEY = "testing"
_AWS_SECRET = "testing"
_AZ_ACCOUNT = "devstoreaccount1"
_AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class EmulatorError(RuntimeError):
    """An emulator could not be found, started or driven."""


def repo_root() -> Path:
    """The repository root (the parent of ``testkit/``)."""
    return Path(__file__).resolve().parent.parent


def _http(
    method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
) -> tuple[int, bytes]:
    """One plain HTTP request; returns (status, body) for any status, raises on no answer."""
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    # No proxies: a proxy from the environment must never see emulator traffic.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


# Emulators still running at interpreter exit (a benchmark that forgot stop(),
# a pytest run cut short) are stopped here so no server outlives its owner.
_live: weakref.WeakSet[Emulator] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for emu in list(_live):
        with contextlib.suppress(Exception):
            emu.stop()


_E = TypeVar("_E", bound="Emulator")


class Emulator:
    """Common surface of the object-store launchers."""

    scheme: ClassVar[str]
    protocol: ClassVar[str]  # fsspec protocol name
    ready_timeout_s: float = 30.0

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = 0
        self._running = False

    # -- lifecycle -----------------------------------------------------------
    def start(self: _E) -> _E:
        if self._running:
            return self
        self._start()
        self._running = True
        _live.add(self)
        return self

    def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        _live.discard(self)
        self._stop()

    @property
    def running(self) -> bool:
        return self._running

    def __enter__(self: _E) -> _E:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    # -- addressing ----------------------------------------------------------
    @property
    def endpoint(self) -> str:
        if not self.port:
            raise EmulatorError(f"{type(self).__name__} is not started; call start() first")
        return f"http://{self.host}:{self.port}"

    def url(self, bucket: str, *parts: str) -> str:
        """``scheme://bucket/part/part``; parts may contain slashes."""
        tail = "/".join(p.strip("/") for p in parts if p.strip("/"))
        return f"{self.scheme}://{bucket}" + (f"/{tail}" if tail else "")

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """fsspec options for this emulator, or for ``endpoint`` (e.g. a proxy in front)."""
        raise NotImplementedError

    def filesystem(self, endpoint: str | None = None) -> fsspec.AbstractFileSystem:
        """A fresh (uncached) fsspec filesystem for this emulator."""
        import fsspec

        return fsspec.filesystem(
            self.protocol, skip_instance_cache=True, **self.storage_options(endpoint)
        )

    # -- data ----------------------------------------------------------------
    def create_bucket(self, name: str) -> str:
        """Create bucket/container ``name``; returns its URL."""
        raise NotImplementedError

    def reset(self) -> None:
        """Delete everything: objects and buckets/containers."""
        raise NotImplementedError


class S3Api:
    """The S3 half of an emulator's surface: fsspec options, AWS_* variables, a boto3 client.

    Subclasses set ``access_key``, ``secret_key`` and ``region`` and are ``Emulator``s.
    """

    access_key: ClassVar[str]
    secret_key: ClassVar[str]
    region: str
    endpoint: str
    _boto: Any

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        # No region_name in client_kwargs: bucket creation would then fail with an
        # invalid location constraint (see shared/EMULATORS.md).
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint},
        }

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """AWS_* variables for boto3, s3torchconnector and the AWS CLI."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def boto3_client(self) -> Any:
        """A cached boto3 S3 client on this server (thread-safe), path-style addressing."""
        if self._boto is None:
            import boto3
            from botocore.config import Config

            self._boto = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                region_name=self.region,
                config=Config(s3={"addressing_style": "path"}),
            )
        return self._boto

    def create_bucket(self, name: str) -> str:
        self.boto3_client().create_bucket(Bucket=name)
        return self.url(name)  # type: ignore[attr-defined]  # Emulator's


class _ProcessEmulator(Emulator):
    """An emulator running as a child process, logging to a file."""

    name: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None

    @property
    def log_path(self) -> Path:
        if self._workdir is None:
            raise EmulatorError(f"{self.name} is not started")
        return self._workdir / "server.log"

    def _command(self, port: int) -> list[str]:
        raise NotImplementedError

    def _child_env(self) -> dict[str, str]:
        return dict(os.environ)

    def _probe(self) -> bool:
        """True once the server answers HTTP (any status)."""
        try:
            _http("GET", self.endpoint + "/")
        except OSError:
            return False
        return True

    def _start(self) -> None:
        self._workdir = Path(tempfile.mkdtemp(prefix=f"dcpv-{self.name}-"))
        # The chosen port can be taken between probe and bind: retry with another.
        last_error = ""
        cmd: list[str] = []
        for _attempt in range(3):
            self.port = free_port()
            try:
                cmd = self._command(self.port)
            except BaseException:
                shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir, self.port = None, 0
                raise
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._child_env(),
                    cwd=self._workdir,
                    # Own process group: a Ctrl-C in the terminal reaches the
                    # owner, which then stops the server in order.
                    start_new_session=True,
                )
            deadline = time.monotonic() + self.ready_timeout_s
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                # Alive after a good probe: the answer came from our server, not
                # from whoever else might hold the port it failed to bind.
                if self._probe() and self._proc.poll() is None:
                    return
                time.sleep(0.05)
            code = self._proc.poll()
            self._kill()
            last_error = (
                f"exited with code {code}"
                if code is not None
                else f"did not answer within {self.ready_timeout_s:.0f} s"
            )
            if code is None:
                break  # a hang is not a port clash; retrying would only wait again
        log_tail = _tail(self.log_path)
        shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None
        self.port = 0
        raise EmulatorError(
            f"{self.name} failed to start on 127.0.0.1: {last_error}.\n"
            f"command: {' '.join(cmd)}\nlast lines of its log:\n{log_tail}"
        )

    def pids(self) -> list[int]:
        """The server's process id (empty when stopped): whose CPU a benchmark counts."""
        return [self._proc.pid] if self._proc is not None and self._proc.poll() is None else []

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def _stop(self) -> None:
        self._kill()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self.port = 0


# ---------------------------------------------------------------------------
# S3: moto
# ---------------------------------------------------------------------------


class MotoServer(S3Api, _ProcessEmulator):
    """moto's S3 server, in this process ("thread") or as a child ("process").

    "thread" starts in ~5 ms (after a ~0.4 s moto import) but shares the GIL
    with the client, so use "process" for throughput figures. All thread-mode
    servers in one process share moto's global state (and its recorder).

    Request log: with ``record_requests=True`` moto's own recorder
    (``/moto-api/recorder/*``) logs every request; ``request_counts()`` then
    gives a Counter of ``(method, "/bucket/key")``. The recorder also stores
    request bodies (base64), so keep it off for large transfers; the proxy's
    ``LatencyProxy.requests`` counts without that cost.
    """

    scheme = "s3"
    protocol = "s3"
    name = "moto"
    access_key = _AWS_KEY
    secret_key = _AWS_SECRET

    def __init__(
        self,
        mode: Literal["thread", "process"] = "thread",
        *,
        record_requests: bool = False,
        region: str = "us-east-1",
        auth_after: int | None = None,
    ) -> None:
        super().__init__()
        if mode not in ("thread", "process"):
            raise ValueError(f"mode must be 'thread' or 'process', not {mode!r}")
        if auth_after is not None and mode != "process":
            raise ValueError("auth_after needs mode='process' (moto reads it at start-up)")
        self.mode = mode
        # Requests after the first `auth_after` must carry valid IAM credentials and
        # signatures (moto's INITIAL_NO_AUTH_ACTION_COUNT); None: anything goes.
        self.auth_after = auth_after
        self.region = region
        self.record_requests = record_requests
        self._thread_server: Any = None
        self._boto: Any = None
        self._recording_path: Path | None = None

    def _command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.auth_after is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(self.auth_after)
        if self._workdir is not None:
            env["MOTO_RECORDER_FILEPATH"] = str(self._workdir / "recording.jsonl")
        return env

    def _probe(self) -> bool:
        try:
            status, _ = _http("GET", self.endpoint + "/moto-api/")
        except OSError:
            return False
        return status == 200

    def _start(self) -> None:
        if self.mode == "process":
            super()._start()
            if self._workdir is not None:
                self._recording_path = self._workdir / "recording.jsonl"
        else:
            from moto.moto_api import recorder
            from moto.server import ThreadedMotoServer

            # werkzeug logs every request at INFO to stderr; that drowns test output.
            logging.getLogger("werkzeug").setLevel(logging.WARNING)
            # Port 0: the OS picks it at bind time, so there is no race to lose.
            # (ThreadedMotoServer.start() would hang forever on a bind error.)
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            self._thread_server = server
            self.port = int(server.get_host_and_port()[1])
            if self.record_requests:
                # The recorder is process-global and defaults to ./moto_recording;
                # point it at a private file so the repo stays clean.
                self._workdir = Path(tempfile.mkdtemp(prefix="dcpv-moto-"))
                self._recording_path = self._workdir / "recording.jsonl"
                recorder._location = str(self._recording_path)
        if self.record_requests:
            self._moto_api("reset-recording")
            self._moto_api("start-recording")

    def _stop(self) -> None:
        self._boto = None
        if self._thread_server is not None:
            server, self._thread_server = self._thread_server, None
            server.stop()
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir = None
            self.port = 0
        else:
            super()._stop()

    def _moto_api(self, what: str) -> bytes:
        status, body = _http("POST", f"{self.endpoint}/moto-api/recorder/{what}")
        if status != 200:
            raise EmulatorError(f"moto recorder {what} answered HTTP {status}")
        return body

    def reset(self) -> None:
        status, _ = _http("POST", f"{self.endpoint}/moto-api/reset")
        if status != 200:
            raise EmulatorError(f"moto reset answered HTTP {status}")
        if self.record_requests:
            self.reset_requests()

    # -- request log (record_requests=True) ----------------------------------
    def reset_requests(self) -> None:
        self._require_recording()
        self._moto_api("reset-recording")

    def request_log(self) -> list[tuple[str, str]]:
        """``(method, path)`` of every request since the last reset, in order.

        ``path`` is percent-decoded and has no query string: ``/bucket/key``
        for object requests, ``/bucket`` for listings.
        """
        self._require_recording()
        status, body = _http("GET", f"{self.endpoint}/moto-api/recorder/download-recording")
        if status != 200:
            raise EmulatorError(f"moto download-recording answered HTTP {status}")
        out: list[tuple[str, str]] = []
        for entry in _iter_json_objects(body.decode()):
            path = urllib.parse.urlsplit(entry["url"]).path
            if not path.startswith("/moto-api/"):
                out.append((str(entry["method"]), urllib.parse.unquote(path)))
        return out

    def request_counts(self) -> collections.Counter[tuple[str, str]]:
        """Counter of ``(method, path)``; e.g. ``counts["GET", "/bkt/a/b"]``."""
        return collections.Counter(self.request_log())

    def _require_recording(self) -> None:
        if not self.record_requests:
            raise EmulatorError("request log needs MotoServer(..., record_requests=True)")


def _iter_json_objects(text: str) -> Iterator[dict[str, Any]]:
    # Concurrent requests can append their lines out of step (the newline is a
    # separate write), so decode a stream of objects instead of splitting lines.
    decoder = json.JSONDecoder()
    pos, end = 0, len(text)
    while True:
        while pos < end and text[pos].isspace():
            pos += 1
        if pos >= end:
            return
        obj, pos = decoder.raw_decode(text, pos)
        yield obj


# ---------------------------------------------------------------------------
# Azure Blob: Azurite
# ---------------------------------------------------------------------------


class Azurite(_ProcessEmulator):
    """Azurite's blob service (npm ``azurite``), installed by ``make test`` into .tools/."""

    scheme = "az"
    protocol = "az"
    name = "azurite"

    def __init__(
        self,
        binary: str | os.PathLike[str] | None = None,
        *,
        memory_limit_mib: int | None = None,
    ) -> None:
        super().__init__()
        self._binary = Path(binary) if binary else None
        # Given: blobs kept in RAM, at most this many MiB of them (a store that fills).
        self._memory_limit_mib = memory_limit_mib

    @staticmethod
    def find_binary() -> Path | None:
        local = repo_root() / ".tools" / "node_modules" / ".bin" / "azurite-blob"
        if local.exists():
            return local
        found = shutil.which("azurite-blob")
        return Path(found) if found else None

    def _command(self, port: int) -> list[str]:
        if self._binary is not None and not self._binary.exists():
            raise EmulatorError(f"azurite-blob not found at {self._binary}")
        binary = self._binary or self.find_binary()
        if binary is None:
            raise EmulatorError(
                "azurite-blob not found (looked in .tools/node_modules/.bin and PATH). "
                "Run `make setup`: it installs it from tools/package-lock.json."
            )
        if self._workdir is None:
            raise EmulatorError("internal: no work dir")
        location = self._workdir / "data"
        location.mkdir(exist_ok=True)
        # --skipApiVersionCheck: the Python SDK speaks a newer API version than
        # this Azurite knows; --disableTelemetry: telemetry tries the internet.
        store = ["--location", str(location)]
        if self._memory_limit_mib is not None:
            store = ["--inMemoryPersistence", "--extentMemoryLimit", str(self._memory_limit_mib)]
        return [
            str(binary),
            "--silent",
            "--disableTelemetry",
            "--skipApiVersionCheck",
            *store,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
        ]

    def _probe(self) -> bool:
        try:
            status, _ = _http("GET", f"{self.endpoint}/{_AZ_ACCOUNT}?comp=list")
        except OSError:
            return False
        # Unsigned request: 403 (auth) proves the blob service is up.
        return status in (200, 403)

    def connection_string(self, endpoint: str | None = None) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={_AZ_ACCOUNT};AccountKey={_AZ_KEY};"
            f"BlobEndpoint={endpoint or self.endpoint}/{_AZ_ACCOUNT};"
        )

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        return {
            "account_name": _AZ_ACCOUNT,
            "account_key": _AZ_KEY,
            "connection_string": self.connection_string(endpoint),
        }

    def service_client(self) -> Any:
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def create_bucket(self, name: str) -> str:
        with self.service_client() as svc:
            svc.create_container(name)
        return self.url(name)

    def reset(self) -> None:
        with self.service_client() as svc:
            for container in svc.list_containers():
                svc.delete_container(container.name)


# ---------------------------------------------------------------------------
# GCS: gcp-storage-emulator
# ---------------------------------------------------------------------------


class GcsEmulator(_ProcessEmulator):
    """gcp-storage-emulator, in memory (``-M``).

    Its HTTP server is single-threaded: requests are served one at a time.
    """

    scheme = "gs"
    protocol = "gs"
    name = "gcs-emulator"
    project = "test"

    def _command(self, port: int) -> list[str]:
        # Same interpreter as ours, so it works from any venv without PATH.
        return [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-q",
            "-M",
        ]

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        return {"endpoint_url": endpoint or self.endpoint, "token": "anon", "project": self.project}

    def create_bucket(self, name: str) -> str:
        status, body = _http(
            "POST",
            f"{self.endpoint}/storage/v1/b?project={self.project}",
            json.dumps({"name": name}).encode(),
            {"Content-Type": "application/json"},
        )
        if status != 200:
            raise EmulatorError(
                f"GCS emulator: create bucket {name!r} answered HTTP {status}: {body[:200]!r}"
            )
        return self.url(name)

    def reset(self) -> None:
        status, _ = _http("GET", f"{self.endpoint}/wipe")
        if status != 200:
            raise EmulatorError(f"GCS emulator wipe answered HTTP {status}")
