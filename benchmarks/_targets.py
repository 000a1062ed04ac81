"""The stores the benchmarks run against, one code path for all of them.

A target is what ``--target`` names: an emulator or server this package starts
and stops (``moto``: moto's S3 server in its own process; ``radosgw``: Ceph's
S3 gateway on a private one-node cluster, ``testkit/radosgw.py``; ``azurite``:
Azurite's Blob service; ``gcs``: gcp-storage-emulator; ``dir``: a local
directory, the mount-path case), or a URL the user gives (``s3://bucket/prefix``
with ``--endpoint`` and ``--storage-option``), e.g. a MinIO or a real bucket.

Every target hands out a ``Server``: its endpoint, fsspec ``storage_options``
(explicit credentials only; importing ``testkit.emulators`` also points every
instance-metadata setting at a closed loopback port) and the process ids whose
CPU time counts as the server's.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import testkit.emulators  # noqa: F401  (first: metadata endpoints -> a closed loopback port)

DEFAULT_TARGET = "moto"
EMULATORS = ("moto", "radosgw", "azurite", "gcs", "dir")


class TargetError(RuntimeError):
    """A target cannot be used as given (what, why, how to fix in the message)."""


@dataclass(frozen=True)
class Target:
    """What a run needs to know about a store before it starts."""

    name: str  # what --target took ("moto", ..., or the URL)
    scheme: str  # URL scheme of the store: "s3", "az", "gs", "file"
    fsspec_client: str  # the fsspec filesystem the peers use there
    server_label: str  # for the report's config
    s3torchconnector: bool  # whether s3torchconnector's rows apply
    multipart: bool = True  # whether the raw floor has a parallel-parts shape here
    proxyable: bool = True  # whether the remote link (an HTTP proxy) can sit in front
    bucket: str | None = None  # a URL target's bucket (emulators make their own)
    prefix: str = ""  # a URL target's key prefix
    endpoint: str | None = None  # --endpoint
    options: Mapping[str, Any] = field(default_factory=dict)  # --storage-option k=v
    # Options of ours, for our writers and readers only (stock clients refuse them).
    volume_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def external(self) -> bool:
        return self.name not in EMULATORS

    def url(self, bucket: str, *parts: str) -> str:
        tail = "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))
        return f"{self.scheme}://{bucket}" + (f"/{tail}" if tail else "")

    def stem(self, base: str) -> str:
        """Result file stem: the default target keeps the names results always had."""
        if self.name == DEFAULT_TARGET:
            return base
        label = self.name if not self.external else f"{self.scheme}_{self.bucket}"
        return f"{base}_{label}"


_BUILTIN = {
    # moto reads the whole object for every ranged GET.
    "moto": Target("moto", "s3", "s3fs", "moto_server (separate process)", True,
                   volume_options={"ranged_reads_cost_whole_object": True}),
    # s3torchconnector's writes fail on Ceph 16 (CompleteMultipartUpload answers an
    # empty ETag; shared/EMULATORS.md), so its rows stay off there.
    "radosgw": Target(
        "radosgw", "s3", "s3fs", "Ceph 16 radosgw, one mon + memstore OSD (testkit/radosgw.py)",
        False,
    ),
    "azurite": Target(
        "azurite", "az", "adlfs", "Azurite blob service (node, separate process)", False
    ),
    # gcsfs has no parallel-parts upload and the emulator serves one request at a time.
    "gcs": Target(
        "gcs", "gs", "gcsfs", "gcp-storage-emulator -M (separate process)", False, multipart=False
    ),
    "dir": Target(
        "dir", "file", "local", "a local directory (the mount-path case)", False,
        multipart=False, proxyable=False,
    ),
}
SCHEMES = {"s3": "s3fs", "az": "adlfs", "abfs": "adlfs", "gs": "gcsfs", "gcs": "gcsfs"}


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """``--target``, ``--endpoint`` and ``--storage-option`` (resolved by ``resolve``)."""
    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        metavar="{" + ",".join(EMULATORS) + ",URL}",
        help="where to run: an emulator this starts and stops (moto: S3, default; radosgw: "
        "Ceph's real S3; azurite: Azure Blob; gcs: the GCS emulator; dir: a local "
        "directory), or a URL (s3://bucket/prefix, a mount path) with --endpoint",
    )
    parser.add_argument(
        "--endpoint",
        default=None,
        help="the server's URL (e.g. a MinIO's http://host:9000): use it instead of starting one",
    )
    parser.add_argument(
        "--storage-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="an fsspec option for the store (repeatable; dots nest: client_kwargs.region_name=x)",
    )


def parse_storage_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["key=value", ...]`` -> a dict; ``client_kwargs.endpoint_url=...`` nests."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise TargetError(
                f"--storage-option {pair!r} is not key=value; e.g. --storage-option key=AKIA..."
            )
        node = out
        *path, leaf = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = _scalar(value)
    return out


def _scalar(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    with contextlib.suppress(ValueError):
        return int(text)
    return text


def resolve(spec: str, *, endpoint: str | None = None, options: list[str] | None = None) -> Target:
    """The target ``--target spec`` names (an emulator's name or a URL)."""
    extra = parse_storage_options(options)
    if spec in _BUILTIN:
        base = _BUILTIN[spec]
        if endpoint and spec != "dir":
            # A server of this kind already runs there (e.g. a MinIO for "moto"'s S3).
            return Target(
                spec, base.scheme, base.fsspec_client, f"{spec} API at {endpoint}",
                base.s3torchconnector, base.multipart, True, None, "", endpoint, extra,
            )
        return Target(**{**base.__dict__, "endpoint": endpoint, "options": extra})
    parsed = urllib.parse.urlsplit(spec)
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme else spec
        if not path.startswith("/"):
            raise TargetError(
                f"--target {spec!r} is neither one of {', '.join(_BUILTIN)} nor a URL: give "
                "an emulator's name, an absolute directory (a mount path) or s3://bucket/prefix"
            )
        return Target(
            spec, "file", "local", f"directory {path}", False, False, False,
            bucket=path.rstrip("/") or "/", options=extra,
        )
    if parsed.scheme not in SCHEMES:
        raise TargetError(
            f"--target {spec!r}: no benchmark client for {parsed.scheme}:// "
            f"(supported: {', '.join(sorted(SCHEMES))}, a directory, or an emulator's name)"
        )
    if not parsed.netloc:
        raise TargetError(f"--target {spec!r} names no bucket: use {parsed.scheme}://bucket/prefix")
    scheme = {"abfs": "az", "gcs": "gs"}.get(parsed.scheme, parsed.scheme)
    return Target(
        spec, scheme, SCHEMES[parsed.scheme], f"{spec} (given)", scheme == "s3",
        multipart=scheme != "gs", proxyable=bool(endpoint), bucket=parsed.netloc,
        prefix=parsed.path.strip("/"), endpoint=endpoint, options=extra,
    )


class ExternalServer:
    """A store this package did not start: the endpoint and options the user gave."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._endpoint = target.endpoint
        parsed = urllib.parse.urlsplit(target.endpoint or "")
        self.host = parsed.hostname or ""
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)

    @property
    def endpoint(self) -> str:
        return self._endpoint or ""

    def pids(self) -> list[int]:
        return []  # not ours to measure

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        opts = dict(self.target.options)
        ep = endpoint or self._endpoint
        if self.target.scheme == "s3" and ep:
            opts["client_kwargs"] = {**opts.get("client_kwargs", {}), "endpoint_url": ep}
        elif self.target.scheme in ("gs", "az") and ep:
            key = "endpoint_url" if self.target.scheme == "gs" else "account_host"
            opts[key] = ep
        return opts

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        opts = self.storage_options(endpoint)
        env = {"AWS_DEFAULT_REGION": "us-east-1"}
        if "key" in opts:
            env["AWS_ACCESS_KEY_ID"] = str(opts["key"])
        if "secret" in opts:
            env["AWS_SECRET_ACCESS_KEY"] = str(opts["secret"])
        return env

    def create_bucket(self, name: str) -> str:
        return self.target.url(name)  # it exists: the user named it

    def __enter__(self) -> ExternalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class DirServer:
    """A local directory standing in for a mount: ``file`` "buckets" are subdirectories."""

    def __init__(self, root: str | None = None) -> None:
        self._own = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="dcpv-bench-dir-"))
        self.host, self.port, self.endpoint = "", 0, ""

    def pids(self) -> list[int]:
        return []  # the kernel is the server

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        return {}

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {}

    def create_bucket(self, name: str) -> str:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        return str(self.root / name)

    def __enter__(self) -> DirServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._own:
            shutil.rmtree(self.root, ignore_errors=True)


def server_pids(server: Any) -> list[int]:
    """Process ids whose CPU counts as the server's (the emulator and its children)."""
    if hasattr(server, "pids"):
        return list(server.pids())
    return []


def store_url(target: Target, server: Any, bucket: str, *parts: str) -> str:
    """The URL (or local path) of ``bucket``/``parts`` on the running target."""
    if target.scheme == "file":
        root = server.root if isinstance(server, DirServer) else Path(target.bucket or "/")
        return str(Path(root, bucket, *parts))
    return target.url(target.bucket or bucket, *parts)


@contextlib.contextmanager
def serve(target: Target, *buckets: str, memory_bytes: int = 0) -> Iterator[Any]:
    """The target's server, started, with ``buckets`` (containers) created.

    ``memory_bytes``: how much the run stores at once at most (radosgw's
    memstore must hold it with room to spare, or Ceph blocks writes).
    """
    from testkit.emulators import Azurite, GcsEmulator, MotoServer

    if target.name == "dir" or (target.scheme == "file" and target.external):
        root = None if target.name == "dir" else str(target.bucket)
        server: Any = DirServer(root)
    elif target.endpoint or target.external:
        server = ExternalServer(target)
    elif target.name == "moto":
        server = MotoServer(mode="process")
    elif target.name == "radosgw":
        from testkit.radosgw import INSTALL_COMMAND, RadosGW

        if RadosGW.find_binaries() is None:
            raise TargetError(
                f"radosgw is not installed: run `{INSTALL_COMMAND}` (Debian packages), "
                "or give --endpoint of an S3 server you run"
            )
        # Memstore reserves nothing: RAM is used as data arrives.
        server = RadosGW(memstore_bytes=max(8 << 30, 2 * memory_bytes))
    elif target.name == "azurite":
        if Azurite.find_binary() is None:
            raise TargetError(
                "azurite-blob is not installed: `make setup` installs it into .tools/ "
                "(pinned by tools/package-lock.json)"
            )
        server = Azurite()
    elif target.name == "gcs":
        server = GcsEmulator()
    else:  # pragma: no cover - resolve() only makes the kinds above
        raise TargetError(f"unknown target {target.name!r}")
    with server:
        if not (target.external or target.endpoint):
            for bucket in buckets:
                server.create_bucket(bucket)
        yield server
