"""Shared plumbing of the benchmarks: paths, links, memory sampling, tables, output.

The benchmarks are a package run from a repository checkout (``python -m
benchmarks ...`` or ``dcp-volumes bench ...``): they import ``dcp_volumes`` and
``testkit.emulators`` from the same working tree.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Where tables' JSON and plots go; the smoke test points it at a temp dir.
RESULTS_DIR = Path(
    os.environ.get("DCP_VOLUMES_BENCH_RESULTS") or REPO_ROOT / "benchmarks" / "results"
)
MiB = 1 << 20

# The "remote" link of both benchmarks: what a real object store a network away
# looks like to one client stream (per-request round trip, per-stream cap).
REMOTE_LATENCY_S = 0.020
REMOTE_BANDWIDTH_BPS = 200e6
# The "tbf" link: the kernel's token bucket on ``lo`` of a network namespace the
# run re-executes itself in (``benchmarks.cli``); the rate is for all streams
# together (a NIC's limit), with no added latency (``tc netem`` is absent here).
TBF_ENV = "DCP_VOLUMES_BENCH_TBF_RATE"
LINKS = ("loopback", "remote", "tbf")


# ---------------------------------------------------------------------------
# Machine facts
# ---------------------------------------------------------------------------


def load_average() -> tuple[float, float, float]:
    """The 1/5/15-minute load averages (how busy the machine was)."""
    return os.getloadavg()


def machine_info() -> dict[str, Any]:
    """What the reader of a result needs to judge it: cores, memory, versions, load."""
    import torch

    try:
        import psutil

        mem_gib = round(psutil.virtual_memory().total / (1 << 30), 1)
    except ImportError:  # pragma: no cover - psutil is a dev dependency
        mem_gib = None
    return {
        "cpus": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "load_average_start": load_average(),
        "code": code_version(),
    }


def code_version() -> dict[str, Any]:
    """Which code a result belongs to: the commit and whether dcp_volumes/ had local edits."""
    import subprocess

    def git(*args: str) -> str:
        try:
            out = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "dcp_volumes_modified_files": git(
            "status", "--porcelain", "--", "dcp_volumes"
        ).splitlines(),
    }


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def current_rss() -> int:
    """Resident set size of this process, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def max_rss_lifetime() -> int:
    """This process's RSS high-water mark since it started (ru_maxrss), in bytes."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def release_free_memory() -> None:
    """Give freed heap pages back to the OS so the next RSS baseline is honest."""
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RssSampler:
    """Samples this process's RSS in a daemon thread and keeps the maximum.

    ``reset()`` starts a new window; ``peak`` is the maximum seen in the window.
    A 5 ms period catches the staging copies of a checkpoint (they live for
    seconds); ``max_rss_lifetime`` is the exact but whole-life alternative.
    """

    def __init__(self, period_s: float = 0.005) -> None:
        import psutil

        self._proc = psutil.Process()
        self._period = period_s
        self._lock = threading.Lock()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=1)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            rss = int(self._proc.memory_info().rss)
            with self._lock:
                self._peak = max(self._peak, rss)

    def reset(self) -> None:
        with self._lock:
            self._peak = current_rss()

    @property
    def peak(self) -> int:
        rss = current_rss()
        with self._lock:
            self._peak = max(self._peak, rss)
            return self._peak


# ---------------------------------------------------------------------------
# The remote-like link: a latency/bandwidth proxy in its own process
# ---------------------------------------------------------------------------


def _proxy_main(
    target_host: str,
    target_port: int,
    latency_s: float,
    bandwidth_bps: float | None,
    total_bandwidth_bps: float | None,
    conn: Any,
) -> None:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from testkit.proxy import LatencyProxy

    proxy = LatencyProxy(
        target_host, target_port, latency_s=latency_s, bandwidth_bps=bandwidth_bps,
        total_bandwidth_bps=total_bandwidth_bps,
    ).start()
    conn.send(proxy.port)
    try:
        conn.recv()  # blocks until the owner says stop
        conn.send(dict(proxy.requests))
    except (EOFError, OSError):
        pass  # the owner died: nobody to report to
    finally:
        proxy.stop()


class ProxyProcess:
    """``LatencyProxy`` from tests/ running in a child process.

    A Python proxy relays every byte; in its own process it gets its own GIL,
    so it slows neither the benchmark's clients nor its own relaying by
    sharing an interpreter with them.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        latency_s: float = REMOTE_LATENCY_S,
        bandwidth_bps: float | None = REMOTE_BANDWIDTH_BPS,
        total_bandwidth_bps: float | None = None,
    ) -> None:
        self._args = (target_host, target_port, latency_s, bandwidth_bps, total_bandwidth_bps)
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.port = 0
        self._proc: Any = None
        self._conn: Any = None
        self.requests: dict[tuple[str, str], int] = {}

    @property
    def pid(self) -> int | None:
        """The proxy's process id while it runs."""
        return None if self._proc is None else int(self._proc.pid)

    @property
    def endpoint(self) -> str:
        if not self.port:
            raise RuntimeError("proxy is not started")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProxyProcess:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_proxy_main, args=(*self._args, child), name="latency-proxy", daemon=True
        )
        self._proc.start()
        if not parent.poll(30):
            self._proc.kill()
            raise RuntimeError("the latency proxy did not start within 30 s")
        self.port = int(parent.recv())
        self._conn = parent
        return self

    def stop(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(OSError, EOFError, BrokenPipeError):
            self._conn.send("stop")
            if self._conn.poll(10):
                self.requests = self._conn.recv()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc = None
        self.port = 0

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def link_endpoint(server: Any, link: str) -> Iterator[str]:
    """The endpoint to use for ``link``: the server itself, or a proxy in front of it."""
    if link == "tbf":
        if not os.environ.get(TBF_ENV):
            raise RuntimeError(
                "the tbf link needs the run inside its shaped network namespace: "
                "use `python -m benchmarks ... --link tbf`, which re-executes itself there"
            )
        yield server.endpoint  # lo itself is shaped
        return
    if link == "loopback":
        yield server.endpoint
        return
    if link != "remote":
        raise ValueError(f"unknown link {link!r}: use one of {', '.join(LINKS)}")
    with ProxyProcess(server.host, server.port) as proxy:
        yield proxy.endpoint


# ---------------------------------------------------------------------------
# Statistics and output
# ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: floats rounded, None/NaN as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (readable in a terminal and pasteable into a README)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(items: Sequence[str]) -> str:
        return "| " + " | ".join(s.ljust(w) for s, w in zip(items, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def results_path(name: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / name


def write_json(name: str, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as pretty JSON under benchmarks/results/; returns the path."""
    path = results_path(name)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")
    os.replace(tmp, path)
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds``."""

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        self.seconds = math.nan
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
