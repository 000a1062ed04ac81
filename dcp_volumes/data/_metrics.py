"""Input-pipeline metrics: how long the training loop waits for data, and why.

Per batch the loader records ``fetch_seconds`` (time blocked in ``next()``)
and ``between_next_seconds`` (time from handing a batch out to the next
``next()``: the training step). Windows of a few seconds aggregate them (mean
and variance) with the workers' counters: cache hits and misses, bytes
fetched, download rate and prefetch depth. A closed window is logged through
``logging`` and, when ``mlflow`` is importable and a run is active, to MLflow
under per-rank keys (``dataloader/fetch_seconds/rank_0``...).

How worker counters reach the main process: each batch carries the counters
its worker accumulated since its previous batch (the loader wraps
``collate_fn``). No shared memory, no locks, nothing to set up per start
method; counts ride on data that crosses the process boundary anyway, so they
arrive in batch order, exactly once, and stop with a dead worker instead of
corrupting a shared counter it held.
"""

from __future__ import annotations

import collections
import logging
import math
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

logger = logging.getLogger("dcp_volumes.data")

# Keys of a window summary that are sent to MLflow (``dataloader/<key>/rank_<r>``).
MLFLOW_KEYS = (
    "fetch_seconds",
    "fetch_seconds_var",
    "fetch_seconds_max",
    "between_next_seconds",
    "between_next_seconds_var",
    "input_bound_fraction",
    "cache_hit_rate",
    "bytes_fetched",
    "download_mib_s",
    "prefetch_depth",
)


@dataclass
class Counters:
    """Counts of the input path: what a ``FileCache`` did (its ``counters``), and what a
    worker delivered between two of its batches (``worker_stats``, sent with each batch).

    A cache counts its fetches (hits, misses with their bytes and download time,
    evictions); a worker counts per sample (a file used twice in its prefetch
    window is one fetch, two samples) and adds how long it waited.
    """

    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    download_seconds: float = 0.0
    evictions: int = 0
    bytes_evicted: int = 0
    samples: int = 0
    wait_seconds: float = 0.0
    ready_ahead: int = 0

    def take(self) -> dict[str, float]:
        """The counts so far, as a plain dict, and reset them."""
        # Once per batch in every worker: plain attribute access, not dataclasses.asdict.
        out = {name: getattr(self, name) for name in _STAT_ZERO}
        for name, zero in _STAT_ZERO.items():
            setattr(self, name, zero)
        return out


_STAT_ZERO = {f.name: f.default for f in fields(Counters)}
_registry: dict[str, Counters] = {}
_registry_mu = threading.Lock()


def worker_stats(dataset_id: str) -> Counters:
    """This process's counters for one dataset (workers and the main process alike)."""
    with _registry_mu:
        stats = _registry.get(dataset_id)
        if stats is None:
            stats = _registry[dataset_id] = Counters()
        return stats


@dataclass
class _Welford:
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    max: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)
        self.max = max(self.max, x)

    @property
    def var(self) -> float:
        return self.m2 / self.n if self.n else 0.0


@dataclass
class _Window:
    started: float = field(default_factory=time.monotonic)
    fetch: _Welford = field(default_factory=_Welford)
    between: _Welford = field(default_factory=_Welford)
    workers: collections.Counter[str] = field(default_factory=collections.Counter)


