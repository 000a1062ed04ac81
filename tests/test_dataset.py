"""VolumeDataset: global order, partitioning over ranks and workers, reproducible
augmentation, changed-data detection, cache limits and bad input."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_volumes import (
    CacheError,
    ConfigurationError,
    DataLoader,
    DatasetChangedError,
    VolumeDataset,
    VolumeNotFoundError,
)
from dcp_volumes._volume import Volume
from dcp_volumes.data._prefetch import Prefetcher
from tests.test_data_support import (
    augment,
    disk_bytes,
    name_of,
    payload,
    read_id,
    run_job,
    to_list,
    write_samples,
)

# More workers than this machine's cores is deliberate here (torch warns about it).
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture
def store_data(memory_bucket: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """36 samples in an object store (the in-memory one: forked workers read its copy)."""
    url, opts = memory_bucket
    write_samples(f"{url}/train", opts, 36)
    return f"{url}/train", opts


def test_stream_is_the_same_for_any_ranks_and_workers(store_data: tuple[str, Any],
                                                      tmp_path: Path) -> None:
    url, opts = store_data
    cache = str(tmp_path / "cache")
    reference, _ = run_job(url, opts, cache, world=1, workers=0, global_batch_size=12)
    assert sorted(reference) == list(range(36))  # every file exactly once per epoch
    assert reference != list(range(36))  # and shuffled
    for world, workers in ((2, 3), (4, 1)):
        stream, state = run_job(url, opts, cache, world=world, workers=workers,
                                global_batch_size=12)
        assert stream == reference, (world, workers)
        assert state["epoch"] == 1 and state["position"] == 0  # the epoch is complete


def test_epochs_seeds_and_order(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    write_samples(src, None, 20)
    cache = str(tmp_path / "cache")
    e0, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=4)
    e0_again, _ = run_job(src, None, cache, world=2, workers=1, global_batch_size=4)
    e1, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=4, epoch=1)
    seed7, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=4, seed=7)
    plain, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=4, shuffle=False)
    assert e0 == e0_again and sorted(e1) == sorted(e0) == list(range(20))
    assert e1 != e0 and seed7 != e0
    assert plain == list(range(20))  # manifest order: sorted by path


def test_pad_and_drop_give_every_rank_the_same_batches(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    write_samples(src, None, 25)
    cache = str(tmp_path / "cache")
    dropped, _ = run_job(src, None, cache, world=3, workers=2, global_batch_size=6,
                         last_batch="drop")
    assert len(dropped) == 24 and len(set(dropped)) == 24
    padded, _ = run_job(src, None, cache, world=3, workers=2, global_batch_size=6)
    assert len(padded) == 30 and set(padded) == set(range(25))
    assert padded[25:] == padded[:5]  # the last global batch wraps to the epoch's start
    single, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=6)
    assert single == padded


def test_augmentation_is_reproducible(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    write_samples(src, None, 16)
    cache = str(tmp_path / "cache")
    reference, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=4,
                           transform=augment)
    # Transforms running in the training process leave its random streams as they were
    # (iterating the dataset directly: torch's DataLoader itself draws a base seed).
    before = torch.get_rng_state()
    plain = list(VolumeDataset(src, cache_dir=cache, transform=augment))
    assert torch.equal(torch.get_rng_state(), before)
    assert plain == reference
    ids = [s[0] for s in reference]
    assert sorted(ids) == list(range(16))
    assert len({s[1] for s in reference}) == 16 and len({s[2] for s in reference}) == 16
    for world, workers in ((1, 2), (2, 3)):
        stream, _ = run_job(src, None, cache, world=world, workers=workers,
                            global_batch_size=4, transform=augment)
        assert stream == reference
    head, state = run_job(src, None, cache, world=2, workers=2, global_batch_size=4,
                          transform=augment, stop_after=2)
    tail, _ = run_job(src, None, cache, world=1, workers=3, global_batch_size=4,
                      transform=augment, state=state)
    assert head + tail == reference
    # Another epoch draws other augmentations of the same files.
    e1, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=4,
                    transform=augment, epoch=1)
    assert {s[1] for s in e1}.isdisjoint({s[1] for s in reference})


def test_changed_data_is_refused_or_warned(store_data: tuple[str, Any], tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    url, opts = store_data
    cache = str(tmp_path / "cache")
    _, state = run_job(url, opts, cache, world=1, workers=0, global_batch_size=6, stop_after=2)
    volume = Volume(url, storage_options=opts)
    volume.publish(name_of(0), payload(0, 64)[::-1])  # same size, new content (new etag)
    ds = VolumeDataset(url, storage_options=opts, cache_dir=cache, transform=read_id)
    with pytest.raises(DatasetChangedError, match="changed since the loader state was saved"):
        DataLoader(ds, batch_size=6, num_workers=0).load_state_dict(state)
    volume.publish(name_of(0), payload(0, 64))
    volume.publish("extra/new.bin", payload(99, 64))  # a file added
    with pytest.raises(DatasetChangedError, match=r"36 files .* then, 37"):
        ds = VolumeDataset(url, storage_options=opts, cache_dir=cache, transform=read_id)
        DataLoader(ds, batch_size=6, num_workers=0).load_state_dict(state)
    ds = VolumeDataset(url, storage_options=opts, cache_dir=cache, transform=read_id,
                       on_data_change="warn")
    loader = DataLoader(ds, batch_size=6, num_workers=0)
    with caplog.at_level(logging.WARNING):
        loader.load_state_dict(state)
    assert "changed since the loader state was saved" in caplog.text
    rest = [i for batch in loader for i in to_list(batch)]
    assert len(rest) == 37 - 12 + 5  # from position 12 of the new order, padded to 6


def test_file_changed_after_listing_is_an_error(store_data: tuple[str, Any],
                                                tmp_path: Path) -> None:
    url, opts = store_data
    ds = VolumeDataset(url, storage_options=opts, cache_dir=tmp_path / "cache", shuffle=False)
    Volume(url, storage_options=opts).publish(name_of(0), payload(0, 100))  # grew
    with pytest.raises(DatasetChangedError, match="has 100 bytes but was listed with 64"):
        next(iter(DataLoader(ds, batch_size=4, num_workers=0)))
    Volume(url, storage_options=opts).publish(name_of(0), payload(0, 10))  # shrank
    with pytest.raises(DatasetChangedError, match="has 10 bytes but was listed with 64"):
        next(iter(DataLoader(ds, batch_size=4, num_workers=0)))


def test_cache_limit_held_under_a_dataset_three_times_larger(memory_bucket: tuple[str, Any],
                                                             tmp_path: Path) -> None:
    url, opts = memory_bucket
    write_samples(url, opts, 60, size=1000)
    cache = str(tmp_path / "cache")
    probe = functools.partial(_id_and_cache_bytes, cache)
    # The limit must exceed what the cache may not evict: a worker's own window
    # (9 positions here: 6 ahead, 2 behind) plus the other worker's pinned files
    # (2 fills, 1 in use) plus the file being added, 13 files. 10 files overshot.
    limit = 20_000
    ds = VolumeDataset(url, storage_options=opts, cache_dir=cache, cache_limit=limit,
                       transform=probe, prefetch=2, prefetch_threads=2)
    loader = DataLoader(ds, batch_size=2, num_workers=2, prefetch_factor=2)
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = [tuple(s) for batch in loader for s in zip(*batch, strict=True)]
        assert sorted(int(i) for i, _ in seen) == list(range(60))
        assert max(int(b) for _, b in seen) <= limit
    assert disk_bytes(cache) <= limit  # at rest: the count above was the truth
    assert loader.metrics.totals["hits"] > 0  # Belady kept files the next epoch used


def _id_and_cache_bytes(cache_dir: str, path: str) -> tuple[int, int]:
    """The sample's id and the bytes the cache holds then: its byte count (data files and
    reservations of fills in flight). Not a walk of the directory: while other workers
    evict and fill, a walk counts files removed after it passed their folder as well as
    files added in folders it reaches later."""
    with open(os.path.join(cache_dir, "usage.lock"), "rb") as f:
        return read_id(path), int(f.read().strip() or 0)


def test_mount_path_cached_or_read_in_place(tmp_path: Path) -> None:
    src = tmp_path / "nfs"
    write_samples(str(src), None, 4)
    cached = VolumeDataset(src, cache_dir=tmp_path / "cache", shuffle=False)
    paths = [p for batch in DataLoader(cached, batch_size=2, num_workers=0) for p in batch]
    assert all(p.startswith(str(tmp_path / "cache")) for p in paths)
    direct = VolumeDataset(src, cache_dir=tmp_path / "cache", shuffle=False, cache_local=False)
    paths = [p for batch in DataLoader(direct, batch_size=2, num_workers=0) for p in batch]
    assert paths == [str(src / name_of(i)) for i in range(4)]
    assert sorted(os.listdir(src)) == ["part-0"]  # the source is never written to


def test_copy_evicted_by_another_job_between_hit_and_use_is_fetched_again(
        tmp_path: Path) -> None:
    src = tmp_path / "nfs"
    files = write_samples(str(src), None, 4)
    evicted: list[str] = []
    armed: list[bool] = []

    def transform(path: str) -> bytes:
        if armed and not evicted:  # warm epoch: the verified copy vanishes before use
            evicted.append(path)
            os.remove(path)
        with open(path, "rb") as f:
            return f.read()

    ds = VolumeDataset(src, cache_dir=tmp_path / "cache", shuffle=False, transform=transform)
    assert sorted(list(ds)) == sorted(files.values())  # cold: fills the cache
    armed.append(True)
    assert sorted(list(ds)) == sorted(files.values())  # warm: hits, one fetched again
    assert evicted and os.path.exists(evicted[0])


def test_a_list_of_file_urls(store_data: tuple[str, Any], tmp_path: Path) -> None:
    url, opts = store_data
    files = [f"{url}/{name_of(i)}" for i in (5, 3, 31)]
    ds = VolumeDataset(files, storage_options=opts, cache_dir=tmp_path / "c", shuffle=False,
                       transform=read_id)
    assert [i for b in DataLoader(ds, batch_size=3, num_workers=0) for i in to_list(b)] == [
        5, 3, 31]
    # Many files in few folders: listed per folder (one LIST each) instead of one HEAD each.
    many = [f"{url}/{name_of(i)}" for i in (19, *range(10), 18, 17)]
    ds = VolumeDataset(many, storage_options=opts, cache_dir=tmp_path / "c", shuffle=False,
                       transform=read_id)
    assert ds.file_table.sizes.tolist() == [64] * 13
    assert [i for b in DataLoader(ds, batch_size=13, num_workers=0) for i in to_list(b)] == [
        19, *range(10), 18, 17]
    with pytest.raises(VolumeNotFoundError):
        VolumeDataset([*many, f"{url}/part-0/missing.bin"], storage_options=opts,
                      cache_dir=tmp_path / "c")


def test_stock_torch_dataloader_needs_only_the_batch_size_hint(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    write_samples(src, None, 12)
    cache = str(tmp_path / "cache")
    ours, _ = run_job(src, None, cache, world=1, workers=0, global_batch_size=3)
    ds = VolumeDataset(src, cache_dir=cache, transform=read_id, batch_size=3)
    stock = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2)
    assert [i for b in stock for i in to_list(b)] == ours


def test_bad_input_gives_clear_errors(memory_bucket: tuple[str, Any], tmp_path: Path) -> None:
    url, opts = memory_bucket
    with pytest.raises(VolumeNotFoundError, match="No files found"):
        VolumeDataset(f"{url}/nothing-here/", storage_options=opts, cache_dir=tmp_path / "c")
    with pytest.raises(ConfigurationError, match="empty"):
        VolumeDataset("", cache_dir=tmp_path / "c")
    src = tmp_path / "src"
    write_samples(str(src), None, 10, size=500)
    with pytest.raises(CacheError, match="smaller than the largest file"):
        VolumeDataset(src, cache_dir=tmp_path / "c", cache_limit=100)
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(CacheError, match="cannot be used"):
        VolumeDataset(src, cache_dir=blocker / "cache")
    with pytest.raises(ConfigurationError, match="inside the dataset directory"):
        VolumeDataset(src, cache_dir=src / ".cache")
    with pytest.raises(ConfigurationError, match="last_batch"):
        VolumeDataset(src, cache_dir=tmp_path / "c", last_batch="keep")
    ds = VolumeDataset(src, cache_dir=tmp_path / "c", transform=read_id, shuffle=False)
    with pytest.raises(ConfigurationError, match="cannot be split evenly over 3 ranks"):
        DataLoader(ds, global_batch_size=10, rank=0, world_size=3)
    with pytest.raises(ConfigurationError, match="disagree"):
        DataLoader(ds, batch_size=4, global_batch_size=10, rank=0, world_size=2)
    with pytest.raises(ConfigurationError, match="in_order"):
        DataLoader(ds, batch_size=2, in_order=False)
    # A file that cannot be read any more: the error names it and reaches the loop.
    os.remove(src / name_of(3))
    loader = DataLoader(ds, batch_size=2, num_workers=1)
    with pytest.raises(VolumeNotFoundError, match=r"sample-00003\.bin"):
        for _ in loader:
            pass


def test_every_backend(volume_url: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    url, opts = volume_url
    write_samples(url, opts, 10, size=300)
    cache = str(tmp_path / "cache")
    stream, state = run_job(url, opts, cache, world=2, workers=1, global_batch_size=4)
    assert sorted(stream[:10]) == list(range(10)) and stream[10:] == stream[:2]  # padded
    again, _ = run_job(url, opts, cache, world=1, workers=0, global_batch_size=4)
    assert again == stream
    assert state["num_files"] == 10 and len(state["file_table"]) == 64


def test_prefetcher_counts_ready_items_and_shares_repeats() -> None:
    # Hits come from `fast` inline; one slow fetch in the pool; a repeated key is
    # fetched once, handed out twice and released after its last use.
    gate = threading.Event()
    released: list[str] = []
    fetched: list[str] = []

    def fetch(key: str) -> str:
        fetched.append(key)
        gate.wait(10)
        return key

    prefetcher: Prefetcher[str, str, str] = Prefetcher(
        [(k, k) for k in "abac"], fetch, released.append, depth=4, threads=2,
        fast=lambda k: None if k == "b" else k,
    )
    it = iter(prefetcher)
    first = next(it)
    assert (first.key, first.ready_ahead, first.first) == ("a", 2, True)  # b still pending
    gate.set()
    second = next(it)
    assert (second.key, second.ready_ahead, second.value) == ("b", 2, "b")
    third = next(it)
    assert (third.key, third.ready_ahead, third.first) == ("a", 1, False)
    assert released == ["b"]
    assert [t.key for t in it] == ["c"]
    assert sorted(released) == ["a", "b", "c"] and fetched == ["b"]


def _imagenet_like(n: int) -> list[Any]:
    """Listing entries shaped like ImageNet's on S3: class folders, quoted md5 etags."""
    from dcp_volumes._volume import FileInfo

    return [FileInfo(f"train/n{i // 1300:08d}/n{i // 1300:08d}_{i:06d}.JPEG", 110_000 + i,
                     f'"{i:032x}"', 1.7e9 + i) for i in range(n)]


