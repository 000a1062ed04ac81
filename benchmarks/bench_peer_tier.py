"""Peer tier benchmark: the restore after a node loss, from a peer node vs the volume.

Two "nodes" on this machine (two torchrun agents, ``--ranks`` ranks each, each
with its own local-tier directory and its own proxy in front of moto: 20 ms a
request, 200 Mbit/s a connection and ``--node-mbit`` (800) Mbit/s for the node
as a whole, so parallel streams cannot beat a node's link). A job saves
``--size-mib`` MiB a rank with ``keep_local=True, local_replicas=1``; then fresh
jobs restore it, timed inside the ranks (the slowest rank: every rank waits for
it; with the CPU seconds of all ranks together, and the largest rank's growth of
its peak RSS over the restore), side by side:

* ``volume``: no local tier, every byte over the link;
* ``node lost, no replicas``: node 1's directory is gone and node 0 has no
  replicas (``keep_local=True`` alone: today's setup before ``local_replicas``);
* ``node lost, peer tier``: node 1's directory is gone; node 0 holds its own
  files and node 1's replica and sends node 1 its files over gloo;
* ``same-node local``: both directories intact (a restart on the same nodes).

Every restore is checked bit for bit. The save's cost is reported too: how
long ``save`` blocked, the commit, the end of the replication, and how much a
save grows a rank's peak RSS with replicas and without.

::

    python -m benchmarks.bench_peer_tier                     # 128 MiB a rank, 1 rank a node
    python -m benchmarks.bench_peer_tier --quick             # 32 MiB, 1 repeat
    python -m benchmarks.bench_peer_tier --size-mib 512 --ranks 2 --repeats 3
    python -m benchmarks.bench_peer_tier --target radosgw    # Ceph's S3 gateway

Writes benchmarks/results/peer_tier[_radosgw][_quick][_x<ranks>][_<MiB>].{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks._common import (
    REMOTE_BANDWIDTH_BPS,
    REMOTE_LATENCY_S,
    REPO_ROOT,
    ProxyProcess,
    format_table,
    load_average,
    machine_info,
    pyplot,
    results_path,
    write_json,
)
from benchmarks._targets import resolve, serve, store_url

_RANK = "benchmarks._peer_rank"
_BUCKET = "bench-peer-tier"
ROWS = ("volume", "node lost, no replicas", "node lost, peer tier", "same-node local")


def _free_port() -> int:
    from testkit.ports import free_port

    return free_port()


def run_job(root: str, work: Path, mode: str, size_mib: int, ranks: int,
            nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One torchrun agent per entry of ``nodes`` (its BENCH_PEER); the ranks' reports."""
    out = work / f"out-{uuid.uuid4().hex[:6]}"
    out.mkdir(parents=True)
    port, run_id = _free_port(), uuid.uuid4().hex[:8]
    procs = []
    for i, node in enumerate(nodes):
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
               "BENCH_PEER": json.dumps(node)}
        conf = f"is_host={'true' if i == 0 else 'false'},join_timeout=120"
        with open(out / f"agent-{i}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}",
                 f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
                 f"--rdzv-conf={conf}", "--max-restarts=0", "--monitor-interval=0.5",
                 "-m", _RANK, root, str(out), mode, str(size_mib)],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        logs = "\n".join((out / f"agent-{i}.log").read_text()[-3000:] for i in range(len(nodes)))
        raise RuntimeError(f"a {mode} job failed ({codes}):\n{logs}")
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    if mode == "restore" and not all(r["exact"] for r in reports):
        raise RuntimeError("a restore returned wrong data: the benchmark is invalid")
    return reports


def _peak_growth(reports: list[dict[str, Any]]) -> int:
    """The largest rank's growth of its peak RSS over the timed save or restore."""
    return max(r["peak_rss"] - r["peak_rss_before"] for r in reports)


