"""Compression benchmark: ratio and end-to-end save/load time with and without zstd.

Three real-looking states, each ``--size-mib`` of raw tensor bytes:

* ``fp32 random``: fp32 noise, the worst case (zstd can do almost nothing);
* ``bf16 + Adam``: bf16 weights with fp32 Adam moments (exp_avg, exp_avg_sq),
  as a mixed-precision optimiser holds them: somewhat compressible;
* ``int + sparse``: int64 token ids and counters, 95 %-zero (pruned) fp32
  weights and bool masks: very compressible.

Each is saved and loaded, side by side in one run, by ``VolumeWriter`` /
``VolumeReader`` without and with ``compression=ZstdCompression(level, threads)``
(default: level 1, no worker threads, as ``compression="zstd"``), and
by stock ``FsspecWriter`` / ``FsspecReader`` (s3fs) without and with torch's
``ZStandard()`` extension (zstd's level 3), to moto's S3 server (its own
process) on two links:
``loopback`` (straight to the server) and ``remote`` (a proxy in its own
process adding 20 ms before each request and capping each connection at
200 Mbit/s, the remote link of the other benchmarks). Every load is checked
bit for bit. On a link slower than the compressor a compressed save must
finish sooner; the table's last column says whether it did.

Usage::

    python benchmarks/bench_compression.py            # 64 MiB per state, 2 repeats
    python benchmarks/bench_compression.py --quick    # 8 MiB, 1 repeat, ours only (smoke test)
    python benchmarks/bench_compression.py --size-mib 256 --repeats 3 --level 3 --threads 2

Writes benchmarks/results/compression.json and .png (``--quick``:
compression_quick.*), or under ``DCP_VOLUMES_BENCH_RESULTS``. Self-contained:
it needs only the package and tests/ (the moto server and the proxy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._extension import ZStandard  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402

from dcp_volumes import VolumeReader, VolumeWriter  # noqa: E402
from dcp_volumes._volume import Volume  # noqa: E402
from dcp_volumes.checkpoint._compression import ZstdCompression, zstd_library  # noqa: E402
from testkit.emulators import MotoServer  # noqa: E402

MiB = 1 << 20
RESULTS_DIR = Path(
    os.environ.get("DCP_VOLUMES_BENCH_RESULTS") or REPO_ROOT / "benchmarks" / "results"
)
REMOTE_LATENCY_S = 0.020
REMOTE_BANDWIDTH_BPS = 200e6
_TENSOR_MIB = 4  # states are made of tensors of about this size

# -- states -----------------------------------------------------------------------------------


def state_fp32(size_mib: int, g: torch.Generator) -> dict[str, Any]:
    n = max(1, size_mib // _TENSOR_MIB)
    numel = _TENSOR_MIB * MiB // 4
    return {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}


def state_bf16_adam(size_mib: int, g: torch.Generator) -> dict[str, Any]:
    # Per parameter: 2 bytes of bf16 weight + 4 + 4 bytes of fp32 moments.
    per_param = 10
    n = max(1, size_mib // _TENSOR_MIB)
    numel = _TENSOR_MIB * MiB // per_param
    model, optim = {}, {}
    for i in range(n):
        grad = torch.randn(numel, generator=g) * 1e-3
        model[f"layer{i}.weight"] = (torch.randn(numel, generator=g) * 0.02).bfloat16()
        optim[f"layer{i}.weight"] = {
            "exp_avg": grad * 0.1,
            "exp_avg_sq": grad * grad * 1e-3,
            "step": torch.tensor(1000.0),
        }
    return {"model": model, "optim": {"state": optim}}


def state_int_sparse(size_mib: int, g: torch.Generator) -> dict[str, Any]:
    # Per group of ``numel``: int64 ids and counts (8 + 8 bytes), 2 x numel fp32
    # pruned weights (8 bytes) and a bool mask (1 byte).
    groups = max(1, round(size_mib / (3 * _TENSOR_MIB)))
    numel = size_mib * MiB // (25 * groups)
    out: dict[str, Any] = {}
    for i in range(groups):
        out[f"data.token_ids{i}"] = torch.randint(0, 50_000, (numel,), generator=g)
        pruned = torch.randn(numel * 2, generator=g)
        pruned[torch.rand(numel * 2, generator=g) < 0.95] = 0.0
        out[f"layer{i}.pruned_weight"] = pruned
        out[f"layer{i}.counts"] = torch.randint(0, 16, (numel,), generator=g, dtype=torch.int64)
        out[f"layer{i}.mask"] = torch.rand(numel, generator=g) > 0.9
    return out


STATES: dict[str, Callable[[int, torch.Generator], dict[str, Any]]] = {
    "fp32 random": state_fp32,
    "bf16 + Adam": state_bf16_adam,
    "int + sparse": state_int_sparse,
}


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}")


def raw_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in _tensors(state))


def blank(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    return {k: blank(v) for k, v in state.items()}


def same(a: Any, b: Any) -> bool:
    ta, tb = dict(_tensors(a)), dict(_tensors(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in tb)


# -- the remote link: the tests' LatencyProxy in a process of its own --------------------------


def _proxy_main(host: str, port: int, conn: Any) -> None:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from testkit.proxy import LatencyProxy

    proxy = LatencyProxy(
        host, port, latency_s=REMOTE_LATENCY_S, bandwidth_bps=REMOTE_BANDWIDTH_BPS
    ).start()
    conn.send(proxy.port)
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    proxy.stop()


@contextlib.contextmanager
def link_endpoint(server: MotoServer, link: str) -> Iterator[str]:
    """The server's endpoint (loopback) or that of a proxy in front of it (remote)."""
    if link == "loopback":
        yield server.endpoint
        return
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_proxy_main, args=(server.host, server.port, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the latency proxy did not start within 60 s")
        yield f"http://127.0.0.1:{int(parent.recv())}"
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


# -- one method: save, measure what is stored, load and check -----------------------------------


def run_method(
    method: str, url: str, opts: dict[str, Any], state: dict[str, Any], level: int, threads: int
) -> tuple[float, float, int]:
    """(save seconds, load seconds, stored bytes) of ``method``; raises on wrong data."""
    zstd = method.endswith("+ zstd")
    out = blank(state)
    if method.startswith("ours"):
        codec = ZstdCompression(level=level, threads=threads) if zstd else None
        writer = VolumeWriter(url, storage_options=opts, compression=codec)
        reader: Any = VolumeReader(url, storage_options=opts)
    else:
        writer = FsspecWriter(url, _extensions=[ZStandard()] if zstd else None, **opts)
        reader = FsspecReader(url, **opts)
    started = time.perf_counter()
    dcp.save(state, storage_writer=writer)
    save_s = time.perf_counter() - started
    stored = sum(f.size for f in Volume(url, storage_options=opts).list()
                 if f.path.endswith(".distcp"))
    started = time.perf_counter()
    dcp.load(out, storage_reader=reader)
    load_s = time.perf_counter() - started
    if not same(out, state):
        raise SystemExit(f"{method} loaded wrong data from {url}: the benchmark is invalid")
    return save_s, load_s, stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=64, help="raw bytes per state")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--level", type=int, default=1, help="zstd level of our writer")
    parser.add_argument("--threads", type=int, default=0, help="zstd threads of our writer")
    parser.add_argument("--quick", action="store_true",
                        help="8 MiB, 1 repeat, without the stock writer (smoke test)")
    args = parser.parse_args()
    methods = ["ours", "ours + zstd", "stock", "stock + zstd"]
    if args.quick:
        args.size_mib, args.repeats = 8, 1
        methods = ["ours", "ours + zstd"]
    logging.basicConfig(level=logging.WARNING)
    warnings.simplefilter("ignore")  # dcp.save without a process group warns each time
    states = {name: make(args.size_mib, torch.Generator().manual_seed(7))
              for name, make in STATES.items()}
    links = ["loopback", "remote"]
    rows: list[dict[str, Any]] = []
    with MotoServer(mode="process") as s3:
        bucket = s3.create_bucket("bench-compression")
        for link in links:
            with link_endpoint(s3, link) as endpoint:
                opts = s3.storage_options(endpoint)
                for name, state in states.items():
                    for method in methods:
                        saves, loads, stored = [], [], 0
                        for _ in range(args.repeats):
                            url = f"{bucket}/{uuid.uuid4().hex[:8]}"
                            save_s, load_s, stored = run_method(
                                method, url, opts, state, args.level, args.threads
                            )
                            saves.append(save_s)
                            loads.append(load_s)
                        raw = raw_bytes(state)
                        rows.append({
                            "link": link, "state": name, "method": method,
                            "raw_bytes": raw, "stored_bytes": stored, "ratio": raw / stored,
                            "save_s": saves, "load_s": loads,
                            "save_median_s": statistics.median(saves),
                            "load_median_s": statistics.median(loads),
                        })
                        last = rows[-1]
                        print(f"{link:8} {name:13} {method:13} save {last['save_median_s']:.2f}s"
                              f" load {last['load_median_s']:.2f}s ratio {raw / stored:.2f}",
                              flush=True)
    report = {
        "config": {"size_mib": args.size_mib, "repeats": args.repeats, "level": args.level,
                   "threads": args.threads,
                   "quick": args.quick, "methods": methods, "links": links,
                   "remote_latency_s": REMOTE_LATENCY_S,
                   "remote_bandwidth_bps": REMOTE_BANDWIDTH_BPS, "zstd_library": zstd_library()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average_end": os.getloadavg()},
        "rows": rows,
        "checks": checks(rows),
    }
    print()
    print(table(rows))
    name = "compression_quick" if args.quick else "compression"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, RESULTS_DIR / f"{name}.png", links, list(states), methods)
    print(f"\nwrote {RESULTS_DIR / name}.json and .png")