def test_the_file_table_costs_bytes_not_objects() -> None:
    """At most 100 bytes a file (ImageNet-like paths and S3 etags), every entry as listed,
    the digest of the listing unchanged, and a pickle to a DataLoader worker (torch's
    multiprocessing) carries shared-memory handles, not the table."""
    import pickle
    import tracemalloc
    from multiprocessing.reduction import ForkingPickler

    from dcp_volumes.data._listing import FileTable, listing_digest

    files = _imagenet_like(20_000)
    tracemalloc.start()
    table = FileTable.of(files)
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert table.nbytes / len(files) <= 100 and kept / len(files) <= 100
    # (An etag is the version: the mtime is only kept for files without one.)
    files = [dataclasses.replace(f, mtime=None) for f in files]
    assert [table.info(i) for i in (0, 1, 12_345, 19_999)] == [files[i] for i in
                                                               (0, 1, 12_345, 19_999)]
    assert table.matches(listing_digest(files))
    local = FileTable.of([dataclasses.replace(f, etag=None, mtime=7.5) for f in files[:5]])
    assert local.info(3) == dataclasses.replace(files[3], etag=None, mtime=7.5)
    table.share()
    assert len(bytes(ForkingPickler.dumps(table))) < 10_000  # handles only
    copy = pickle.loads(pickle.dumps(table))  # by value (a broadcast to other ranks)
    assert copy.info(777) == files[777] and copy.digest == table.digest


