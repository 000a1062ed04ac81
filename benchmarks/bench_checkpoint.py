"""Checkpoint benchmark: VolumeWriter/VolumeReader against the stock DCP writers and the link.

Two gloo ranks, each with its own ``--size-mib`` of state, save to an
object-store emulator (a separate process) side by side in one run:
``--target moto`` (S3, the default) or ``--target azurite`` (Azure Blob).

* the floors: ``memcpy`` into preallocated tensors (for blocking time) and the
  raw parallel uploads of the same bytes with the store's own SDK (boto3 /
  azure-storage-blob; for end-to-end time);
* the peers: ``dcp.save`` with ``FsspecWriter`` (s3fs / adlfs; thread_count 1
  and 8), ``dcp.async_save`` with ``FsspecWriter``, s3torchconnector's
  ``S3StorageWriter`` (S3 only), and ``FileSystemWriter`` to local disk for
  reference;
* ours: ``dcp.save`` and ``dcp.async_save`` with ``VolumeWriter``;
* loads: raw parallel downloads, ``FsspecReader``, ``S3StorageReader`` (S3
  only) and ``VolumeReader``, all reading the same checkpoint.

Each configuration saves ``--repeats`` times; the first save and the steady
state (median of the 2nd and later saves) are reported. Both links run by
default: ``loopback`` (straight to the server) and ``remote`` (a proxy in front
of it adding 20 ms before each request and capping each connection at 200
Mbit/s, as a real object store a network away limits each stream).

Usage::

    python benchmarks/bench_checkpoint.py            # full run, both links
    python benchmarks/bench_checkpoint.py --quick    # smoke test (< 60 s)
    python benchmarks/bench_checkpoint.py --link remote --size-mib 64
    python benchmarks/bench_checkpoint.py --target azurite [--quick]

Writes benchmarks/results/checkpoint.json and checkpoint.png (``--quick``:
checkpoint_quick.*; ``--target azurite``: checkpoint_azurite[_quick].*).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from statistics import median
from typing import Any

from _ckpt_ranks import (
    ASYNC_METHODS,
    LOAD_METHODS,
    RAW_LOADS,
    RAW_SAVES,
    S3_ONLY,
    SAVE_METHODS,
    Job,
    rank_main,
    save_url,
)
from _common import (
    REMOTE_BANDWIDTH_BPS,
    REMOTE_LATENCY_S,
    MiB,
    format_table,
    link_endpoint,
    load_average,
    machine_info,
    pyplot,
    results_path,
    write_json,
)
from _targets import TARGETS, Target, add_target_argument, serve

LABELS = {
    "memcpy": "memcpy into preallocated tensors",
    "local_fs": "FileSystemWriter -> local disk (t=8)",
    "raw_put": "raw parallel PUTs of chunk objects",
    "raw_multipart": "raw parallel multipart upload",
    "fsspec_t1": "dcp.save FsspecWriter t=1",
    "fsspec_t8": "dcp.save FsspecWriter t=8",
    "fsspec_async": "dcp.async_save FsspecWriter t=8",
    "s3tc": "dcp.save s3torchconnector t=8",
    "vw_sync": "dcp.save VolumeWriter",
    "vw_async": "dcp.async_save VolumeWriter",
    "vw_async_f32": "dcp.async_save VolumeWriter file_size=32MiB (not default)",
    "raw_get": "raw parallel GETs of the chunks",
    "raw_ranged": "raw parallel ranged GETs",
    "local_reader": "dcp.load FileSystemReader <- local disk (no network: DCP's own cost)",
    "fsspec_reader": "dcp.load FsspecReader",
    "s3tc_reader": "dcp.load s3torchconnector",
    "vw_reader": "dcp.load VolumeReader",
    "vw_reader_f32": "dcp.load VolumeReader, 32 MiB files (not default)",
}
# Where the store's own words differ from S3's.
AZURE_LABELS = {
    "raw_put": "raw parallel PUTs of chunk blobs",
    "raw_multipart": "raw parallel block upload (stage_block + commit)",
    "raw_get": "raw parallel GETs of the chunk blobs",
}
PEERS = ("fsspec_t1", "fsspec_t8", "fsspec_async", "s3tc")

# The targets of the issue, in one place.
BLOCKING_VS_MEMCPY = 2.0
E2E_VS_FLOOR = 1.15
SPEEDUP_VS_BEST_PEER = 1.2
LOAD_VS_RAW = 0.8
PEAK_VS_STATE = 1.25

WORLD_SIZE = 2
BUCKET = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke run: 16 MiB per rank, 1 save, one pair of processes",
    )
    add_target_argument(p)
    p.add_argument(
        "--link",
        choices=("both", "loopback", "remote"),
        default="both",
        help="which link(s) to run (default: both, two tables)",
    )
    p.add_argument("--size-mib", type=int, default=None, help="state per rank (default 256)")
    p.add_argument("--tensor-mib", type=int, default=None, help="size of each tensor (default 8)")
    p.add_argument("--repeats", type=int, default=None, help="saves per method (default 5)")
    p.add_argument("--load-repeats", type=int, default=None, help="loads per reader (default 2)")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset of: "
        + ", ".join((*SAVE_METHODS, "load"))
        + " (default: all that apply to the target; s3tc is S3 only)",
    )
    p.add_argument(
        "--vw-file-size",
        default=None,
        help="VolumeWriter file_size (e.g. 32MiB); default: the library's default",
    )
    p.add_argument(
        "--shared-processes",
        action="store_true",
        help="run all methods in one pair of rank processes (default for --quick); "
        "otherwise every method gets fresh processes, so memory peaks are exact",
    )
    args = p.parse_args(argv)
    args.size_mib = args.size_mib or (16 if args.quick else 256)
    args.tensor_mib = args.tensor_mib or (2 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.load_repeats = args.load_repeats or (1 if args.quick else 2)
    args.shared_processes = args.shared_processes or args.quick
    args.target = TARGETS[args.target]
    if args.methods is None:
        applies = args.target.s3torchconnector
        methods = tuple(m for m in (*SAVE_METHODS, "load") if applies or m not in S3_ONLY)
    else:
        methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = set(methods) - set(SAVE_METHODS) - {"load"}
    if unknown:
        p.error(f"unknown methods: {sorted(unknown)}")
    if not args.target.s3torchconnector and S3_ONLY & set(methods):
        p.error(f"s3torchconnector speaks S3 only: drop {sorted(S3_ONLY & set(methods))}")
    args.methods = methods
    if args.size_mib < 1 or args.tensor_mib < 1 or args.repeats < 1:
        p.error("--size-mib, --tensor-mib and --repeats must be >= 1")
    return args


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


def make_job(args: argparse.Namespace, server: Any, link: str, endpoint: str) -> Job:
    source_method = "vw_sync" if "vw_sync" in args.methods else "fsspec_t8"
    job = Job(
        link=link,
        scheme=args.target.scheme,
        methods=args.methods,
        size_bytes=args.size_mib * MiB,
        tensor_bytes=args.tensor_mib * MiB,
        repeats=args.repeats,
        bucket=BUCKET,
        prefix=link,
        endpoint=endpoint,
        direct_endpoint=server.endpoint,
        storage_options=server.storage_options(endpoint),
        direct_storage_options=server.storage_options(),
        isolated=not args.shared_processes,
        vw_options={"file_size": args.vw_file_size} if args.vw_file_size else {},
        load_repeats=args.load_repeats,
        keep=(*RAW_SAVES, "vw_async_f32", source_method) if "load" in args.methods else (),
    )
    return dataclasses.replace(job, load_source=save_url(job, source_method, args.repeats - 1))


def run_links(args: argparse.Namespace, server: Any, links: tuple[str, ...]) -> dict[str, Any]:
    """Run every method on every link; returns the summary of each link."""
    from tests.dist import run_ranks

    per_save_s = 60 + args.size_mib * 0.5
    with contextlib.ExitStack() as stack:
        jobs = [
            make_job(args, server, link, stack.enter_context(link_endpoint(server, link)))
            for link in links
        ]
        # Isolated: fresh rank processes per (link, method), so ru_maxrss and
        # first-save figures belong to that method alone. Shared: one pair of
        # processes runs everything (fast; what --quick does).
        if args.shared_processes:
            batches = [tuple(jobs)]
        else:
            batches = [(dataclasses.replace(j, methods=(m,)),) for j in jobs for m in j.methods]
        merged = {j.link: [{"methods": {}} for _ in range(WORLD_SIZE)] for j in jobs}
        for batch in batches:
            t0 = time.perf_counter()
            units = sum(len(j.methods) + 3 * ("load" in j.methods) for j in batch)
            out = run_ranks(
                rank_main, WORLD_SIZE, batch, timeout=120 + per_save_s * args.repeats * units
            )
            for rank, per_job in enumerate(out):
                for job, res in zip(batch, per_job, strict=True):
                    merged[job.link][rank]["state_bytes"] = res["state_bytes"]
                    merged[job.link][rank]["methods"].update(res["methods"])
            names = ", ".join(f"{j.link}: {'+'.join(j.methods)}" for j in batch)
            print(
                f"[{names}] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True
            )
    return {
        j.link: summarise(
            merged[j.link], j.link, j.load_source or "", j.keep[-1] if j.keep else "", args.target
        )
        for j in jobs
    }


# ---------------------------------------------------------------------------
# Summaries, targets, tables
# ---------------------------------------------------------------------------


def _steady(values: list[float]) -> float:
    """The steady state: the median of the saves after the first (one save on this
    shared 2-core VM can be 0.3 s off its neighbours)."""
    return median(values[1:]) if len(values) > 1 else (values[0] if values else math.nan)


def summarise(
    ranks: list[dict[str, Any]], link: str, load_source: str, source_method: str, target: Target
) -> dict[str, Any]:
    labels = {**LABELS, **(AZURE_LABELS if target.scheme == "az" else {})}
    state = int(ranks[0]["state_bytes"])
    total = state * len(ranks)
    saves: dict[str, Any] = {}
    for method in SAVE_METHODS:
        per_rank = [r["methods"].get(method) for r in ranks]
        if any(p is None for p in per_rank):
            continue
        error = next((p["error"] for p in per_rank if p["error"]), None)
        n = min(len(p["saves"]) for p in per_rank)
        blocking = [max(p["saves"][i]["blocking_s"] for p in per_rank) for i in range(n)]
        e2e = [max(p["saves"][i]["e2e_s"] for p in per_rank) for i in range(n)]
        peaks = [p["saves"][i]["peak_extra"] for p in per_rank for i in range(n)]
        peaks += [p["lifetime_peak_extra"] for p in per_rank if p["lifetime_peak_extra"]]
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
        }
    loads: dict[str, Any] = {}
    load_parts = [r["methods"].get("load") for r in ranks]
    if all(p is not None for p in load_parts):
        for reader in (m for m in LOAD_METHODS if m in load_parts[0]):
            per_rank = [p[reader] for p in load_parts]
            error = next((p["error"] for p in per_rank if p["error"]), None)
            n = min(len(p["runs"]) for p in per_rank)
            secs = [max(p["runs"][i]["e2e_s"] for p in per_rank) for i in range(n)]
            loads[reader] = {
                "label": labels[reader],
                "error": error,
                "seconds": secs,
                "first_s": secs[0] if secs else math.nan,
                "steady_s": _steady(secs),
                "steady_mib_s": total / MiB / _steady(secs) if secs else math.nan,
                "verified": all(p["runs"][i]["verified"] for p in per_rank for i in range(n))
                and n > 0,
            }
    out = {
        "target": target.name,
        "link": link,
        "state_bytes_per_rank": state,
        "world_size": len(ranks),
        "load_source": load_source,
        "load_source_method": source_method,
        "saves": saves,
        "loads": loads,
    }
    out["targets"] = check_targets(out)
    return out


def _ok(method: dict[str, Any] | None) -> bool:
    return bool(method) and not method["error"] and bool(method["e2e_s"])


def check_targets(res: dict[str, Any]) -> dict[str, Any]:
    saves, loads = res["saves"], res["loads"]
    # The link floor: the faster way of moving the same raw bytes on this server.
    raws = [saves[m]["steady_e2e_s"] for m in RAW_SAVES if _ok(saves.get(m))]
    floor = min(raws) if raws else math.nan
    memcpy = saves["memcpy"]["steady_e2e_s"] if _ok(saves.get("memcpy")) else math.nan
    peers = [saves[p]["steady_e2e_s"] for p in PEERS if _ok(saves.get(p))]
    best_peer = min(peers) if peers else math.nan
    best_peer_name = next(
        (p for p in PEERS if _ok(saves.get(p)) and saves[p]["steady_e2e_s"] == best_peer), None
    )
    targets: dict[str, Any] = {
        "floor_s": floor,
        "memcpy_s": memcpy,
        "best_peer": best_peer_name,
        "best_peer_s": best_peer,
        "checks": {},
    }
    for s in saves.values():
        s["x_floor"] = s["steady_e2e_s"] / floor if _ok(s) else math.nan
    for m in ("vw_sync", "vw_async", "vw_async_f32"):
        s = saves.get(m)
        if s is None:
            continue
        checks: dict[str, Any] = {}
        ok = _ok(s)
        e2e = s["steady_e2e_s"] if ok else math.nan
        checks["e2e_vs_floor"] = {
            "value": e2e / floor,
            "target": f"<= {E2E_VS_FLOOR}",
            "met": ok and e2e <= E2E_VS_FLOOR * floor,
        }
        checks["speedup_vs_best_peer"] = {
            "value": best_peer / e2e,
            "target": f">= {SPEEDUP_VS_BEST_PEER}",
            "met": ok and best_peer >= SPEEDUP_VS_BEST_PEER * e2e,
        }
        if m in ASYNC_METHODS:
            blk = s["steady_blocking_s"] if ok else math.nan
            checks["blocking_vs_memcpy"] = {
                "value": blk / memcpy,
                "target": f"<= {BLOCKING_VS_MEMCPY}",
                "met": ok and blk <= BLOCKING_VS_MEMCPY * memcpy,
            }
            checks["peak_extra_vs_state"] = {
                "value": s["peak_extra_vs_state"],
                "target": f"<= {PEAK_VS_STATE}",
                "met": ok and s["peak_extra_vs_state"] <= PEAK_VS_STATE,
            }
        targets["checks"][m] = checks
    raw_loads = [
        loads[m]["steady_s"]
        for m in RAW_LOADS
        if m in loads and not loads[m]["error"] and loads[m]["seconds"]
    ]
    raw_s = min(raw_loads) if raw_loads else math.nan
    targets["raw_download_s"] = raw_s
    for s in loads.values():
        s["x_raw"] = raw_s / s["steady_s"] if s["seconds"] and not s["error"] else math.nan
    for name in ("vw_reader", "vw_reader_f32"):
        vr = loads.get(name)
        if vr is None:
            continue
        ok = not vr["error"] and bool(vr["seconds"]) and vr["verified"]
        targets["checks"][name] = {
            "load_vs_raw": {
                "value": vr["x_raw"],
                "target": f">= {LOAD_VS_RAW}",
                "met": ok and vr["x_raw"] >= LOAD_VS_RAW,
            }
        }
    return targets


def _verdict(checks: dict[str, Any] | None) -> str:
    if not checks:
        return ""
    failed = [name for name, c in checks.items() if not c["met"]]
    return "yes" if not failed else "no: " + ", ".join(failed)


def save_table(res: dict[str, Any]) -> str:
    headers = [
        "method",
        "blocking s",
        "end-to-end s",
        "MiB/s",
        "x floor",
        "peak extra RSS / state",
        "1st save blocking s",
        "1st save e2e s",
        "target met",
    ]
    rows = []
    for m, s in res["saves"].items():
        if s["error"] and not s["e2e_s"]:
            rows.append([s["label"], *["-"] * 7, f"FAILED: {s['error'][:60]}"])
            continue
        verdict = _verdict(res["targets"]["checks"].get(m))
        if s["error"]:
            verdict = f"FAILED: {s['error'][:60]}"
        rows.append(
            [
                s["label"],
                s["steady_blocking_s"],
                s["steady_e2e_s"],
                s["steady_mib_s"],
                s["x_floor"],
                s["peak_extra_vs_state"],
                s["first_blocking_s"],
                s["first_e2e_s"],
                verdict,
            ]
        )
    return format_table(headers, rows)


def load_table(res: dict[str, Any]) -> str:
    headers = ["reader", "load s", "MiB/s", "x raw floor", "1st load s", "verified", "target met"]
    rows = []
    for r, s in res["loads"].items():
        if s["error"] and not s["seconds"]:
            rows.append([s["label"], "-", "-", "-", "-", "-", f"FAILED: {s['error'][:60]}"])
            continue
        verdict = _verdict(res["targets"]["checks"].get(r))
        rows.append(
            [
                s["label"],
                s["steady_s"],
                s["steady_mib_s"],
                s["x_raw"],
                s["first_s"],
                s["verified"],
                verdict,
            ]
        )
    return format_table(headers, rows)


def plot(report: dict[str, Any], path: Any) -> None:
    plt = pyplot()
    links = list(report["links"])
    fig, axes = plt.subplots(
        len(links),
        2,
        figsize=(15, 4.8 * len(links)),
        squeeze=False,
        gridspec_kw={"width_ratios": [3, 2]},
    )
    for row, link in enumerate(links):
        res = report["links"][link]
        ax = axes[row][0]
        names = [m for m, s in res["saves"].items() if s["e2e_s"]]
        labels = [res["saves"][m]["label"] for m in names]
        e2e = [res["saves"][m]["steady_e2e_s"] for m in names]
        blk = [res["saves"][m]["steady_blocking_s"] for m in names]
        colors = [
            "tab:green"
            if m.startswith("vw_")
            else "tab:gray"
            if m in ("memcpy", "local_fs", *RAW_SAVES)
            else "tab:blue"
            for m in names
        ]
        y = range(len(names))
        ax.barh(y, e2e, color=colors, alpha=0.45, label="end-to-end")
        ax.barh(y, blk, color=colors, alpha=1.0, label="blocking (training waits)")
        floor = res["targets"]["floor_s"]
        if not math.isnan(floor):
            ax.axvline(floor, color="k", linestyle="--", linewidth=1, label="link floor")
        ax.set_yticks(list(y), labels)
        ax.invert_yaxis()
        ax.set_xlabel("seconds (steady state, lower is better)")
        mib = res["state_bytes_per_rank"] / MiB
        ax.set_title(
            f"save to {res['target']}, {link} link: {res['world_size']} ranks x {mib:.0f} MiB"
        )
        ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
        ax = axes[row][1]
        rnames = [r for r, s in res["loads"].items() if s["seconds"]]
        ax.barh(
            range(len(rnames)),
            [res["loads"][r]["steady_s"] for r in rnames],
            color=[
                "tab:green" if r.startswith("vw_") else "tab:gray" if r in RAW_LOADS else "tab:blue"
                for r in rnames
            ],
        )
        ax.set_yticks(range(len(rnames)), [res["loads"][r]["label"] for r in rnames])
        ax.invert_yaxis()
        ax.set_xlabel("seconds (lower is better)")
        ax.set_title(f"load from {res['target']}, {link} link")
    fig.suptitle(f"{report['config']['target']}: {report['command']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target: Target = args.target
    links = ("loopback", "remote") if args.link == "both" else (args.link,)
    command = "python benchmarks/bench_checkpoint.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    report: dict[str, Any] = {
        "benchmark": "checkpoint",
        "command": command.strip(),
        "config": {
            "target": target.name,
            "world_size": WORLD_SIZE,
            "size_mib_per_rank": args.size_mib,
            "tensor_mib": args.tensor_mib,
            "repeats": args.repeats,
            "load_repeats": args.load_repeats,
            "methods": list(args.methods),
            "isolated_processes_per_method": not args.shared_processes,
            "volume_writer_options": {"file_size": args.vw_file_size} if args.vw_file_size else {},
            "remote_link": {"latency_s": REMOTE_LATENCY_S, "bandwidth_bps": REMOTE_BANDWIDTH_BPS},
            "server": target.server_label,
        },
        "machine": machine_info(),
        "links": {},
    }
    t_start = time.perf_counter()
    with serve(target, BUCKET) as server:
        report["links"] = run_links(args, server, links)
    report["wall_s"] = time.perf_counter() - t_start
    report["machine"]["load_average_end"] = load_average()
    stem = target.stem("checkpoint") + ("_quick" if args.quick else "")
    if args.vw_file_size:
        stem += f"_file_size_{args.vw_file_size.lower()}"
    json_path = write_json(f"{stem}.json", report)
    png_path = results_path(f"{stem}.png")
    plot(report, png_path)

    for link, res in report["links"].items():
        mib = res["state_bytes_per_rank"] / MiB
        extra = (
            f" (+{REMOTE_LATENCY_S * 1000:.0f} ms/request, "
            f"{REMOTE_BANDWIDTH_BPS / 1e6:.0f} Mbit/s per connection)"
            if link == "remote"
            else ""
        )
        print(
            f"\n## {target.name} ({target.scheme}://), {link} link{extra}: "
            f"{res['world_size']} ranks x {mib:.0f} MiB, "
            f"steady state of {args.repeats} saves\n"
        )
        print(save_table(res))
        t = res["targets"]
        print(
            f"\nlink floor (best raw upload) {t['floor_s']:.2f} s; memcpy {t['memcpy_s']:.3f} s; "
            f"best peer {t['best_peer']} {t['best_peer_s']:.2f} s; "
            f"best raw download {t['raw_download_s']:.2f} s\n"
        )
        print(load_table(res))
    la0, la1 = report["machine"]["load_average_start"], report["machine"]["load_average_end"]
    print(
        f"\nload average start {la0[0]:.2f}, end {la1[0]:.2f}; wall {report['wall_s']:.0f} s"
        f"\nwrote {json_path} and {png_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
