"""The object stores the benchmarks run against, one code path for all of them.

``moto``: moto's S3 server (a separate Python process); ``azurite``: Azurite's
Blob service (node, a separate process). A target names its URL scheme, the
fsspec client the peers use on it, and whether s3torchconnector applies (S3
only). Every client gets the emulator's explicit credentials
(``storage_options()``); importing ``tests.emulators`` also points every
instance-metadata setting at a closed loopback port.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import _common  # noqa: F401  (puts the repository root on sys.path)

import tests.emulators  # noqa: F401  (first: metadata endpoints -> a closed loopback port)

DEFAULT_TARGET = "moto"


@dataclass(frozen=True)
class Target:
    name: str  # what --target takes
    scheme: str  # URL scheme of the store ("s3", "az")
    fsspec_client: str  # the fsspec filesystem the peers use there
    server_label: str  # for the report's config
    s3torchconnector: bool  # whether s3torchconnector's rows apply

    def url(self, bucket: str, *parts: str) -> str:
        tail = "/".join(p.strip("/") for p in parts if p.strip("/"))
        return f"{self.scheme}://{bucket}" + (f"/{tail}" if tail else "")

    def stem(self, base: str) -> str:
        """Result file stem: the default target keeps the names results always had."""
        return base if self.name == DEFAULT_TARGET else f"{base}_{self.name}"


TARGETS = {
    "moto": Target("moto", "s3", "s3fs", "moto_server (separate process)", True),
    "azurite": Target(
        "azurite", "az", "adlfs", "Azurite blob service (node, separate process)", False
    ),
}


def add_target_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        choices=tuple(TARGETS),
        default=DEFAULT_TARGET,
        help="object store to run against: moto (S3, default) or azurite (Azure Blob)",
    )


@contextlib.contextmanager
def serve(target: Target, *buckets: str) -> Iterator[Any]:
    """The target's emulator, started, with ``buckets`` (containers) created."""
    from tests.emulators import Azurite, MotoServer

    server: Any = MotoServer(mode="process") if target.name == "moto" else Azurite()
    with server:
        for bucket in buckets:
            server.create_bucket(bucket)
        yield server
