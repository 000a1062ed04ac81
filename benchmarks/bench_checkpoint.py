"""Checkpoint benchmark: VolumeWriter/VolumeReader against the stock DCP writers and the link.

A matrix of cells, each one run of real gloo ranks (``testkit/ranks.py``) against
the target's server: every link (``loopback``, ``remote``: a proxy adding 20 ms
per request and 200 Mbit/s per connection, ``tbf``: the kernel's token bucket
in a network namespace) x every state size per rank x every rank count. In a
cell, side by side in the same rank processes:

* the floors: ``memcpy`` into preallocated tensors (blocking time) and the
  raw parallel uploads / downloads of the same bytes with the store's own SDK
  (the faster of single PUTs and multipart);
* the peers: ``torch.save`` then upload, ``FileSystemWriter`` to local disk,
  ``FsspecWriter`` sync and async (thread_count 8, its best here),
  s3torchconnector (S3 where it works);
* ours: ``VolumeWriter`` sync and async, one writer reused across saves and a
  fresh writer per save;
* loads: raw GETs, ``FsspecReader``, s3torchconnector, ``VolumeReader``, all of
  the same state; then ``VolumeReader`` on a different world size.

Per save it records blocking and end-to-end time, peak extra RSS and CPU time
(the ranks' and the server's). After the matrix: a restore through
``CheckpointManager`` with and without the node-local tier, and the goodput
model (``_goodput.py``) for every writer. Tables, JSON and PNG plots go to
``benchmarks/results/`` (``_ckpt_report.py``).

Run it as ``python -m benchmarks checkpoint ...`` or ``dcp-volumes bench
checkpoint ...`` (``benchmarks/cli.py`` has the options).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from benchmarks._ckpt_ranks import (
    ASYNC_METHODS,
    ENCRYPTED,
    LOAD_METHODS,
    RAW_LOADS,
    RAW_SAVES,
    S3_ONLY,
    SAVE_METHODS,
    VW_METHODS,
    Job,
    rank_main,
    save_url,
)
from benchmarks._common import (
    REMOTE_BANDWIDTH_BPS,
    REMOTE_LATENCY_S,
    MiB,
    link_endpoint,
    load_average,
    machine_info,
)
from benchmarks._goodput import GoodputModel
from benchmarks._targets import Target, serve, server_pids, store_url

GiB = 1 << 30
BUCKET = "bench"

LABELS = {
    "memcpy": "memcpy into preallocated tensors",
    "local_fs": "FileSystemWriter -> local disk (t=8)",
    "raw_put": "raw parallel PUTs of chunk objects",
    "raw_multipart": "raw parallel multipart upload",
    "fsspec_t1": "dcp.save FsspecWriter t=1",
    "fsspec_t8": "dcp.save FsspecWriter t=8",
    "fsspec_async": "dcp.async_save FsspecWriter t=8",
    "s3tc": "dcp.save s3torchconnector t=8",
    "torch_save": "torch.save -> local file, then upload",
    "vw_sync": "dcp.save VolumeWriter (reused)",
    "vw_async": "dcp.async_save VolumeWriter (reused)",
    "vw_sync_fresh": "dcp.save VolumeWriter (fresh per save)",
    "vw_async_fresh": "dcp.async_save VolumeWriter (fresh per save)",
    "vw_async_f32": "dcp.async_save VolumeWriter file_size=32MiB (not default)",
    "vw_sync_enc": "dcp.save VolumeWriter, encryption= (reused)",
    "vw_async_enc": "dcp.async_save VolumeWriter, encryption= (reused)",
    "raw_get": "raw parallel GETs of the chunks",
    "raw_ranged": "raw parallel ranged GETs",
    "local_reader": "dcp.load FileSystemReader <- local disk (no network: DCP's own cost)",
    "fsspec_reader": "dcp.load FsspecReader",
    "s3tc_reader": "dcp.load s3torchconnector",
    "vw_reader": "dcp.load VolumeReader",
    "vw_reader_f32": "dcp.load VolumeReader, 32 MiB files (not default)",
    "vw_reader_enc": "dcp.load VolumeReader, encryption=",
    "vw_reader_reshard": "dcp.load VolumeReader, another world size",
}
AZURE_LABELS = {
    "raw_put": "raw parallel PUTs of chunk blobs",
    "raw_multipart": "raw parallel block upload (stage_block + commit)",
    "raw_get": "raw parallel GETs of the chunk blobs",
}
# Stock ways of saving to the store, against which "best peer" is taken.
PEERS = ("fsspec_t1", "fsspec_t8", "fsspec_async", "s3tc", "torch_save")
# Every method of the default matrix (fsspec_t1 and the 32 MiB files on request).
DEFAULT_METHODS = tuple(m for m in SAVE_METHODS
                        if m not in ("fsspec_t1", "vw_async_f32", *ENCRYPTED))

# The targets of issue 16, in one place.
BLOCKING_VS_MEMCPY = 2.0
FIRST_VS_STEADY = 1.2
E2E_VS_FLOOR = 1.15
SPEEDUP_VS_BEST_PEER = 1.2
LOAD_VS_FLOOR = 1.25
LOCAL_TIER_SPEEDUP = 3.0
PEAK_VS_STATE = 1.1


@dataclass(frozen=True)
class CheckpointConfig:
    """One run of the checkpoint benchmark (built by ``benchmarks.cli``)."""

    target: Target
    links: tuple[str, ...] = ("loopback", "remote")
    sizes_mib: tuple[int, ...] = (32, 128, 512)
    ranks: tuple[int, ...] = (1, 2, 4)
    repeats: int = 3
    load_repeats: int = 2
    shape: str = "mixed"
    tensor_mib: float = 8  # --shape uniform; 1/64 = 16 KiB tensors (a model of many small ones)
    methods: tuple[str, ...] = (*DEFAULT_METHODS, "load")
    vw_options: dict[str, Any] = field(default_factory=dict)
    reshard: bool = True
    local_tier: bool = True
    local_tier_repeats: int = 3
    goodput: GoodputModel = field(default_factory=GoodputModel)
    quick: bool = False
    command: str = ""

    def __post_init__(self) -> None:
        if self.repeats < 2:
            raise ValueError("repeats must be >= 2: the first save and a steady state")
        if not self.sizes_mib or min(self.sizes_mib) < 1:
            raise ValueError("sizes_mib must be >= 1 MiB each")
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError("ranks must be >= 1 each")
        unknown = set(self.methods) - set(SAVE_METHODS) - {"load"}
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; known: {SAVE_METHODS}")


def applicable_methods(target: Target, methods: tuple[str, ...]) -> tuple[str, ...]:
    """The methods that can run on the target (s3torchconnector S3 only, parts where they are)."""
    skip = set() if target.s3torchconnector else set(S3_ONLY)
    if not target.multipart:
        skip.add("raw_multipart")
    return tuple(m for m in methods if m not in skip)


# ---------------------------------------------------------------------------
# Running the matrix
# ---------------------------------------------------------------------------


def make_job(
    cfg: CheckpointConfig, server: Any, link: str, endpoint: str, size_mib: int, ranks: int
) -> Job:
    methods = applicable_methods(cfg.target, cfg.methods)
    source = "vw_sync" if "vw_sync" in methods else "vw_sync_fresh"
    root = store_url(cfg.target, server, BUCKET)
    bucket = root if cfg.target.scheme == "file" else (cfg.target.bucket or BUCKET)
    prefix = "/".join(p for p in (cfg.target.prefix, link, f"r{ranks}_{size_mib}m") if p)
    job = Job(
        link=link,
        scheme=cfg.target.scheme,
        methods=methods,
        size_bytes=size_mib * MiB,
        tensor_bytes=int(cfg.tensor_mib * MiB),
        repeats=cfg.repeats,
        bucket=bucket,
        prefix=prefix,
        endpoint=endpoint,
        direct_endpoint=server.endpoint,
        storage_options=server.storage_options(endpoint or None),
        direct_storage_options=server.storage_options(),
        isolated=False,
        vw_options=dict(cfg.vw_options),
        load_repeats=cfg.load_repeats,
        keep=(*RAW_SAVES, "torch_save", "vw_async_f32", *ENCRYPTED, source)
        if "load" in methods else (),
        shape=cfg.shape,
        multipart=cfg.target.multipart,
        server_pids=tuple(server_pids(server)),
        s3tc=cfg.target.s3torchconnector,
        volume_options=dict(cfg.target.volume_options),
    )
    return dataclasses.replace(job, load_source=save_url(job, source, cfg.repeats - 1))


def other_world(ranks: int) -> int:
    """The world size a cell's checkpoint is also loaded on (half, or 2 for one rank)."""
    return 2 if ranks == 1 else ranks // 2


