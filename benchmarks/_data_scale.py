"""The data benchmark at scale (``--files N``): one dataset of N small files, end to end.

Measured in one run, on one target (``--target dir``: a local directory;
``moto``: S3):

* ``listing``: a raw recursive listing with the store's fastest plain client
  (``os.scandir`` with a ``stat`` per file; boto3's ``list_objects_v2`` pages)
  against ``VolumeDataset`` construction (listing, file table, cache set-up);
* memory: the file table's bytes a file, what construction keeps (tracemalloc),
  RSS and PSS of the training process and of each DataLoader worker mid-epoch;
* the cache: inodes and bytes on disk a cached sample after the cold epoch;
* throughput (files/s): the cold epoch and a warm one, against raw GETs
  written to files (the ceiling of any read-through cache) and the same files
  read from local disk by a plain map-style Dataset;
* resume: from ``load_state_dict`` at 90% of the epoch to the first batch,
  next to the same from the epoch's start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from torch.utils.data import DataLoader as TorchLoader

from benchmarks._common import format_table, machine_info, pyplot, results_path, write_json
from benchmarks._data_peers import LocalFiles, raw_concurrent_gets, read_local
from benchmarks._raw import LocalRaw, S3Raw, raw_store
from benchmarks._targets import Target, serve, server_pids, store_url

BUCKET = "dcpv-bench-scale"
FOLDER = "scale"
PER_FOLDER = 1000  # files a folder (ImageNet: ~1300 a class)


def _keys(n: int) -> list[str]:
    return [f"{FOLDER}/d{i // PER_FOLDER:05d}/f{i:08d}.bin" for i in range(n)]


def _make_files(store: Any, keys: list[str], size: int, local: Path | None) -> None:
    """Write ``keys`` to the store (and the same files below ``local``)."""
    body = os.urandom(size)

    def one(i: int) -> None:
        data = i.to_bytes(8, "little") + body[8:]
        store.put(keys[i], data)
        if local is not None:
            path = local / keys[i]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(len(keys))))


def raw_listing(store: Any) -> int:
    """List every file below the scale folder with the store's plain client (``_raw``);
    returns the count (sizes and etags/mtimes read, as a dataset needs them)."""
    if isinstance(store, LocalRaw):
        count, stack = 0, [os.path.join(store.root, FOLDER)]
        while stack:
            for entry in os.scandir(stack.pop()):
                if entry.is_dir():
                    stack.append(entry.path)
                else:
                    entry.stat()
                    count += 1
        return count
    if not isinstance(store, S3Raw):
        raise SystemExit("--files: a raw listing of this store is not implemented; use "
                         "--target dir or moto")
    count = 0
    pages = store.client.get_paginator("list_objects_v2").paginate(
        Bucket=store.bucket, Prefix=f"{FOLDER}/"
    )
    for page in pages:
        count += sum(1 for o in page.get("Contents", ()) if o["Size"] >= 0 and o["ETag"])
    return count


def _memory(proc: psutil.Process) -> dict[str, int]:
    with contextlib.suppress(psutil.Error):
        full = proc.memory_full_info()
        return {"rss": int(full.rss), "pss": int(full.pss), "uss": int(full.uss)}
    return {}


def _processes(servers: set[int]) -> dict[str, Any]:
    """RSS/PSS/USS of this (training) process and of each child but the servers' (the
    DataLoader workers)."""
    me = psutil.Process()
    workers = []
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            line = " ".join(child.cmdline())
            helper = any(h in line for h in ("forkserver", "resource_tracker", "torch_shm"))
            if child.pid not in servers and not helper:
                workers.append(_memory(child))
    return {"main": _memory(me), "workers": workers}


def _cache_on_disk(cache_dir: str, n: int, size: int) -> dict[str, float]:
    files = dirs = blocks = 0
    for root, names, entries in os.walk(cache_dir):
        dirs += len(names)
        for name in entries:
            files += 1
            blocks += os.lstat(os.path.join(root, name)).st_blocks
    on_disk = blocks * 512
    return {
        "files": files,
        "dirs": dirs,
        "inodes_per_sample": (files + dirs) / n,
        "bytes_per_sample": on_disk / n,
        "overhead_bytes_per_sample": (on_disk - n * size) / n,
    }


def _epoch(
    loader: Any, *, sample_at: int | None = None, servers: set[int] | None = None
) -> tuple[float, dict[str, Any]]:
    """Seconds of one epoch and the processes' memory at batch ``sample_at``."""
    memory: dict[str, Any] = {}
    t0 = time.perf_counter()
    for i, _ in enumerate(loader):
        if i == sample_at:
            memory = _processes(servers or set())
    return time.perf_counter() - t0, memory


