"""FileCache against real stores and real processes: read-through, one download per file,
atomic fills, limits and eviction, integrity checks, recovery from killed fillers."""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes import CacheError, ConfigurationError
from dcp_volumes._volume import FileInfo, Volume
from dcp_volumes.data._cache import FileCache
from dcp_volumes.data._entry import RECORD_XATTR
from dcp_volumes.data._hot import SharedHot
from testkit.emulators import LatencyProxy, MotoServer
from tests.test_data_support import disk_bytes, payload, write_samples

# Fork: children start in milliseconds and need nothing pickled. They only use
# fresh clients (Volume creates its fsspec client per process).
_FORK = mp.get_context("fork")


def _reserved(ref: Any) -> bool:
    """A fill of this entry is in progress (or was killed): its .fill file holds the bytes."""
    return os.path.exists(ref.fill)


@pytest.fixture
def proxied_bucket(moto_server: MotoServer, s3_bucket: tuple[str, dict[str, Any]]
                   ) -> Iterator[tuple[str, dict[str, Any], LatencyProxy]]:
    """A fresh bucket reached through a request-counting proxy (writes go direct)."""
    url, _ = s3_bucket
    with LatencyProxy.in_front_of(moto_server, latency_s=0.02) as proxy:
        yield url, moto_server.storage_options(proxy.endpoint), proxy


def _bucket_path(url: str, rel: str) -> str:
    return f"/{url.removeprefix('s3://').strip('/')}/{rel}"