def test_the_table_digest_tells_listings_apart_as_the_line_digest_does() -> None:
    """The file table's digest (a hash over its columns) says "same listing" exactly when
    the digest of lines per file that states carried before it does, and ``matches`` takes
    either: a state saved before it still resumes, one of another listing never does."""
    from dcp_volumes.data._listing import FileTable, listing_digest

    r = dataclasses.replace
    base = _imagenet_like(300)
    base[1::3] = [r(f, etag=None) for f in base[1::3]]  # versioned by mtime
    base[2::7] = [r(f, etag=None, mtime=None) for f in base[2::7]]  # no version at all
    base[5] = r(base[5], path="train/ünï/cödé.JPEG")
    variants = [base[:-1], base[1:], [base[1], base[0], *base[2:]], [*base, base[0]]]
    for i in (0, 1, 2, 5, 150, 299):
        f = base[i]
        variants += [
            [*base[:i], change, *base[i + 1:]]
            for change in (
                r(f, size=f.size + 1), r(f, path=f.path + "x"), r(f, etag="e"),
                r(f, etag=None), r(f, mtime=(f.mtime or 0.0) + 0.5), r(f, mtime=None),
                r(f, etag=f.etag, mtime=-0.0),
            )
        ]
    # A byte moved from one path to the next: the same bytes, other files.
    variants.append([r(base[0], path=base[0].path + "a"), r(base[1], path=base[1].path[1:]),
                     *base[2:]])
    table = FileTable.of(base)
    assert table.matches(table.digest) and table.matches(listing_digest(base))
    outcomes = set()
    for files in variants:
        same = listing_digest(files) == listing_digest(base)
        outcomes.add(same)
        assert (FileTable.of(files).digest == table.digest) is same
        assert table.matches(listing_digest(files)) is same
        assert table.matches(FileTable.of(files).digest) is same
    assert outcomes == {True, False}  # (an etag'd file's mtime is not its version)


