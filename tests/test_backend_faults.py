"""Saves, discovery, loads and epochs on a store that is briefly inconsistent.

``tests/faulty_backend.py`` wraps the real backend (a local directory, the
in-memory object store: what is tested is our layer, not a server) and makes
what a proxy cannot: listings that leave out objects written
just before (eventual consistency) and a file that answers "not found" for a
moment. Each outcome must be the right data or a clear error, never a
checkpoint that fails to load, a partial checkpoint restored, a wrong tensor,
or a stale listing reported as a lost file. The counts are printed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from dcp_volumes import (
    CheckpointManager,
    DataLoader,
    VolumeDataset,
    VolumeReader,
    VolumeWriter,
)
from dcp_volumes._volume import LAG_TOTAL_S, MEMORY_PROTOCOL, Volume
from dcp_volumes.checkpoint import _reader
from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from testkit.states import differences, empty_state, load_into, state_for
from tests.faulty_backend import Faults, install
from tests.test_data_support import payload, read_id, write_samples

_SIZE = 64


@pytest.fixture(params=["local", "memory"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        return str(tmp_path / "vol"), {}
    url, opts = request.getfixturevalue("memory_bucket")
    return url, opts


def _object_store(root: str) -> bool:
    return root.startswith(f"{MEMORY_PROTOCOL}://")


@pytest.fixture
def lagging(where: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """``where``, on a store that says its listings may lag its writes (a mount does;
    an object store through the option): the commit checks every upload in a listing there."""
    root, opts = where
    return (root, {**opts, "listing_lags": True}) if _object_store(root) else (root, opts)


def _report(what: str, faults: Faults, outcome: str) -> None:
    print(f"\n[backend faults {what}] calls={sum(faults.calls.values())} "
          f"({dict(sorted(faults.calls.items()))}) faults={dict(sorted(faults.faults.items()))} "
          f"outcome: {outcome}")


def _last_line(exc: BaseException) -> str:
    # DCP's CheckpointException carries each rank's traceback: its last line is the error.
    return str(exc).strip().splitlines()[-1][:300]


# -- 1. the save's check after upload ------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_briefly_stale_listing_after_upload_still_commits(
    lagging: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = lagging
    # Every listing for the next 2 calls misses what was written in the last minute:
    # the rank's check after upload and a first re-list see no shard at all.
    faults = Faults(stale_lists=2, stale_window_s=60, stale_match=".distcp")
    install(monkeypatch, faults)
    want = state_for(1, size=_SIZE)
    dcp.save(want, storage_writer=VolumeWriter(f"{root}/ck", storage_options=opts,
                                               file_size="8KiB"), no_dist=True)
    problems = differences(load_into(empty_state(size=_SIZE), f"{root}/ck", opts), want)
    with capsys.disabled():
        _report("save, stale check listing", faults,
                f"committed, loads back {'equal' if not problems else problems[:3]}")
    assert faults.faults["objects hidden"] > 0  # the listing really was stale
    assert problems == []


@pytest.mark.timeout(30)
def test_a_listing_that_stays_stale_fails_the_save_cleanly(
    lagging: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = lagging
    faults = Faults(stale_lists=10**6, stale_window_s=60, stale_match=".distcp")
    install(monkeypatch, faults)
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException is a BaseException
        dcp.save(state_for(1, size=_SIZE), storage_writer=VolumeWriter(
            f"{root}/ck", storage_options=opts, file_size="8KiB"), no_dist=True)
    text = str(caught.value)
    with capsys.disabled():
        _report("save, listing stale for good", faults, f"failed: {_last_line(caught.value)}")
    assert "did not land whole" in text and "missing" in text
    assert "listing" in text  # says the store's listing may lag, not only "cut short"
    volume = Volume(f"{root}/ck", storage_options=opts)
    assert not volume.exists(".metadata")
    # The manifest went up while the check ran; the failed check took it back.
    assert not volume.exists(MANIFEST_NAME)


@pytest.mark.timeout(30)
def test_where_listings_show_every_write_the_ranks_results_vouch_for_the_uploads(
    memory_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An object store lists every write that returned: the commit lists nothing (its pages grow
    # with the ranks, one after another), so a listing that would leave the shards
    # out neither holds the commit up nor fails it.
    root, opts = memory_bucket
    faults = Faults(stale_lists=10**6, stale_window_s=60, stale_match=".distcp")
    install(monkeypatch, faults)
    want = state_for(1, size=_SIZE)
    started = time.monotonic()
    dcp.save(want, storage_writer=VolumeWriter(f"{root}/ck", storage_options=opts,
                                               file_size="8KiB"), no_dist=True)
    assert time.monotonic() - started < LAG_TOTAL_S  # never waited for a listing
    assert faults.calls["list"] == 0
    assert faults.faults["objects hidden"] == 0
    faults.stale_lists = 0
    assert differences(load_into(empty_state(size=_SIZE), f"{root}/ck", opts), want) == []


# -- 2. CheckpointManager discovery ----------------------------------------------------------


@pytest.mark.timeout(30)
def test_discovery_with_the_newest_metadata_unlisted_restores_a_complete_one(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = where
    faults = Faults()
    wrappers = install(monkeypatch, faults)
    with CheckpointManager(f"{root}/run", keep_last=2, storage_options=opts) as mgr:
        mgr.save(1, state_for(1, size=_SIZE))
        mgr.wait()
        before_2 = time.time()
        mgr.save(2, state_for(2, size=_SIZE))
        mgr.wait()
    # Step 2 is committed, but the store's listings do not show its .metadata yet.
    for w in wrappers.values():
        w.stale_since = before_2
    faults.stale_lists, faults.stale_match = 10**6, ".metadata"
    outcomes = []
    with CheckpointManager(f"{root}/run", keep_last=2, storage_options=opts) as mgr:
        state = empty_state(size=_SIZE)
        restored = mgr.restore(state)
        outcomes.append(restored)
        assert restored in (1, 2)
        assert differences(state, state_for(restored, size=_SIZE)) == []
    faults.stale_lists = 0  # the store caught up
    with CheckpointManager(f"{root}/run", keep_last=2, storage_options=opts) as mgr:
        state = empty_state(size=_SIZE)
        outcomes.append(mgr.restore(state))
        assert differences(state, state_for(2, size=_SIZE)) == []
    with capsys.disabled():
        _report("manager discovery, newest .metadata unlisted", faults,
                f"restored step {outcomes[0]} while stale, then step {outcomes[1]}")
    assert faults.faults["objects hidden"] > 0
    assert outcomes[1] == 2  # step 2 was not removed as "partial" while it looked so


# -- 3. VolumeReader: a data file gone for a moment -----------------------------------------


@pytest.mark.timeout(30)
def test_a_load_survives_a_data_file_that_vanishes_for_a_moment(
    memory_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Object stores only: a local volume's reader opens data files in place, not through
    # the protocol.
    root, opts = memory_bucket
    want = state_for(1, size=_SIZE)
    dcp.save(want, storage_writer=VolumeWriter(f"{root}/ck", storage_options=opts,
                                               file_size="8KiB"), no_dist=True)
    faults = Faults(vanish=[".distcp"], vanish_calls=1)
    install(monkeypatch, faults)
    problems = differences(load_into(empty_state(size=_SIZE), f"{root}/ck", opts), want)
    with capsys.disabled():
        _report("load, data files not found once each", faults,
                f"loaded {'equal' if not problems else problems[:3]}")
    assert sum(faults.faults.values()) > 0
    assert problems == []


def _save_small(root: str, opts: dict[str, Any]) -> None:
    """A committed checkpoint of several 8 KiB data files at ``root``/ck."""
    dcp.save(state_for(1, size=_SIZE), storage_writer=VolumeWriter(
        f"{root}/ck", storage_options=opts, file_size="8KiB"), no_dist=True)


@pytest.mark.timeout(30)
def test_a_load_names_a_data_file_that_stays_gone(
    memory_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = memory_bucket
    _save_small(root, opts)
    gone = next(f.path for f in Volume(f"{root}/ck", storage_options=opts).list()
                if f.path.endswith(".distcp"))
    faults = Faults(vanish=[gone], vanish_calls=10**6)
    install(monkeypatch, faults)
    with pytest.raises(BaseException) as caught:
        load_into(empty_state(size=_SIZE), f"{root}/ck", opts)
    text = str(caught.value)
    with capsys.disabled():
        _report("load, one data file gone for good", faults, f"failed: {_last_line(caught.value)}")
    assert gone in text and "missing" in text and "asked again" in text


@pytest.mark.timeout(30)
def test_a_load_with_a_stale_listing_is_not_called_damaged(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = where
    # The size check lists (as a rank reading many files does) rather than HEADs each.
    monkeypatch.setattr(_reader, "_PAGE_COST", 1)
    want = state_for(1, size=_SIZE)
    faults = Faults()
    install(monkeypatch, faults)
    dcp.save(want, storage_writer=VolumeWriter(f"{root}/ck", storage_options=opts,
                                               file_size="8KiB"), no_dist=True)
    faults.stale_lists, faults.stale_window_s, faults.stale_match = 1, 60, ".distcp"
    problems = differences(load_into(empty_state(size=_SIZE), f"{root}/ck", opts), want)
    with capsys.disabled():
        _report("load, size-check listing stale", faults,
                f"loaded {'equal' if not problems else problems[:3]}")
    assert faults.faults["objects hidden"] > 0
    assert problems == []


# -- 4. VolumeDataset cold epoch ------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_cold_epoch_on_a_stale_listing_delivers_each_listed_sample_once(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = where
    faults = Faults()
    wrappers = install(monkeypatch, faults)
    write_samples(f"{root}/data", opts, 30, size=256)
    cutoff = time.time()
    time.sleep(0.01)
    vol = Volume(f"{root}/data", storage_options=opts)
    for i in range(100, 110):  # written "just now": the first listings miss them
        vol.publish(f"z/late-{i}.bin", payload(i, 256))
    for w in wrappers.values():
        w.stale_since = cutoff
    faults.stale_lists = 10**6  # every listing of this epoch misses the last 10 samples
    ds = VolumeDataset(f"{root}/data", storage_options=opts, cache_dir=tmp_path / "cache",
                       transform=read_id, shuffle=True, seed=3)
    seen = [int(x) for batch in DataLoader(ds, batch_size=5, num_workers=0) for x in batch]
    with capsys.disabled():
        _report("cold epoch, stale first listing", faults,
                f"{len(seen)} samples, {len(set(seen))} distinct")
    if not _object_store(root):
        # A directory is walked, not listed through the store: it cannot lag its writes,
        # and the walk sees the late files too (each once).
        assert sorted(seen) == list(range(30)) + list(range(100, 110))
        return
    assert faults.faults["objects hidden"] + faults.faults["prefixes hidden"] > 0
    assert sorted(seen) == list(range(30))  # each listed sample once, none of the unlisted


@pytest.mark.timeout(30)
def test_a_cold_epoch_names_a_sample_that_vanishes(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = where
    files = write_samples(f"{root}/data", opts, 20, size=256)
    gone = sorted(files)[7]
    faults = Faults(vanish=[gone], vanish_calls=10**6)
    install(monkeypatch, faults)
    ds = VolumeDataset(f"{root}/data", storage_options=opts, cache_dir=tmp_path / "cache",
                       transform=read_id, shuffle=False)
    seen: list[int] = []
    with pytest.raises(Exception) as caught:
        for batch in DataLoader(ds, batch_size=4, num_workers=0):
            seen += [int(x) for x in batch]
    text = str(caught.value)
    with capsys.disabled():
        _report("cold epoch, one sample gone", faults,
                f"{len(seen)} delivered, then {type(caught.value).__name__}: "
                f"{_last_line(caught.value)}")
    assert gone in text and "was listed" in text and "Fix:" in text
    assert len(seen) == len(set(seen))


@pytest.mark.timeout(30)
def test_a_cold_epoch_rides_out_samples_not_found_for_a_moment(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = where
    write_samples(f"{root}/data", opts, 20, size=256)
    faults = Faults(vanish=["sample-0000"], vanish_calls=1)  # samples 0-9: once each
    install(monkeypatch, faults)
    ds = VolumeDataset(f"{root}/data", storage_options=opts, cache_dir=tmp_path / "cache",
                       transform=read_id, shuffle=True, seed=5)
    seen = [int(x) for batch in DataLoader(ds, batch_size=5, num_workers=0) for x in batch]
    with capsys.disabled():
        _report("cold epoch, 10 samples not found once", faults,
                f"{len(seen)} samples, {len(set(seen))} distinct")
    assert sum(faults.faults.values()) == 10
    assert sorted(seen) == list(range(20))


# -- (c) a file that reads back shorter than listed -----------------------------------------


@pytest.mark.timeout(30)
def test_a_load_refuses_a_data_file_that_reads_back_short(
    memory_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = memory_bucket
    _save_small(root, opts)
    faults = Faults(short=[".distcp"], short_by=7)
    install(monkeypatch, faults)
    with pytest.raises(BaseException) as caught:
        load_into(empty_state(size=_SIZE), f"{root}/ck", opts)
    text = _last_line(caught.value)
    with capsys.disabled():
        _report("load, data files read back 7 bytes short", faults, f"failed: {text}")
    assert faults.faults["short read"] > 0
    assert "CheckpointCorruptError" in text and ".distcp" in text


@pytest.mark.timeout(30)
def test_a_cold_epoch_refuses_a_sample_that_reads_back_short(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, opts = where
    files = write_samples(f"{root}/data", opts, 10, size=256)
    short = sorted(files)[4]
    faults = Faults(short=[short], short_by=7)
    install(monkeypatch, faults)
    ds = VolumeDataset(f"{root}/data", storage_options=opts, cache_dir=tmp_path / "cache",
                       transform=read_id, shuffle=False)
    with pytest.raises(Exception) as caught:
        for _ in DataLoader(ds, batch_size=2, num_workers=0):
            pass
    text = _last_line(caught.value)
    with capsys.disabled():
        _report("cold epoch, one sample 7 bytes short", faults,
                f"{type(caught.value).__name__}: {text}")
    assert faults.faults["short read"] > 0
    assert short in text and "changed" in text


# -- 5. what a save costs besides its data ----------------------------------------------------


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Faults:
    """The wrapper with no faults: it counts the backend calls (and each upload)."""
    faults = Faults()
    install(monkeypatch, faults)
    return faults


@pytest.mark.timeout(30)
def test_a_save_makes_three_requests_besides_its_data(
    where: tuple[str, dict[str, Any]], counted: Faults,
) -> None:
    # Each request before or after the uploads is a round trip the save waits for
    # (20 ms and more a network away): one listing to start (bucket, credentials, a
    # committed checkpoint), the manifest, .metadata; on a mount, whose listings may
    # lag, a listing (a walk) to check the uploads as well.
    root, opts = where
    besides = {"check_root": 1, "put": 2} | ({} if _object_store(root) else {"list": 1})
    writer = VolumeWriter(f"{root}/ck-1", storage_options=opts, file_size="8KiB")
    for name in ("ck-1", "ck-2"):  # a fresh save, then the same writer's next one
        counted.calls.clear()
        dcp.save(state_for(1, size=_SIZE), storage_writer=writer,
                 checkpoint_id=f"{root}/{name}", no_dist=True)
        calls = dict(counted.calls)
        data_files = [f for f in Volume(f"{root}/{name}", storage_options=opts).list()
                      if f.path.endswith(".distcp")]
        assert len(data_files) > 1  # the state spans several files
        assert calls.pop("upload") == len(data_files)
        assert calls == besides
        got = load_into(empty_state(size=_SIZE), f"{root}/{name}", opts)
        assert differences(got, state_for(1, size=_SIZE)) == []


@pytest.mark.timeout(30)
def test_the_commit_checks_the_uploads_while_the_manifest_goes_up(
    lagging: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The listing that checks every upload and the manifest's PUT are each a round
    # trip; in flight at once they cost the save one. The wrapper holds each of the
    # two until the other has started: in sequence, the first would wait in vain.
    root, opts = lagging
    faults = Faults(meet=[("list", ""), ("put", MANIFEST_NAME)])
    install(monkeypatch, faults)
    want = state_for(1, size=_SIZE)
    dcp.save(want, storage_writer=VolumeWriter(f"{root}/ck", storage_options=opts,
                                               file_size="8KiB"), no_dist=True)
    assert faults.faults["no meeting"] == 0
    assert faults.calls["list"] == 1 and faults.calls["put"] == 2
    assert differences(load_into(empty_state(size=_SIZE), f"{root}/ck", opts), want) == []


@pytest.mark.timeout(30)
def test_the_save_lists_its_location_while_dcp_plans(
    memory_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What is at the location (a committed checkpoint?) is a round trip's answer that
    # the global plan needs. Asked at set-up, it comes while DCP plans. The local plan
    # waits until the listing has started: asked after planning, it would wait in vain.
    root, opts = memory_bucket
    faults = Faults(meet=[("check_root", ""), ("plan", "")])
    wrappers = install(monkeypatch, faults)
    Volume(root, storage_options=opts).exists("-")  # the writer's backend, made now
    (backend,) = wrappers.values()
    writer = VolumeWriter(f"{root}/ck", storage_options=opts)

    class MeetingPlanner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            backend.arrive("plan")
            return super().create_local_plan()

    want = state_for(1, size=_SIZE)
    dcp.save(want, storage_writer=writer, planner=MeetingPlanner(), no_dist=True)
    assert faults.faults["no meeting"] == 0
    assert faults.calls["check_root"] == 1
    assert differences(load_into(empty_state(size=_SIZE), f"{root}/ck", opts), want) == []


def _load_ck_with(faults: Faults, where: tuple[str, dict[str, Any]],
                  monkeypatch: pytest.MonkeyPatch) -> VolumeReader:
    """Save a state to ``ck``, then load it with ``faults`` installed; returns the reader."""
    root, opts = where
    want = state_for(1, size=_SIZE)
    dcp.save(want, storage_writer=VolumeWriter(f"{root}/ck", storage_options=opts),
             no_dist=True)
    install(monkeypatch, faults)
    reader = VolumeReader(f"{root}/ck", storage_options=opts, verify=True)
    got = empty_state(size=_SIZE)
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert differences(got, want) == []
    return reader


def test_a_load_reads_the_manifest_beside_the_metadata(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each is a round trip before the load can plan; in flight at once they cost one.
    faults = Faults(meet=[("read", METADATA_NAME), ("read", MANIFEST_NAME)])
    reader = _load_ck_with(faults, where, monkeypatch)
    assert faults.faults["no meeting"] == 0
    assert reader.manifest is not None


def test_a_manifest_read_ahead_of_its_metadata_and_missed_is_read_again(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Read before .metadata, the manifest may not be there yet (the save committed in
    # between) or be another save's: the load then reads it again, and still verifies.
    faults = Faults(vanish=[MANIFEST_NAME])
    reader = _load_ck_with(faults, where, monkeypatch)
    assert faults.faults["vanished read"] == 1
    assert reader.manifest is not None  # the second read found it: checksums still apply


@pytest.mark.timeout(30)
def test_a_ranks_bytes_go_up_in_two_waves_of_puts(
    where: tuple[str, dict[str, Any]], counted: Faults,
) -> None:
    # On an object store every request costs a round trip and the server's work, and
    # the last file's upload is the save's tail: each stream carries a large file,
    # then a small one. 32 MiB over 4 streams: 4 files of 6 MiB, then 4 of 2 MiB.
    root, opts = where
    state = {f"t{i:02d}": torch.full((2**18,), float(i)) for i in range(32)}  # 32 x 1 MiB
    _save_and_load_back(f"{root}/ck", opts, state, upload_concurrency=4)
    files = Volume(f"{root}/ck", storage_options=opts).list()
    by_index = {int(f.path.rsplit("_", 1)[1].split(".")[0]): f.size
                for f in files if f.path.endswith(".distcp")}
    if Volume(root, storage_options=opts).capabilities.local_files:
        assert len(by_index) == 1  # a mount gets file_size files (256 MiB): renamed, not sent
        return
    assert counted.calls["upload"] == len(by_index) == 8
    mib = [round(by_index[i] / 2**20) for i in sorted(by_index)]
    assert mib == [6, 6, 6, 6, 2, 2, 2, 2]


@pytest.mark.timeout(30)
def test_a_tensor_larger_than_a_part_goes_up_in_parallel_parts(
    where: tuple[str, dict[str, Any]], counted: Faults,
) -> None:
    # One file per stream, except a tensor larger than that (an embedding): sent
    # by one stream it would be the save's tail, so its parts go up side by side.
    root, opts = where
    state = {"embedding": torch.randn(3 * 2**20), "bias": torch.randn(2**10)}  # 12 MiB + 4 KiB
    _save_and_load_back(f"{root}/ck", opts, state, part_size="5MiB")
    if Volume(root, storage_options=opts).capabilities.local_files:
        assert counted.uploads == [(counted.uploads[0][0], 1)]  # a rename
    else:
        big = [c for size, c in counted.uploads if size > 12 * 2**20]
        assert big == [3]  # 12 MiB in 5 MiB parts: 3 at once


@pytest.mark.timeout(60)
def test_a_refused_upload_stops_the_serialisation(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first refused upload ends the save: the rest of the state is not
    # serialised (a file each here, 256 of them) only to be thrown away.
    root, opts = where
    faults = Faults(refuse_uploads_after=0)
    install(monkeypatch, faults)
    state = {f"t{i:03d}": torch.full((2**16,), float(i)) for i in range(256)}  # 256 x 256 KiB
    writer = VolumeWriter(f"{root}/ck", storage_options=opts, file_size="256KiB")
    with pytest.raises(BaseException, match=r"upload of .*\.distcp refused"):
        dcp.save(state, storage_writer=writer, no_dist=True)
    _report("refused upload", faults, f"{faults.calls['upload']} of 256 files sent")
    assert 1 <= faults.calls["upload"] < 128
    assert not Volume(f"{root}/ck", storage_options=opts).exists(METADATA_NAME)


def _save_and_load_back(url: str, opts: dict[str, Any], state: dict[str, torch.Tensor],
                        **writer_options: Any) -> None:
    dcp.save(state, storage_writer=VolumeWriter(url, storage_options=opts, **writer_options),
             no_dist=True)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=VolumeReader(url, storage_options=opts), no_dist=True)
    assert all(torch.equal(got[k], state[k]) for k in state)