def comparison(root: str, endpoints: list[dict[str, Any]], size_mib: int, ranks: int,
               repeats: int) -> dict[str, Any]:
    """Save once, then time every restore of ``ROWS`` ``repeats`` times (interleaved)."""
    work = Path(tempfile.mkdtemp(prefix="dcpv-bench-peer-"))
    try:
        saved = [work / "saved-0", work / "saved-1"]

        def nodes(dirs: list[Path], *, keep_local: bool = True, replicas: int = 1
                  ) -> list[dict[str, Any]]:
            return [{"storage_options": opts, "local_dir": str(d), "keep_local": keep_local,
                     "local_replicas": replicas} for opts, d in zip(endpoints, dirs, strict=True)]

        save = run_job(root, work, "save", size_mib, ranks, nodes(saved))
        replica_bytes = sum(f.stat().st_size for d in saved
                            for f in (d / "replicas").rglob("*.distcp"))
        # The save's blocking with and without replicas (a fresh job and checkpoint
        # root each, alternated): replication runs after the commit, off the step.
        blocked: dict[str, list[float]] = {"local_replicas=1": [], "local_replicas=0": []}
        extra_rss: dict[str, list[int]] = {label: [] for label in blocked}
        for i in range(repeats):
            for label in blocked:
                dirs = [work / f"{label}-{i}-{n}" for n in (0, 1)]
                reports = run_job(f"{root}-{label.replace('=', '')}-{i}", work, "save",
                                  size_mib, ranks, nodes(dirs, replicas=int(label[-1])))
                blocked[label].append(max(r["blocked_s"] for r in reports))
                # The save's and the replication's growth of the peak, largest rank.
                extra_rss[label].append(_peak_growth(reports))
                for d in dirs:
                    shutil.rmtree(d, ignore_errors=True)
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
        for _ in range(repeats):
            for name in ROWS:
                dirs = [work / "run-0", work / "run-1"]
                for d in dirs:
                    shutil.rmtree(d, ignore_errors=True)
                if name != "volume":
                    for src, d in zip(saved, dirs, strict=True):
                        shutil.copytree(src, d)
                if name.startswith("node lost"):
                    shutil.rmtree(dirs[1])  # node 1 lost with its disk: the new one is empty
                    dirs[1].mkdir()
                if name == "node lost, no replicas":
                    shutil.rmtree(dirs[0] / "replicas")
                reports = run_job(root, work, "restore", size_mib, ranks,
                                  nodes(dirs, keep_local=name != "volume",
                                        replicas=1 if name != "volume" and
                                        name != "node lost, no replicas" else 0))
                results[name].append({
                    "seconds": max(r["restore_s"] for r in reports),
                    "cpu_s": sum(r["cpu_s"] for r in reports),
                    "peak_rss_growth": _peak_growth(reports),
                    "sources": {k: sum(r["sources"][k] for r in reports)
                                for k in ("local", "peer", "volume")},
                    "events": {r["rank"]: r["events"] for r in reports},
                })
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in results.items()}
    return {
        "size_mib_per_rank": size_mib, "ranks_per_node": ranks, "nodes": 2,
        "repeats": repeats,
        "save": {k: max(r[k] for r in save) for k in ("blocked_s", "committed_s", "closed_s")},
        "save_blocked_s": blocked,
        "blocked_with_vs_without_replicas": (statistics.median(blocked["local_replicas=1"])
                                             / statistics.median(blocked["local_replicas=0"])),
        "save_extra_peak_rss_bytes": extra_rss,
        "replication_extra_peak_rss_bytes": (statistics.median(extra_rss["local_replicas=1"])
                                             - statistics.median(extra_rss["local_replicas=0"])),
        "replica_bytes": replica_bytes,
        "restores": results,
        "median_seconds": med,
        "speedup_vs_volume": {k: med["volume"] / v for k, v in med.items()},
        "vs_same_node_local": {k: v / med["same-node local"] for k, v in med.items()},
    }


def table(res: dict[str, Any]) -> str:
    med = res["median_seconds"]
    rows = []
    for name, runs in res["restores"].items():
        src = runs[-1]["sources"]
        where = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in src.items() if v)
        rows.append([name, med[name], min(r["seconds"] for r in runs),
                     res["speedup_vs_volume"][name], res["vs_same_node_local"][name],
                     statistics.median(r["cpu_s"] for r in runs),
                     statistics.median(r["peak_rss_growth"] for r in runs) / 2**20,
                     where or "-"])
    return format_table(["restore after", "median s", "best s", "x faster than volume",
                         "x same-node local", "CPU s, all ranks", "peak RSS + MiB",
                         "read from (MiB)"], rows)


