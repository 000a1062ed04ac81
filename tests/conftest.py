"""Shared fixtures: emulators (started lazily, once per session) and fresh volume locations.

Fixtures:
    moto_server   (session) MotoServer in thread mode, record_requests=False.
    azurite       (session) Azurite blob service; fails (not skips) if not installed.
    gcs_emulator  (session) gcp-storage-emulator, in memory.
    s3_bucket     (function) ("s3://<fresh bucket>", storage_options) on moto_server.
    radosgw       (session) Ceph radosgw, a real S3 server (one mon, a memstore OSD).
    memory_store  (function) a MemoryStore (dcp_volumes.testing), closed after the test.
    memory_bucket (function) ("dcp-memory://<fresh bucket>", {}) on memory_store: for
                  single-process tests that need some object store, not a server.
    volume_url    (function, params local/file/s3/azure/gcs) (url, storage_options)
                  for a fresh, empty location.
    conformance_url  the same params plus radosgw and memory (the volume conformance
                  suite, which proves the in-memory store behaves as the servers do).

Emulators are wiped after each test that used them, so data does not pile up
in memory over a session.
"""

from __future__ import annotations

import os

# Must precede any gcsfs import (see testkit/emulators.py): without it every gcsfs
# call waits ~60 s on a probe the emulator never answers.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes.testing import MemoryStore
from testkit.emulators import Azurite, Emulator, GcsEmulator, MotoServer
from testkit.radosgw import RadosGW

VolumeLocation = tuple[str, dict[str, Any]]

EMULATOR_FIXTURE = {
    "s3": "moto_server",
    "azure": "azurite",
    "gcs": "gcs_emulator",
    "radosgw": "radosgw",
}


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    with MotoServer(mode="thread") as server:
        yield server


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    if Azurite.find_binary() is None:
        pytest.fail(
            "Azurite (azurite-blob) is not installed. Run `make test`, which installs it "
            "into .tools/ from tools/package-lock.json (or run `make setup`).",
            pytrace=False,
        )
    with Azurite() as server:
        yield server


@pytest.fixture(scope="session")
def radosgw() -> Iterator[RadosGW]:
    """Ceph's S3 server (a real one); fails (not skips) if its packages are missing."""
    if RadosGW.find_binaries() is None:
        pytest.fail(
            "Ceph radosgw is not installed. Run `make test`, which installs it "
            "(or: bash testkit/install_radosgw.sh).",
            pytrace=False,
        )
    with RadosGW() as server:
        yield server


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    with GcsEmulator() as server:
        yield server


def unique_bucket_name(request: pytest.FixtureRequest) -> str:
    """A valid S3/GCS bucket and Azure container name, unique, readable in logs."""
    # 3-63 chars of [a-z0-9-], starting with a letter, no "--" (Azure).
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    return f"t-{stem}-{uuid.uuid4().hex[:8]}" if stem else f"t-{uuid.uuid4().hex[:12]}"


def _fresh_bucket(emulator: Emulator, request: pytest.FixtureRequest) -> Iterator[VolumeLocation]:
    name = unique_bucket_name(request)
    url = emulator.create_bucket(name)
    try:
        yield url, emulator.storage_options()
    finally:
        # Wipe (buckets included) so the in-memory emulators do not grow all session.
        emulator.reset()


@pytest.fixture
def s3_bucket(moto_server: MotoServer, request: pytest.FixtureRequest) -> Iterator[VolumeLocation]:
    """``("s3://<fresh bucket>", storage_options)`` on the session's moto server."""
    yield from _fresh_bucket(moto_server, request)


@pytest.fixture
def memory_store() -> Iterator[MemoryStore]:
    """An in-memory object store for this test (its buckets are gone after it)."""
    with MemoryStore() as store:
        yield store


@pytest.fixture
def memory_bucket(
    memory_store: MemoryStore, request: pytest.FixtureRequest
) -> Iterator[VolumeLocation]:
    """``("dcp-memory://<fresh bucket>", {})``: a store for tests not about a server."""
    yield memory_store.create_bucket(unique_bucket_name(request)), {}


def _kinds(*remote: str) -> list[Any]:
    """Fixture params: the two local forms, then the emulators named (marked ``emulator``)."""
    return ["local", "file", *(pytest.param(k, marks=pytest.mark.emulator) for k in remote)]


@pytest.fixture(params=_kinds("s3", "azure", "gcs"))
def volume_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[VolumeLocation]:
    """A fresh, empty volume location as ``(url, storage_options)``.

    local: an existing empty directory, as a plain absolute path.
    file:  the same, as ``file:///abs/path``.
    s3 / azure / gcs: the root of a new bucket/container (``s3://b``, ``az://c``,
    ``gs://b``) on the session's emulator; it is wiped after the test.
    """
    yield from _location(request.param, request, tmp_path)


@pytest.fixture(params=[*_kinds("s3", "radosgw", "azure", "gcs"), "memory"])
def conformance_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[VolumeLocation]:
    """Like ``volume_url``, plus Ceph radosgw (a real S3 server) and the in-memory store:
    for the volume conformance suite, which every backend must pass."""
    if request.param == "memory":
        yield request.getfixturevalue("memory_bucket")
        return
    yield from _location(request.param, request, tmp_path)


def _location(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[VolumeLocation]:
    if kind in ("local", "file"):
        root = tmp_path / "volume"
        root.mkdir()
        # "file://" + path, not as_uri(): fsspec does not undo percent-encoding.
        yield (str(root) if kind == "local" else f"file://{root}"), {}
        return
    # Lazily: only the emulators that the selected params need are started.
    emulator: Emulator = request.getfixturevalue(EMULATOR_FIXTURE[kind])
    yield from _fresh_bucket(emulator, request)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot create files in, also when running as root.

    Plain chmod does not stop root (CI runs as root), so root gets the
    immutable attribute (``chattr +i``), which binds root too.
    """
    path = tmp_path / "read-only"
    path.mkdir()
    immutable = False
    if os.geteuid() == 0:
        import subprocess

        immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
        if not immutable:
            pytest.skip("running as root and chattr +i is unavailable on this filesystem")
    else:
        path.chmod(0o555)
    try:
        yield path
    finally:
        if immutable:
            import subprocess

            subprocess.run(["chattr", "-i", str(path)], check=False)
        else:
            path.chmod(0o755)


# pytest-xdist groups (`make test` runs two workers with --dist loadgroup): the
# tests of one group run on one worker, one after another.
#   radosgw: one Ceph cluster for the session, not one per worker.
#   kills:   real SIGKILLs/SIGTERMs of process trees, timed stalls and torchrun
#            jobs, whose deadlines must not share the cores with another such test.
_KILL_AND_TIMING_MODULES = frozenset({
    "test_concurrency.py", "test_crash_injection.py", "test_demo.py", "test_exit_in_flight.py",
    "test_preemption.py", "test_recipes.py", "test_stalled_upload.py", "test_stalls.py",
    "test_torchrun_restarts.py",
})


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        on_radosgw = any(isinstance(p, str) and p == "radosgw" for p in params)
        if item.path.name == "test_radosgw_server.py" or on_radosgw:
            item.add_marker(pytest.mark.xdist_group("radosgw"))
        elif item.path.name in _KILL_AND_TIMING_MODULES:
            item.add_marker(pytest.mark.xdist_group("kills"))
