"""Checkpoints at N simulated ranks: what the coordinator pays, and what every rank asks the store.

Each simulated rank is a real ``VolumeWriter`` / ``VolumeReader`` (or stock
DCP's ``FsspecWriter`` / ``FsspecReader``, side by side) with DCP's default
planners and a tiny state of its own (``--files-per-rank`` tensors, one file
each), driven through DCP's call order (``state_dict_saver`` /
``state_dict_loader``): every rank's ``local_step``, the coordinator's
``global_step``, every rank's ``write_data`` / ``read_data``, the
coordinator's ``finish``. What DCP's collectives move (the local plans to the
coordinator, the central plans and the write results back) is handed over
directly, in one process: the costs measured are the storage layer's and the
planner's, not a network's. Ranks' writes and reads run ``--parallel`` at a
time.

moto (a child process) counts every request with its recorder, sorted by
operation and object (``.metadata``, the manifest, data files, listings).
The coordinator's phases are timed, and with ``--trace-memory`` their peak
Python allocation (tracemalloc) recorded instead, in a run of its own: tracing
slows them several times.

save: ``plan_dcp`` (DCP's ``create_global_plan``), ``plan_storage`` (the
writer's ``prepare_global_plan``), ``write`` (all ranks), ``commit`` (the
coordinator's ``finish``: manifest, listing check, ``.metadata``);
load: ``metadata`` (every rank's ``read_metadata``), ``setup`` (every rank's
``set_up_storage_reader``: the manifest), ``plan`` (the coordinator's global
plan), ``read`` (all ranks).

    python -m benchmarks scale --ranks 8,64,256,1024
    python -m benchmarks scale --ranks 8,64,256 --trace-memory
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import pickle
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from benchmarks._common import (
    code_version,
    format_table,
    machine_info,
    pyplot,
    results_path,
    write_json,
)

logger = logging.getLogger(__name__)

METHODS = ("ours", "stock")
DEFAULT_RANKS = (8, 64, 256, 1024)
TENSOR_ELEMS = 256  # 1 KiB of float32 per file: the costs measured are per file, not per byte


def _simulated_retry() -> Any:
    # One moto process answers every simulated rank, so under hundreds of ranks it
    # answers a 1 KiB GET late; the stall detector (measured in tests/test_stalls.py)
    # would cut and retry those, and the counts here would be the retries'.
    from dcp_volumes import RetryPolicy

    return RetryPolicy(stall_s=60.0)


@dataclasses.dataclass
class Phase:
    """One phase of one run: seconds, the coordinator's peak allocation, requests by kind."""

    seconds: float = 0.0
    peak_bytes: int = 0
    requests: dict[str, int] = dataclasses.field(default_factory=dict)


def classify(method: str, path: str) -> str:
    """A request's kind for the tables: the operation and which object it names."""
    name = path.rsplit("/", 1)[-1]
    if path.count("/") <= 1:  # "/bucket": a listing (or a bucket-level call)
        what = "list"
    elif name == ".metadata":
        what = ".metadata"
    elif "manifest" in name:
        what = "manifest"
    elif name.endswith(".distcp"):
        what = "data"
    else:
        what = "other"
    return f"{method} {what}"


