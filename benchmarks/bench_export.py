"""Hugging Face export benchmark: ``export_safetensors`` against its floor and torch's route,
and ``SafetensorsReader`` against raw ranged GETs.

A state of ``--size-mib`` fp32 weight matrices, saved by 2 gloo ranks as FSDP2
does (``DTensor`` rows, ``Shard(0)``) with ``VolumeWriter`` to moto's S3 server
(its own process, loopback), is exported to bfloat16 safetensors files of at
most ``--max-shard-mib``, three ways, each in a fresh process (peak RSS is its
``ru_maxrss``; local disk its files' peak, sampled):

* ``floor``: raw boto3 ranged GETs of the checkpoint's data files, in parallel,
  then raw multipart PUTs of the output's bytes: the bytes moved, nothing else;
* ``ours``: ``export_safetensors`` (ranged reads, one file staged at a time);
* ``torch``: torch's route: download the checkpoint, ``dcp_to_torch_save``,
  ``torch.load``, cast, ``safetensors`` files as ``save_pretrained`` shards
  them, upload.

Then ``SafetensorsReader`` loads the export into 2 ranks (DTensor ``Shard(0)``
targets), timed against raw ranged GETs of the same bytes (16 streams).

Usage::

    python benchmarks/bench_export.py --quick     # 256 MiB state, 64 MiB files
    python benchmarks/bench_export.py --quick --target radosgw
    python benchmarks/bench_export.py --size-mib 2048 --max-shard-mib 512
    python benchmarks/bench_export.py --size-mib 2048 --max-shard-mib 512 --link remote
    python benchmarks/bench_export.py --size-mib 8192 --target radosgw --no-torch-route

A state above 2 GiB on radosgw is kept on disk (BlueStore on a sparse file) rather
than in RAM.

Writes benchmarks/results/export[_radosgw][_remote][_<MiB>mib][_quick].{json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20
COLS = 1024
_STREAMS = 16  # the floor's parallel requests
RESULTS_DIR = Path(
    os.environ.get("DCP_VOLUMES_BENCH_RESULTS") or REPO_ROOT / "benchmarks" / "results"
)


# -- the checkpoint: 2 ranks, FSDP2-style row shards ------------------------------------------


def _save_rank(rank: int, world: int, url: str, opts: dict[str, Any], size_mib: int,
               tensor_mib: int, how: str = "dcp") -> float:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_volumes import SafetensorsWriter, VolumeWriter

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    rows = tensor_mib * MiB // (4 * COLS)
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": distribute_tensor(torch.randn(rows, COLS, generator=g),
                                                     mesh, [Shard(0)])
             for i in range(max(1, size_mib // tensor_mib))}
    dist.barrier()
    start = time.perf_counter()
    if how == "dcp":
        dcp.save({"model": model, "step": 1},
                 storage_writer=VolumeWriter(url, storage_options=opts))
    else:  # the same shards straight to the HF layout (bfloat16)
        dcp.save(model, storage_writer=SafetensorsWriter(
            url, storage_options=opts, max_shard_size="64MiB", dtype=torch.bfloat16))
    return time.perf_counter() - start


def _load_rank(rank: int, world: int, url: str, opts: dict[str, Any]) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_volumes import SafetensorsReader

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    reader = SafetensorsReader(url, storage_options=opts)
    shapes = {k: v.size for k, v in reader.read_metadata().state_dict_metadata.items()}
    target = {k: distribute_tensor(torch.empty(s, dtype=torch.bfloat16), mesh, [Shard(0)])
              for k, s in shapes.items()}
    dist.barrier()
    start = time.perf_counter()
    dcp.load(target, storage_reader=reader)
    return {"seconds": time.perf_counter() - start, "bytes": reader.stats.data_bytes,
            "requests": reader.stats.data_requests}


# -- the three exports, each run in a fresh process (``--child``) -----------------------------


def _disk_sampler(directory: str) -> tuple[threading.Event, list[int]]:
    stop, peak = threading.Event(), [0]

    def run() -> None:
        while not stop.wait(0.02):
            total = 0
            for root, _, files in os.walk(directory):
                for f in files:
                    with contextlib.suppress(OSError):  # gone since the walk saw it
                        total += os.path.getsize(os.path.join(root, f))
            peak[0] = max(peak[0], total)

    threading.Thread(target=run, daemon=True).start()
    return stop, peak


def _client(opts: dict[str, Any]) -> Any:
    """The floor's boto3 client: a connection per stream, no optional body checksums."""
    from benchmarks._raw import boto3_client

    return boto3_client(opts["client_kwargs"]["endpoint_url"], _STREAMS, key=opts["key"],
                        secret=opts["secret"])


