"""Data benchmark: VolumeDataset + DataLoader against the usual ways of reading training files.

Side by side in one run, over the same files on the target (``--target``:
moto, radosgw, azurite, gcs, dir or a URL; ``benchmarks/_targets.py``),
every loader with batch_size=16 and 2 workers (stock loaders with
persistent workers and prefetch_factor=4, as ours defaults to):

* ``local``     the same files in a local directory, a plain map-style Dataset;
* ``naive``     a map-style Dataset that reads each file through fsspec (s3fs /
  adlfs) every time;
* ``filecache`` the same through fsspec's ``filecache::`` (download once, then local);
* ``s3tc``      s3torchconnector's ``S3MapDataset`` (S3 only);
* ``ours``      ``VolumeDataset`` + ``dcp_volumes.DataLoader`` (fresh cache: epoch 1 cold);
* ``raw``       raw concurrent GETs of every file with a thread pool and the
  store's own SDK (boto3 / azure-storage-blob; no DataLoader);
* ``raw_to_files`` (paired cold rounds only) the same GETs, each body written to a
  new local file: the least a read-through cache does, so its ceiling.

Experiments (each prints a table):

1. throughput on loopback, no compute: a small-file set and a large-file set,
   epoch 1 (cold) and epoch 2 (warm) samples/s;
2. fetch latency with a compute step per batch (20 ms, and for ours also a
   step longer than its per-batch fetch time): ``fetch_seconds`` p50/p95, the
   time the training loop waits in ``next()``;
3. the cold epoch behind a remote-like link (a proxy adding 20 ms before each
   request and capping each connection at 200 Mbit/s), on a subset.

Then, on loopback, the workers' start-up: ``iter(loader)`` to the first batch
of a fresh ``dcp_volumes.DataLoader`` (warm cache), with the start method it
picks once the process has done I/O through obstore (forkserver) against
``multiprocessing_context="fork"``.

Usage::

    python -m benchmarks data            # full run (< ~10 min)
    python -m benchmarks data --quick    # smoke test (< 60 s)
    python -m benchmarks data --target azurite [--quick]

Writes benchmarks/results/data.json and data.png (``--quick``: data_quick.*;
``--target azurite``: data_azurite[_quick].*).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from benchmarks._common import (
    REMOTE_BANDWIDTH_BPS,
    REMOTE_LATENCY_S,
    MiB,
    format_table,
    link_endpoint,
    load_average,
    machine_info,
    percentile,
    results_path,
    write_json,
)
from benchmarks._data_report import _epoch, _rate, plot, startup_table, table
from benchmarks._raw import raw_store
from benchmarks._targets import (
    Target,
    TargetError,
    add_target_arguments,
    resolve,
    serve,
    store_url,
)

T = TypeVar("T")
BUCKET = "data"
ROWS = ("local", "naive", "filecache", "s3tc", "ours", "raw")
S3_ONLY_ROWS = frozenset({"s3tc"})
# The targets of issue 16: the warm epoch against local disk; the cold epoch
# against the raw GETs written to local files (the ceiling of any cache).
WARM_VS_LOCAL = 0.95
COLD_VS_RAW_TO_FILES = 0.9
COLD_VS_NAIVE_REMOTE = 3.0
# fetch_seconds p50 counts as "near zero" at <= this share of the compute step.
NEAR_ZERO_SHARE = 0.1
# No batch takes this long here; a worker that does is stuck (see ``retry_stuck``).
WORKER_TIMEOUT_S = 120.0
# Pause before each paired cold measurement (see ``settle``).
SETTLE_S = 6.0
# Fresh loaders per start method in the start-up table (the median is shown).
STARTUP_ROUNDS = 3
STARTUP_FILES = 256  # more than the workers' first prefetch window (2 x 4 batches x 16)


def retry_stuck(what: str, run: Callable[[], T]) -> T:
    """``run()``, once more if a DataLoader worker got stuck (``WORKER_TIMEOUT_S``).

    A forked worker inherits the parent's locks as they were at the fork: when
    another thread of this process (a peer's client shutting down, a pool
    thread exiting) held one of OpenSSL's at that instant, the worker blocks
    forever at its first TLS or hashing call. Rare (seen once in ~20 runs) and
    no fault of the loader being measured, so the row runs again with fresh
    workers, and the retry is printed. Ours' workers stop themselves sooner
    (``DCP_VOLUMES_CLIENT_START_TIMEOUT``, set to 30 s in ``main``).
    """
    try:
        return run()
    except RuntimeError as exc:
        # torch's timeout, or the worker stopped by dcp_volumes' client watchdog
        if "timed out" not in str(exc) and "exited unexpectedly" not in str(exc):
            raise
        print(f"  {what}: a worker got stuck ({exc}); running it again", file=sys.stderr)
        return run()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny smoke run (< 60 s)")
    add_target_arguments(p)
    p.add_argument(
        "--link",
        choices=("both", "loopback", "remote", "tbf"),
        default="both",
        help="tbf: the loopback experiments on a shaped lo (run through `python -m benchmarks`)",
    )
    p.add_argument("--small-files", type=int, default=None, help="default 2000 (quick 64)")
    p.add_argument("--small-kib", type=int, default=100)
    p.add_argument("--large-files", type=int, default=None, help="default 64 (quick 16)")
    p.add_argument("--large-mib", type=int, default=None, help="default 8 (quick 1)")
    p.add_argument("--compute-ms", type=float, default=20.0, help="compute step per batch")
    p.add_argument(
        "--compute-files",
        type=int,
        default=None,
        help="small files in the compute-step runs (default 640, quick 32)",
    )
    p.add_argument(
        "--remote-small",
        type=int,
        default=None,
        help="small files in the remote-link runs (default 480, quick 32)",
    )
    p.add_argument(
        "--remote-large",
        type=int,
        default=None,
        help="large files in the remote-link runs (default 64, quick 16)",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="paired rounds per target comparison (default 3, quick 1)",
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--raw-threads",
        type=int,
        default=16,
        help="threads of the raw GET row (ours: 2 workers x 8 fetch threads)",
    )
    p.add_argument(
        "--warm-epochs",
        type=int,
        default=None,
        help="warm epochs per side in each paired warm round (default 3, quick 1)",
    )
    p.add_argument(
        "--files",
        type=int,
        default=None,
        metavar="N",
        help="the scale run instead (benchmarks/_data_scale.py): one dataset of N small files",
    )
    p.add_argument("--file-bytes", type=int, default=1024, help="with --files: bytes a file")
    args = p.parse_args(argv)
    if args.files is not None and args.files < 1:
        p.error("--files must be >= 1")
    try:
        args.target = resolve(args.target, endpoint=args.endpoint, options=args.storage_option)
    except TargetError as exc:
        p.error(str(exc))
    if args.link == "tbf":
        args.link = "loopback"  # the namespace's lo is the shaped link
    elif not args.target.proxyable and args.link != "loopback":
        print(f"{args.target.name}: no remote link (nothing to put a proxy in front of); "
              "loopback only", file=sys.stderr)
        args.link = "loopback"
    q = args.quick
    args.small_files = args.small_files or (64 if q else 2000)
    args.large_files = args.large_files or (16 if q else 64)
    args.large_mib = args.large_mib or (1 if q else 8)
    args.compute_files = min(args.small_files, args.compute_files or (32 if q else 640))
    args.remote_small = min(args.small_files, args.remote_small or (32 if q else 480))
    args.remote_large = min(args.large_files, args.remote_large or (16 if q else 64))
    args.pairs = args.pairs or (1 if q else 3)
    args.warm_epochs = args.warm_epochs or (1 if q else 3)
    # The longest compute step of the "step > fetch" run (it adapts to the cold rate).
    args.max_step_s = 0.15 if q else 0.5
    return args


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FileSet:
    name: str  # "small" / "large"
    keys: tuple[str, ...]
    size: int
    local_dir: str
    scheme: str  # the store's URL scheme ("s3", "az", "gs", "file")
    root: str  # URL of the bucket (a directory's path for "file")
    bucket: str  # what the raw client takes: the bucket's name (the path for "file")
    prefix: str = ""  # the target's key prefix (a URL target's path)

    def subset(self, n: int) -> FileSet:
        return dataclasses.replace(self, keys=self.keys[:n])

    def urls(self) -> list[str]:
        return [f"{self.root}/{k}" for k in self.keys]

    @property
    def prefix_url(self) -> str:
        return "/".join(p for p in (self.root, self.prefix, self.name) if p) + "/"

    def local_paths(self) -> list[str]:
        return [str(Path(self.local_dir) / k) for k in self.keys]

    @property
    def total_bytes(self) -> int:
        return self.size * len(self.keys)


def make_files(
    server: Any, target: Target, root: Path, name: str, count: int, size: int
) -> FileSet:
    """Upload ``count`` distinct files of ``size`` bytes and write the same files locally."""
    import numpy as np

    base = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
    keys = tuple(
        "/".join(p for p in (target.prefix, name, f"f{i:05d}.bin") if p) for i in range(count)
    )
    bucket_url = store_url(dataclasses.replace(target, prefix=""), server, BUCKET)
    bucket = bucket_url if target.scheme == "file" else (target.bucket or BUCKET)
    store = raw_store(target.scheme, server.storage_options(), bucket, 32)
    local = root / "local"

    def one(i: int) -> None:
        data = i.to_bytes(8, "little") + base[8:]
        store.put(keys[i], data)
        path = local / keys[i]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(count)))
    return FileSet(name, keys, size, str(local), target.scheme, bucket_url, bucket, target.prefix)


# ---------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def make_loader(
    row: str,
    files: FileSet,
    storage_options: dict[str, Any],
    args: argparse.Namespace,
    tmp: Path,
    full_set: bool,
    *,
    cache_dir: str | None = None,
    context: str | None = None,
) -> Iterator[Any]:
    """A loader of ``row``; ours may get a given (warm) ``cache_dir`` and start method."""
    import torch
    from torch.utils.data import DataLoader as TorchLoader

    from benchmarks._data_peers import (
        FsspecFileCache,
        LocalFiles,
        NaiveFsspec,
        read_local,
        read_s3_reader,
    )

    spent_cache = cache_dir is None  # emptied afterwards (a given one stays warm)
    cache_dir = cache_dir or tempfile.mkdtemp(prefix=f"{row}-cache-", dir=tmp)
    loader: Any
    if row == "ours":
        from dcp_volumes import DataLoader, VolumeDataset

        source: Any = files.prefix_url if full_set else files.urls()
        ds = VolumeDataset(
            source,
            cache_dir=cache_dir,
            storage_options=storage_options,
            transform=read_local,
            shuffle=True,
            seed=0,
        )
        # None: the loader's own choice (forkserver once this process used obstore).
        chosen: dict[str, Any] = {} if context is None else {"multiprocessing_context": context}
        loader = DataLoader(
            ds,
            batch_size=args.batch_size,
            num_workers=args.workers,
            timeout=WORKER_TIMEOUT_S,
            **chosen,
        )
    else:
        if row == "local":
            dataset: Any = LocalFiles(files.local_paths())
        elif row == "naive":
            dataset = NaiveFsspec(files.urls(), storage_options)
        elif row == "filecache":
            dataset = FsspecFileCache(files.urls(), storage_options, cache_dir)
        elif row == "s3tc":
            from s3torchconnector import S3ClientConfig, S3MapDataset

            dataset = S3MapDataset.from_objects(
                files.urls(),
                region="us-east-1",
                endpoint=storage_options["client_kwargs"]["endpoint_url"],
                transform=read_s3_reader,
                s3client_config=S3ClientConfig(force_path_style=True),
            )
        else:
            raise ValueError(f"unknown row {row!r}")
        loader = TorchLoader(
            dataset,
            batch_size=args.batch_size,
            num_workers=args.workers,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            persistent_workers=True,
            prefetch_factor=4,
            timeout=WORKER_TIMEOUT_S,
        )
    try:
        yield loader
    finally:
        # The persistent workers stop when the loader (and its iterator) is
        # collected: torch offers no public shutdown.
        del loader
        gc.collect()
        if spent_cache:
            _empty_files(cache_dir)


def _empty_files(root: str) -> None:
    """Free a spent cache's bytes but keep its files until the run ends (``tmp`` goes then).

    Deleting thousands of files makes creating new ones slow for ~30 s on ext4
    (its inode allocator skips recently deleted inodes): the next row's fresh
    cache would pay for this row's clean-up, which a real first epoch does not.
    Truncating frees the memory and disk all the same.
    """
    for folder, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                os.truncate(os.path.join(folder, name), 0)
    os.sync()


def run_epochs(loader: Any, epochs: int, compute_s: float) -> list[dict[str, Any]]:
    """Iterate ``epochs`` epochs as a training loop would; time each and each ``next()``."""
    out = []
    for _ in range(epochs):
        fetch: list[float] = []
        samples = nbytes = 0
        t0 = time.perf_counter()
        it = iter(loader)
        while True:
            tf = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            fetch.append(time.perf_counter() - tf)
            samples += int(batch.shape[0])
            nbytes += int(batch.numel())
            if compute_s:
                time.sleep(compute_s)  # the training step (the GIL is free, as on a GPU)
        seconds = time.perf_counter() - t0
        out.append(
            {"seconds": seconds, "samples": samples, "bytes": nbytes, "fetch_seconds": fetch}
        )
    return out


def raw_gets(
    files: FileSet, storage_options: dict[str, Any], threads: int, to_dir: str | None = None
) -> tuple[float, int]:
    """``raw_concurrent_gets`` of the files through the store's own SDK (``_raw.raw_store``)."""
    from benchmarks._data_peers import raw_concurrent_gets

    store = raw_store(files.scheme, storage_options, files.bucket, threads * 2)
    return raw_concurrent_gets(store, files.keys, threads, to_dir)