def test_construction_leaves_the_digest_to_the_loader_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Constructing a dataset computes no digest (at a million files it cost a good part
    of the listing); the loader's state does, once. A state saved with the earlier digest
    resumes; one of a listing that differs is refused."""
    from dcp_volumes.data import _listing

    write_samples(str(tmp_path / "src"), None, 30, size=8)
    calls: list[int] = []
    real = _listing._column_digest
    monkeypatch.setattr(_listing, "_column_digest", lambda c: calls.append(1) or real(c))
    ds = VolumeDataset(str(tmp_path / "src"), cache_dir=tmp_path / "c", transform=read_id)
    assert calls == []
    state = DataLoader(ds, batch_size=5, num_workers=0).state_dict()
    assert DataLoader(ds, batch_size=5, num_workers=0).state_dict() == state and calls == [1]
    files = [ds.file_table.info(i) for i in range(ds.num_files)]
    before = {**state, "file_table": _listing.listing_digest(files)}
    DataLoader(ds, batch_size=5, num_workers=0).load_state_dict(before)
    files[7] = dataclasses.replace(files[7], mtime=(files[7].mtime or 0.0) + 1)
    for digest in (_listing.listing_digest(files), _listing.FileTable.of(files).digest):
        with pytest.raises(DatasetChangedError, match="changed since the loader state"):
            DataLoader(ds, batch_size=5, num_workers=0).load_state_dict(
                {**state, "file_table": digest})


def test_dataset_memory_per_file_and_loader_state(tmp_path: Path) -> None:
    """What a constructed dataset keeps is columns (tracemalloc: under 100 bytes a file),
    and the loader's state stays the same few hundred bytes."""
    import tracemalloc

    write_samples(str(tmp_path / "src"), None, 3000, size=8)
    write_samples(str(tmp_path / "warm-up"), None, 3, size=8)
    VolumeDataset(str(tmp_path / "warm-up"), cache_dir=tmp_path / "c0")  # lazy imports
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ds = VolumeDataset(str(tmp_path / "src"), cache_dir=tmp_path / "c", transform=read_id)
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert kept / ds.num_files <= 100, kept / ds.num_files
    loader = DataLoader(ds, batch_size=10, num_workers=0)
    assert len(repr(loader.state_dict())) < 400