def _child(method: str, src: str, dest: str, opts: dict[str, Any], shard: int) -> dict[str, Any]:
    import torch

    from benchmarks._raw import S3Raw, get_objects, put_multipart
    from dcp_volumes import export_safetensors
    from dcp_volumes._volume import Volume

    warnings.simplefilter("ignore")
    local = tempfile.mkdtemp(prefix="bench-export-")
    stop, disk = _disk_sampler(local)
    start = time.perf_counter()
    if method == "ours":
        export_safetensors(src, dest, dtype="bfloat16", max_shard_size=shard,
                           storage_options=opts, staging_dir=local)
    elif method == "floor":
        bucket, _, prefix = src.removeprefix("s3://").partition("/")
        store = S3Raw(_client(opts), bucket)
        vol = Volume(src, storage_options=opts)
        files = [f for f in vol.list("") if f.path.endswith(".distcp")]
        total = sum(f.size for f in files)
        with ThreadPoolExecutor(_STREAMS) as pool:
            get_objects(store, pool, [(f"{prefix}/{f.path}", bytearray(f.size)) for f in files],
                        16 * MiB)

            class _Bytes:
                def __init__(self, n: int) -> None:
                    self.total, self._data = n, bytes(min(n, shard))

                def read(self, start: int, length: int) -> bytes:
                    return self._data[:length] if length <= len(self._data) else bytes(length)

            out = total // 2  # the bfloat16 output
            dest_prefix = dest.removeprefix("s3://").partition("/")[2]
            for i in range(0, out, shard):
                put_multipart(store, pool, f"{dest_prefix}/f{i}",
                              _Bytes(min(shard, out - i)), 16 * MiB)  # type: ignore[arg-type]
    else:  # torch's route
        from huggingface_hub import split_torch_state_dict_into_shards
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        vol = Volume(src, storage_options=opts)
        ckpt = os.path.join(local, "ckpt")
        with ThreadPoolExecutor(_STREAMS) as pool:  # files side by side, as `aws s3 cp` does
            list(pool.map(lambda f: vol.get_file(f.path, os.path.join(ckpt, f.path)),
                          vol.list("")))
        dcp_to_torch_save(ckpt, os.path.join(local, "full.pt"))
        state = torch.load(os.path.join(local, "full.pt"), weights_only=False)
        model = {k: v.to(torch.bfloat16) for k, v in state["model"].items()}
        del state
        split = split_torch_state_dict_into_shards(model, max_shard_size=shard)
        out = Volume(dest, storage_options=opts)
        for name, tensors in split.filename_to_tensors.items():
            path = os.path.join(local, name)
            save_file({t: model[t] for t in tensors}, path, metadata={"format": "pt"})
            out.put_file(path, name, concurrency=8)
        out.publish("model.safetensors.index.json", json.dumps(
            {"metadata": split.metadata, "weight_map": split.tensor_to_filename}).encode())
    seconds = time.perf_counter() - start
    stop.set()
    time.sleep(0.05)
    shutil.rmtree(local, ignore_errors=True)
    return {"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            * 1024, "local_disk_peak": disk[0]}


def _run_child(method: str, src: str, dest: str, opts: dict[str, Any], shard: int) -> Any:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps([method, src, dest, opts, shard])],
        capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    if proc.returncode:
        raise RuntimeError(f"{method} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _raw_read(url: str, opts: dict[str, Any]) -> tuple[float, int]:
    from benchmarks._raw import S3Raw, get_objects
    from dcp_volumes._volume import Volume

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = _client(opts)
    files = [f for f in Volume(url, storage_options=opts).list("")
             if f.path.endswith(".safetensors")]
    start = time.perf_counter()
    with ThreadPoolExecutor(_STREAMS) as pool:
        get_objects(S3Raw(client, bucket), pool,
                    [(f"{prefix}/{f.path}", bytearray(f.size)) for f in files], 16 * MiB)
    return time.perf_counter() - start, sum(f.size for f in files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--max-shard-mib", type=int, default=512)
    parser.add_argument("--tensor-mib", type=int, default=32)
    parser.add_argument("--target", choices=("moto", "radosgw"), default="moto",
                        help="the S3 server, started here on 127.0.0.1 (default: moto)")
    parser.add_argument("--link", choices=("loopback", "remote"), default="loopback",
                        help="what the exports and loads go through: loopback, or remote "
                             "(a proxy adding 20 ms a request and 200 Mbit/s a connection; "
                             "the checkpoint is saved over loopback first)")
    parser.add_argument("--no-torch-route", action="store_true",
                        help="skip torch's route (it needs the checkpoint twice over and the "
                             "output on local disk, and the whole state in RAM)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*json.loads(args.child))))
        return 0
    if args.quick:
        args.size_mib, args.max_shard_mib, args.tensor_mib = 256, 64, 16
    from benchmarks._common import link_endpoint
    from dcp_volumes._volume import Volume
    from testkit.emulators import MotoServer
    from testkit.radosgw import RadosGW
    from testkit.ranks import run_ranks

    shard = args.max_shard_mib * MiB
    rows: list[dict[str, Any]] = []
    if args.target == "moto":
        server: Any = MotoServer(mode="process")
    elif args.size_mib <= 2048:
        server = RadosGW(memstore_bytes=max(2 << 30, 8 * args.size_mib * MiB))
    else:  # the checkpoint and the outputs would not fit in RAM beside torch's route
        server = RadosGW(disk_bytes=8 * args.size_mib * MiB)
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(server)
        bucket = s3.create_bucket("bench-export")
        opts = s3.storage_options()
        src = f"{bucket}/step-1"
        dcp_save_s = max(run_ranks(_save_rank, 2, src, opts, args.size_mib, args.tensor_mib,
                                   timeout=1800))
        writer_s = max(run_ranks(_save_rank, 2, f"{bucket}/hf-writer", opts, args.size_mib,
                                 args.tensor_mib, "safetensors", timeout=1800))
        print(f"save, 2 ranks: VolumeWriter {dcp_save_s:.2f} s, SafetensorsWriter "
              f"{writer_s:.2f} s", flush=True)
        # What no later step reads is deleted at once: the server's space is the limit.
        Volume(f"{bucket}/hf-writer", storage_options=opts).delete_prefix("")
        opts = s3.storage_options(endpoint=stack.enter_context(link_endpoint(s3, args.link)))
        # Our classes are told what the benchmarks' moto target tells them (_targets.py):
        # moto reads the whole object for every ranged GET.
        ours = {**opts, "ranged_reads_cost_whole_object": True} if args.target == "moto" else opts
        for method in ("floor", "ours") if args.no_torch_route else ("floor", "ours", "torch"):
            r = _run_child(method, src, f"{bucket}/hf-{method}", ours if method == "ours" else opts,
                           shard)
            rows.append({"method": method, **r})
            if method != "ours":  # the reader loads ours below
                Volume(f"{bucket}/hf-{method}", storage_options=opts).delete_prefix("")
            print(f"export {method:6} {r['seconds']:7.2f} s  peak RSS "
                  f"{r['peak_rss'] / MiB:7.0f} MiB  local disk "
                  f"{r['local_disk_peak'] / MiB:7.0f} MiB", flush=True)
        loads = run_ranks(_load_rank, 2, f"{bucket}/hf-ours", ours, timeout=1800)
        load_s = max(r["seconds"] for r in loads)
        raw_s, raw_bytes = _raw_read(f"{bucket}/hf-ours", opts)
    floor = rows[0]["seconds"]
    print()
    print("$ python benchmarks/bench_export.py " + " ".join(sys.argv[1:]))
    print(f"state {args.size_mib} MiB fp32 (2 ranks, Shard(0)), output bfloat16, files of "
          f"{args.max_shard_mib} MiB, {args.target} {args.link}")
    print("| export | seconds | x floor | peak RSS MiB | local disk peak MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['seconds']:.2f} | {r['seconds'] / floor:.2f} | "
              f"{r['peak_rss'] / MiB:.0f} | {r['local_disk_peak'] / MiB:.0f} |")
    requests = sum(r["requests"] for r in loads)
    print(f"| SafetensorsReader, 2 ranks | {load_s:.2f} | {load_s / raw_s:.2f} x raw ranged GETs "
          f"({raw_s:.2f} s, {raw_bytes / MiB:.0f} MiB; {requests} GETs) | | |")
    print(f"| save, 2 ranks: VolumeWriter (fp32 DCP) | {dcp_save_s:.2f} | | | |")
    print(f"| save, 2 ranks: SafetensorsWriter (bf16 HF) | {writer_s:.2f} | | | |")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = ("export" + ("" if args.target == "moto" else f"_{args.target}")
            + ("" if args.link == "loopback" else f"_{args.link}")
            + ("" if args.quick or args.size_mib == 2048 else f"_{args.size_mib}mib"))
    out = RESULTS_DIR / (name + ("_quick.json" if args.quick else ".json"))
    out.write_text(json.dumps({"args": vars(args), "exports": rows, "load_s": load_s,
                               "volume_writer_s": dcp_save_s, "safetensors_writer_s": writer_s,
                               "load_requests": requests,
                               "raw_read_s": raw_s, "raw_read_bytes": raw_bytes}, indent=1))
    _plot(rows, out.with_suffix(".png"), f"{args.size_mib} MiB state, {args.target} {args.link}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Each export's seconds and peak RSS, side by side."""
    from benchmarks._common import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3))
    names = [r["method"] for r in rows]
    left.bar(names, [r["seconds"] for r in rows])
    left.set_ylabel("export, s")
    right.bar(names, [r["peak_rss"] / MiB for r in rows])
    right.set_ylabel("peak RSS, MiB")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