class LoaderMetrics:
    """Per-batch timings and windowed summaries of one loader on one rank.

    Attributes:
        fetch_seconds: the latest per-batch waits in ``next()`` (bounded deque).
        between_next_seconds: the latest per-batch times between batches.
        windows: summaries of the latest closed windows (dicts, newest last).
        totals: cumulative counts since the loader was created.
    """

    def __init__(
        self,
        *,
        rank: int = 0,
        window_s: float = 10.0,
        keep: int = 10_000,
        mlflow: bool = True,
        mlflow_interval_s: float = 5.0,
    ) -> None:
        self.rank = rank
        self.window_s = window_s
        self.fetch_seconds: collections.deque[float] = collections.deque(maxlen=keep)
        self.between_next_seconds: collections.deque[float] = collections.deque(maxlen=keep)
        self.windows: collections.deque[dict[str, float]] = collections.deque(maxlen=1000)
        self.totals: collections.Counter[str] = collections.Counter()
        self._window = _Window()
        self._step = 0
        self._mlflow = mlflow
        self._mlflow_interval_s = mlflow_interval_s
        self._mlflow_pending: list[dict[str, float]] = []
        self._mlflow_sent = 0.0
        self._mu = threading.Lock()

    @property
    def last(self) -> dict[str, float] | None:
        """The most recent closed window, or None."""
        return self.windows[-1] if self.windows else None

    def record(
        self,
        *,
        fetch_s: float,
        between_s: float | None,
        worker: Mapping[str, float] | None,
        step: int,
    ) -> None:
        """Add one delivered batch; closes the window when it is old enough."""
        with self._mu:
            self.fetch_seconds.append(fetch_s)
            w = self._window
            w.fetch.add(fetch_s)
            if between_s is not None:
                self.between_next_seconds.append(between_s)
                w.between.add(between_s)
            if worker:
                w.workers.update({k: v for k, v in worker.items() if v})
                self.totals.update({k: v for k, v in worker.items() if v})
            self.totals["batches"] += 1
            self._step = step
            due = time.monotonic() - w.started >= self.window_s
        if due:
            self.flush(force_sinks=False)

    def flush(self, *, force_sinks: bool = True) -> dict[str, float] | None:
        """Close the current window now (epoch end, a ``break``, shutdown) and emit it."""
        with self._mu:
            w, self._window = self._window, _Window()
            if w.fetch.n == 0:
                summary = None
            else:
                summary = self._summarize(w)
                self.windows.append(summary)
        if summary is not None:
            self._log(summary)
        self._to_mlflow(summary, force=force_sinks)
        return summary

    def _summarize(self, w: _Window) -> dict[str, float]:
        seconds = max(time.monotonic() - w.started, 1e-9)
        hits, misses = w.workers["hits"], w.workers["misses"]
        samples = w.workers["samples"]
        waited = w.fetch.mean * w.fetch.n
        computed = w.between.mean * w.between.n
        return {
            "rank": float(self.rank),
            "step": float(self._step),
            "batches": float(w.fetch.n),
            "window_seconds": seconds,
            "fetch_seconds": w.fetch.mean,
            "fetch_seconds_var": w.fetch.var,
            "fetch_seconds_max": w.fetch.max,
            "between_next_seconds": w.between.mean,
            "between_next_seconds_var": w.between.var,
            "input_bound_fraction": waited / (waited + computed) if waited + computed else 0.0,
            "cache_hits": float(hits),
            "cache_misses": float(misses),
            "cache_hit_rate": hits / (hits + misses) if hits + misses else math.nan,
            "bytes_fetched": float(w.workers["bytes_fetched"]),
            "download_mib_s": w.workers["bytes_fetched"] / 2**20 / seconds,
            "prefetch_depth": w.workers["ready_ahead"] / samples if samples else math.nan,
            "worker_wait_seconds": float(w.workers["wait_seconds"]),
        }

    def _log(self, s: Mapping[str, float]) -> None:
        logger.info(
            "dataloader rank %d step %d: %d batches, fetch %.2f ms (sd %.2f, max %.2f), "
            "between %.2f ms, input-bound %.1f%%, cache hit rate %s, %.1f MiB/s, "
            "prefetch depth %s",
            int(s["rank"]),
            int(s["step"]),
            int(s["batches"]),
            s["fetch_seconds"] * 1e3,
            math.sqrt(s["fetch_seconds_var"]) * 1e3,
            s["fetch_seconds_max"] * 1e3,
            s["between_next_seconds"] * 1e3,
            s["input_bound_fraction"] * 100,
            "n/a" if math.isnan(s["cache_hit_rate"]) else f"{s['cache_hit_rate']:.1%}",
            s["download_mib_s"],
            "n/a" if math.isnan(s["prefetch_depth"]) else f"{s['prefetch_depth']:.1f}",
        )

    def _to_mlflow(self, summary: dict[str, float] | None, *, force: bool) -> None:
        if not self._mlflow:
            return
        if summary is not None:
            self._mlflow_pending.append(summary)
        now = time.monotonic()
        if not self._mlflow_pending or (
            not force and now - self._mlflow_sent < self._mlflow_interval_s
        ):
            return  # batched: at most one burst every mlflow_interval_s
        # Only an mlflow the program already imported: an active run implies it, and
        # importing it here would stall next() for seconds inside the training loop.
        mlflow = sys.modules.get("mlflow")
        if mlflow is None or mlflow.active_run() is None:
            self._mlflow_pending.clear()
            return
        pending, self._mlflow_pending = self._mlflow_pending, []
        self._mlflow_sent = now
        try:
            for s in pending:
                values = {
                    f"dataloader/{k}/rank_{self.rank}": float(s[k])
                    for k in MLFLOW_KEYS
                    if not math.isnan(s[k])
                }
                mlflow.log_metrics(values, step=int(s["step"]))
        except Exception as exc:  # a metrics sink must never stop training
            logger.warning("could not log dataloader metrics to MLflow: %s", exc)

    def summary(self) -> dict[str, Any]:
        """Cumulative figures since creation (a plain dict, for reports and tests)."""
        with self._mu:
            totals = dict(self.totals)
            fetch = list(self.fetch_seconds)
        hits, misses = totals.get("hits", 0), totals.get("misses", 0)
        return {
            "batches": totals.get("batches", 0),
            "fetch_seconds_total": sum(fetch),
            "cache_hit_rate": hits / (hits + misses) if hits + misses else math.nan,
            "bytes_fetched": totals.get("bytes_fetched", 0),
            **totals,
        }