def _first_batch_s(loader: Any) -> float:
    """Seconds from ``iter`` (workers starting) to the first batch."""
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    seconds = time.perf_counter() - t0
    del it  # (its workers stop)
    return seconds


def run(args: Any, target: Target) -> dict[str, Any]:
    """Run the scale cells; returns the report (also written as JSON and PNG)."""
    from dcp_volumes import DataLoader, VolumeDataset

    n, size, workers, batch = args.files, args.file_bytes, args.workers, args.batch_size
    tmp = Path(tempfile.mkdtemp(prefix="dcpv-bench-scale-"))
    out: dict[str, Any] = {
        "benchmark": "data_scale",
        "command": args.command,
        "config": {"files": n, "file_bytes": size, "workers": workers, "batch_size": batch,
                   "target": target.name, "raw_threads": args.raw_threads},
        "machine": machine_info(),
    }
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    try:
        with serve(target, BUCKET) as server:
            opts = server.storage_options()
            bucket_url = store_url(target, server, BUCKET)
            bucket = bucket_url if target.scheme == "file" else (target.bucket or BUCKET)
            store = raw_store(target.scheme, opts, bucket, 32)
            local = None if target.scheme == "file" else tmp / "local"
            t0 = time.perf_counter()
            _make_files(store, _keys(n), size, local)  # (no list of N names held from here)
            say(f"wrote {n} files of {size} B in {time.perf_counter() - t0:.1f} s")
            servers = set(server_pids(server))
            prefix = f"{bucket_url}/{FOLDER}/"
            cache_dir = str(tmp / "cache")

            def construct() -> Any:
                shutil.rmtree(cache_dir, ignore_errors=True)
                return VolumeDataset(prefix, cache_dir=cache_dir, cache_limit=None,
                                     storage_options=opts, batch_size=batch,
                                     transform=read_local, prefetch_threads=8)

            raw_s, ours_s = [], []
            for _ in range(2):  # alternate; the best of each (a warm page cache)
                t0 = time.perf_counter()
                listed = raw_listing(store)
                raw_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ds = construct()
                ours_s.append(time.perf_counter() - t0)
                if listed != n or ds.num_files != n:
                    raise RuntimeError(f"listed {listed} / {ds.num_files} of {n} files")
                del ds
            out["listing"] = {"raw_s": min(raw_s), "dataset_s": min(ours_s),
                              "ratio": min(ours_s) / min(raw_s)}
            say(f"listing: raw {min(raw_s):.2f} s, dataset {min(ours_s):.2f} s")

            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            ds = construct()
            kept = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            table = getattr(ds, "file_table", None)  # (None: a library before it)
            table_bytes = getattr(table, "nbytes", None)
            out["memory"] = {
                "table_bytes_per_file": table_bytes / n if table_bytes is not None else None,
                "traced_bytes_per_file": kept / n,
                "shared_hot_bytes_per_file": 8,
            }
            loader = DataLoader(ds, batch_size=batch, num_workers=workers,
                                persistent_workers=True)
            mid = max(1, n // batch // 2)
            cold_s, mem = _epoch(loader, sample_at=mid, servers=servers)
            out["memory"]["processes_mid_cold_epoch"] = mem
            out["cache"] = _cache_on_disk(cache_dir, n, size)
            say(f"cold epoch {n / cold_s:.0f} files/s; cache {out['cache']}")
            warm_s, mem = _epoch(loader, sample_at=mid, servers=servers)
            out["memory"]["processes_mid_warm_epoch"] = mem
            state = len(bytes(repr(loader.state_dict()), "utf-8"))
            out["memory"]["loader_state_bytes"] = state
            say(f"warm epoch {n / warm_s:.0f} files/s")

            resume = loader.state_dict()
            g = loader.global_batch_size
            first: list[float] = []
            for position in (0, (n * 9 // 10) // g * g):
                fresh = DataLoader(ds, batch_size=batch, num_workers=workers)
                fresh.load_state_dict({**resume, "epoch": 2, "position": position})
                first.append(_first_batch_s(fresh))
                del fresh
            start_s, deep_s = first
            out["resume"] = {"first_batch_at_start_s": start_s, "first_batch_at_90pct_s": deep_s}
            say(f"resume: first batch {start_s:.2f} s at 0, {deep_s:.2f} s at 90%")
            del loader

            to_dir = tmp / "raw-to-files"
            to_dir.mkdir()
            secs, _ = raw_concurrent_gets(store, _keys(n), args.raw_threads, str(to_dir))
            shutil.rmtree(to_dir, ignore_errors=True)
            local_root = bucket if local is None else str(local)
            local_paths = [os.path.join(local_root, k) for k in _keys(n)]
            local_loader = TorchLoader(LocalFiles(local_paths), batch_size=batch,
                                       num_workers=workers, shuffle=True)
            local_s, _ = _epoch(local_loader)
            out["throughput_files_s"] = {
                "cold": n / cold_s,
                "warm": n / warm_s,
                "raw_gets_to_files": n / secs,
                "local_disk": n / local_s,
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["wall_s"] = time.perf_counter() - started
    return out


def report(out: dict[str, Any]) -> str:
    """The run as one table (markdown)."""
    t, m, c = out["throughput_files_s"], out["memory"], out["cache"]
    workers = m["processes_mid_warm_epoch"].get("workers") or [{}]
    rows = [
        ["files", out["config"]["files"]],
        ["raw listing s", out["listing"]["raw_s"]],
        ["dataset construction s", out["listing"]["dataset_s"]],
        ["construction / raw listing", out["listing"]["ratio"]],
        ["file table bytes / file", m["table_bytes_per_file"]],
        ["kept by construction (tracemalloc) bytes / file", m["traced_bytes_per_file"]],
        ["main RSS MiB (mid warm epoch)",
         m["processes_mid_warm_epoch"].get("main", {}).get("rss", 0) / 2**20],
        ["worker RSS MiB (max)", max(w.get("rss", 0) for w in workers) / 2**20],
        ["worker PSS MiB (max)", max(w.get("pss", 0) for w in workers) / 2**20],
        ["worker private (USS) MiB (max)", max(w.get("uss", 0) for w in workers) / 2**20],
        ["loader state bytes", m["loader_state_bytes"]],
        ["cache inodes / sample", c["inodes_per_sample"]],
        ["cache bytes on disk / sample", c["bytes_per_sample"]],
        ["cold epoch files/s", t["cold"]],
        ["warm epoch files/s", t["warm"]],
        ["raw GETs to files files/s", t["raw_gets_to_files"]],
        ["local disk files/s", t["local_disk"]],
        ["first batch at epoch start s", out["resume"]["first_batch_at_start_s"]],
        ["first batch resuming at 90% s", out["resume"]["first_batch_at_90pct_s"]],
        ["whole run s", out.get("wall_s", 0.0)],
    ]
    return format_table(["measure", "value"], rows)


def plot(out: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    t = out["throughput_files_s"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["cold", "warm", "raw_gets_to_files", "local_disk"]
    a.bar(names, [t[k] for k in names], color=["C0", "C0", "C7", "C7"])
    a.set_ylabel("files/s")
    a.set_title(f"{out['config']['files']} files on {out['config']['target']}: epochs")
    a.tick_params(axis="x", rotation=20)
    lst = out["listing"]
    b.bar(["raw listing", "dataset construction"], [lst["raw_s"], lst["dataset_s"]],
          color=["C7", "C0"])
    b.set_ylabel("seconds")
    b.set_title(f"construction = {lst['ratio']:.2f}x a raw listing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: Any, target: Target) -> int:
    out = run(args, target)
    stem = target.stem("data") + f"_scale_{args.files}"
    json_path = write_json(f"{stem}.json", out)
    png_path = results_path(f"{stem}.png")
    plot(out, png_path)
    print(f"## {target.name}, {args.files} files of {args.file_bytes} B\n")
    print(report(out))
    print(f"\nwrote {json_path} and {png_path}")
    return 0