class Counting:
    """Request counts by kind since the last ``take``: a counting proxy's, or moto's own
    recorder's (``MotoServer(record_requests=True)``)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def take(self) -> dict[str, int]:
        """The counts since the last call (read after a phase, when nothing is in flight)."""
        if hasattr(self.source, "request_counts"):  # moto's recorder
            seen = self.source.request_counts()
            self.source.reset_requests()
        else:
            seen = collections.Counter(self.source.requests)
            self.source.reset_counts()
        out: collections.Counter[str] = collections.Counter()
        for (method, path), n in seen.items():
            out[classify(method, path)] += n
        return dict(sorted(out.items()))


@contextmanager
def measured(phase: Phase, counting: Counting, *, trace: bool) -> Iterator[None]:
    """Time the body; with ``trace``, record its peak Python allocation."""
    counting.take()
    if trace:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        yield
    finally:
        phase.seconds = time.perf_counter() - started
        if trace:
            phase.peak_bytes = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        phase.requests = counting.take()


def rank_state(rank: int, files: int) -> dict[str, Any]:
    import torch

    return {f"rank{rank}.w{k}": torch.full((TENSOR_ELEMS,), float(rank * files + k))
            for k in range(files)}


def _each(parallel: int, n: int, fn: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, n))) as pool:
        return list(pool.map(fn, range(n)))


def save(method: str, url: str, opts: dict[str, Any], n: int, files: int, parallel: int,
         staging: str, counting: Counting, *, trace: bool = False,
         ) -> tuple[dict[str, Phase], dict[str, Any]]:
    """Save with ``n`` simulated ranks in DCP's call order; the phases and sizes.

    ``trace``: record the coordinator's peak allocation in each of its phases
    (tracemalloc slows allocation-heavy code several times, so its seconds are
    not the untraced run's).
    """
    from torch.distributed.checkpoint import DefaultSavePlanner

    phases = {k: Phase() for k in ("setup", "plan_dcp", "plan_storage", "write", "commit")}
    writers = [_writer(method, url, opts, files, staging) for _ in range(n)]
    planners = [DefaultSavePlanner() for _ in range(n)]
    states = [rank_state(r, files) for r in range(n)]

    def local_step(r: int) -> Any:
        w, p = writers[r], planners[r]
        w.reset()  # as dcp.save without a checkpoint_id: the location given at construction
        p.set_up_planner(states[r], storage_meta=w.storage_meta(), is_coordinator=r == 0)
        w.set_up_storage_writer(r == 0, rank=r, use_collectives=True)
        return w.prepare_local_plan(p.create_local_plan())

    with measured(phases["setup"], counting, trace=False):
        local_plans = [local_step(r) for r in range(n)]
    with measured(phases["plan_dcp"], counting, trace=trace):
        plans, metadata = planners[0].create_global_plan(local_plans)
    with measured(phases["plan_storage"], counting, trace=trace):
        plans = writers[0].prepare_global_plan(plans)

    def write(r: int) -> Any:
        final = planners[r].finish_plan(plans[r])
        return writers[r].write_data(final, planners[r]).wait()

    with measured(phases["write"], counting, trace=False):
        results = _each(parallel, n, write)
    with measured(phases["commit"], counting, trace=trace):
        writers[0].finish(metadata=metadata, results=results)
    # What any DCP storage writer's commit pays for `.metadata` (stock's too): the
    # part of the commit that is not ours.
    started = time.perf_counter()
    pickled = pickle.dumps(metadata)
    sizes: dict[str, Any] = {"metadata_pickle_bytes": len(pickled),
                             "metadata_pickle_s": time.perf_counter() - started}
    for w in writers:
        if hasattr(w, "close"):
            w.close()
    return phases, sizes


def _writer(method: str, url: str, opts: dict[str, Any], files: int, staging: str) -> Any:
    if method == "ours":
        from dcp_volumes import VolumeWriter

        return VolumeWriter(url, storage_options=opts, staging_dir=staging,
                            file_size=TENSOR_ELEMS * 4, upload_concurrency=files,
                            staging_headroom=0, retry=_simulated_retry())
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # thread_count files per rank, one per thread (stock's layout).
    return FsspecWriter(url, thread_count=files, sync_files=False, **opts)


def load(method: str, url: str, opts: dict[str, Any], n: int, files: int, parallel: int,
         counting: Counting, *, read_once: bool = False, trace: bool = False,
         ) -> dict[str, Phase]:
    """Load with ``n`` simulated ranks in DCP's call order; the phases.

    ``read_once``: as ``CheckpointManager.restore`` loads, the coordinator reads
    ``.metadata`` and the manifest and broadcasts them (here: a pickle round trip,
    what ``broadcast_object_list`` does); otherwise every rank reads them, as
    ``dcp.load`` with a ``VolumeReader`` alone does.
    """
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    phases = {k: Phase() for k in ("metadata", "setup", "plan", "read")}
    readers = [_reader(method, url, opts) for _ in range(n)]
    planners = [DefaultLoadPlanner() for _ in range(n)]
    states = [{k: torch.zeros_like(v) for k, v in rank_state(r, files).items()}
              for r in range(n)]
    with measured(phases["metadata"], counting, trace=False):
        if read_once:
            readers[0].read_metadata_ahead()
            shared = pickle.dumps(readers[0].shared_read_ahead())
            for r in readers[1:]:
                r.use_shared_read_ahead(pickle.loads(shared))
        for r in readers:
            r.reset()  # dcp.load's first call: keeps what was read for this location
        metas = _each(parallel, n, lambda r: readers[r].read_metadata())

    def set_up(r: int) -> Any:
        planners[r].set_up_planner(states[r], metas[r], r == 0)
        readers[r].set_up_storage_reader(metas[r], r == 0, rank=r, use_collectives=True)
        return readers[r].prepare_local_plan(planners[r].create_local_plan())

    with measured(phases["setup"], counting, trace=False):
        local_plans = _each(parallel, n, set_up)
    with measured(phases["plan"], counting, trace=trace):
        plans = readers[0].prepare_global_plan(planners[0].create_global_plan(local_plans))

    def read(r: int) -> None:
        final = planners[r].finish_plan(plans[r])
        readers[r].read_data(final, planners[r]).wait()

    with measured(phases["read"], counting, trace=False):
        _each(parallel, n, read)
    for r in range(n):  # exact, or the measurement means nothing
        for k, v in rank_state(r, files).items():
            if not torch.equal(states[r][k], v):
                raise AssertionError(f"{method}: rank {r} loaded wrong data for {k}")
    return phases


def _reader(method: str, url: str, opts: dict[str, Any]) -> Any:
    if method == "ours":
        from dcp_volumes import VolumeReader

        return VolumeReader(url, storage_options=opts, retry=_simulated_retry())
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **opts)


def run(ranks: Sequence[int], *, files: int = 8, parallel: int = 16,
        methods: Sequence[str] = METHODS, trace: bool = False, out: Any = None,
        ) -> dict[str, Any]:
    """The simulation at each N in ``ranks`` for each method, against moto.

    moto runs as a child process and counts the requests itself (its recorder): a
    server or a counting proxy in the ranks' process would share their GIL, and
    at hundreds of ranks answer late enough to look stalled.
    """
    from testkit.emulators import MotoServer

    rows: list[dict[str, Any]] = []
    with MotoServer(mode="process", record_requests=True) as s3, \
            tempfile.TemporaryDirectory(prefix="dcpv-scale-") as staging:
        opts = s3.storage_options()
        counting = Counting(s3)
        for n in ranks:
            for method in methods:
                bucket = f"scale-{method}-{n}"
                s3.create_bucket(bucket)
                url = s3.url(bucket, "ck")
                started = time.perf_counter()
                save_phases, sizes = save(method, url, opts, n, files, parallel, staging,
                                          counting, trace=trace)
                load_phases = load(method, url, opts, n, files, parallel, counting,
                                   read_once=method == "ours", trace=trace)
                if method == "ours":  # dcp.load with a VolumeReader, without the manager
                    reader_phases = load(method, url, opts, n, files, parallel, counting)
                sizes.update(_object_sizes(s3, bucket))
                row = {
                    "method": method, "ranks": n, "files_per_rank": files,
                    "save": {k: dataclasses.asdict(v) for k, v in save_phases.items()},
                    "load": {k: dataclasses.asdict(v) for k, v in load_phases.items()},
                    "load_dcp": ({k: dataclasses.asdict(v) for k, v in reader_phases.items()}
                                 if method == "ours" else None),
                    "sizes": sizes, "wall_s": time.perf_counter() - started,
                }
                rows.append(row)
                s3.reset()
                if out is not None:
                    print(_row_line(row), file=out, flush=True)
    return {"config": {"ranks": list(ranks), "files_per_rank": files, "parallel": parallel,
                       "traced": trace, "server": "moto (a child process), its recorder counting"},
            "machine": machine_info(), "code": code_version(), "rows": rows}


def _object_sizes(s3: Any, bucket: str) -> dict[str, int]:
    fs = s3.filesystem()
    out = {}
    for name, key in (("metadata_bytes", ".metadata"),
                      ("manifest_bytes", ".dcp_volumes.manifest.json")):
        try:
            out[name] = int(fs.info(f"{bucket}/ck/{key}")["size"])
        except FileNotFoundError:
            out[name] = 0
    return out


def _row_line(row: dict[str, Any]) -> str:
    s, ld = row["save"], row["load"]
    return (f"{row['method']:5s} N={row['ranks']:5d}: commit {s['commit']['seconds']:.3f}s "
            f"plan {s['plan_dcp']['seconds']:.3f}+{s['plan_storage']['seconds']:.3f}s "
            f"load metadata GETs {ld['metadata']['requests'].get('GET .metadata', 0)} "
            f"(wall {row['wall_s']:.0f}s)")


def table(result: dict[str, Any]) -> str:
    """The side-by-side table (our and stock DCP's costs per N)."""
    headers = ["method", "ranks", "plan_dcp s", "plan_storage s", "commit s",
               "of it .metadata pickle s", "commit MiB peak",
               "commit requests", "metadata KiB", "manifest KiB", "load GET .metadata",
               "load GET manifest", "load LIST", "load HEAD", "load plan s",
               "dcp.load GET .metadata"]
    rows = []
    for row in result["rows"]:
        s, ld, z = row["save"], row["load"], row["sizes"]
        load_reqs = _totals(ld)
        plain = _totals(row.get("load_dcp") or ld)  # every rank reads for itself
        rows.append([
            row["method"], row["ranks"], f"{s['plan_dcp']['seconds']:.3f}",
            f"{s['plan_storage']['seconds']:.3f}", f"{s['commit']['seconds']:.3f}",
            f"{z.get('metadata_pickle_s', 0):.3f}",
            (f"{s['commit']['peak_bytes'] / 2**20:.1f}" if result["config"].get("traced")
             else "-"),
            " ".join(f"{k}:{v}" for k, v in s["commit"]["requests"].items()),
            f"{z.get('metadata_bytes', 0) / 1024:.0f}", f"{z.get('manifest_bytes', 0) / 1024:.0f}",
            load_reqs.get("GET .metadata", 0), load_reqs.get("GET manifest", 0),
            load_reqs.get("GET list", 0),
            sum(v for k, v in load_reqs.items() if k.startswith("HEAD")),
            f"{ld['plan']['seconds']:.3f}", plain.get("GET .metadata", 0),
        ])
    return format_table(headers, rows)


def _totals(phases: dict[str, Any]) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for phase in phases.values():
        out.update(phase["requests"])
    return out


def plot(result: dict[str, Any], path: Any) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in METHODS:
        rows = [r for r in result["rows"] if r["method"] == method]
        if not rows:
            continue
        n = [r["ranks"] for r in rows]
        axes[0].plot(n, [r["save"]["commit"]["seconds"] for r in rows], "o-",
                     label=f"{method}: commit")
        axes[0].plot(n, [r["save"]["plan_dcp"]["seconds"] + r["save"]["plan_storage"]["seconds"]
                         for r in rows], "s--", label=f"{method}: global plan")
        axes[1].plot(n, [sum(p["requests"].get("GET .metadata", 0) + p["requests"].get(
            "GET manifest", 0) + p["requests"].get("GET list", 0) for p in r["load"].values())
            for r in rows], "o-", label=f"{method}: load's GET .metadata + manifest + LIST")
    for ax, title in zip(axes, ("coordinator seconds (save)", "requests to shared objects (load)"),
                         strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(ranks: Sequence[int], *, files: int, parallel: int, methods: Sequence[str],
         trace: bool, out: Any) -> int:
    result = run(ranks, files=files, parallel=parallel, methods=methods, trace=trace, out=out)
    name = "scale_traced" if trace else "scale"
    json_path = write_json(f"{name}.json", result)
    png = results_path(f"{name}.png")
    plot(result, png)
    print(table(result), file=out)
    print(f"wrote {json_path} and {png}", file=out)
    return 0