def _row(rows: list[dict[str, Any]], link: str, state: str, method: str) -> dict[str, Any] | None:
    return next((r for r in rows if (r["link"], r["state"], r["method"]) == (link, state, method)),
                None)


def checks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per link and state: does our compressed save finish sooner than our plain one?"""
    out: dict[str, Any] = {}
    for r in rows:
        if r["method"] != "ours + zstd":
            continue
        plain = _row(rows, r["link"], r["state"], "ours")
        if plain is not None:
            out[f"{r['link']}/{r['state']}"] = {
                "ratio": r["ratio"],
                "save_speedup": plain["save_median_s"] / r["save_median_s"],
                "load_speedup": plain["load_median_s"] / r["load_median_s"],
                "compressed_save_sooner": r["save_median_s"] < plain["save_median_s"],
            }
    return out


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["link", "state", "method", "stored MiB", "ratio", "save s", "load s",
               "save vs uncompressed"]
    lines = []
    for r in rows:
        base = _row(rows, r["link"], r["state"], r["method"].replace(" + zstd", ""))
        speed = "-" if base is None or base is r else (
            f"{base['save_median_s'] / r['save_median_s']:.2f}x")
        lines.append([r["link"], r["state"], r["method"], f"{r['stored_bytes'] / MiB:.1f}",
                      f"{r['ratio']:.2f}", f"{r['save_median_s']:.2f}",
                      f"{r['load_median_s']:.2f}", speed])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]

    def fmt(items: list[str]) -> str:
        return "| " + " | ".join(s.ljust(w) for s, w in zip(items, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(headers), sep, *(fmt(line) for line in lines)])


def plot(rows: list[dict[str, Any]], path: Path, links: list[str], states: list[str],
         methods: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    width = 0.8 / len(methods)
    for ax, link in zip(axes[0], links, strict=True):
        for j, method in enumerate(methods):
            values = [(_row(rows, link, s, method) or {}).get("save_median_s", 0.0)
                      for s in states]
            bars = ax.bar([i + j * width for i in range(len(states))], values, width,
                          label=method)
            for bar, s in zip(bars, states, strict=True):
                r = _row(rows, link, s, method)
                if r is not None and method.endswith("zstd"):
                    ax.annotate(f"{r['ratio']:.1f}x", (bar.get_x() + bar.get_width() / 2,
                                                       bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(states))], states)
        ax.set_ylabel("save, end to end (s)")
        ax.set_title(f"{link} link (labels: compression ratio)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