def rows_for(target: Target, rows: tuple[str, ...]) -> tuple[str, ...]:
    """The rows that apply to the target (s3torchconnector speaks S3 only)."""
    return tuple(r for r in rows if target.s3torchconnector or r not in S3_ONLY_ROWS)


def run_row(
    row: str,
    files: FileSet,
    endpoint: str,
    server: Any,
    args: argparse.Namespace,
    tmp: Path,
    *,
    epochs: int,
    compute_s: float,
    full_set: bool,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "row": row,
        "compute_s": compute_s,
        "files": len(files.keys),
        "file_bytes": files.size,
        "error": None,
        "epochs": [],
    }
    t0 = time.perf_counter()
    try:
        if row == "raw":
            secs, nbytes = raw_gets(files, server.storage_options(endpoint), args.raw_threads)
            result["epochs"] = [
                {"seconds": secs, "samples": len(files.keys), "bytes": nbytes, "fetch_seconds": []}
            ]
        else:

            def measure() -> None:
                with make_loader(
                    row, files, server.storage_options(endpoint), args, tmp, full_set
                ) as loader:
                    result["epochs"] = run_epochs(loader, epochs, compute_s)
                    metrics = getattr(loader, "metrics", None)
                    if metrics is not None:  # ours: what the loader itself reports
                        own = list(metrics.fetch_seconds)
                        result["loader_metrics_fetch_p50_s"] = percentile(own, 50)
                        result["loader_metrics_fetch_p95_s"] = percentile(own, 95)

            retry_stuck(f"{files.name} {row}", measure)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    for e in result["epochs"]:
        e["files_s"] = e["samples"] / e["seconds"]
        e["mib_s"] = e["bytes"] / MiB / e["seconds"]
        e["fetch_p50_s"] = percentile(e["fetch_seconds"], 50)
        e["fetch_p95_s"] = percentile(e["fetch_seconds"], 95)
    print(
        f"  {files.name:5s} {row:10s} compute {compute_s * 1000:4.0f} ms: "
        + ", ".join(f"{e['files_s']:8.1f} files/s" for e in result["epochs"])
        + (f"  ERROR {result['error']}" if result["error"] else "")
        + f"  ({time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return result


def _one_epoch(loader: Any) -> float:
    """Files/s of one epoch without a compute step."""
    e = run_epochs(loader, 1, 0.0)[0]
    return float(e["samples"] / e["seconds"])


def _note_round(
    rounds: list[dict[str, float]], what: str, name: str, value: float, peer: str, other: float
) -> None:
    """Record one round of ``name`` against ``peer`` (files/s each) and print it."""
    rounds.append({f"{name}_files_s": value, f"{peer}_files_s": other, "ratio": value / other})
    print(
        f"  paired {what} round {len(rounds)}: {name} {value:8.1f}, {peer} {other:8.1f} "
        f"files/s = {value / other:.2f}",
        file=sys.stderr,
        flush=True,
    )


def _paired(rounds: list[dict[str, float]]) -> dict[str, Any]:
    return {"rounds": rounds, "median_ratio": statistics.median(x["ratio"] for x in rounds)}


def paired_warm(
    files: FileSet, storage_options: dict[str, Any], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """Warm epochs of ours against the local-disk loader, in ``args.pairs`` rounds.

    One pass per row (the tables) is at the mercy of a noisy 2-core VM: the same
    local loader measured twice in a row differs by up to 2x. Each round makes a
    fresh cache (a cold epoch 1) and starts the local loader (its page cache
    warm), then times ``args.warm_epochs`` warm epochs of ours interleaved with
    as many local epochs (alternating which goes first);
    the round's ratio is ours' files/s over the local loader's, each over all
    its epochs, and the target uses the median of the rounds' ratios.
    """
    rounds: list[dict[str, float]] = []
    n = len(files.keys) * args.warm_epochs

    def one_round(r: int) -> tuple[float, float]:
        """Seconds of ours' and the local loader's warm epochs in round ``r``."""
        with (
            make_loader("local", files, storage_options, args, tmp, True) as local,
            make_loader("ours", files, storage_options, args, tmp, True) as ours,
        ):
            _one_epoch(local)  # workers started, page cache warm
            _one_epoch(ours)  # epoch 1 (cold) fills the cache
            spent = {"ours": 0.0, "local": 0.0}
            for e in range(args.warm_epochs):
                pair = (("ours", ours), ("local", local))
                for name, loader in pair if (r + e) % 2 else pair[::-1]:
                    spent[name] += len(files.keys) / _one_epoch(loader)
            return spent["ours"], spent["local"]

    for r in range(args.pairs):
        o_s, lo_s = retry_stuck(f"{files.name} warm round {r + 1}", partial(one_round, r))
        _note_round(rounds, f"{files.name} warm", "ours", n / o_s, "local", n / lo_s)
    return _paired(rounds)


def settle(args: argparse.Namespace) -> None:
    """Start every paired cold measurement alike: writeback done, then a pause.

    Seen with one ``write`` per 8 MiB file: memory freed a moment ago was
    cheap to write into for a second or two (512 MiB of new files: 0.33 CPU-s
    1 s after deleting as many, 1.59 after 12 s), so a cold epoch right after
    another row freed its copies looked faster. Cache files are now written
    in 1 MiB pieces (``WRITE_PIECE``), often a tenth of that CPU; the pause stays.
    """
    os.sync()
    time.sleep(0.0 if args.quick else SETTLE_S)


def paired_cold(
    files: FileSet,
    storage_options: dict[str, Any],
    args: argparse.Namespace,
    tmp: Path,
    full_set: bool,
) -> dict[str, Any]:
    """Ours' cold epoch against raw concurrent GETs, in ``args.pairs`` rounds.

    Each round also times the same GETs written to new local files
    (``raw_to_files``, see ``raw_concurrent_gets``), the ceiling of any cache's
    cold epoch, alternates the order of the three and ``settle``s before each.
    Returns the paired results ``cold_vs_raw`` (the target),
    ``raw_to_files_vs_raw`` and ``cold_vs_raw_to_files``.
    """

    def raw(to_files: bool) -> float:
        settle(args)
        out = tempfile.mkdtemp(prefix="raw-files-", dir=tmp) if to_files else None
        secs, _ = raw_gets(files, storage_options, args.raw_threads, out)
        if out is not None:
            _empty_files(out)
        return len(files.keys) / secs

    def epoch() -> float:
        settle(args)
        with make_loader("ours", files, storage_options, args, tmp, full_set) as loader:
            return _one_epoch(loader)

    vs_raw: list[dict[str, float]] = []
    floor: list[dict[str, float]] = []
    vs_floor: list[dict[str, float]] = []
    for r in range(args.pairs):
        label = f"{files.name} cold round {r + 1}"
        if r % 2:
            o, rf, rw = retry_stuck(label, epoch), raw(True), raw(False)
        else:
            rw, rf, o = raw(False), raw(True), retry_stuck(label, epoch)
        _note_round(vs_raw, f"{files.name} cold", "ours", o, "raw", rw)
        _note_round(floor, f"{files.name} raw to files", "raw_to_files", rf, "raw", rw)
        _note_round(vs_floor, f"{files.name} cold", "ours", o, "raw_to_files", rf)
    return {
        "cold_vs_raw": _paired(vs_raw),
        "raw_to_files_vs_raw": _paired(floor),
        "cold_vs_raw_to_files": _paired(vs_floor),
    }


def worker_startup(
    files: FileSet, storage_options: dict[str, Any], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """Seconds from ``iter(loader)`` to the first batch of a fresh ``DataLoader``, warm cache.

    What every new loader costs before training can start (once per loader:
    its workers persist). Ours picks forkserver once this process has done
    I/O through obstore (a forked child could not use it): each worker is then
    a fresh process that unpickles the dataset and imports what it needs.
    Against ``multiprocessing_context="fork"``: forked workers start from this
    process's memory (they could not use obstore, but a warm cache never asks
    the store). ``STARTUP_ROUNDS`` rounds of both, alternating which goes first
    (the forkserver itself is up already after the experiments, as in a job
    after its first loader).
    """
    from dcp_volumes import VolumeDataset
    from dcp_volumes._volume import obstore_used_here

    cache_dir = tempfile.mkdtemp(prefix="startup-cache-", dir=tmp)
    # Fill the cache here, through obstore, under the keys the workers look up
    # (the dataset's own volume and listing): no loader of its own to start.
    ds = VolumeDataset(files.urls(), cache_dir=cache_dir, storage_options=storage_options)
    cache = ds.cache
    if cache is None:
        raise RuntimeError("the dataset has no cache")
    with ThreadPoolExecutor(16) as pool:
        table = ds.file_table
        infos = [table.info(i) for i in range(len(table))]
        list(pool.map(lambda f: cache.fetch_from(ds.volume, f.path, expected=f), infos))

    def first_batch(context: str | None) -> tuple[float, str]:
        with make_loader(
            "ours", files, storage_options, args, tmp, False, cache_dir=cache_dir, context=context
        ) as loader:
            t0 = time.perf_counter()
            next(iter(loader))
            seconds = time.perf_counter() - t0
            ctx = loader.multiprocessing_context
            return seconds, ctx.get_start_method() if ctx is not None else "fork (torch default)"

    rounds: dict[str, list[float]] = {"default": [], "fork": []}
    methods: dict[str, str] = {}
    for r in range(STARTUP_ROUNDS):
        for name in ("default", "fork") if r % 2 == 0 else ("fork", "default"):
            seconds, methods[name] = retry_stuck(
                f"start-up {name}", partial(first_batch, None if name == "default" else "fork")
            )
            rounds[name].append(seconds)
    out = {
        "files": len(files.keys),
        "workers": args.workers,
        "obstore_used_in_this_process": obstore_used_here(),
        "start_method": methods,
        "rounds_s": rounds,
        "median_s": {k: statistics.median(v) for k, v in rounds.items()},
    }
    print(
        "  start-up: "
        + ", ".join(f"{k} ({methods[k]}) {v:.2f} s" for k, v in out["median_s"].items()),
        file=sys.stderr,
        flush=True,
    )
    return out


# ---------------------------------------------------------------------------
# Experiments
# ---------------------------------------------------------------------------


def run_all(args: argparse.Namespace, server: Any, sets: dict[str, FileSet], tmp: Path) -> dict:
    experiments: dict[str, Any] = {}
    if args.link in ("both", "loopback"):
        exp: dict[str, Any] = {"link": "loopback", "compute_s": 0.0, "sets": {}}
        print("experiment 1: throughput, loopback, no compute step", file=sys.stderr)
        for name, files in sets.items():
            exp["sets"][name] = {
                row: run_row(
                    row,
                    files,
                    server.endpoint,
                    server,
                    args,
                    tmp,
                    epochs=2,
                    compute_s=0.0,
                    full_set=True,
                )
                for row in rows_for(args.target, ROWS)
            }
        print("paired rounds, loopback (the targets' medians)", file=sys.stderr)
        opts = server.storage_options(server.endpoint)
        exp["paired"] = {
            name: {
                "warm_vs_local": paired_warm(files, opts, args, tmp),
                **paired_cold(files, opts, args, tmp, True),
            }
            for name, files in sets.items()
        }
        experiments["throughput"] = exp

        compute_s = args.compute_ms / 1000
        print(
            f"experiment 2: fetch_seconds with a {args.compute_ms:.0f} ms step, loopback",
            file=sys.stderr,
        )
        files = sets["small"].subset(args.compute_files)
        rows = {
            row: run_row(
                row,
                files,
                server.endpoint,
                server,
                args,
                tmp,
                epochs=2,
                compute_s=compute_s,
                full_set=False,
            )
            for row in rows_for(args.target, ("naive", "filecache", "s3tc", "ours"))
        }
        # A step longer than ours' cold per-batch fetch time (from experiment 1):
        # the prefetch should then hide the fetch entirely.
        cold = _rate(exp["sets"]["small"]["ours"], 0)
        wanted = 2.0 * args.batch_size / cold if cold > 0 else math.inf
        slow_step = min(max(compute_s, wanted), args.max_step_s)
        rows["ours_slow_step"] = run_row(
            "ours",
            files,
            server.endpoint,
            server,
            args,
            tmp,
            epochs=1,
            compute_s=slow_step,
            full_set=False,
        )
        experiments["compute"] = {
            "link": "loopback",
            "compute_s": compute_s,
            "slow_step_s": slow_step,
            "ours_cold_fetch_per_batch_s": args.batch_size / cold if cold > 0 else math.nan,
            "sets": {"small": rows},
        }
    if args.link in ("both", "remote"):
        print("experiment 3: cold epoch behind the remote-like link", file=sys.stderr)
        with link_endpoint(server, "remote") as endpoint:
            exp = {"link": "remote", "compute_s": 0.0, "sets": {}}
            for name, n in (("small", args.remote_small), ("large", args.remote_large)):
                files = sets[name].subset(n)
                exp["sets"][name] = {
                    row: run_row(
                        row,
                        files,
                        endpoint,
                        server,
                        args,
                        tmp,
                        epochs=1,
                        compute_s=0.0,
                        full_set=False,
                    )
                    for row in rows_for(args.target, ("naive", "filecache", "s3tc", "ours", "raw"))
                }
            print("paired rounds, remote (the targets' medians)", file=sys.stderr)
            opts = server.storage_options(endpoint)
            exp["paired"] = {
                name: paired_cold(sets[name].subset(n), opts, args, tmp, False)
                for name, n in (("small", args.remote_small), ("large", args.remote_large))
            }
            experiments["remote"] = exp
    return experiments


def check_targets(experiments: dict[str, Any]) -> dict[str, Any]:
    checks: dict[str, Any] = {}

    def add(name: str, value: float, target: str, met: bool) -> None:
        checks[name] = {
            "value": value,
            "target": target,
            "met": bool(met) and not math.isnan(value),
        }

    def median_or(exp: dict[str, Any], name: str, key: str, single: float) -> float:
        """The paired rounds' median ratio when the run made them, else the single pass."""
        paired = exp.get("paired", {}).get(name, {}).get(key)
        return float(paired["median_ratio"]) if paired else single

    thr = experiments.get("throughput")
    if thr:
        for name, rows in thr["sets"].items():
            v = _rate(rows["ours"], 1) / _rate(rows["local"], 1)
            v = median_or(thr, name, "warm_vs_local", v)
            add(
                f"loopback/{name}: warm vs local disk", v, f">= {WARM_VS_LOCAL}", v >= WARM_VS_LOCAL
            )
            v = median_or(thr, name, "cold_vs_raw_to_files", math.nan)
            add(
                f"loopback/{name}: cold vs raw GETs to files",
                v,
                f">= {COLD_VS_RAW_TO_FILES}",
                v >= COLD_VS_RAW_TO_FILES,
            )
    rem = experiments.get("remote")
    if rem:
        for name, rows in rem["sets"].items():
            v = median_or(rem, name, "cold_vs_raw_to_files", math.nan)
            add(
                f"remote/{name}: cold vs raw GETs to files",
                v,
                f">= {COLD_VS_RAW_TO_FILES}",
                v >= COLD_VS_RAW_TO_FILES,
            )
            v = _rate(rows["ours"], 0) / _rate(rows["naive"], 0)
            add(
                f"remote/{name}: cold vs naive",
                v,
                f">= {COLD_VS_NAIVE_REMOTE}",
                v >= COLD_VS_NAIVE_REMOTE,
            )
    comp = experiments.get("compute")
    if comp:
        rows = comp["sets"]["small"]
        e = _epoch(rows["ours_slow_step"], 0)
        if e:
            share = e["fetch_p50_s"] / rows["ours_slow_step"]["compute_s"]
            add(
                "compute: cold fetch p50 / step (step > fetch)",
                share,
                f"<= {NEAR_ZERO_SHARE}",
                share <= NEAR_ZERO_SHARE,
            )
        e = _epoch(rows["ours"], 1)
        if e:
            share = e["fetch_p50_s"] / comp["compute_s"]
            add(
                "compute: warm fetch p50 / step",
                share,
                f"<= {NEAR_ZERO_SHARE}",
                share <= NEAR_ZERO_SHARE,
            )
    return checks


# ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target: Target = args.target
    command = "python -m benchmarks data " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.files:
        from benchmarks import _data_scale

        args.command = command.strip()
        return _data_scale.main(args, target)
    report: dict[str, Any] = {
        "benchmark": "data",
        "command": command.strip(),
        "config": {
            k: getattr(args, k)
            for k in (
                "small_files",
                "small_kib",
                "large_files",
                "large_mib",
                "compute_ms",
                "compute_files",
                "remote_small",
                "remote_large",
                "batch_size",
                "workers",
                "raw_threads",
                "pairs",
                "warm_epochs",
                "link",
            )
        },
        "machine": machine_info(),
    }
    report["config"]["target"] = target.name
    report["config"]["server"] = target.server_label
    report["config"]["remote_link"] = {
        "latency_s": REMOTE_LATENCY_S,
        "bandwidth_bps": REMOTE_BANDWIDTH_BPS,
    }
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="dcpv-bench-data-"))
    try:
        with serve(target, BUCKET) as server:
            if target.s3torchconnector:
                # s3torchconnector's client (in the loader workers) reads credentials from
                # the environment; the endpoint is passed explicitly per run.
                env = server.env()
                os.environ.update({k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"})
            os.environ.setdefault("DCP_VOLUMES_CLIENT_START_TIMEOUT", "30")
            small, large = args.small_kib * 1024, args.large_mib * MiB
            sets = {
                "small": make_files(server, target, tmp, "small", args.small_files, small),
                "large": make_files(server, target, tmp, "large", args.large_files, large),
            }
            print(f"uploaded the files in {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
            report["experiments"] = run_all(args, server, sets, tmp)
            print("worker start-up: first batch of a fresh loader, warm cache", file=sys.stderr)
            startup_files = sets["small"].subset(STARTUP_FILES)
            report["worker_startup"] = worker_startup(
                startup_files, server.storage_options(), args, tmp
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["targets"] = check_targets(report["experiments"])
    report["wall_s"] = time.perf_counter() - t_start
    report["machine"]["load_average_end"] = load_average()
    stem = target.stem("data") + ("_quick" if args.quick else "")
    json_path = write_json(f"{stem}.json", report)
    png_path = results_path(f"{stem}.png")
    plot(report, png_path)

    titles = {
        "throughput": "throughput, loopback, no compute step",
        "compute": f"fetch_seconds with a {args.compute_ms:.0f} ms compute step per batch, "
        "loopback",
        "remote": f"cold epoch behind the remote-like link (+{REMOTE_LATENCY_S * 1000:.0f} ms "
        f"per request, {REMOTE_BANDWIDTH_BPS / 1e6:.0f} Mbit/s per connection)",
    }
    for exp_name, exp in report["experiments"].items():
        for rows in exp["sets"].values():
            any_row = next(iter(rows.values()))
            size = any_row["file_bytes"]
            size_s = f"{size / MiB:.0f} MiB" if size >= MiB else f"{size / 1024:.0f} KiB"
            print(
                f"\n## {target.name} ({target.scheme}://), {titles[exp_name]}: "
                f"{any_row['files']} x {size_s} files\n"
            )
            print(table(rows))
    paired_rows = [
        [
            f"{exp['link']}/{name}: {key.replace('_', ' ')}",
            ", ".join(f"{x['ratio']:.2f}" for x in result["rounds"]),
            result["median_ratio"],
        ]
        for exp in report["experiments"].values()
        for name, comparisons in exp.get("paired", {}).items()
        for key, result in comparisons.items()
    ]
    if paired_rows:
        print("\n## paired rounds (ours / peer per round, alternating order)\n")
        print(format_table(["comparison", "rounds", "median"], paired_rows))
    startup = report["worker_startup"]
    print(
        f"\n## worker start-up, loopback: iter(loader) to the first batch, fresh DataLoader, "
        f"{startup['workers']} workers, warm cache, median of {STARTUP_ROUNDS}\n"
    )
    print(startup_table(startup))
    print("\n## targets\n")
    print(
        format_table(
            ["check", "value", "target", "met"],
            [[k, v["value"], v["target"], v["met"]] for k, v in report["targets"].items()],
        )
    )
    la0, la1 = report["machine"]["load_average_start"], report["machine"]["load_average_end"]
    print(
        f"\nload average start {la0[0]:.2f}, end {la1[0]:.2f}; wall {report['wall_s']:.0f} s"
        f"\nwrote {json_path} and {png_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
