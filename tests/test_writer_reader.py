"""VolumeWriter / VolumeReader: conformance on every backend, interop with stock DCP, layout."""

from __future__ import annotations

import io
import itertools
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from dcp_volumes import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    VolumeReader,
    VolumeWriter,
    storage_error,
)
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint import _layout
from dcp_volumes.checkpoint._file_reads import coalesce, find_span, split_range
from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from dcp_volumes.checkpoint._manifest import Manifest
from testkit.emulators import LatencyProxy, MotoServer
from tests import faulty_backend
from tests.checkpoint_helpers import assert_same, blank_like, failure_of, join, sample_state

# dcp.save/load without a process group warn that they run in a single process.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _data_files(url: str, opts: dict[str, Any]) -> dict[str, int]:
    return {
        f.path: f.size
        for f in Volume(url, storage_options=opts).list()
        if f.path.endswith(".distcp")
    }


# -- conformance: every backend ---------------------------------------------------------------


def test_roundtrip_every_backend(volume_url: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    url, opts = volume_url
    ck = join(url, "run", "step-1")
    staging = tmp_path / "staging"
    staging.mkdir()
    state = sample_state()
    writer = VolumeWriter(ck, storage_options=opts, staging_dir=staging, file_size="1MiB")
    dcp.save(state, storage_writer=writer)

    files = _data_files(ck, opts)
    assert len(files) >= 3, f"file_size=1MiB should split ~4 MiB into several files: {files}"
    listed = {f.path for f in Volume(ck, storage_options=opts).list()}
    assert {METADATA_NAME, MANIFEST_NAME} <= listed
    manifest = Manifest.from_json(Volume(ck, storage_options=opts).read_bytes(MANIFEST_NAME))
    assert dict(manifest.files.items()) and {k: r.size for k, r in manifest.files.items()} == files
    assert list(staging.iterdir()) == [], "staged files must be removed after the upload"

    out = blank_like(state)
    dcp.load(out, storage_reader=VolumeReader(ck, storage_options=opts))
    assert_same(out, state)

    # verify=True reads every file whole and checks it: same result.
    out = blank_like(state)
    dcp.load(out, storage_reader=VolumeReader(ck, storage_options=opts, verify=True))
    assert_same(out, state)


def test_partial_load_reads_only_needed_keys(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    state = sample_state()
    dcp.save(state, storage_writer=VolumeWriter(ck, file_size="1MiB"))
    out = {"f32": torch.zeros(17, 5), "nested": {"step": 0}}
    dcp.load(out, storage_reader=VolumeReader(ck))
    assert_same(out["f32"], state["f32"])
    assert out["nested"]["step"] == state["nested"]["step"]


def test_checkpoint_id_overrides_path_and_writer_is_reused(tmp_path: Path) -> None:
    writer = VolumeWriter(tmp_path / "unused")
    reader = VolumeReader(tmp_path / "unused")
    for step in (1, 2):
        state = sample_state(seed=step, big_mib=1)
        dcp.save(state, checkpoint_id=str(tmp_path / f"step-{step}"), storage_writer=writer)
        out = blank_like(state)
        dcp.load(out, checkpoint_id=str(tmp_path / f"step-{step}"), storage_reader=reader)
        assert_same(out, state)
    assert not (tmp_path / "unused").exists()


def test_metadata_read_ahead_is_typed_and_is_the_one_the_load_uses(tmp_path: Path) -> None:
    # CheckpointManager.restore reads .metadata before dcp.load for typed errors; the
    # load must not ask the volume again (a round trip on an object store).
    with pytest.raises(CheckpointNotFoundError):
        VolumeReader(tmp_path / "nothing").read_metadata_ahead()
    state = sample_state(big_mib=1)
    dcp.save(state, storage_writer=VolumeWriter(tmp_path / "ck"))
    reader = VolumeReader(tmp_path / "ck")
    reader.read_metadata_ahead()
    (tmp_path / "ck" / METADATA_NAME).unlink()  # a second read would fail
    out = blank_like(state)
    dcp.load(out, checkpoint_id=str(tmp_path / "ck"), storage_reader=reader)
    assert_same(out, state)
    # A rank-local checkpoint: the rank's own __<rank>.metadata, read ahead the same way.
    dcp.save(state, storage_writer=VolumeWriter(tmp_path / "local"), use_collectives=False)
    reader = VolumeReader(tmp_path / "local")
    reader.read_metadata_ahead(rank=0)
    (tmp_path / "local" / _layout.rank_metadata_name(0)).unlink()
    out = blank_like(state)
    dcp.load(out, checkpoint_id=str(tmp_path / "local"), storage_reader=reader)
    assert_same(out, state)


# -- .metadata holds only stock types ---------------------------------------------------------

_UNPICKLE_WITHOUT_US = r"""
import pickle, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "dcp_volumes":
            raise ImportError("dcp_volumes must not be needed to read .metadata")
        return None
sys.meta_path.insert(0, Block())
with open(sys.argv[1], "rb") as f:
    md = pickle.load(f)
types = {type(v).__module__ + "." + type(v).__qualname__ for v in md.storage_data.values()}
print(sorted(types), type(md.storage_meta).__qualname__)
assert not any(m.startswith("dcp_volumes") for m in sys.modules)
"""


def test_metadata_unpickles_without_dcp_volumes(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(sample_state(big_mib=1), storage_writer=VolumeWriter(ck, prefix_spread=4))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _UNPICKLE_WITHOUT_US, str(ck / METADATA_NAME)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "torch.distributed.checkpoint.filesystem._StorageInfo" in proc.stdout
    assert "StorageMeta" in proc.stdout


# -- interop with stock DCP -------------------------------------------------------------------


@pytest.mark.emulator
@pytest.mark.parametrize("spread", [0, 16])
def test_stock_readers_load_volume_writer(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path, spread: int
) -> None:
    url, opts = s3_bucket
    ck = join(url, "ck")
    state = sample_state()
    dcp.save(
        state,
        storage_writer=VolumeWriter(ck, storage_options=opts, file_size="512KiB",
                                    prefix_spread=spread),
    )
    files = _data_files(ck, opts)
    prefixes = {p.split("/")[0] for p in files if "/" in p}
    if spread:
        # Each file lies under the prefix its name hashes to (the save's random tag
        # is in the name, so how many prefixes 4 files cover varies from save to
        # save: >= 3 of 16 failed 1 save in ~40), and names spread over the prefixes.
        assert all(p == _layout.relative_path(p.split("/")[1], spread) for p in files), files
        names = [_layout.data_file_name("__0_274f5965_", i) for i in range(64)]
        assert len({_layout.spread_prefix(n, spread) for n in names}) >= 12
    else:
        assert not prefixes

    # Stock FsspecReader straight from S3.
    out = blank_like(state)
    dcp.load(out, storage_reader=FsspecReader(ck, **opts))
    assert_same(out, state)

    # Stock FileSystemReader after downloading the directory.
    local = tmp_path / "download"
    vol = Volume(ck, storage_options=opts)
    for f in vol.list():
        vol.get_file(f.path, local / f.path)
    out = blank_like(state)
    dcp.load(out, storage_reader=FileSystemReader(local))
    assert_same(out, state)


def test_data_files_skip_the_zip_crc32_and_still_load_everywhere(tmp_path: Path) -> None:
    # torch.save's per-record CRC-32 is never checked by torch.load; the manifest's
    # checksums cover every file, so the writer leaves the field 0 (0.5 s/GiB less CPU).
    ck = tmp_path / "ck"
    state = sample_state(big_mib=1)
    dcp.save(state, storage_writer=VolumeWriter(ck))
    storage = FileSystemReader(ck).read_metadata().storage_data
    crcs = []
    for info in storage.values():
        with open(ck / info.relative_path, "rb") as f:
            f.seek(info.offset)
            item = f.read(info.length)
        if item[:2] != b"PK":
            continue  # an object item (BYTE_IO): raw bytes, no zip
        with zipfile.ZipFile(io.BytesIO(item)) as z:
            crcs += [r.CRC for r in z.infolist() if "/data/" in r.filename]
    assert crcs and set(crcs) == {0}, crcs

    # The switch is the saving thread's and only for the save: a user's own
    # torch.save afterwards (or after a save that failed) still writes CRCs.
    with pytest.raises(BaseException, match="pickle"):  # fails while serialising
        dcp.save({"x": torch.ones(4), "lock": threading.Lock()},
                 storage_writer=VolumeWriter(tmp_path / "failed"))
    assert torch.serialization.get_crc32_options()
    buffer = io.BytesIO()
    torch.save(torch.arange(1000), buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as z:
        assert all(r.CRC for r in z.infolist() if "/data/" in r.filename)

    for reader in (FileSystemReader(ck), VolumeReader(ck)):
        out = blank_like(state)
        dcp.load(out, storage_reader=reader)
        assert_same(out, state)


def test_volume_reader_loads_stock_filesystem_writer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = tmp_path / "stock"
    state = sample_state()
    dcp.save(state, storage_writer=FileSystemWriter(ck, thread_count=2))
    out = blank_like(state)
    with caplog.at_level(logging.DEBUG, logger="dcp_volumes"):
        dcp.load(out, storage_reader=VolumeReader(ck, verify=True))
    assert_same(out, state)
    skipped = [r for r in caplog.records if "verification skipped" in r.getMessage()]
    assert skipped and skipped[0].levelno == logging.DEBUG


@pytest.mark.emulator
def test_volume_reader_loads_stock_fsspec_writer(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    url, opts = s3_bucket
    ck = join(url, "stock")
    state = sample_state()
    dcp.save(state, storage_writer=FsspecWriter(ck, **opts))
    out = blank_like(state)
    dcp.load(out, storage_reader=VolumeReader(ck, storage_options=opts))
    assert_same(out, state)


# -- commit ordering --------------------------------------------------------------------------


@pytest.mark.emulator
def test_metadata_appears_only_after_every_shard(
    moto_server: MotoServer, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """Poll the bucket while a bandwidth-capped save runs: never `.metadata` before all files."""
    url, _ = s3_bucket
    bucket = url.split("://", 1)[1]
    state = sample_state(big_mib=2)
    client = moto_server.boto3_client()
    snapshots: list[dict[str, int]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            resp = client.list_objects_v2(Bucket=bucket, Prefix="ck/")
            snapshots.append({o["Key"][3:]: o["Size"] for o in resp.get("Contents", [])})
            time.sleep(0.01)

    # 40 Mbit/s per connection: ~5 MiB of shards take about a second to upload.
    with LatencyProxy.in_front_of(moto_server, bandwidth_bps=40e6) as proxy:
        opts = moto_server.storage_options(proxy.endpoint)
        writer = VolumeWriter(
            join(url, "ck"), storage_options=opts, file_size="512KiB", upload_concurrency=2
        )
        poller = threading.Thread(target=poll)
        poller.start()
        try:
            dcp.save(state, storage_writer=writer)
        finally:
            stop.set()
            poller.join()
    listing = client.list_objects_v2(Bucket=bucket, Prefix="ck/")["Contents"]
    final = {o["Key"][3:]: o["Size"] for o in listing}
    manifest = Manifest.from_json(
        client.get_object(Bucket=bucket, Key=f"ck/{MANIFEST_NAME}")["Body"].read()
    )
    expected = {name: rec.size for name, rec in manifest.files.items()}
    assert len(expected) >= 3
    assert {k: final[k] for k in expected} == expected
    in_flight = [s for s in snapshots if METADATA_NAME not in s and any(k in expected for k in s)]
    assert in_flight, "the poller never saw the save in progress; the test proved nothing"
    for snap in snapshots:
        if METADATA_NAME in snap:
            assert MANIFEST_NAME in snap
            assert {k: snap.get(k) for k in expected} == expected, "committed before all shards"


# -- overwrite --------------------------------------------------------------------------------


def test_overwrite_refused_then_allowed(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    first = sample_state(seed=1)
    dcp.save(first, storage_writer=VolumeWriter(ck, file_size="256KiB"))
    many_files = set(_data_files(str(ck), {}))

    second = sample_state(seed=2, big_mib=1)
    with pytest.raises(BaseException) as excinfo:
        dcp.save(second, storage_writer=VolumeWriter(ck))
    err = failure_of(excinfo.value)
    assert isinstance(err, CheckpointExistsError) and str(ck) in str(err)
    out = blank_like(first)
    dcp.load(out, storage_reader=VolumeReader(ck))
    assert_same(out, first)  # untouched

    dcp.save(second, storage_writer=VolumeWriter(ck, overwrite=True))
    out = blank_like(second)
    dcp.load(out, storage_reader=VolumeReader(ck, verify=True))
    assert_same(out, second)
    remaining = set(_data_files(str(ck), {}))
    assert len(remaining) < len(many_files), "files of the replaced checkpoint must be removed"


def test_a_save_replaces_the_manifest_of_a_save_that_crashed_before_its_commit(
    tmp_path: Path,
) -> None:
    ck = tmp_path / "ck"
    dcp.save(sample_state(seed=1), storage_writer=VolumeWriter(ck))
    (ck / METADATA_NAME).unlink()  # killed between the manifest and .metadata
    crashed = Manifest.from_json((ck / MANIFEST_NAME).read_bytes(), where="test")

    state = sample_state(seed=2)
    dcp.save(state, storage_writer=VolumeWriter(ck))
    manifest = Manifest.from_json((ck / MANIFEST_NAME).read_bytes(), where="test")
    assert manifest.extra["save_id"] != crashed.extra["save_id"]
    assert not set(manifest.files) & set(crashed.files)
    out = blank_like(state)
    dcp.load(out, storage_reader=VolumeReader(ck, verify=True))
    assert_same(out, state)


def test_a_commit_that_lands_while_a_stale_manifest_is_checked_wins(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(sample_state(seed=1), storage_writer=VolumeWriter(ck))
    committed = (ck / METADATA_NAME).read_bytes()
    (ck / METADATA_NAME).unlink()
    first_files = set(_data_files(str(ck), {}))
    # Another job's .metadata lands while this save waits to call the manifest stale.
    landing = threading.Timer(0.3, (ck / METADATA_NAME).write_bytes, args=(committed,))
    landing.start()
    try:
        with pytest.raises(BaseException) as err:
            dcp.save(sample_state(seed=2), storage_writer=VolumeWriter(ck))
    finally:
        landing.join()
    assert isinstance(storage_error(err.value), CheckpointExistsError), err.value
    assert set(_data_files(str(ck), {})) == first_files, "the loser's files were removed"
    out = blank_like(sample_state(seed=1))
    dcp.load(out, storage_reader=VolumeReader(ck, verify=True))
    assert_same(out, sample_state(seed=1))


def test_overwrite_failure_leaves_incomplete_not_mixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = tmp_path / "ck"
    old = sample_state(seed=1, big_mib=1)
    dcp.save(old, storage_writer=VolumeWriter(ck))
    old_files = set(_data_files(str(ck), {}))
    # Fault: the store refuses the new save's second upload.
    faults = faulty_backend.Faults(refuse_uploads_after=1)
    faulty_backend.install(monkeypatch, faults)

    new = sample_state(seed=2, big_mib=1)
    with pytest.raises(BaseException, match=r"upload of .*\.distcp refused"):
        dcp.save(new, storage_writer=VolumeWriter(ck, overwrite=True, file_size="256KiB"))
    assert faults.faults["refused upload"] >= 1
    assert not (ck / METADATA_NAME).exists(), "a failed overwrite must leave no .metadata"
    left = set(_data_files(str(ck), {}))
    assert left and not left & old_files, "the old files were removed, the new first one uploaded"
    with pytest.raises(CheckpointNotFoundError, match="incomplete"):
        VolumeReader(ck).read_metadata()


# -- local tier -------------------------------------------------------------------------------


def test_local_copy_is_kept_and_preferred(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ck = tmp_path / "volume" / "step-5"
    local_root = tmp_path / "nvme"
    state = sample_state()
    writer = VolumeWriter(ck, local_copy_dir=local_root, file_size="1MiB")
    dcp.save(state, storage_writer=writer)
    assert writer.local_copy_path == str(local_root / "step-5")
    local_files = sorted(p.name for p in (local_root / "step-5").iterdir())
    assert MANIFEST_NAME in local_files
    assert sorted(_data_files(str(ck), {})) == [n for n in local_files if n.endswith(".distcp")]

    # Damage one file on the volume: the intact local copy is read instead.
    first, second = sorted(_data_files(str(ck), {}))[:2]
    victim = ck / first
    original = victim.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    victim.write_bytes(bytes(damaged))
    out = blank_like(state)
    dcp.load(out, storage_reader=VolumeReader(ck, local_copy_dir=local_root))
    assert_same(out, state)
    with pytest.raises(BaseException, match="checksum"):
        dcp.load(blank_like(state), storage_reader=VolumeReader(ck))

    # Damage a local file too, restore the volume: that file falls back to the volume, logged.
    victim.write_bytes(original)
    local_victim = local_root / "step-5" / second
    local_bytes = local_victim.read_bytes()
    local_victim.write_bytes(local_bytes[:-1] + bytes([local_bytes[-1] ^ 0xFF]))
    out = blank_like(state)
    with caplog.at_level(logging.INFO, logger="dcp_volumes"):
        dcp.load(out, storage_reader=VolumeReader(ck, local_copy_dir=local_root))
    assert_same(out, state)
    assert any(second in r.getMessage() and "volume" in r.getMessage()
               for r in caplog.records)


@pytest.mark.emulator
def test_a_restore_from_the_local_tier_asks_the_volume_only_for_the_commit(
    tmp_path: Path,
) -> None:
    # Behind a real link every request is a round trip: a restore whose files are
    # all local reads .metadata and the manifest, and neither lists nor fetches.
    with MotoServer(mode="process", record_requests=True) as s3:
        ck = f"{s3.create_bucket('tier')}/step-5"
        opts = s3.storage_options()
        state = sample_state()
        local_root = tmp_path / "nvme"
        dcp.save(state, storage_writer=VolumeWriter(ck, storage_options=opts,
                                                    local_copy_dir=local_root, file_size="1MiB"))
        data = sorted(_data_files(ck, opts))
        assert len(data) >= 2

        s3.reset_requests()
        out = blank_like(state)
        dcp.load(out, storage_reader=VolumeReader(ck, storage_options=opts,
                                                  local_copy_dir=local_root))
        assert_same(out, state)
        asked = s3.request_log()
        assert sorted(asked) == sorted(
            [("GET", f"/tier/step-5/{METADATA_NAME}"), ("GET", f"/tier/step-5/{MANIFEST_NAME}")]
        ), asked

        # A damaged local file is fetched from the volume, checked by its checksum.
        local_victim = local_root / "step-5" / data[0]
        local_victim.write_bytes(b"\0" + local_victim.read_bytes()[1:])
        s3.reset_requests()
        out = blank_like(state)
        dcp.load(out, storage_reader=VolumeReader(ck, storage_options=opts,
                                                  local_copy_dir=local_root))
        assert_same(out, state)
        fetched = {path for method, path in s3.request_log() if method == "GET"}
        assert f"/tier/step-5/{data[0]}" in fetched
        assert not any(f"/tier/step-5/{name}" in fetched for name in data[1:])


# -- tensors read straight into their targets ---------------------------------------------------


def _direct_count(caplog: pytest.LogCaptureFixture) -> int:
    counts = [int(r.getMessage().split(": ")[-1].split()[0]) for r in caplog.records
              if "read straight into their target" in r.getMessage()]
    assert len(counts) == 1, counts
    return counts[0]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_tensor_data_is_read_straight_into_targets(
    where: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if where == "memory":  # an object store's read path (ranged reads into buffers)
        url, opts = request.getfixturevalue("memory_bucket")
        ck = join(url, "direct")
    else:
        ck, opts = str(tmp_path / "volume" / "direct"), {}
    state = sample_state()
    dcp.save(state, storage_writer=VolumeWriter(ck, storage_options=opts, file_size="1MiB"))
    volume = Volume(ck, storage_options=opts)
    manifest = Manifest.from_json(volume.read_bytes(MANIFEST_NAME))
    metadata = pickle.loads(volume.read_bytes(METADATA_NAME))

    # The manifest says where each tensor's raw data lies, in logical order: check those
    # bytes. A view into a bigger buffer is saved as a compact copy, so it qualifies too;
    # a transposed tensor is saved with its strides and does not.
    contiguous = {k for k, v in state.items() if isinstance(v, torch.Tensor)} - {"transposed"}
    contiguous.add("nested.inner.t")
    located = set()
    for index, info in metadata.storage_data.items():
        entry = manifest.files[info.relative_path].tensors.get(info.offset)
        if entry is None:
            continue
        at, nbytes = entry
        assert info.offset < at and at + nbytes <= info.offset + info.length
        expected = state["nested"]["inner"]["t"] if index.fqn == "nested.inner.t" else state[
            index.fqn]
        raw = expected.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert volume.read_bytes(info.relative_path, at, at + nbytes) == raw, index.fqn
        located.add(index.fqn)
    assert located == contiguous

    # Plain targets: every located tensor is read in place.
    out = blank_like(state)
    with caplog.at_level(logging.DEBUG, logger="dcp_volumes.checkpoint._reader"):
        dcp.load(out, storage_reader=VolumeReader(ck, storage_options=opts, verify=True))
    assert_same(out, state)
    assert _direct_count(caplog) == len(contiguous)

    # Targets that need a conversion or are views take the deserialising path, correctly.
    caplog.clear()
    out = blank_like(state)
    out["f32"] = torch.zeros(17, 5, dtype=torch.float64)  # another dtype: converted
    out["big2"] = torch.zeros(256, state["big2"].shape[0]).t()  # a non-contiguous target
    out["f16"] = torch.zeros(33, dtype=torch.bfloat16)  # same item size, other dtype
    with caplog.at_level(logging.DEBUG, logger="dcp_volumes.checkpoint._reader"):
        dcp.load(out, storage_reader=VolumeReader(ck, storage_options=opts))
    assert torch.equal(out["f32"], state["f32"].double())
    assert torch.equal(out["big2"], state["big2"])
    assert torch.equal(out["f16"], state["f16"].bfloat16())
    assert torch.equal(out["big1"], state["big1"])
    assert _direct_count(caplog) == len(contiguous) - 3


@pytest.mark.emulator
@pytest.mark.parametrize("whole_object_ranges", [False, True])
def test_a_load_with_idle_streams_cuts_files_unless_ranges_cost_whole_reads(
    moto_server: MotoServer, s3_bucket: tuple[str, dict[str, Any]], whole_object_ranges: bool
) -> None:
    """A file of 1.4 parts is two GETs while streams idle, one where each range reads it all."""
    url, _ = s3_bucket
    state = {"w": torch.arange(2.8 * 2**20 / 4, dtype=torch.float32)}
    with LatencyProxy.in_front_of(moto_server) as proxy:
        opts = {
            **moto_server.storage_options(proxy.endpoint),
            "ranged_reads_cost_whole_object": whole_object_ranges,
        }
        ck = join(url, "split")
        dcp.save(state, storage_writer=VolumeWriter(ck, storage_options=opts))
        (data_file,) = _data_files(ck, opts)
        path = f"/{ck.split('://', 1)[1]}/{data_file}"
        out = {"w": torch.zeros_like(state["w"])}
        # 8 streams for 2.8 MiB: each stream's share is far below the 2 MiB part.
        reader = VolumeReader(ck, storage_options=opts, part_size="2MiB", read_concurrency=8)
        dcp.load(out, storage_reader=reader)
        gets = proxy.count("GET", path)  # a save reads no data file back
    assert torch.equal(out["w"], state["w"])
    assert gets == (1 if whole_object_ranges else 2), proxy.requests


# -- async staging buffers and pickling --------------------------------------------------------


def test_stage_reuses_buffers_and_isolates_training(tmp_path: Path) -> None:
    writer = VolumeWriter(tmp_path / "ck")
    live = {"w": torch.randn(256, 256), "b": torch.zeros(3), "step": 1}
    staged = writer.stage(live)
    ptr = staged["w"].data_ptr()
    live["w"].add_(1.0)
    assert not torch.equal(staged["w"], live["w"]), "staged copy must not follow training"
    again = writer.stage(live)
    assert again["w"].data_ptr() == ptr, "buffers must be reused across saves"
    assert torch.equal(again["w"], live["w"])
    live["b"] = torch.zeros(4)  # shape change: new buffers, right values
    third = writer.stage(live)
    assert third["b"].shape == (4,)

    blob = pickle.dumps(writer)
    assert len(blob) < 64 * 1024, "staging buffers must not be pickled"
    clone = pickle.loads(blob)
    state = sample_state(big_mib=1)
    dcp.save(state, storage_writer=clone)
    reader = pickle.loads(pickle.dumps(VolumeReader(tmp_path / "ck")))
    out = blank_like(state)
    dcp.load(out, storage_reader=reader)
    assert_same(out, state)


def test_async_save_thread_reuses_writer(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    writer = VolumeWriter(tmp_path / "a1", file_size="1MiB")
    state = sample_state(seed=1)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    fut = dcp.async_save(
        state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD
    )
    state["f32"].add_(100.0)  # training continues: must not leak into the checkpoint
    fut.result()
    out = blank_like(expected)
    dcp.load(out, storage_reader=VolumeReader(tmp_path / "a1"))
    assert_same(out, expected)

    second = sample_state(seed=2)
    fut = dcp.async_save(second, checkpoint_id=str(tmp_path / "a2"), storage_writer=writer)
    fut.result()
    out = blank_like(second)
    dcp.load(out, storage_reader=VolumeReader(tmp_path / "a2"))
    assert_same(out, second)


# -- range coalescing (plan shapes) ----------------------------------------------------------

_FILE_SIZE = 4096


@pytest.fixture(scope="module")
def blob_volume(tmp_path_factory: pytest.TempPathFactory) -> tuple[Volume, bytes]:
    root = tmp_path_factory.mktemp("blob")
    blob = os.urandom(_FILE_SIZE)
    (root / "f.distcp").write_bytes(blob)
    return Volume(root), blob


@given(
    items=st.lists(
        st.tuples(st.integers(0, _FILE_SIZE), st.integers(0, 600)), min_size=1, max_size=40
    ),
    gap=st.sampled_from([0, 1, 7, 100, 1000]),
    part=st.sampled_from([64, 512, 10_000]),
)
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_coalesced_ranges_cover_and_read_back(
    blob_volume: tuple[Volume, bytes], items: list[tuple[int, int]], gap: int, part: int
) -> None:
    volume, blob = blob_volume
    ranges = [(o, min(_FILE_SIZE, o + n)) for o, n in items]
    spans = coalesce(ranges, gap=gap)
    # Sorted, disjoint, and separated by more than the gap (else they would have merged).
    for (s1, e1), (s2, e2) in itertools.pairwise(spans):
        assert s1 <= e1 < s2 <= e2 and s2 - e1 > gap
    starts = [s for s, _ in spans]
    # Fetch through the spans the way the reader does: split into parts, in parallel.
    buffers = []
    for s, e in spans:
        parts = [p for p in split_range(s, e, part) if p[1] > p[0]]
        data = b"".join(volume.read_bytes("f.distcp", a, b) for a, b in parts)
        assert len(data) == e - s
        buffers.append(data)
    for s, e in ranges:
        i = find_span(starts, spans, s, e)
        lo = s - spans[i][0]
        assert buffers[i][lo : lo + (e - s)] == blob[s:e]
    assert sum(e - s for s, e in spans) <= _FILE_SIZE


def test_coalesce_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError):
        coalesce([(5, 3)])
    with pytest.raises(KeyError):
        find_span([0], [(0, 10)], 5, 11)


# -- async staging cost (benchmark target) -----------------------------------------------------


@pytest.mark.soak
def test_async_save_reuses_buffers_and_bounds_memory(tmp_path: Path) -> None:
    """Extra RAM <= 1.25x the state on the first save, ~nothing on later ones (buffers reused).

    The blocking-time target (<= 2x a memcpy) is measured in benchmarks/bench_checkpoint.py,
    not here: timings on a shared CI machine are too noisy for an assertion.
    """
    psutil = pytest.importorskip("psutil")
    mib = 2**20
    size = 256 * mib
    live = {f"layer{i}": torch.randn(size // 4 // 32) for i in range(32)}
    live["step"] = 0
    writer = VolumeWriter(tmp_path / "unused", file_size="64MiB")
    proc = psutil.Process()

    def peak_extra_during(fn: Any) -> tuple[float, int]:
        base = proc.memory_info().rss
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            seconds = fn()
        finally:
            stop.set()
            sampler.join()
        return seconds, peak[0] - base

    def save(step: int) -> float:
        started = time.perf_counter()
        fut = dcp.async_save(live, checkpoint_id=str(tmp_path / f"s{step}"), storage_writer=writer)
        blocked = time.perf_counter() - started
        fut.result()
        return blocked

    _, first_extra = peak_extra_during(lambda: save(0))
    assert first_extra <= 1.25 * size, f"first save took {first_extra / mib:.0f} MiB extra"
    extras = []
    for step in range(1, 5):
        live["step"] = step
        _, extra = peak_extra_during(lambda step=step: save(step))
        extras.append(extra)
    assert max(extras) <= 0.25 * size, f"steady-state saves took {max(extras) / mib:.0f} MiB extra"