def run_cell(cfg: CheckpointConfig, job: Job, ranks: int) -> dict[str, Any]:
    """One cell: the ranks save and load; then the load on another world size."""
    from testkit.ranks import run_ranks

    units = len(job.methods) * job.repeats + 4 * job.load_repeats
    timeout = 120 + units * (20 + job.size_bytes / MiB * 0.3)
    # fresh: each rank a new interpreter, as under torchrun (no fork server's pages).
    out = run_ranks(rank_main, ranks, (job,), timeout=timeout, fresh=True)
    merged = [r[0] for r in out]
    reshard: list[dict[str, Any]] | None = None
    if cfg.reshard and "load" in job.methods and job.load_source:
        other = other_world(ranks)
        rjob = dataclasses.replace(job, methods=("load_reshard",), saved_world_size=ranks)
        reshard = [r[0] for r in run_ranks(rank_main, other, (rjob,), timeout=timeout,
                                           fresh=True)]
    return summarise(merged, job, cfg.target, reshard)


def _purge_cell(job: Job) -> None:
    with contextlib.suppress(Exception):  # best effort: the next cell uses its own prefix
        job.raw(8, direct=True).delete_prefix(job.prefix)


@contextlib.contextmanager
def _collecting_garbage(server: Any, period_s: float = 10.0) -> Iterator[None]:
    """Run the server's garbage collector every ``period_s`` while a cell runs.

    radosgw frees deleted objects' data only when its collector runs (every
    ~30 s here), and its memstore OSD blocks every write once full: a cell
    deletes each save as the next starts, faster than that.
    """
    collect = getattr(server, "collect_garbage", None)
    if not callable(collect):
        yield
        return
    import threading

    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period_s):
            with contextlib.suppress(Exception):  # best effort; the next round retries
                collect()

    thread = threading.Thread(target=loop, name="rgw-gc", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


@contextlib.contextmanager
def _links(cfg: CheckpointConfig, server: Any) -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as stack:
        yield {
            link: stack.enter_context(link_endpoint(server, link)) for link in cfg.links
        }


def run(
    cfg: CheckpointConfig,
    progress: Callable[[str], None] | None = None,
    partial: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the matrix; returns the report (JSON-ready).

    ``partial(report)`` is called after every cell, so a run cut short (a
    timeout, Ctrl-C) still leaves the cells it finished.
    """
    from tqdm import tqdm

    say = progress or (lambda text: tqdm.write(text, file=sys.stderr))
    cells = [(lk, s, n) for lk in cfg.links for s in cfg.sizes_mib for n in cfg.ranks]
    report: dict[str, Any] = {
        "benchmark": "checkpoint",
        "command": cfg.command,
        "config": {
            "target": cfg.target.name,
            "server": cfg.target.server_label,
            "links": list(cfg.links),
            "sizes_mib_per_rank": list(cfg.sizes_mib),
            "ranks": list(cfg.ranks),
            "repeats": cfg.repeats,
            "load_repeats": cfg.load_repeats,
            "shape": cfg.shape,
            "methods": list(applicable_methods(cfg.target, cfg.methods)),
            "volume_writer_options": cfg.vw_options,
            "remote_link": {"latency_s": REMOTE_LATENCY_S, "bandwidth_bps": REMOTE_BANDWIDTH_BPS},
            "goodput_model": dataclasses.asdict(cfg.goodput),
            "quick": cfg.quick,
        },
        "machine": machine_info(),
        "cells": [],
        "local_tier": {},
    }
    t_start = time.perf_counter()
    biggest = max(cfg.sizes_mib) * MiB * max(cfg.ranks)
    # Kept saves (loads read them) plus saves deleted but not yet collected.
    with serve(cfg.target, BUCKET, memory_bytes=biggest * 8) as server, _links(
        cfg, server
    ) as endpoints:
        bar = tqdm(total=len(cells), desc="checkpoint cells", unit="cell", file=sys.stderr)
        with bar:
            for link, size, ranks in cells:
                bar.set_postfix_str(f"{link} {ranks} x {size} MiB")
                job = make_job(cfg, server, link, endpoints[link], size, ranks)
                t0 = time.perf_counter()
                try:
                    with _collecting_garbage(server):
                        cell = run_cell(cfg, job, ranks)
                finally:
                    _purge_cell(job)
                    collect = getattr(server, "collect_garbage", None)
                    if callable(collect):
                        with contextlib.suppress(Exception):
                            collect()  # radosgw frees deleted objects' RAM only then
                cell["wall_s"] = time.perf_counter() - t0
                report["cells"].append(cell)
                say(cell_line(cell))
                bar.update()
                if partial is not None:
                    partial(report)
        if cfg.local_tier:
            from benchmarks.bench_local_tier import restore_comparison

            size = min(max(cfg.sizes_mib), 256)
            for link in cfg.links:
                say(f"local tier: restore of {size} MiB over {link}")
                root = store_url(cfg.target, server, BUCKET, "local-tier", link)
                res = restore_comparison(
                    root,
                    server.storage_options(endpoints[link] or None),
                    size,
                    cfg.local_tier_repeats,
                )
                res["target"] = check_local_tier(res)
                report["local_tier"][link] = res
    if set(ENCRYPTED) & set(cfg.methods):
        report["encryption"] = encryption_report(report["cells"], cfg.quick)
        for line in encryption_lines(report["encryption"]):
            say(line)
    report["goodput"] = goodput_report(report["cells"], cfg.goodput)
    report["wall_s"] = time.perf_counter() - t_start
    report["machine"]["load_average_end"] = load_average()
    return report


# ---------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------


def _steady(values: list[float]) -> float:
    """The steady state: the median of the saves after the first."""
    return median(values[1:]) if len(values) > 1 else (values[0] if values else math.nan)


def _labels(target: Target) -> dict[str, str]:
    return {**LABELS, **(AZURE_LABELS if target.scheme == "az" else {})}


def _runs(per_rank: list[dict[str, Any]], key: str, total: int) -> dict[str, Any]:
    """Times of runs done by all ranks at once: the slowest rank's, plus CPU per GiB."""
    n = min(len(p[key]) for p in per_rank)
    e2e = [max(p[key][i]["e2e_s"] for p in per_rank) for i in range(n)]
    cpu = [sum(p[key][i].get("cpu_s", 0.0) for p in per_rank) for i in range(n)]
    server = [per_rank[0][key][i].get("server_cpu_s", 0.0) for i in range(n)]
    gib = total / GiB
    return {
        "e2e": e2e,
        "n": n,
        "client_cpu_s_per_gib": _steady(cpu) / gib if n else math.nan,
        "server_cpu_s_per_gib": _steady(server) / gib if n else math.nan,
    }


def summarise(
    ranks: list[dict[str, Any]],
    job: Job,
    target: Target,
    reshard: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    labels = _labels(target)
    state = max(int(r["state_bytes"]) for r in ranks)
    total = sum(int(r["state_bytes"]) for r in ranks)
    saves: dict[str, Any] = {}
    for method in SAVE_METHODS:
        per_rank = [r["methods"].get(method) for r in ranks]
        if any(p is None for p in per_rank):
            continue
        error = next((p["error"] for p in per_rank if p["error"]), None)
        runs = _runs(per_rank, "saves", total)
        n, e2e = runs["n"], runs["e2e"]
        blocking = [max(p["saves"][i]["blocking_s"] for p in per_rank) for i in range(n)]
        peaks = [p["saves"][i]["peak_extra"] for p in per_rank for i in range(n)]
        peak = max(peaks) if peaks else math.nan
        saves[method] = {
            "label": labels[method],
            "error": error,
            "blocking_s": blocking,
            "e2e_s": e2e,
            "first_blocking_s": blocking[0] if blocking else math.nan,
            "first_e2e_s": e2e[0] if e2e else math.nan,
            "steady_blocking_s": _steady(blocking),
            "steady_e2e_s": _steady(e2e),
            "steady_mib_s": total / MiB / _steady(e2e) if e2e else math.nan,
            "peak_extra_bytes": peak,
            "peak_extra_vs_state": peak / state,
            "client_cpu_s_per_gib": runs["client_cpu_s_per_gib"],
            "server_cpu_s_per_gib": runs["server_cpu_s_per_gib"],
        }
    loads: dict[str, Any] = {}
    load_parts = [r["methods"].get("load") for r in ranks]
    if all(p is not None for p in load_parts):
        for reader in (m for m in LOAD_METHODS if m in load_parts[0]):
            loads[reader] = _load_row(labels[reader], [p[reader] for p in load_parts], total)
    if reshard:
        parts = [r["methods"]["load_reshard"]["vw_reader"] for r in reshard]
        row = _load_row(labels["vw_reader_reshard"], parts, total)
        row["world_size"] = len(reshard)
        loads["vw_reader_reshard"] = row
    out = {
        "target": target.name,
        "scheme": target.scheme,
        "link": job.link,
        "state_bytes_per_rank": state,
        "size_mib": job.size_bytes // MiB,
        "world_size": len(ranks),
        "load_source": job.load_source,
        "saves": saves,
        "loads": loads,
    }
    out["targets"] = check_targets(out)
    return out


def _load_row(label: str, per_rank: list[dict[str, Any]], total: int) -> dict[str, Any]:
    error = next((p["error"] for p in per_rank if p["error"]), None)
    runs = _runs([{"runs": p["runs"]} for p in per_rank], "runs", total)
    n, secs = runs["n"], runs["e2e"]
    return {
        "label": label,
        "error": error,
        "seconds": secs,
        "first_s": secs[0] if secs else math.nan,
        "steady_s": _steady(secs),
        "steady_mib_s": total / MiB / _steady(secs) if secs else math.nan,
        "verified": n > 0 and all(p["runs"][i]["verified"] for p in per_rank for i in range(n)),
        "client_cpu_s_per_gib": runs["client_cpu_s_per_gib"],
        "server_cpu_s_per_gib": runs["server_cpu_s_per_gib"],
    }


def _ok(method: dict[str, Any] | None) -> bool:
    return bool(method) and not method["error"] and bool(method["e2e_s"])


def _check(value: float, limit: float, *, at_most: bool) -> dict[str, Any]:
    """One target: value, the limit, met, and by how much it misses (a share of the limit)."""
    bad = math.isnan(value)
    met = not bad and (value <= limit if at_most else value >= limit)
    miss = math.nan if bad or met else abs(value - limit) / limit
    return {
        "value": value,
        "target": f"{'<=' if at_most else '>='} {limit:g}",
        "met": met,
        "miss_by": miss,
    }


def _peer_check(best_peer: float, e2e: float, floor: float) -> dict[str, Any]:
    """x best peer; a miss notes when the peer itself runs so near the floor that
    beating it by the target would take a save faster than the raw upload."""
    check = _check(best_peer / e2e, SPEEDUP_VS_BEST_PEER, at_most=False)
    reach = best_peer / floor
    if not check["met"] and reach < SPEEDUP_VS_BEST_PEER:
        check["note"] = (
            f"peer at {reach:.2f}x floor: {SPEEDUP_VS_BEST_PEER:g}x faster = "
            f"{reach / SPEEDUP_VS_BEST_PEER:.2f}x floor"
        )
    return check


def check_targets(res: dict[str, Any]) -> dict[str, Any]:
    saves, loads = res["saves"], res["loads"]
    raws = [saves[m]["steady_e2e_s"] for m in RAW_SAVES if _ok(saves.get(m))]
    floor = min(raws) if raws else math.nan
    memcpy = saves["memcpy"]["steady_e2e_s"] if _ok(saves.get("memcpy")) else math.nan
    peers = PEERS + (("local_fs",) if res["scheme"] == "file" else ())
    ok_peers = [p for p in peers if _ok(saves.get(p))]
    best_peer_name = min(ok_peers, key=lambda p: saves[p]["steady_e2e_s"], default=None)
    best_peer = saves[best_peer_name]["steady_e2e_s"] if best_peer_name else math.nan
    targets: dict[str, Any] = {
        "floor_s": floor,
        "memcpy_s": memcpy,
        "best_peer": best_peer_name,
        "best_peer_s": best_peer,
        "checks": {},
    }
    for s in saves.values():
        s["x_floor"] = s["steady_e2e_s"] / floor if _ok(s) else math.nan
    for m in VW_METHODS:
        s = saves.get(m)
        if s is None:
            continue
        ok = _ok(s)
        e2e = s["steady_e2e_s"] if ok else math.nan
        checks: dict[str, Any] = {
            "e2e_vs_floor": _check(e2e / floor, E2E_VS_FLOOR, at_most=True),
            "speedup_vs_best_peer": _peer_check(best_peer, e2e, floor),
            "first_vs_steady": _check(
                s["first_e2e_s"] / e2e if ok else math.nan, FIRST_VS_STEADY, at_most=True
            ),
            "peak_extra_vs_state": _check(
                s["peak_extra_vs_state"] if ok else math.nan, PEAK_VS_STATE, at_most=True
            ),
        }
        if m in ASYNC_METHODS:
            blk = s["steady_blocking_s"] if ok else math.nan
            checks["blocking_vs_memcpy"] = _check(blk / memcpy, BLOCKING_VS_MEMCPY, at_most=True)
        targets["checks"][m] = checks
    raw_loads = [
        loads[m]["steady_s"] for m in RAW_LOADS if m in loads and not loads[m]["error"]
        and loads[m]["seconds"]
    ]
    raw_s = min(raw_loads) if raw_loads else math.nan
    targets["raw_download_s"] = raw_s
    for s in loads.values():
        s["x_floor"] = s["steady_s"] / raw_s if s["seconds"] and not s["error"] else math.nan
    for name in ("vw_reader", "vw_reader_f32"):
        vr = loads.get(name)
        if vr is None:
            continue
        ok = not vr["error"] and bool(vr["seconds"]) and vr["verified"]
        targets["checks"][name] = {
            "load_vs_floor": _check(vr["x_floor"] if ok else math.nan, LOAD_VS_FLOOR, at_most=True)
        }
    return targets


def check_local_tier(res: dict[str, Any]) -> dict[str, Any]:
    return _check(res["speedup_vs_remote"]["local tier"], LOCAL_TIER_SPEEDUP, at_most=False)


def goodput_report(cells: list[dict[str, Any]], model: GoodputModel) -> dict[str, Any]:
    """Best interval and goodput per writer of every cell, from its steady save times."""
    out: dict[str, Any] = {
        "mtbf_s": model.mtbf_s,
        "failures_per_day": model.failures_per_day,
        "restart_s": model.restart_s,
        "cells": [],
    }
    for cell in cells:
        writers = {}
        # Floors are no writers; FileSystemWriter to local disk is one only on a directory.
        floors = ("memcpy", *RAW_SAVES, *(("local_fs",) if cell["scheme"] != "file" else ()))
        for m, s in cell["saves"].items():
            if m in floors or not _ok(s):
                continue
            best = model.best(s["steady_blocking_s"], s["steady_e2e_s"])
            writers[m] = {"blocking_s": s["steady_blocking_s"], "e2e_s": s["steady_e2e_s"], **best}
        out["cells"].append(
            {
                "link": cell["link"],
                "size_mib": cell["size_mib"],
                "world_size": cell["world_size"],
                "writers": writers,
            }
        )
    return out


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> float:
    if not (a and b and not a.get("error") and not b.get("error")):
        return math.nan
    return float(a[key]) / float(b[key]) if b[key] else math.nan


def encryption_report(cells: list[dict[str, Any]], quick: bool) -> dict[str, Any]:
    """Encrypted / unencrypted per cell (the same writer, reused), and the cipher's own
    throughput on one core (``Encryption``'s frames, no store, no DCP)."""
    rows = []
    for cell in cells:
        saves, loads = cell["saves"], cell["loads"]
        rows.append({
            "link": cell["link"], "world_size": cell["world_size"],
            "size_mib": cell["size_mib"],
            "sync_e2e_ratio": _ratio(saves.get("vw_sync_enc"), saves.get("vw_sync"),
                                     "steady_e2e_s"),
            "async_e2e_ratio": _ratio(saves.get("vw_async_enc"), saves.get("vw_async"),
                                      "steady_e2e_s"),
            "async_blocking_ratio": _ratio(saves.get("vw_async_enc"), saves.get("vw_async"),
                                           "steady_blocking_s"),
            "load_ratio": _ratio(loads.get("vw_reader_enc"), loads.get("vw_reader"), "steady_s"),
            "load_verified": bool(loads.get("vw_reader_enc", {}).get("verified")),
        })
    return {"cells": rows, "cipher_one_core": cipher_throughput(64 if quick else 256)}


def cipher_throughput(mib: int) -> dict[str, float]:
    """MiB/s (CPU time) of encrypting ``mib`` MiB through the extension, one thread, and
    of decrypting them as a load does: a tensor's item straight into its (preallocated)
    target, and an item whole into a new buffer (stock readers, objects)."""
    import io

    import numpy as np
    import torch

    from benchmarks._ckpt_ranks import bench_encryption
    from dcp_volumes._streams import MemoryReader
    from dcp_volumes.checkpoint._encryption_stream import EncryptedStreams, registry_for

    class Sink(io.RawIOBase):  # takes the ciphertext and keeps none of it
        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            return len(memoryview(b))

    data = bytes(mib * MiB)
    ext = EncryptedStreams(bench_encryption())
    t0 = time.process_time()
    with ext.transform_to(Sink()) as w:  # type: ignore[arg-type]
        w.write(data)
    enc_s = time.process_time() - t0
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = io.BytesIO()
    with ext.transform_to(out) as w:
        w.expect_tensor(tensor)  # type: ignore[attr-defined]
        torch.save(tensor, w)
    descriptor = w.descriptor  # type: ignore[attr-defined]
    stored = memoryview(out.getvalue())
    reader = registry_for(bench_encryption()).from_descriptor_list([descriptor])[0]
    target = np.empty(len(data), dtype=np.uint8)
    target[:] = 1  # a target's pages exist already
    t0 = time.process_time()
    assert reader.decode_tensor_into(MemoryReader(stored), memoryview(target))
    into_s = time.process_time() - t0
    t0 = time.process_time()
    reader.transform_from(MemoryReader(stored))  # decrypted into a new buffer
    dec_s = time.process_time() - t0
    return {"mib": mib, "encrypt_mib_s": mib / enc_s, "decrypt_mib_s": mib / dec_s,
            "decrypt_into_mib_s": mib / into_s}


def encryption_lines(rep: dict[str, Any]) -> list[str]:
    """The encrypted / unencrypted ratios, one line per cell, and the cipher's speed."""
    lines = []
    for r in rep["cells"]:
        lines.append(
            f"encrypted/plain {r['link']:>8} {r['world_size']} x {r['size_mib']:>4} MiB: "
            f"save e2e sync {r['sync_e2e_ratio']:.2f}x, async {r['async_e2e_ratio']:.2f}x; "
            f"blocking {r['async_blocking_ratio']:.2f}x; load {r['load_ratio']:.2f}x"
            f"{'' if r['load_verified'] else ' (load NOT verified)'}")
    c = rep["cipher_one_core"]
    lines.append(f"AES-256-GCM frames, one core (CPU time): encrypt {c['encrypt_mib_s']:.0f} "
                 f"MiB/s, decrypt into the target {c['decrypt_into_mib_s']:.0f} MiB/s, "
                 f"into a new buffer {c['decrypt_mib_s']:.0f} MiB/s ({c['mib']} MiB)")
    return lines


def cell_line(cell: dict[str, Any]) -> str:
    """One progress line per finished cell: the verdicts of our writers."""
    checks = cell["targets"]["checks"]
    met = sum(c["met"] for per in checks.values() for c in per.values())
    total = sum(len(per) for per in checks.values())
    parts = []
    for m in ("vw_async_fresh", "vw_sync_fresh"):
        s = cell["saves"].get(m)
        if s and _ok(s):
            parts.append(f"{m} {s['x_floor']:.2f}x floor")
    return (
        f"{cell['link']:>8} {cell['world_size']} x {cell['size_mib']:>4} MiB: "
        f"{met}/{total} targets met; " + ", ".join(parts) + f" ({cell.get('wall_s', 0):.0f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench_checkpoint ...`` = ``python -m benchmarks checkpoint ...``."""
    from benchmarks.cli import main as cli_main

    return cli_main(["checkpoint", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