def plot(res: dict[str, Any], name: str) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = list(res["median_seconds"])
    ax.barh(labels, [res["median_seconds"][k] for k in labels], color="#4477aa")
    ax.invert_yaxis()
    ax.set_xlabel("restore seconds (slowest rank, median)")
    ax.set_title(f"restore of {res['size_mib_per_rank']} MiB/rank, 2 nodes x "
                 f"{res['ranks_per_node']} rank(s)")
    fig.tight_layout()
    path = results_path(name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("moto", "radosgw"), default="moto",
                        help="the S3 server behind the nodes' links")
    parser.add_argument("--size-mib", type=int, default=128, help="MiB of state a rank")
    parser.add_argument("--ranks", type=int, default=1, help="ranks a node")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--node-mbit", type=float, default=800.0,
                        help="cap of a node's link to the store, all connections together")
    parser.add_argument("--quick", action="store_true", help="32 MiB, 1 repeat (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.repeats = 32, 1
    info = machine_info()
    target = resolve(args.target)
    # (radosgw's memstore holds every save of the run: the matrix's and the blocking's.)
    stored = args.size_mib * 2**20 * args.ranks * 2 * (1 + 2 * args.repeats)
    with serve(target, _BUCKET, memory_bytes=stored) as s3, \
            ProxyProcess(s3.host, s3.port, total_bandwidth_bps=args.node_mbit * 1e6) as p0, \
            ProxyProcess(s3.host, s3.port, total_bandwidth_bps=args.node_mbit * 1e6) as p1:
        root = store_url(target, s3, _BUCKET, "run")
        endpoints = [s3.storage_options(p.endpoint) for p in (p0, p1)]
        started = time.monotonic()
        res = comparison(root, endpoints, args.size_mib, args.ranks, args.repeats)
    print(f"\nPeer tier ({target.server_label}): restore of {args.size_mib} MiB a rank, 2 nodes "
          f"x {args.ranks} rank(s); "
          f"each node's link {REMOTE_LATENCY_S * 1000:.0f} ms/request, "
          f"{REMOTE_BANDWIDTH_BPS / 1e6:.0f} Mbit/s a connection, {args.node_mbit:.0f} Mbit/s "
          f"in all; {args.repeats} repeats ({time.monotonic() - started:.0f} s)")
    save = res["save"]
    print(f"save (keep_local, local_replicas=1): blocked {save['blocked_s']:.2f} s, committed "
          f"after {save['committed_s']:.2f} s, replicated after {save['closed_s']:.2f} s; "
          f"{res['replica_bytes'] / 2**20:.0f} MiB of replicas")
    blocked = {k: statistics.median(v) for k, v in res["save_blocked_s"].items()}
    print(f"save blocked (median of {args.repeats}): {blocked['local_replicas=1']:.3f} s with "
          f"replicas, {blocked['local_replicas=0']:.3f} s without: "
          f"{res['blocked_with_vs_without_replicas']:.2f}x")
    rss = {k: statistics.median(v) / 2**20 for k, v in res["save_extra_peak_rss_bytes"].items()}
    print(f"a save's growth of a rank's peak RSS (median): {rss['local_replicas=1']:.0f} MiB "
          f"with replicas, {rss['local_replicas=0']:.0f} MiB without: the replication's "
          f"{res['replication_extra_peak_rss_bytes'] / 2**20:+.0f} MiB\n")
    print(table(res))
    stem = target.stem("peer_tier") + ("_quick" if args.quick else "")
    if args.ranks > 1:
        stem += f"_x{args.ranks}"
    if args.size_mib != 128 and not args.quick:
        stem += f"_{args.size_mib}"
    png = plot(res, f"{stem}.png")
    doc = {
        "benchmark": "peer_tier", **res,
        "link": {"latency_s": REMOTE_LATENCY_S, "bandwidth_bps": REMOTE_BANDWIDTH_BPS,
                 "node_bandwidth_bps": args.node_mbit * 1e6},
        "machine": {**info, "load_average_end": load_average()},
    }
    path = write_json(f"{stem}.json", doc)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
