"""The suite's command line: ``python -m benchmarks`` and ``dcp-volumes bench``.

::

    python -m benchmarks checkpoint --target radosgw          # the checkpoint matrix
    python -m benchmarks data --target azurite --quick        # the data benchmark
    python -m benchmarks all --target moto --quick            # both (the CI smoke run)
    python -m benchmarks checkpoint --target s3://bucket/run --endpoint http://minio:9000 \\
        --storage-option key=... --storage-option secret=...
    python -m benchmarks checkpoint --link tbf --tbf-rate 800mbit   # kernel-shaped lo
    python -m benchmarks replot [benchmarks/results/checkpoint.json ...]  # redraw the PNGs
    python -m benchmarks scale --ranks 8,64,256,1024     # N simulated ranks, ours and stock

This module only parses and dispatches; the benchmarks are ``bench_*.py``.
Heavy imports (torch, the clients) happen once a benchmark runs, so building
``dcp-volumes``'s parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import LINKS, RESULTS_DIR, TBF_ENV, results_path, write_json
from benchmarks._goodput import DEFAULT_FAILURES_PER_DAY, DEFAULT_RESTART_S
from benchmarks._targets import TargetError, add_target_arguments, resolve

SUITES = ("checkpoint", "data", "all", "replot", "scale")
QUICK = {"sizes": (8,), "ranks": (2,), "repeats": 2, "load_repeats": 1, "local_tier_repeats": 1}


def _shape(text: str) -> str:
    kind, _, count = text.partition(":")
    if text in ("mixed", "uniform", "gpt2", "llama") or (kind == "small" and count.isdigit()):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: use mixed, uniform, small:N (N small tensors), gpt2 or llama")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers separated by commas") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's options (``dcp-volumes bench`` adds the same to its subparser)."""
    p.add_argument("suite", choices=SUITES,
                   help="which benchmark(s) to run; replot: draw the figures of saved results "
                        "again")
    p.add_argument("results", nargs="*", metavar="JSON",
                   help="replot: the result files to draw (default: every checkpoint and data "
                        "result under the results directory)")
    add_target_arguments(p)
    p.add_argument("--quick", action="store_true",
                   help="the smoke profile: 2 ranks x 8 MiB, 2 saves, small data sets (~2 min)")
    p.add_argument("--link", choices=("both", *LINKS), default="both",
                   help="loopback, remote (proxy: +20 ms/request, 200 Mbit/s per connection), "
                        "both (default), or tbf (kernel token bucket on lo in a network "
                        "namespace; needs root)")
    p.add_argument("--tbf-rate", default="800mbit",
                   help="the tbf link's rate, all streams together (tc syntax; default 800mbit)")
    g = p.add_argument_group("checkpoint matrix")
    g.add_argument("--sizes", type=_ints, default=None, metavar="MIB,...",
                   help="state per rank in MiB (default 32,128,512; quick 8)")
    g.add_argument("--ranks", type=_ints, default=None, metavar="N,...",
                   help="rank counts (default 1,2,4; quick 2; scale: 8,64,256,1024)")
    g.add_argument("--repeats", type=int, default=None,
                   help="saves per method, >= 2: the first and the steady state (default 3)")
    g.add_argument("--load-repeats", type=int, default=None, help="loads per reader (default 2)")
    g.add_argument("--methods", default=None,
                   help="comma-separated save methods (and 'load'); default: all that apply")
    g.add_argument("--shape", type=_shape, default="mixed",
                   help="mixed: model + Adam state, a few large and many small tensors "
                        "(default); uniform: --tensor-mib tensors; small:N: 4 big tensors "
                        "and N of 4 KiB (small:2048, small:10240); gpt2, llama: GPT-2 small's "
                        "and Llama 3.2 1B's names and shapes, widths scaled to --sizes, with "
                        "AdamW's state")
    g.add_argument("--tensor-mib", type=float, default=8,
                   help="tensor size of --shape uniform (e.g. 0.015625: 16 KiB)")
    g.add_argument("--vw-file-size", default=None, help="VolumeWriter file_size, e.g. 32MiB")
    g.add_argument("--no-reshard", action="store_true",
                   help="skip the load on another world size")
    g.add_argument("--no-local-tier", action="store_true", help="skip the local-tier restore")
    g.add_argument("--encrypt", action="store_true",
                   help="add VolumeWriter/VolumeReader with encryption= beside the same "
                        "unencrypted (vw_sync, vw_async, their loads) and print the ratios "
                        "and the cipher's one-core throughput")
    g.add_argument("--files-per-rank", type=int, default=8,
                   help="scale: files (tensors) of each simulated rank (default 8)")
    g.add_argument("--parallel", type=int, default=16,
                   help="scale: simulated ranks writing or reading at once (default 16)")
    g.add_argument("--trace-memory", action="store_true",
                   help="scale: record the coordinator's peak allocation a phase (tracemalloc; "
                        "its seconds are slower than an untraced run's)")
    g.add_argument("--failures-per-day", type=float, default=DEFAULT_FAILURES_PER_DAY,
                   help=f"goodput model: interruptions per day (default "
                        f"{DEFAULT_FAILURES_PER_DAY}, Llama 3)")
    g.add_argument("--restart-s", type=float, default=DEFAULT_RESTART_S,
                   help=f"goodput model: seconds a restart costs (default {DEFAULT_RESTART_S:g})")
    d = p.add_argument_group("data")
    d.add_argument("--files", type=int, default=None, metavar="N",
                   help="the data benchmark at scale: one dataset of N small files (listing, "
                        "memory, cache inodes, epochs, resume; e.g. 1000000 with --target dir)")
    d.add_argument("--file-bytes", type=int, default=None,
                   help="with --files: bytes a file (default 1024)")


