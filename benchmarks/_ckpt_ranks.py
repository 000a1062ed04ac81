"""Rank-side half of bench_checkpoint.py: what each gloo rank does and times.

Every rank holds its own state dict (distinct keys per rank, so DCP's
de-duplication of replicated tensors never drops one): by default a model and
its Adam state (``shape="mixed"``: a few large tensors, a dozen medium ones and
many small ones, each parameter with ``exp_avg``, ``exp_avg_sq`` and a
one-element ``step``), ``shape="uniform"`` tensors of one size, ``"small:N"``
(4 big tensors and N of a few KiB) or a transformers model's names and shapes
with its AdamW state (``"gpt2"``, ``"llama"``; ``make_state``). It runs the
methods it is given in order. A method is a number of saves (or loads); for each save the
rank records the time until the call gave control back to training
(``blocking_s``) and until the checkpoint was committed (``e2e_s``), and its
RSS peak above the RSS it had just before the method began.

Save methods:

``memcpy``          torch ``copy_`` into preallocated (faulted-in) tensors: the
                    floor of any staging copy; the blocking target is relative to it.
``local_fs``        stock ``FileSystemWriter`` to local disk (thread_count=8,
                    sync_files=False): DCP serialisation without a network.
``raw_put``         the same bytes as parallel PUTs of chunk objects (boto3 /
                    azure-storage-blob).
``raw_multipart``   the same bytes as one object uploaded in parallel parts (S3
                    multipart upload / Azure stage_block + commit_block_list).
                    The link floor is the faster of the two.
``fsspec_t1/_t8``   ``dcp.save`` with stock ``FsspecWriter`` (thread_count 1 / 8).
``fsspec_async``    ``dcp.async_save`` with ``FsspecWriter`` (thread_count=8).
``s3tc``            ``dcp.save`` with s3torchconnector's ``S3StorageWriter``
                    (thread_count=8; S3 only).
``torch_save``      ``torch.save`` of the rank's state to a local file, then the
                    file uploaded as one object (parallel parts where the store has
                    them): what a job without DCP does.
``vw_sync/_async``  ``dcp.save`` / ``dcp.async_save`` with ``VolumeWriter``,
                    one writer reused across saves (its staging buffers too).
``vw_sync_fresh``   the same with a new ``VolumeWriter`` for every save (the README's
``vw_async_fresh``  first example, and how most training code calls DCP).

Every save also records the CPU time it cost: this rank's process (all its
threads; ``time.process_time``) and, on rank 0, the server's processes
(``Job.server_pids``, psutil), read after a barrier so every rank's requests
are in.

``load`` runs the readers: parallel whole-object GETs of the raw chunks,
parallel ranged GETs of the raw multipart object (the download floor is the
faster), ``FsspecReader``, s3torchconnector's ``S3StorageReader`` (S3 only)
and ``VolumeReader``, the last three on the same checkpoint.

The store is the job's ``scheme`` (``s3://`` on moto, ``az://`` on Azurite):
the peers' fsspec client follows from the URL (s3fs / adlfs), the raw
transfers from ``_raw.raw_store``.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks._common import MiB, RssSampler, current_rss, max_rss_lifetime, release_free_memory
from benchmarks._raw import (
    ByteSource,
    RawStore,
    chunk_size,
    get_chunks,
    get_ranges,
    put_chunks,
    put_multipart,
    raw_store,
)

SAVE_METHODS = (
    "memcpy",
    "local_fs",
    "raw_put",
    "raw_multipart",
    "fsspec_t1",
    "fsspec_t8",
    "fsspec_async",
    "s3tc",
    "torch_save",
    "vw_sync",
    "vw_async",
    "vw_sync_fresh",
    "vw_async_fresh",
    "vw_async_f32",
    "vw_sync_enc",
    "vw_async_enc",
)
LOAD_METHODS = (
    "raw_get",
    "raw_ranged",
    "local_reader",
    "fsspec_reader",
    "s3tc_reader",
    "vw_reader",
    "vw_reader_f32",
    "vw_reader_enc",
)
# Methods of s3torchconnector, which speaks S3 only.
S3_ONLY = frozenset({"s3tc", "s3tc_reader"})
RAW_SAVES = ("raw_put", "raw_multipart")
RAW_LOADS = ("raw_get", "raw_ranged")
ASYNC_METHODS = frozenset({"fsspec_async", "vw_async", "vw_async_fresh", "vw_async_f32",
                           "vw_async_enc"})
VW_METHODS = ("vw_sync", "vw_async", "vw_sync_fresh", "vw_async_fresh", "vw_async_f32",
              "vw_sync_enc", "vw_async_enc")
# Client-side encryption (``Encryption``) beside the same writer unencrypted: a fixed
# benchmark key (nothing here is secret).
ENCRYPTED = ("vw_sync_enc", "vw_async_enc")
BENCH_KEY = bytes(range(32))
FRESH_WRITER = frozenset({"vw_sync_fresh", "vw_async_fresh"})
# A non-default VolumeWriter setting shown beside the defaults: files of 32 MiB
# (default 256 MiB) go up as single PUTs and read back as whole-object GETs.
SMALL_FILES = {"file_size": "32MiB"}

# The memcpy floor takes milliseconds, so one scheduling hiccup on 2 shared cores
# is most of a save: its steady state is the median of this many.
MEMCPY_REPEATS = 11
UPLOAD_STREAMS = 8  # VolumeWriter's default upload_concurrency
DOWNLOAD_STREAMS = 16  # VolumeReader's default read_concurrency
PEER_THREADS = 8  # thread_count of the stock writers: their best on this link


def save_repeats(method: str, repeats: int) -> int:
    """How many saves ``method`` makes in a cell of ``repeats``."""
    return max(repeats, MEMCPY_REPEATS) if method == "memcpy" else repeats


@dataclass(frozen=True)
class Job:
    """Everything a rank needs; pickled to the spawned ranks."""

    link: str
    scheme: str  # the store's URL scheme: "s3" (moto) or "az" (Azurite)
    methods: tuple[str, ...]
    size_bytes: int
    tensor_bytes: int
    repeats: int
    bucket: str
    prefix: str  # key prefix of this link's objects, e.g. "remote"
    endpoint: str  # what clients talk to (the proxy on the remote link)
    direct_endpoint: str  # the server itself, for housekeeping outside the timings
    storage_options: dict[str, Any]  # for ``endpoint``
    direct_storage_options: dict[str, Any]  # for ``direct_endpoint``
    isolated: bool  # one fresh pair of processes per method (ru_maxrss is then exact)
    vw_options: dict[str, Any] = field(default_factory=dict)  # extra VolumeWriter options
    load_repeats: int = 2
    load_source: str | None = None  # checkpoint URL the DCP readers load
    keep: tuple[str, ...] = field(default=())  # methods whose last save the loads need
    shape: str = "mixed"  # the state: see make_state
    multipart: bool = True  # whether the store has a parallel-parts upload
    server_pids: tuple[int, ...] = ()  # the server's processes, for its CPU time
    # Loading on another world size: the ranks whose saved state each rank reads
    # (rank r loads the states of saved ranks s with s % world_size == r).
    saved_world_size: int = 0
    s3tc: bool = False  # whether s3torchconnector's rows apply to the store
    volume_options: dict[str, Any] = field(default_factory=dict)  # ours only (Target's)

    @property
    def our_storage_options(self) -> dict[str, Any]:
        """``storage_options`` for VolumeWriter / VolumeReader (with the target's own)."""
        return {**self.storage_options, **self.volume_options}

    @property
    def loads(self) -> tuple[str, ...]:
        """The readers that apply to this store and to what was saved."""
        skip = set() if self.s3tc else set(S3_ONLY)
        if not self.multipart or "raw_multipart" not in self.methods:
            skip.add("raw_ranged")
        if "raw_put" not in self.methods:
            skip.add("raw_get")
        if "vw_async_f32" not in self.methods:
            skip.add("vw_reader_f32")
        if not set(ENCRYPTED) & set(self.methods):
            skip.add("vw_reader_enc")
        return tuple(m for m in LOAD_METHODS if m not in skip)

    def raw(self, pool: int, *, direct: bool = False) -> RawStore:
        """The store's own SDK on the link (or, ``direct``, on the server itself)."""
        options = self.direct_storage_options if direct else self.storage_options
        return raw_store(self.scheme, options, self.bucket, pool)


def url(job: Job, *parts: str) -> str:
    if job.scheme == "file":  # a directory: the "bucket" is its absolute path
        return os.path.join(job.bucket, job.prefix, *parts)
    return f"{job.scheme}://{job.bucket}/" + "/".join((job.prefix, *parts))


def save_url(job: Job, method: str, i: int) -> str:
    return url(job, method, f"save{i}")


def raw_prefix(job: Job, method: str, rank: int, i: int) -> str:
    return f"{job.prefix}/{method}/save{i}/rank{rank}"


# ---------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------


SMALL_TENSOR = 16 * 1024  # norms and biases
LAYERS = 12


def param_sizes(size_bytes: int) -> list[tuple[str, int]]:
    """(name, bytes) of a model's parameters whose Adam state totals ``size_bytes``.

    A third of the state is parameters (then ``exp_avg`` and ``exp_avg_sq``):
    half of them in two large tensors (embedding and output), the other half in
    ``LAYERS`` medium weights, plus three small tensors per layer.
    """
    budget = max(3 * 4096, size_bytes // 3)
    large = budget // 4
    medium = max(4096, (budget - 2 * large - 3 * LAYERS * SMALL_TENSOR) // LAYERS)
    sizes = [("embed.weight", large), ("output.weight", large)]
    for i in range(LAYERS):
        sizes.append((f"layer{i:02d}.weight", medium))
        sizes += [(f"layer{i:02d}.{n}", SMALL_TENSOR) for n in ("norm.weight", "norm.bias", "bias")]
    return sizes


# Tensors of the "small:N" shape: a few KiB each (norms, biases, a step per parameter).
FEW_KIB = 4096
BIG_TENSORS = 4


def _model_dims(full: dict[str, int], scale: float) -> dict[str, int]:
    """A config's widths times ``scale`` (multiples of 8, at least 8); layer counts stay."""
    return {k: v if k == "layers" else max(8, int(v * scale) // 8 * 8) for k, v in full.items()}


GPT2_SMALL = {"layers": 12, "hidden": 768, "inner": 3072, "vocab": 50257, "positions": 1024}
LLAMA_1B = {"layers": 16, "hidden": 2048, "inner": 8192, "vocab": 128256, "kv": 512}


def gpt2_params(d: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """GPT2LMHeadModel's state dict names and shapes (``lm_head`` is tied to ``wte``)."""
    h, i = d["hidden"], d["inner"]
    out = [("transformer.wte.weight", (d["vocab"], h)),
           ("transformer.wpe.weight", (d["positions"], h))]
    for n in range(d["layers"]):
        b = f"transformer.h.{n}."
        out += [(b + "ln_1.weight", (h,)), (b + "ln_1.bias", (h,)),
                (b + "attn.c_attn.weight", (h, 3 * h)), (b + "attn.c_attn.bias", (3 * h,)),
                (b + "attn.c_proj.weight", (h, h)), (b + "attn.c_proj.bias", (h,)),
                (b + "ln_2.weight", (h,)), (b + "ln_2.bias", (h,)),
                (b + "mlp.c_fc.weight", (h, i)), (b + "mlp.c_fc.bias", (i,)),
                (b + "mlp.c_proj.weight", (i, h)), (b + "mlp.c_proj.bias", (h,))]
    return [*out, ("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]


def llama_params(d: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """LlamaForCausalLM's state dict names and shapes (Llama 3.2 1B: ``lm_head`` tied)."""
    h, i, kv = d["hidden"], d["inner"], d["kv"]
    out = [("model.embed_tokens.weight", (d["vocab"], h))]
    for n in range(d["layers"]):
        b = f"model.layers.{n}."
        out += [(b + "self_attn.q_proj.weight", (h, h)), (b + "self_attn.k_proj.weight", (kv, h)),
                (b + "self_attn.v_proj.weight", (kv, h)), (b + "self_attn.o_proj.weight", (h, h)),
                (b + "mlp.gate_proj.weight", (i, h)), (b + "mlp.up_proj.weight", (i, h)),
                (b + "mlp.down_proj.weight", (h, i)),
                (b + "input_layernorm.weight", (h,)), (b + "post_attention_layernorm.weight", (h,))]
    return [*out, ("model.norm.weight", (h,))]


MODELS = {"gpt2": (GPT2_SMALL, gpt2_params), "llama": (LLAMA_1B, llama_params)}


def model_params(shape: str, size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameters, widths scaled so that they and AdamW's two moments
    (float32) take about ``size_bytes``."""
    full, params = MODELS[shape]

    def state_bytes(scale: float) -> int:
        return sum(3 * 4 * math.prod(s) for _, s in params(_model_dims(full, scale)))

    lo, hi = 0.0, 1.0
    for _ in range(30):  # the largest scale whose state fits (1.0: the real config)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if state_bytes(mid) <= size_bytes else (lo, mid)
    return params(_model_dims(full, lo))


def shape_names() -> str:
    return "mixed, uniform, small:N (4 big + N small tensors), " + ", ".join(MODELS)


def make_state(
    rank: int, size_bytes: int, tensor_bytes: int, shape: str = "mixed"
) -> dict[str, Any]:
    """About ``size_bytes`` of float32 tensors with keys unique to this rank.

    ``mixed``: a model and its Adam state; ``uniform``: ``tensor_bytes`` tensors;
    ``small:N``: 4 big tensors and ``N`` of a few KiB (a real model's count);
    ``gpt2`` / ``llama``: GPT-2 small's / Llama 3.2 1B's parameter names and
    shapes, widths scaled to the size, with AdamW's state (a 0-d ``step`` each).
    """
    import torch

    gen = torch.Generator().manual_seed(1234 + rank)
    if shape == "uniform":
        n = max(1, size_bytes // tensor_bytes)
        numel = tensor_bytes // 4
        return {
            "model": {
                f"rank{rank}.layer{i:03d}.weight": torch.rand(numel, generator=gen)
                for i in range(n)
            }
        }
    if shape.startswith("small:"):
        n_small = int(shape.split(":", 1)[1])
        big = max(4, (size_bytes - n_small * FEW_KIB) // BIG_TENSORS // 4)
        model = {f"rank{rank}.big{i}": torch.rand(big, generator=gen) for i in range(BIG_TENSORS)}
        model.update({f"rank{rank}.small{i:05d}": torch.rand(FEW_KIB // 4, generator=gen)
                      for i in range(n_small)})
        return {"model": model}
    if shape in MODELS:
        model = {}
        optim: dict[str, Any] = {}
        for name, dims in model_params(shape, size_bytes):
            key = f"rank{rank}.{name}"
            model[key] = torch.rand(dims, generator=gen)
            optim[key] = {
                "step": torch.tensor(1000.0),
                "exp_avg": torch.rand(dims, generator=gen),
                "exp_avg_sq": torch.rand(dims, generator=gen),
            }
        return {"model": model, "optim": {"state": optim}}
    if shape != "mixed":
        raise ValueError(f"unknown state shape {shape!r}: use one of {shape_names()}")
    model = {}
    optim = {}
    for name, nbytes in param_sizes(size_bytes):
        key = f"rank{rank}.{name}"
        model[key] = torch.rand(nbytes // 4, generator=gen)
        optim[key] = {
            "exp_avg": torch.rand(nbytes // 4, generator=gen),
            "exp_avg_sq": torch.rand(nbytes // 4, generator=gen),
            "step": torch.full((1,), 1000.0),
        }
    return {"model": model, "optim": {"state": optim}}


def merged_state(ranks: list[int], size_bytes: int, tensor_bytes: int, shape: str) -> Any:
    """The states of several saved ranks in one dict (a load on a smaller world)."""
    out: dict[str, Any] = {}
    for r in ranks:
        part = make_state(r, size_bytes, tensor_bytes, shape)
        for top, sub in part.items():
            if top == "optim":
                out.setdefault("optim", {"state": {}})["state"].update(sub["state"])
            else:
                out.setdefault(top, {}).update(sub)
    return out


def state_tensors(state: Any) -> list[Any]:
    """Every tensor of a (nested) state dict, in a fixed order."""
    if isinstance(state, dict):
        return [t for k in sorted(state) for t in state_tensors(state[k])]
    return [state]


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(state))


def byte_source(state: dict[str, Any]) -> ByteSource:
    """Zero-copy byte views of the tensors: the raw transfers move exactly these bytes."""
    return ByteSource([memoryview(t.reshape(-1).numpy()).cast("B") for t in state_tensors(state)])


def fingerprint(state: dict[str, Any]) -> list[float]:
    return [float(t.double().sum()) for t in state_tensors(state)]


def s3tc_config() -> Any:
    from s3torchconnector import S3ClientConfig

    # Path-style: the endpoint is an IP address, not a virtual-host name.
    return S3ClientConfig(force_path_style=True)


def purge(job: Job, prefix: str, keep_last: bool, store: RawStore | None = None) -> None:
    """Delete a method's objects (keeping its last save when the loads need it)."""
    store = store or job.raw(4, direct=True)
    store.delete_prefix(prefix, f"{prefix}/save{job.repeats - 1}/" if keep_last else None)


def _failures() -> tuple[type[BaseException], ...]:
    from torch.distributed.checkpoint.api import CheckpointException

    # DCP raises CheckpointException, a BaseException, on every rank when any fails.
    return (Exception, CheckpointException)


_FAILURES = _failures()


def _describe(exc: BaseException) -> str:
    """One line for the table; the full traceback goes to stderr."""
    traceback.print_exception(exc)
    failures = getattr(exc, "failures", None)  # CheckpointException: rank -> (exc, frames)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


# ---------------------------------------------------------------------------
# Saves
# ---------------------------------------------------------------------------


def _dcp_sync(state: dict[str, Any], writer: Any, checkpoint_id: str | None = None) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id)


def _dcp_async(
    state: dict[str, Any], writer: Any, checkpoint_id: str | None = None
) -> tuple[float, Any]:
    """Start an async save; returns (seconds training was blocked, upload future)."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    resp = dcp.async_save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
    staging = getattr(resp, "staging_completion", None)
    if staging is not None:  # an AsyncSaveResponse: training may go on once staged
        staging.result()
        resp = resp.upload_completion
    return time.perf_counter() - t0, resp


class Saver:
    """One method's state across its repeated saves (writer, buffers, pools)."""

    def __init__(self, job: Job, method: str, rank: int, state: dict[str, Any]) -> None:
        self.job, self.method, self.rank, self.state = job, method, rank, state
        self.tmp = tempfile.mkdtemp(prefix=f"dcpv-bench-{method}-r{rank}-")
        self.writer: Any = None
        self.pool: ThreadPoolExecutor | None = None
        self.dst: list[Any] = []
        if method == "memcpy":
            import torch

            self.dst = [torch.empty_like(t) for t in state_tensors(state)]
            for dst, src in zip(self.dst, state_tensors(state), strict=True):
                dst.copy_(src)  # preallocated and warm, as reused staging buffers are
        elif method in RAW_SAVES:
            self.store = job.raw(UPLOAD_STREAMS * 2)
            self.pool = ThreadPoolExecutor(UPLOAD_STREAMS)
            self.src = byte_source(state)
            self.chunk = chunk_size(self.src.total, UPLOAD_STREAMS)
        elif method == "torch_save":
            self.store = job.raw(UPLOAD_STREAMS * 2)
            self.pool = ThreadPoolExecutor(UPLOAD_STREAMS)
        elif method in VW_METHODS and method not in FRESH_WRITER:
            self.writer = self.volume_writer()

    def volume_writer(self) -> Any:
        from dcp_volumes import VolumeWriter

        m = self.method
        options = {**self.job.vw_options, **(SMALL_FILES if m == "vw_async_f32" else {})}
        if m in ENCRYPTED:
            options["encryption"] = bench_encryption()
        return VolumeWriter(
            url(self.job, m),
            storage_options=self.job.our_storage_options,
            staging_dir=self.tmp,
            **options,
        )

    def torch_save_upload(self, i: int) -> None:
        """torch.save to a local file, then that file up as one object."""
        import mmap

        import torch

        path = os.path.join(self.tmp, f"save{i}.pt")
        torch.save(self.state, path)
        key = raw_prefix(self.job, "torch_save", self.rank, i) + ".pt"
        assert self.pool is not None
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            src = ByteSource([memoryview(mm)])
            part = chunk_size(src.total, UPLOAD_STREAMS)
            if self.job.multipart and src.total > part:
                put_multipart(self.store, self.pool, key, src, part)
            else:
                self.store.put(key, src.read(0, src.total))
            del src
        os.unlink(path)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        close = getattr(self.writer, "close", None)
        if callable(close):
            close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def save(self, i: int) -> tuple[float, float]:
        """One save; returns (blocking seconds, end-to-end seconds)."""
        job, m = self.job, self.method
        t0 = time.perf_counter()
        if m == "memcpy":
            for dst, src in zip(self.dst, state_tensors(self.state), strict=True):
                dst.copy_(src)
        elif m == "local_fs":
            from torch.distributed.checkpoint import FileSystemWriter

            w = FileSystemWriter(f"{self.tmp}/save{i}", thread_count=PEER_THREADS, sync_files=False)
            _dcp_sync(self.state, w)
        elif m == "raw_put":
            prefix = raw_prefix(job, m, self.rank, i)
            put_chunks(self.store, self.pool, prefix, self.src, self.chunk)
        elif m == "raw_multipart":
            key = raw_prefix(job, m, self.rank, i) + ".bin"
            put_multipart(self.store, self.pool, key, self.src, self.chunk)
        elif m in ("fsspec_t1", "fsspec_t8", "fsspec_async"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            # A new writer per save: FsspecWriter.reset(checkpoint_id) drops the
            # storage options (the endpoint), so the path must come at construction.
            w = FsspecWriter(
                save_url(job, m, i),
                thread_count=1 if m == "fsspec_t1" else PEER_THREADS,
                sync_files=False,
                **job.storage_options,
            )
            if m == "fsspec_async":
                blocking, fut = _dcp_async(self.state, w)
                fut.result()
                return blocking, time.perf_counter() - t0
            _dcp_sync(self.state, w)
        elif m == "s3tc":
            from s3torchconnector.dcp import S3StorageWriter

            w = S3StorageWriter(
                region="us-east-1",
                path=save_url(job, m, i),
                s3client_config=s3tc_config(),
                thread_count=PEER_THREADS,
            )
            _dcp_sync(self.state, w)
        elif m == "torch_save":
            self.torch_save_upload(i)
        elif m in ("vw_sync", "vw_sync_fresh", "vw_sync_enc"):
            writer = self.volume_writer() if m in FRESH_WRITER else self.writer
            _dcp_sync(self.state, writer, save_url(job, m, i))
        elif m in ("vw_async", "vw_async_f32", "vw_async_fresh", "vw_async_enc"):
            writer = self.volume_writer() if m in FRESH_WRITER else self.writer
            blocking, fut = _dcp_async(self.state, writer, save_url(job, m, i))
            fut.result()
            return blocking, time.perf_counter() - t0
        else:
            raise ValueError(f"unknown method {m!r}")
        e2e = time.perf_counter() - t0
        return e2e, e2e


def free_pooled_buffers() -> None:
    """Empty dcp_volumes' staging pool (what ``CheckpointManager.close`` does)."""
    from dcp_volumes.checkpoint._state_copy import free_pooled_buffers as free

    free()


def server_cpu(job: Job) -> float:
    """CPU seconds the server's processes (and their children) have used so far."""
    import psutil

    total = 0.0
    for pid in job.server_pids:
        try:
            proc = psutil.Process(pid)
            procs = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue  # gone: it counts nothing more
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
    return total


def run_save_method(
    job: Job,
    method: str,
    rank: int,
    state: dict[str, Any],
    sampler: RssSampler,
    barrier: Callable[[], None],
) -> dict[str, Any]:
    """``save_repeats(method, job.repeats)`` saves with one method: times and
    memory peak of each."""
    # Rank 0 drops each previous save between saves; its client exists before the
    # baseline, so its memory is not counted as the method's.
    cleaner = job.raw(4, direct=True) if rank == 0 else None
    # A process-wide staging pool a previous method filled would hide this
    # method's own staging memory (and first-save cost) from its figures.
    free_pooled_buffers()
    release_free_memory()
    barrier()
    # Taken before the method allocates anything: its writer, buffers and
    # staging copies all count as its extra memory.
    baseline = current_rss()
    saves: list[dict[str, Any]] = []
    error = None
    saver: Saver | None = None
    try:
        saver = Saver(job, method, rank, state)
        for i in range(save_repeats(method, job.repeats)):
            if cleaner is not None:
                # Before each save, outside the timing: the server keeps no more than
                # the previous checkpoint (moto holds objects in its own memory and
                # slows as it grows), and the page cache starts clean, before the
                # first save too (on this VM's slow disk, writeback left by a save,
                # or by the method before, would throttle this one's writes;
                # checkpoints of a real job are minutes apart).
                if i > 0:
                    purge(job, f"{job.prefix}/{method}/save{i - 1}", keep_last=False,
                          store=cleaner)
                os.sync()
            barrier()
            sampler.reset()
            server0 = server_cpu(job) if rank == 0 else 0.0
            cpu0 = time.process_time()
            blocking, e2e = saver.save(i)
            cpu = time.process_time() - cpu0
            peak = sampler.peak - baseline
            barrier()  # every rank's requests are in before the server's CPU is read
            server = server_cpu(job) - server0 if rank == 0 else 0.0
            saves.append(
                {
                    "blocking_s": blocking,
                    "e2e_s": e2e,
                    "peak_extra": peak,
                    "cpu_s": cpu,
                    "server_cpu_s": server,
                }
            )
    except _FAILURES as exc:
        error = _describe(exc)
    finally:
        if saver is not None:
            saver.close()
    return {
        "saves": saves,
        "error": error,
        "baseline_rss": baseline,
        # ru_maxrss is exact but covers the process's whole life: only
        # meaningful when this method is all the process did.
        "lifetime_peak_extra": max_rss_lifetime() - baseline if job.isolated else None,
    }


# ---------------------------------------------------------------------------
# Loads
# ---------------------------------------------------------------------------


def local_copy_dir(job: Job) -> str:
    """Where both ranks keep a local-disk copy of the state for the reference load."""
    return os.path.join(tempfile.gettempdir(), f"dcpv-bench-{job.bucket}-{job.prefix}")


def _make_reader(job: Job, name: str) -> Any:
    if name == "local_reader":
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(local_copy_dir(job))
    if job.load_source is None:
        raise RuntimeError("no checkpoint to load")
    if name == "fsspec_reader":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(job.load_source, **job.storage_options)
    if name == "s3tc_reader":
        from s3torchconnector.dcp import S3StorageReader

        return S3StorageReader(
            region="us-east-1", path=job.load_source, s3client_config=s3tc_config()
        )
    if name == "vw_reader_enc":
        from dcp_volumes import VolumeReader

        method = encrypted_source(job)
        return VolumeReader(save_url(job, method, job.repeats - 1),
                            storage_options=job.our_storage_options,
                            encryption=bench_encryption())
    if name in ("vw_reader", "vw_reader_f32"):
        from dcp_volumes import VolumeReader

        source = job.load_source
        if name == "vw_reader_f32":
            source = save_url(job, "vw_async_f32", job.repeats - 1)
        return VolumeReader(source, storage_options=job.our_storage_options)
    raise ValueError(f"unknown reader {name!r}")


def bench_encryption() -> Any:
    from dcp_volumes import Encryption

    return Encryption(key=BENCH_KEY, key_id="bench")


def encrypted_source(job: Job) -> str:
    """The encrypted method whose last save ``vw_reader_enc`` loads."""
    return "vw_sync_enc" if "vw_sync_enc" in job.methods else "vw_async_enc"


def _raw_loads(
    job: Job, rank: int, name: str, state: dict[str, Any], barrier: Callable[[], None]
) -> list[dict[str, Any]]:
    src = byte_source(state)
    size = chunk_size(src.total, UPLOAD_STREAMS)
    store = job.raw(DOWNLOAD_STREAMS * 2)
    buf = bytearray(src.total)
    runs = []
    with ThreadPoolExecutor(DOWNLOAD_STREAMS) as pool:
        for _ in range(job.load_repeats):
            np.frombuffer(buf, dtype=np.uint8)[:] = 0  # a load that reads nothing must not pass
            barrier()
            server0 = server_cpu(job) if rank == 0 else 0.0
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            if name == "raw_get":
                prefix = raw_prefix(job, "raw_put", rank, job.repeats - 1)
                get_chunks(store, pool, prefix, buf, size)
            else:
                key = raw_prefix(job, "raw_multipart", rank, job.repeats - 1) + ".bin"
                # As many ranges as streams, as a reader that fills its streams would.
                per = max(MiB, -(-src.total // DOWNLOAD_STREAMS))
                get_ranges(store, pool, key, buf, per)
            dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            barrier()
            server = server_cpu(job) - server0 if rank == 0 else 0.0
            runs.append(
                {"e2e_s": dt, "verified": src.equals(buf), "cpu_s": cpu, "server_cpu_s": server}
            )
    return runs


def run_loads(
    job: Job, rank: int, state: dict[str, Any], barrier: Callable[[], None]
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    expected = fingerprint(state)
    out: dict[str, Any] = {}
    for name in job.loads:
        runs: list[dict[str, Any]] = []
        error = None
        try:
            if name in RAW_LOADS:
                runs = _raw_loads(job, rank, name, state, barrier)
            else:
                if name == "local_reader":  # untimed: the copy DCP then reads from disk
                    from torch.distributed.checkpoint import FileSystemWriter

                    dcp.save(state, storage_writer=FileSystemWriter(local_copy_dir(job)))
                for _ in range(job.load_repeats):
                    for t in state_tensors(state):
                        t.zero_()  # a load that reads nothing must not pass
                    reader = _make_reader(job, name)
                    barrier()
                    server0 = server_cpu(job) if rank == 0 else 0.0
                    cpu0 = time.process_time()
                    t0 = time.perf_counter()
                    dcp.load(state, storage_reader=reader)
                    dt = time.perf_counter() - t0
                    cpu = time.process_time() - cpu0
                    barrier()
                    server = server_cpu(job) - server0 if rank == 0 else 0.0
                    runs.append(
                        {
                            "e2e_s": dt,
                            "verified": fingerprint(state) == expected,
                            "cpu_s": cpu,
                            "server_cpu_s": server,
                        }
                    )
        except _FAILURES as exc:
            error = _describe(exc)
        out[name] = {"runs": runs, "error": error}
        barrier()
        if name == "local_reader" and rank == 0:
            shutil.rmtree(local_copy_dir(job), ignore_errors=True)
    return out


# ---------------------------------------------------------------------------
# The rank entry point (run through testkit/ranks.py run_ranks)
# ---------------------------------------------------------------------------


def reshard_load(
    job: Job, rank: int, world_size: int, barrier: Callable[[], None]
) -> dict[str, Any]:
    """Load a checkpoint saved by ``job.saved_world_size`` ranks on ``world_size`` ranks."""
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeReader

    mine = [s for s in range(job.saved_world_size) if s % world_size == rank]
    state = merged_state(mine, job.size_bytes, job.tensor_bytes, job.shape)
    expected = fingerprint(state)
    runs: list[dict[str, Any]] = []
    error = None
    try:
        for _ in range(job.load_repeats):
            for t in state_tensors(state):
                t.zero_()
            reader = VolumeReader(job.load_source or "", storage_options=job.our_storage_options)
            barrier()
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            dcp.load(state, storage_reader=reader)
            dt = time.perf_counter() - t0
            runs.append(
                {
                    "e2e_s": dt,
                    "verified": fingerprint(state) == expected,
                    "cpu_s": time.process_time() - cpu0,
                    "server_cpu_s": 0.0,
                }
            )
    except _FAILURES as exc:
        error = _describe(exc)
    barrier()
    return {
        "state_bytes": state_bytes(state),
        "methods": {"load_reshard": {"vw_reader": {"runs": runs, "error": error}}},
    }


def _import_everything() -> None:
    """Import every library a method may use before any RSS baseline is taken.

    s3fs/aiobotocore, boto3, s3torchconnector, adlfs and the Azure SDK each
    add tens of MiB of code and tables to a process once; charged to the first
    method that imports them, that would swamp small-state figures.
    """
    import contextlib
    import importlib

    for name in (
        "torch.distributed.checkpoint",
        "torch.distributed.checkpoint._fsspec_filesystem",
        "s3fs",
        "boto3",
        "s3torchconnector",
        "s3torchconnector.dcp",
        "adlfs",
        "azure.storage.blob",
        "obstore",
        "dcp_volumes",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def rank_main(rank: int, world_size: int, jobs: tuple[Job, ...]) -> list[dict[str, Any]]:
    """One rank: build the state, run each job's methods in order, return the measurements."""
    import os

    import torch.distributed as dist

    def barrier() -> None:
        dist.barrier()

    _import_everything()
    out = []
    state: dict[str, Any] | None = None
    made: tuple[Any, ...] = ()
    for job in jobs:
        if job.saved_world_size and job.saved_world_size != world_size:
            out.append(reshard_load(job, rank, world_size, barrier))
            continue
        if state is None or made != (job.size_bytes, job.tensor_bytes, job.shape):
            state = None
            release_free_memory()
            state = make_state(rank, job.size_bytes, job.tensor_bytes, job.shape)
            made = (job.size_bytes, job.tensor_bytes, job.shape)
        if job.s3tc:
            # s3torchconnector takes its endpoint and credentials from the environment.
            os.environ["AWS_ENDPOINT_URL"] = job.endpoint
            for var, opt in (("AWS_ACCESS_KEY_ID", "key"), ("AWS_SECRET_ACCESS_KEY", "secret")):
                if opt in job.storage_options:
                    os.environ.setdefault(var, str(job.storage_options[opt]))
            os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        results: dict[str, Any] = {"state_bytes": state_bytes(state), "methods": {}}
        with RssSampler() as sampler:
            for method in job.methods:
                t0 = time.perf_counter()
                if method == "load":
                    release_free_memory()
                    barrier()
                    results["methods"]["load"] = run_loads(job, rank, state, barrier)
                else:
                    results["methods"][method] = run_save_method(
                        job, method, rank, state, sampler, barrier
                    )
                barrier()
                if rank == 0 and method not in ("memcpy", "local_fs", "load"):
                    purge(job, f"{job.prefix}/{method}", keep_last=method in job.keep)
                if rank == 0 and not job.isolated:
                    print(
                        f"  [{job.link}] {method}: {time.perf_counter() - t0:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                barrier()
        out.append(results)
    return out