def test_read_through_then_local(volume_url: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    url, opts = volume_url
    files = write_samples(url, opts, 3, size=5000)
    cache = FileCache(tmp_path / "cache", limit="1MiB")
    volume = Volume(url, storage_options=opts)
    for rel, data in files.items():
        path = cache.fetch(volume.url_of(rel), storage_options=opts)
        assert Path(path).read_bytes() == data
        assert path.startswith(str(tmp_path / "cache"))
    assert cache.counters.misses == 3 and cache.counters.hits == 0
    for rel in files:
        cache.fetch(volume.url_of(rel), storage_options=opts)
    assert cache.counters.hits == 3 and cache.counters.misses == 3
    assert cache.usage() == 3 * 5000 == disk_bytes(cache.cache_dir)


def test_hits_make_no_requests(proxied_bucket: tuple[str, dict[str, Any], LatencyProxy],
                               tmp_path: Path) -> None:
    url, opts, proxy = proxied_bucket
    files = write_samples(url, opts, 2)
    proxy.reset_counts()
    cache = FileCache(tmp_path / "cache")
    rel = next(iter(files))
    for _ in range(3):
        assert Path(cache.fetch(f"{url}/{rel}", storage_options=opts, size=64)).read_bytes() == (
            files[rel])
    assert proxy.count("GET", _bucket_path(url, rel)) == 1
    assert proxy.count("HEAD", _bucket_path(url, rel)) == 0  # the size came from the caller


def _fetch_all(cache_dir: str, urls: list[str], opts: dict[str, Any], barrier: Any,
               out: Any) -> None:
    cache = FileCache(cache_dir, limit="10MiB")
    barrier.wait()
    digests = []
    for url in urls:
        with cache.pin(url, storage_options=opts, size=4096) as cached, open(cached, "rb") as f:
            digests.append(hashlib.sha256(f.read()).hexdigest())
    out.put(digests)


def test_eight_processes_one_download_per_file(
    proxied_bucket: tuple[str, dict[str, Any], LatencyProxy], tmp_path: Path
) -> None:
    url, opts, proxy = proxied_bucket
    files = write_samples(url, opts, 6, size=4096)
    proxy.reset_counts()
    urls = [f"{url}/{rel}" for rel in files]
    barrier = _FORK.Barrier(8)
    out = _FORK.Queue()
    procs = [_FORK.Process(target=_fetch_all,
                           args=(str(tmp_path / "cache"), urls[i % 2:] + urls[:i % 2], opts,
                                 barrier, out))
             for i in range(8)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    expected = {hashlib.sha256(data).hexdigest() for data in files.values()}
    for digests in results:
        assert set(digests) == expected  # byte-equal, never torn
    for rel in files:
        assert proxy.count("GET", _bucket_path(url, rel)) == 1, proxy.requests


def test_limit_held_evicted_file_refetched(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = write_samples(str(src), None, 30, size=1000)  # 3x the limit
    cache = FileCache(tmp_path / "cache", limit=10_000, headroom=0)
    for rel, data in files.items():
        assert Path(cache.fetch(str(src / rel))).read_bytes() == data
        assert disk_bytes(cache.cache_dir) <= 10_000
        assert cache.usage() <= 10_000
    assert cache.counters.evictions == 20
    first = str(src / next(iter(files)))
    assert not cache.contains(first)  # least recently used: evicted
    misses = cache.counters.misses
    assert Path(cache.fetch(first)).read_bytes() == files[next(iter(files))]
    assert cache.counters.misses == misses + 1
    assert disk_bytes(cache.cache_dir) <= 10_000


def test_pinned_files_are_never_evicted(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = write_samples(str(src), None, 7, size=1000)
    urls = [str(src / rel) for rel in files]
    cache = FileCache(tmp_path / "cache", limit=3000, headroom=0)
    pins = [cache.pin(u) for u in urls[:3]]
    other = FileCache(tmp_path / "cache", limit=3000, headroom=0)  # as another process would
    for u in urls[3:6]:
        other.fetch(u)
    # The pins survive; the limit is exceeded by no more than the newest fill.
    assert all(cache.contains(u) for u in urls[:3]) and cache.contains(urls[5])
    assert disk_bytes(cache.cache_dir) == 4000
    for pin in pins:
        pin.release()
    other.fetch(urls[6])  # now it can make room again
    assert disk_bytes(cache.cache_dir) <= 3000 and cache.usage() <= 3000


class _Order:
    """A schedule saying when each file is used next (smaller = sooner)."""

    def __init__(self, cache: FileCache, distance: dict[str, float | None]) -> None:
        self.by_key = {cache.key_of(Volume(os.path.dirname(u)), os.path.basename(u)): d
                       for u, d in distance.items()}

    def eviction_priority(self, key: str) -> float | None:
        return self.by_key.get(key, float("inf"))


def test_belady_evicts_furthest_next_use_and_spares_the_window(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = write_samples(str(src), None, 5, size=1000)
    urls = [str(src / rel) for rel in files]
    cache = FileCache(tmp_path / "cache", limit=4000, headroom=0)
    for u in urls[:4]:
        cache.fetch(u)
    # urls[0] is inside the prefetch window (None): never evicted even if LRU-oldest;
    # urls[2] is needed furthest in the future: the victim.
    cache.set_schedule(_Order(cache, {urls[0]: None, urls[1]: 5.0, urls[2]: 50.0,
                                      urls[3]: 7.0}))
    cache.fetch(urls[4])
    assert [cache.contains(u) for u in urls] == [True, True, False, True, True]


def test_corrupted_copy_detected_and_refetched(volume_url: tuple[str, dict[str, Any]],
                                               tmp_path: Path) -> None:
    url, opts = volume_url
    files = write_samples(url, opts, 1, size=3000)
    rel, data = next(iter(files.items()))
    full = Volume(url, storage_options=opts).url_of(rel)
    cache = FileCache(tmp_path / "cache")
    path = cache.fetch(full, storage_options=opts)
    with open(path, "r+b") as f:
        f.truncate(100)  # a torn copy (e.g. a crash before the data reached the disk)
    assert not cache.contains(full, storage_options=opts)
    assert Path(cache.fetch(full, storage_options=opts)).read_bytes() == data
    assert cache.counters.misses == 2
    # A listing that disagrees with the cached copy (the object changed) refetches too.
    Volume(url, storage_options=opts).publish(rel, b"x" * 10)
    assert Path(cache.fetch(full, storage_options=opts, size=10)).read_bytes() == b"x" * 10


def test_fast_hits_notice_another_process_replacing_the_copy(tmp_path: Path) -> None:
    # Hits of verified copies skip the record (one stat): a copy evicted and
    # refilled by another process in between must still be noticed.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"one")
    url = str(src / "a.bin")
    ours, other = FileCache(tmp_path / "cache"), FileCache(tmp_path / "cache")
    assert Path(ours.fetch(url)).read_bytes() == b"one"
    assert Path(ours.fetch(url)).read_bytes() == b"one"
    assert (ours.counters.misses, ours.counters.hits) == (1, 1)
    assert other.evict(url)
    (src / "a.bin").write_bytes(b"three")
    assert Path(other.fetch(url, size=5)).read_bytes() == b"three"
    assert Path(ours.fetch(url, size=5)).read_bytes() == b"three"
    assert ours.counters.hits == 2  # served the other process's fill, found by its record


def test_shared_hot_table_makes_copies_verified_elsewhere_hits(tmp_path: Path) -> None:
    # A dataset's workers share what they verified (SharedHot): a copy one of them
    # verified is a hit in another at once; a copy replaced since is never adopted.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"one")
    volume, info = Volume(str(src)), FileInfo("a.bin", 3)
    shared = pickle.loads(pickle.dumps(SharedHot(1)))
    first, second = FileCache(tmp_path / "cache"), FileCache(tmp_path / "cache")
    assert second.fetch_hot(volume, "a.bin", expected=info, shared=shared, slot=0) is None
    with first.fetch_from(volume, "a.bin", expected=info, pin=True, shared=shared, slot=0):
        pass
    hit = second.fetch_hot(volume, "a.bin", expected=info, shared=shared, slot=0)
    assert hit is not None and hit.hit and Path(hit.path).read_bytes() == b"one"
    assert second.fetch_hot(volume, "a.bin", expected=FileInfo("a.bin", 4), shared=shared,
                            slot=0) is None  # listed differently now
    # Evicted and refilled by a process outside the table: neither adopts it.
    assert FileCache(tmp_path / "cache").evict(str(src / "a.bin"))
    (src / "a.bin").write_bytes(b"two")
    FileCache(tmp_path / "cache").fetch(str(src / "a.bin"))
    assert second.fetch_hot(volume, "a.bin", expected=info, shared=shared, slot=0) is None
    third = FileCache(tmp_path / "cache")
    assert third.fetch_hot(volume, "a.bin", expected=info, shared=shared, slot=0) is None
    again = third.fetch_from(volume, "a.bin", expected=info, shared=shared, slot=0)
    assert Path(again.path).read_bytes() == b"two"
    hit = second.fetch_hot(volume, "a.bin", expected=info, shared=shared, slot=0)
    assert hit is not None and Path(hit.path).read_bytes() == b"two"


def test_what_a_process_keeps_does_not_grow_with_the_files_it_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A DataLoader worker's own memory: its memo of verified copies is bounded and its
    # view of the entries is only kept for eviction (a limit). Reading twice as many
    # files, filled then hit, keeps at most a memo's worth more (it kept an object set a
    # file: at a million files, hundreds of MB in every worker).
    import tracemalloc

    from dcp_volumes.data import _hot

    monkeypatch.setattr(_hot, "_HOT_MAX", 32)
    n = 2048
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n):
        (src / f"{i:05d}.bin").write_bytes(b"x")
    volume, shared = Volume(str(src)), SharedHot(n)
    infos = [FileInfo(f"{i:05d}.bin", 1) for i in range(n)]
    cache = FileCache(tmp_path / "cache", limit=None)

    def read(files: range) -> None:
        for i in files:
            got = cache.fetch_from(volume, infos[i].path, expected=infos[i], shared=shared,
                                   slot=i)
            assert got.size == 1

    read(range(n // 2))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    read(range(n // 2, n))  # fills
    read(range(n))  # hits
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert kept / (n // 2) < 100, kept / (n // 2)
    assert cache.counters.misses == n and cache.counters.hits == n


def test_a_pin_with_an_etag_the_store_no_longer_has_serves_the_store_file(
    tmp_path: Path,
) -> None:
    # An etag alone (no size) that the store does not have: pin, like fetch, serves the
    # file the store holds now, downloaded once; it used to refetch it for ever.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"now")
    cache = FileCache(tmp_path / "cache")
    got: list[bytes] = []

    def pin_twice() -> None:
        for _ in range(2):
            with cache.pin(str(src / "a.bin"), etag="gone") as cached:
                got.append(Path(cached.path).read_bytes())

    worker = threading.Thread(target=pin_twice, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert got == [b"now", b"now"], "pin() never returned"
    assert (cache.counters.misses, cache.counters.hits) == (1, 1)


def _slow_fetch(cache_dir: str, url: str, opts: dict[str, Any]) -> None:
    FileCache(cache_dir).fetch(url, storage_options=opts, size=256 * 1024)


@contextlib.contextmanager
def _slow_filler(moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path,
                 seed: int) -> Iterator[tuple[str, bytes, dict[str, Any], Any, FileCache, Any]]:
    """Start a forked filler of ``url``/big.bin (256 KiB) over a slow link and wait (up to
    20 s) for its reservation; yields url, data, opts, filler, cache and the entry's ref."""
    url, direct = s3_bucket
    data = payload(seed, 256 * 1024)
    Volume(url, storage_options=direct).publish("big.bin", data)
    cache_dir = str(tmp_path / "cache")
    # ~2 s for 256 KiB: the filler is surely mid-download when it is killed.
    with LatencyProxy.in_front_of(moto_server, bandwidth_bps=1e6) as slow:
        opts = moto_server.storage_options(slow.endpoint)
        filler = _FORK.Process(target=_slow_fetch, args=(cache_dir, f"{url}/big.bin", opts))
        filler.start()
        cache = FileCache(cache_dir, reconcile=False)
        ref = cache._entry(Volume(url, storage_options=opts), "big.bin")
        deadline = time.monotonic() + 20
        while not _reserved(ref) and time.monotonic() < deadline:
            time.sleep(0.02)
        yield url, data, opts, filler, cache, ref


def test_killed_filler_is_recovered(moto_server: MotoServer, s3_bucket: tuple[str, Any],
                                    tmp_path: Path) -> None:
    with _slow_filler(moto_server, s3_bucket, tmp_path, seed=7) as (
        url, data, opts, filler, cache, ref
    ):
        assert _reserved(ref), "the filler never started"
        time.sleep(0.3)
        assert filler.is_alive()
        os.kill(filler.pid or 0, signal.SIGKILL)
        filler.join()
        # Its leftovers are never served: the next fetch cleans up and downloads again.
        assert not cache.contains(f"{url}/big.bin", storage_options=opts)
        path = cache.fetch(f"{url}/big.bin", storage_options=opts, size=len(data))
    assert Path(path).read_bytes() == data
    assert not _reserved(ref) and not os.path.exists(ref.fill)
    assert cache.usage() == len(data)  # the dead filler's reservation was given back


def test_waiting_reader_gets_the_file_after_the_filler_dies(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], tmp_path: Path
) -> None:
    with _slow_filler(moto_server, s3_bucket, tmp_path, seed=9) as (
        url, data, opts, filler, cache, ref
    ):
        got: list[str] = []
        waiter = threading.Thread(target=lambda: got.append(
            cache.fetch(f"{url}/big.bin", storage_options=opts, size=len(data))))
        waiter.start()  # blocks on the entry lock the filler holds
        time.sleep(0.3)
        assert waiter.is_alive() and not got
        os.kill(filler.pid or 0, signal.SIGKILL)
        filler.join()
        waiter.join(timeout=30)
    assert got and Path(got[0]).read_bytes() == data
    assert not os.path.exists(ref.fill)


def test_restart_reconciles_the_directory(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = write_samples(str(src), None, 4, size=500)
    urls = [str(src / rel) for rel in files]
    cache = FileCache(tmp_path / "cache")
    refs = [cache._entry(Volume(os.path.dirname(u)), os.path.basename(u)) for u in urls]
    for u in urls:
        cache.fetch(u)
    Path(refs[0].fill).write_bytes(b"half")            # a killed fill (its reservation)
    os.removexattr(refs[1].data, RECORD_XATTR)         # a file without its record
    os.remove(refs[2].data)                            # no file
    Path(refs[2].meta).write_bytes(b"stray")           # ... and a stray record file
    legacy = Path(refs[3].fill[: -len(".fill")] + ".resv")
    legacy.write_text("7")                             # an older version's reservation file
    foreign = tmp_path / "cache" / "objects" / "notes.txt"
    foreign.write_text("not the cache's")
    restarted = FileCache(tmp_path / "cache")
    report = restarted.reconcile()  # (already ran at start-up: now a no-op)
    assert report.removed_temp == 0 and report.entries == 2
    assert not os.path.exists(refs[0].fill) and not _reserved(refs[0])
    assert not os.path.exists(refs[1].data) and not os.path.exists(refs[2].meta)
    assert not legacy.exists()
    assert foreign.exists()  # never deletes what it did not create
    assert restarted.usage() == 1000 == disk_bytes(restarted.cache_dir) - len("not the cache's")
    assert Path(restarted.fetch(urls[1])).read_bytes() == files[os.path.relpath(urls[1], src)]


def test_bad_cache_configuration(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CacheError, match="cannot be used"):
        FileCache(blocker / "cache")
    with pytest.raises(ConfigurationError):
        FileCache(tmp_path / "c", limit="lots")
    with pytest.raises(ConfigurationError):
        FileCache(tmp_path / "c", limit=0)
    src = tmp_path / "src"
    files = write_samples(str(src), None, 1, size=5000)
    small = FileCache(tmp_path / "c", limit=1000)
    with pytest.raises(CacheError, match="larger than the cache limit"):
        small.fetch(str(src / next(iter(files))))
    assert small.usage() == 0
    with pytest.raises(ConfigurationError, match="names no file"):
        small.fetch("s3://bucket-only")
    # The options, parsed and checked once, travel with the cache to a worker process.
    opts = FileCache(tmp_path / "c", limit="2KiB", headroom="1KiB", reconcile=False).options
    assert (opts.limit, opts.headroom, opts.reconcile, opts.limit_chosen) == (2048, 1024,
                                                                              False, True)
    copy = pickle.loads(pickle.dumps(small))
    assert copy.options == small.options and copy.limit == 1000 and copy.cache_dir == str(
        tmp_path / "c")
    assert not FileCache(tmp_path / "c").options.limit_chosen


@pytest.mark.soak
def test_large_file_ranged_fill_killed_midway(moto_server: MotoServer,
                                              s3_bucket: tuple[str, Any],
                                              tmp_path: Path) -> None:
    """A >16 MiB file is fetched as parallel ranges into <fill>.part-*; a kill leaves those
    behind, and the next fill removes them before it starts."""
    url, direct = s3_bucket
    data = os.urandom(20 * 2**20)
    Volume(url, storage_options=direct).publish("large.bin", data)
    cache_dir = str(tmp_path / "cache")
    with LatencyProxy.in_front_of(moto_server, bandwidth_bps=40e6) as slow:
        opts = moto_server.storage_options(slow.endpoint)
        filler = _FORK.Process(target=_fetch_large, args=(cache_dir, f"{url}/large.bin", opts))
        filler.start()
        cache = FileCache(cache_dir, reconcile=False)
        ref = cache._entry(Volume(url, storage_options=opts), "large.bin")
        folder = os.path.dirname(ref.fill)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            os.path.isdir(folder) and any(".fill.part-" in n for n in os.listdir(folder))):
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(filler.pid or 0, signal.SIGKILL)
        filler.join()
        assert any(".fill.part-" in n for n in os.listdir(folder))
        path = cache.fetch(f"{url}/large.bin", storage_options=opts, size=len(data))
    assert Path(path).read_bytes() == data
    assert not any(".part-" in n or n.endswith((".fill", ".resv")) for n in os.listdir(folder))
    assert cache.usage() == len(data)


def _fetch_large(cache_dir: str, url: str, opts: dict[str, Any]) -> None:
    FileCache(cache_dir).fetch(url, storage_options=opts, size=20 * 2**20)


def test_a_limit_beyond_the_disk_warns_only_when_the_caller_chose_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    from dcp_volumes.data import _cache

    real = shutil.disk_usage
    small = real(tmp_path)._replace(total=10 * 2**30)  # a 10 GiB disk
    monkeypatch.setattr(_cache.shutil, "disk_usage", lambda path: small)
    with caplog.at_level("INFO", logger="dcp_volumes.data._cache"):
        FileCache(tmp_path / "default")  # the default limit (100GB): no news
        FileCache(tmp_path / "chosen", limit="500GB")
    levels = [(r.levelname, "chosen" in r.getMessage()) for r in caplog.records
              if "exceeds the size of the disk" in r.getMessage()]
    assert levels == [("INFO", False), ("WARNING", True)]


def _cache_inodes(cache_dir: str) -> tuple[int, int]:
    """(files, folders) below ``cache_dir``."""
    files = folders = 0
    for _, dirs, names in os.walk(cache_dir):
        files += len(names)
        folders += len(dirs)
    return files, folders


def test_one_inode_per_cached_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = write_samples(str(src), None, 300, size=100)
    cache = FileCache(tmp_path / "cache")
    pins = [cache.pin(str(src / rel)) for rel in list(files)[:20]]  # pins cost no file
    for rel in files:
        cache.fetch(str(src / rel))
    names, folders = _cache_inodes(cache.cache_dir)
    # The data files, the byte counter and the entries' lock file; the folders are
    # objects/ and at most 256 of objects/<k2>/.
    assert names == len(files) + 2 and folders <= 257
    for pin in pins:
        pin.release()
    restarted = FileCache(tmp_path / "cache")
    assert restarted.reconcile().entries == len(files)
    assert all(Path(restarted.fetch(str(src / rel))).read_bytes() == data
               for rel, data in files.items())
    assert restarted.counters.misses == 0


def test_a_cache_of_the_previous_layout_is_never_served(tmp_path: Path) -> None:
    """Entries written by the JSON-sidecar layout (data, .meta, .lock per file) are not
    trusted: a fetch downloads again, and reconcile removes their files."""
    src = tmp_path / "src"
    files = write_samples(str(src), None, 2, size=500)
    (first, data0), (second, data1) = files.items()
    cache = FileCache(tmp_path / "cache")
    refs = [cache._entry(Volume(str((src / rel).parent)), os.path.basename(rel))
            for rel in (first, second)]
    for ref, data in zip(refs, (data0, data1), strict=True):
        os.makedirs(os.path.dirname(ref.data), exist_ok=True)
        Path(ref.data).write_bytes(b"y" * len(data))  # same size, stale bytes
        Path(ref.meta).write_text(json.dumps({"v": 1, "url": "", "size": len(data),
                                              "etag": None, "mtime": None, "fetched": 0}))
        Path(ref.fill[: -len(".fill")] + ".lock").write_text("")
    assert not cache.contains(str(src / first))
    assert Path(cache.fetch(str(src / first), size=len(data0))).read_bytes() == data0
    assert cache.counters.misses == 1
    FileCache(tmp_path / "cache")  # reconcile at start-up
    folder = os.path.dirname(refs[1].data)
    assert not os.path.exists(refs[1].data) and not os.path.exists(refs[1].meta)
    assert not any(n.endswith((".lock", ".meta")) for n in os.listdir(folder))
    assert Path(cache.fetch(str(src / second))).read_bytes() == data1


def test_records_written_by_this_format_are_served(tmp_path: Path) -> None:
    """The on-disk record is a format: "dcv2", size (int64), mtime (float64, NaN for
    none), then the etag's UTF-8, as an xattr or a .meta file. Entries written in it by
    earlier versions are hits; a record of another size or etag is a miss, refilled."""
    import math
    import struct

    src = tmp_path / "src"
    files = write_samples(str(src), None, 3, size=500)
    cache = FileCache(tmp_path / "cache")
    urls = [str(src / rel) for rel in files]
    refs = [cache._entry(Volume(os.path.dirname(u)), os.path.basename(u)) for u in urls]
    stale = b"y" * 500  # not the source's bytes: a hit is served from the cache
    for i, ref in enumerate(refs):
        os.makedirs(os.path.dirname(ref.data), exist_ok=True)
        Path(ref.data).write_bytes(stale)
        size = 500 if i < 2 else 499  # the third record says another size: never served
        record = struct.pack("<4sqd", b"dcv2", size, math.nan) + b"etag-1"
        if i == 0 and hasattr(os, "setxattr"):
            try:
                os.setxattr(ref.data, RECORD_XATTR, record)
                continue
            except OSError:
                pass  # no user xattrs here: the .meta file below
        Path(ref.meta).write_bytes(record)
    for url in urls[:2]:
        assert Path(cache.fetch(url, size=500, etag="etag-1")).read_bytes() == stale
    assert cache.counters.misses == 0 and cache.counters.hits == 2
    data = list(files.values())
    assert Path(cache.fetch(urls[0], size=500, etag="etag-2")).read_bytes() == data[0]
    assert Path(cache.fetch(urls[2])).read_bytes() == data[2]  # its record's size is wrong
    assert cache.counters.misses == 2


def test_without_xattrs_records_are_meta_files(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem takes no user xattrs the record is a .meta file; both kinds
    of records are read, so processes that disagree still share the cache."""
    from dcp_volumes.data import _entry

    src = tmp_path / "src"
    files = write_samples(str(src), None, 6, size=1000)
    urls = [str(src / rel) for rel in files]
    data = list(files.values())
    with_xattrs = FileCache(tmp_path / "cache", limit=4000, headroom=0)
    with_xattrs.fetch(urls[0])
    monkeypatch.setattr(_entry, "xattrs_supported", lambda folder: False)
    cache = FileCache(tmp_path / "cache", limit=4000, headroom=0)
    for u, d in zip(urls[:4], data, strict=False):
        assert Path(cache.fetch(u)).read_bytes() == d
    assert cache.counters.misses == 3  # urls[0]'s xattr record was read
    ref = cache._entry(Volume(os.path.dirname(urls[1])), os.path.basename(urls[1]))
    assert os.path.exists(ref.meta)
    with pytest.raises(OSError):
        os.getxattr(ref.data, RECORD_XATTR)
    assert _cache_inodes(cache.cache_dir)[0] == 3 * 2 + 1 + 2
    with cache.pin(urls[1]):
        for u in urls[4:]:
            cache.fetch(u)  # evicts, never the pinned one
        assert cache.contains(urls[1])
    assert disk_bytes(cache.cache_dir) <= 4000
    os.remove(ref.meta)
    assert not cache.contains(urls[1])  # a file without its record
    assert Path(cache.fetch(urls[1])).read_bytes() == data[1]


def test_without_byte_locks_a_pinned_fill_is_taken_again_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where OFD locks are missing each entry has a lock file (``EntryLock``), whose
    exclusive lock cannot turn shared in one step: a pinned fill releases it and pins the
    copy it then finds, which nobody can evict until the pin goes."""
    from dcp_volumes.data import _entry
    from dcp_volumes.data._locks import EntryLock

    monkeypatch.setattr(_entry, "byte_locks_supported", lambda: False)
    src = tmp_path / "src"
    files = write_samples(str(src), None, 1, size=700)
    url = str(src / next(iter(files)))
    cache = FileCache(tmp_path / "cache")
    ref = cache._entry(Volume(os.path.dirname(url)), os.path.basename(url))
    assert ref.lock_file.endswith(".lock")
    with cache.pin(url) as pinned:
        assert pinned.pinned and not pinned.hit
        assert Path(pinned.path).read_bytes() == next(iter(files.values()))
        assert not EntryLock(ref.lock_file).acquire(exclusive=True, blocking=False)
        assert not cache.evict(url)
    assert cache.evict(url) and not cache.contains(url)


def _hold_lock(path: str, key: str, ready: Any) -> None:
    from dcp_volumes.data._locks import ByteLock

    lock = ByteLock(path, key)
    lock.acquire(exclusive=True)
    ready.set()
    time.sleep(60)
    lock.release()


def test_entry_locks_are_bytes_of_one_file(tmp_path: Path) -> None:
    from dcp_volumes.data._locks import ByteLock

    path = str(tmp_path / "entries.lock")
    a, b = "a" * 32, "b" * 32
    first = ByteLock(path, a)
    assert first.acquire(exclusive=True)
    assert ByteLock(path, b).acquire(exclusive=True, blocking=False)  # another entry
    assert not ByteLock(path, a).acquire(exclusive=False, blocking=False)  # same entry
    first.release()
    pins = [ByteLock(path, a), ByteLock(path, a)]
    assert all(p.acquire(exclusive=False, blocking=False) for p in pins)  # shared
    assert not ByteLock(path, a).acquire(exclusive=True, blocking=False)
    for p in pins:
        p.release()
    # A filler that keeps its copy pinned turns its lock shared in place: others may pin
    # the entry at once, and nobody may take it exclusive (evict) meanwhile.
    filler = ByteLock(path, a)
    assert filler.acquire(exclusive=True) and filler.downgrade()
    reader = ByteLock(path, a)
    assert reader.acquire(exclusive=False, blocking=False)
    assert not ByteLock(path, a).acquire(exclusive=True, blocking=False)
    reader.release()
    assert not ByteLock(path, a).acquire(exclusive=True, blocking=False)
    filler.release()
    # A holder killed with SIGKILL leaves no lock behind.
    ready = _FORK.Event()
    holder = _FORK.Process(target=_hold_lock, args=(path, a, ready))
    holder.start()
    assert ready.wait(20)
    assert not ByteLock(path, a).acquire(exclusive=True, blocking=False)
    os.kill(holder.pid or 0, signal.SIGKILL)
    holder.join()
    assert ByteLock(path, a).acquire(exclusive=True, blocking=False)