def to_argv(args: argparse.Namespace) -> list[str]:
    """The command line of ``args``, options at their defaults left out (for reports, re-exec)."""
    defaults = vars(build_parser().parse_args([args.suite]))
    argv = [args.suite]
    for dest, default in defaults.items():
        value = getattr(args, dest, None)
        if dest in ("suite", "results", "json", "no_progress") or value is None or value == default:
            continue
        flag = "--" + dest.replace("_", "-")  # every option here is spelled after its dest
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        elif isinstance(value, tuple):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="dcp_volumes benchmark suite (run from a repository checkout)",
    )
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _links(args: argparse.Namespace) -> tuple[str, ...]:
    return ("loopback", "remote") if args.link == "both" else (args.link,)


def _in_tbf_namespace() -> bool:
    return bool(os.environ.get(TBF_ENV))


def reexec_in_tbf_namespace(argv: Sequence[str], rate: str) -> int:
    """Run this command again inside a new network namespace whose lo has a tbf qdisc."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise TargetError(f"--link tbf needs {', '.join(missing)} (util-linux, iproute2)")
    script = (
        'ip link set lo up && tc qdisc add dev lo root tbf rate "$0" burst 1mb latency 50ms '
        '&& exec "$@"'
    )
    cmd = ["unshare", "-n", "--", "sh", "-c", script, rate,
           sys.executable, "-m", "benchmarks", *argv]
    env = {**os.environ, TBF_ENV: rate}
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode != 0 and os.geteuid() != 0:
        print("--link tbf: a network namespace with a qdisc needs root (CAP_NET_ADMIN); "
              "use --link remote (the user-space proxy) instead", file=sys.stderr)
    return proc.returncode


def checkpoint_config(args: argparse.Namespace, command: str) -> Any:
    from benchmarks._goodput import GoodputModel
    from benchmarks.bench_checkpoint import DEFAULT_METHODS, CheckpointConfig

    quick = args.quick
    methods = (
        tuple(m.strip() for m in args.methods.split(",") if m.strip())
        if args.methods
        else (*DEFAULT_METHODS, "load")
    )
    if getattr(args, "encrypt", False):
        from benchmarks._ckpt_ranks import ENCRYPTED

        extra = [m for m in ("vw_sync", "vw_async", *ENCRYPTED) if m not in methods]
        # Before "load": the loads read the last saves of the methods before them.
        saves = tuple(m for m in methods if m != "load")
        methods = (*saves, *extra, *(("load",) if "load" in methods else ()))
    return CheckpointConfig(
        target=resolve(args.target, endpoint=args.endpoint, options=args.storage_option),
        links=_links(args),
        sizes_mib=args.sizes or (QUICK["sizes"] if quick else (32, 128, 512)),
        ranks=args.ranks or (QUICK["ranks"] if quick else (1, 2, 4)),
        repeats=args.repeats or (QUICK["repeats"] if quick else 3),
        load_repeats=args.load_repeats or (QUICK["load_repeats"] if quick else 2),
        shape=args.shape,
        tensor_mib=args.tensor_mib,
        methods=methods,
        vw_options={"file_size": args.vw_file_size} if args.vw_file_size else {},
        reshard=not args.no_reshard,
        local_tier=not args.no_local_tier,
        local_tier_repeats=QUICK["local_tier_repeats"] if quick else 3,
        goodput=GoodputModel(args.failures_per_day, args.restart_s),
        quick=quick,
        command=command,
    )


def run_checkpoint(args: argparse.Namespace, command: str, out: Any = None) -> int:
    from benchmarks import _ckpt_report as rep
    from benchmarks.bench_checkpoint import run

    stream = out or sys.stdout
    cfg = checkpoint_config(args, command)
    for link in cfg.links:
        if link == "remote" and not cfg.target.proxyable:
            raise TargetError(
                f"--target {cfg.target.name}: there is no server to put the remote link's proxy "
                "in front of; use --link loopback (or give --endpoint)"
            )
    stem = cfg.target.stem("checkpoint") + ("_quick" if cfg.quick else "")
    stem += "_tbf" if "tbf" in cfg.links else ""
    if args.vw_file_size:
        stem += f"_file_size_{args.vw_file_size.lower()}"
    # Every finished cell lands on disk at once: a run cut short keeps them.
    report = run(cfg, partial=lambda doc: write_json(f"{stem}.partial.json", doc))
    results_path(f"{stem}.partial.json").unlink(missing_ok=True)
    json_path = write_json(f"{stem}.json", report)
    md_path = results_path(f"{stem}.md")
    md_path.write_text(rep.markdown(report) + "\n")
    pngs = rep.plot_all(report, results_path(stem))
    if getattr(args, "json", False):
        print(json.dumps(report, default=str), file=stream)
        return 0
    print(f"\n## checkpoints on {cfg.target.name}: `{command}`\n", file=stream)
    head = rep.headline_cells(report)
    if head:
        print(f"### {head[0]['world_size']} ranks x {head[0]['size_mib']} MiB, steady state "
              f"(loads: x the download floor)\n", file=stream)
        print(rep.headline_table(report), file=stream)
        print("\n### targets per cell (ours)\n", file=stream)
    print(rep.summary_table(report), file=stream)
    if report["local_tier"]:
        print("\n## restore from the local tier\n", file=stream)
        print(rep.local_tier_table(report), file=stream)
    print(f"\n## goodput model ({cfg.goodput.failures_per_day:g} failures/day, restart "
          f"{cfg.goodput.restart_s:g} s), the largest cell of each link\n", file=stream)
    print(rep.goodput_table(report), file=stream)
    la0, la1 = report["machine"]["load_average_start"], report["machine"]["load_average_end"]
    print(f"\nload average start {la0[0]:.2f}, end {la1[0]:.2f}; wall {report['wall_s']:.0f} s",
          file=stream)
    print(f"every table: {md_path}\nnumbers: {json_path}\nplots: "
          + ", ".join(str(p) for p in pngs), file=stream)
    return 0


def run_data(args: argparse.Namespace) -> int:
    from benchmarks import bench_data

    argv = ["--target", args.target, "--link", args.link]
    if args.endpoint:
        argv += ["--endpoint", args.endpoint]
    for opt in args.storage_option or ():
        argv += ["--storage-option", opt]
    if args.quick:
        argv.append("--quick")
    if args.files:
        argv += ["--files", str(args.files)]
    if args.file_bytes:
        argv += ["--file-bytes", str(args.file_bytes)]
    return int(bench_data.main(argv))


def _result_file(name: str) -> Path:
    path = Path(name)
    if path.exists():
        return path
    if (RESULTS_DIR / path).exists():
        return RESULTS_DIR / path
    raise ValueError(f"{name}: no such result file (here or under {RESULTS_DIR}). Fix: give the "
                     "path of a .json a benchmark wrote, e.g. benchmarks/results/checkpoint.json")


def replot(names: Sequence[str], out: Any = None) -> int:
    """Draw the figures of saved results again, beside each JSON, from its numbers alone.

    With no names: every checkpoint and data result under the results directory
    (what a change to the plots regenerates before it is committed).
    """
    from benchmarks import _ckpt_report, _data_report

    explicit = bool(names)
    files = (
        [_result_file(n) for n in names]
        if explicit
        else sorted(p for p in RESULTS_DIR.rglob("*.json") if not p.name.endswith(".partial.json"))
    )
    for path in files:
        report = json.loads(path.read_text())
        kind = report.get("benchmark")
        if kind == "checkpoint":
            drawn = _ckpt_report.plot_all(report, path.with_suffix(""))
        elif kind == "data":
            drawn = [path.with_suffix(".png")]
            _data_report.plot(report, drawn[0])
        elif explicit:
            raise ValueError(f"{path}: not a checkpoint or data result (its 'benchmark' is "
                             f"{kind!r}). Fix: give a checkpoint*.json or data*.json")
        else:
            continue
        print(f"{path}: " + ", ".join(p.name for p in drawn), file=out or sys.stdout)
    return 0


def run_scale(args: argparse.Namespace, out: Any = None) -> int:
    """The simulation of N ranks (``bench_scale``); moto only, ours and stock side by side."""
    if args.target != "moto":
        raise ValueError("scale runs against moto only (it counts requests through a proxy)")
    from benchmarks import bench_scale

    methods = tuple(args.methods.split(",")) if args.methods else bench_scale.METHODS
    unknown = set(methods) - set(bench_scale.METHODS)
    if unknown:
        raise ValueError(f"scale --methods: {sorted(unknown)}; choose from {bench_scale.METHODS}")
    if args.files_per_rank < 1 or args.parallel < 1:
        raise ValueError("--files-per-rank and --parallel must be >= 1")
    return bench_scale.main(args.ranks or bench_scale.DEFAULT_RANKS, files=args.files_per_rank,
                            parallel=args.parallel, methods=methods, trace=args.trace_memory,
                            out=out or sys.stdout)


def run(args: argparse.Namespace, argv: Sequence[str], out: Any = None) -> int:
    """Run what ``args`` asks for; ``argv`` is the command line (for the reports and tbf)."""
    if args.suite == "replot":
        return replot(args.results, out)
    if args.results:
        raise ValueError(f"{' '.join(args.results)}: result files are for `replot`; "
                         f"`{args.suite}` takes options only")
    resolve(args.target, endpoint=args.endpoint, options=args.storage_option)  # fail early
    if getattr(args, "no_progress", False):
        os.environ["TQDM_DISABLE"] = "1"  # tqdm reads it (the ranks inherit it too)
    if args.link == "tbf" and not _in_tbf_namespace():
        return reexec_in_tbf_namespace(argv, args.tbf_rate)
    command = "python -m benchmarks " + " ".join(argv)
    if args.suite == "scale":
        return run_scale(args, out)
    code = 0
    if args.suite in ("checkpoint", "all"):
        code = run_checkpoint(args, command, out) or code
    if args.suite in ("data", "all"):
        code = run_data(args) or code
    return code


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM unwinds like Ctrl-C: the ranks, proxies and servers this run started
    # are stopped by their `finally` blocks instead of outliving it.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run(args, to_argv(args))
    except (TargetError, ValueError) as exc:
        print(f"python -m benchmarks: error: {exc}", file=sys.stderr)
        return 2