def test_a_directory_is_walked_into_the_table_the_listing_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk straight into columns (local directories) gives the listing's files, order
    and digest (a state saved before it still resumes), with hidden files and suffixes."""
    from dcp_volumes.data import _listing

    names = ["a/b.bin", "a-1.bin", "a.txt", "a/c/d.bin", "ab/x.bin", ".hidden/y.bin",
             "z/.h.bin", "Z.bin", "a0.bin", "a/c.bin", "a!/q.BIN"]
    for i, name in enumerate(names):
        (tmp_path / "d" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / name).write_bytes(b"x" * i)

    def tables(**kw: Any) -> list[Any]:
        return [_listing.build_file_table(str(tmp_path / "d"), storage_options=None, **kw)[1]]

    walked = tables() + tables(suffixes=[".bin"])
    monkeypatch.setattr(_listing._walk, "walk", lambda root, wanted, **kw: [])
    listed = tables() + tables(suffixes=[".bin"])
    for fast, slow in zip(walked, listed, strict=True):
        assert [fast.info(i) for i in range(len(fast))] == [slow.info(i) for i in
                                                              range(len(slow))]
        assert fast.digest == slow.digest
    assert [walked[1].path(i) for i in range(len(walked[1]))] == sorted(
        n for n in names if n.lower().endswith(".bin") and "/." not in "/" + n)


def test_a_walk_takes_threads_only_where_its_folders_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folders whose metadata is in memory are read on one thread (threads there only
    pass the GIL around); folders that wait (a network mount's round trips, here a
    sleep before each folder's read) go to a pool. Both give the same sorted files."""
    from dcp_volumes.data import _walk

    for d in range(5):
        for f in range(300):
            path = tmp_path / "d" / f"k{d}" / ("sub" if f % 7 == 0 else "") / f"{f:04d}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * f)
    root = str(tmp_path / "d")
    real, readers = _walk.read_entries, []

    def reading(folder: str, rel: str, wanted: Any, wait: float = 0.0) -> Any:
        readers.append((rel, threading.current_thread().name))
        time.sleep(wait)
        return real(folder, rel, wanted)

    def walk(threads: int, wait: float = 0.0) -> tuple[Any, set[str]]:
        readers.clear()
        monkeypatch.setattr(_walk, "read_entries", functools.partial(reading, wait=wait))
        found = _walk.walk(root, None, threads=threads, processes=1)
        return [b"".join(p[0] for p in found), [n for p in found for n in p[2]]], dict(readers)

    serial, threads = walk(1)
    assert set(threads.values()) == {"MainThread"} and len(serial[1]) == 5 * 300
    cached, threads = walk(4)
    assert set(threads.values()) == {"MainThread"} and cached == serial
    slow, threads = walk(4, wait=0.05)
    # The pool starts once two folders waited; the later ones, at every level, go to it.
    assert all(threads[f"k{d}/"].startswith("dcpv-walk") for d in (2, 3, 4)), threads
    assert slow == serial


def test_a_large_tree_is_walked_by_worker_processes_into_the_same_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tree past ``PARALLEL_FROM`` files (lowered here) is divided among worker
    processes below its first level with several folders; the table is the one walk
    in this process gives (order, sizes, mtimes, digest), with suffixes and non-ASCII
    names. A worker that cannot start leaves its folders to this process: same table."""
    from dcp_volumes.data import _listing, _walk

    for d in range(7):
        for f in range(40):
            name = f"{f:03d}" + ("é" if f % 9 == 0 else "") + (".txt" if f % 5 == 0 else ".bin")
            sub = "" if f % 3 else "inner/"
            path = tmp_path / "data" / "train" / f"class{d}" / sub / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * (d * 100 + f))
    (tmp_path / "data" / "train" / "class3" / ".hidden").write_bytes(b"h")
    root = str(tmp_path / "data")
    spawned: list[Any] = []
    real_run = subprocess.run

    def counting(*args: Any, **kw: Any) -> Any:
        spawned.append(args[0])
        return real_run(*args, **kw)

    monkeypatch.setattr(subprocess, "run", counting)
    real_read, read_here = _walk.read_entries, []

    def reading(folder: str, rel: str, wanted: Any) -> Any:
        read_here.append(rel)
        return real_read(folder, rel, wanted)

    monkeypatch.setattr(_walk, "read_entries", reading)

    def table(suffixes: Any = None, parallel_from: int = 10**9) -> Any:
        monkeypatch.setattr(_walk, "PARALLEL_FROM", parallel_from)
        monkeypatch.setattr(_listing, "available_cpus", lambda: 4)
        return _listing.build_file_table(root, storage_options=None, suffixes=suffixes)[1]

    for suffixes in (None, [".bin"]):
        here = table(suffixes)
        assert not spawned
        read_here.clear()
        spread = table(suffixes, parallel_from=10)
        assert len(spawned) == 4, spawned  # 6 folders after the first, 4 workers
        # Here: the two levels down to the classes, and the first class (and its folder).
        assert read_here == ["", "train/", "train/class0/", "train/class0/inner/"], read_here
        spawned.clear()
        assert len(here) == (7 * 40 if suffixes is None else 7 * 32)
        assert [spread.info(i) for i in range(len(spread))] == [
            here.info(i) for i in range(len(here))]
        assert spread.digest == here.digest
        paths = [here.path(i) for i in range(len(here))]
        assert paths == sorted(paths) and paths[0].startswith("train/class0/")
    here = table()
    monkeypatch.setattr(_walk.sys, "executable", str(tmp_path / "no-python"))
    with caplog.at_level(logging.DEBUG, logger="dcp_volumes.data._walk"):
        fallen = table(parallel_from=10)
    assert "no worker process" in caplog.text
    assert [fallen.info(i) for i in range(len(fallen))] == [
        here.info(i) for i in range(len(here))]


def test_manifest_is_a_deprecated_name_of_the_file_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``VolumeDataset.manifest`` (the file table's old name) still answers, and says once
    per process that it is deprecated."""
    from dcp_volumes.data import _dataset

    write_samples(str(tmp_path / "src"), None, 3, size=8)
    ds = VolumeDataset(str(tmp_path / "src"), cache_dir=tmp_path / "c")
    monkeypatch.setattr(_dataset, "_MANIFEST_WARNED", False)
    with pytest.warns(DeprecationWarning, match="use VolumeDataset.file_table"):
        assert ds.manifest is ds.file_table
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ds.manifest is ds.file_table  # once
