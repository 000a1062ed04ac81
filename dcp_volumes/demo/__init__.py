"""The goodput demo behind ``dcp-volumes demo`` (``make demo``).

A small image classifier trains under ``torchrun`` while ranks are killed
with SIGKILL at planned instants (inside an async upload, in the window
between the last shard and ``.metadata``, mid-training, a whole node, whose
local disk goes with it and which a new node replaces);
torchrun's elastic agent restarts the group and the job resumes by itself.
A preemption sends SIGTERM to the torchrun agents instead: the ranks save the
step they are at and exit, and the launcher requeues the job.
The same job runs again without crashes (the reference) and once more with
a naive setup (a map-style dataset reading the volume on every access, a
synchronous ``torch.save`` + upload), and the demo reports where the wall
time went, the goodput of each, and whether the resumed job ended exactly
where the reference did.

Modules: ``_config`` (settings, the crash plan), ``_launcher`` (volume,
training set, torchrun), ``_rank`` (a training rank), ``_naive`` (the naive
setup), ``_faults`` (crash injection), ``_events`` (what ranks record),
``_report`` (breakdown, checks, goodput model, table), ``_plot`` (timeline).
Importing this package does not import torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes.demo._config import DemoConfig

__all__ = ["DemoConfig", "add_arguments", "config_from_args", "parse_storage_options"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``dcp-volumes demo``."""
    d = DemoConfig()
    p.add_argument("--volume", default=None, metavar="URL",
                   help="where data and checkpoints go: a directory/mount path, s3://bucket/"
                        "prefix, gs://..., any fsspec URL (default: an embedded S3 server)")
    p.add_argument("--storage-option", action="append", default=[], metavar="K=V",
                   help="an fsspec option for --volume (repeatable; dotted keys nest: "
                        "client_kwargs.endpoint_url=http://127.0.0.1:9000)")
    p.add_argument("--fresh", action="store_true",
                   help="delete an earlier demo run at --volume first (only what it created)")
    p.add_argument("--nproc", type=int, default=d.nproc, help="ranks (one CPU each)")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps")
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between saves")
    p.add_argument("--crashes", type=int, default=d.crashes,
                   help="crashes to inject: SIGKILLs (in an upload, in the commit window, "
                        "mid-training: a node loss, the node replaced, on 2 ranks or more); "
                        "the fourth is a preemption (SIGTERM, requeue)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="draws the crashes (which rank, which step) and the data")
    p.add_argument("--shrink", action="store_true",
                   help="the last crash loses a node and nothing replaces it: the job comes "
                        "back on fewer ranks")
    p.add_argument("--quick", action="store_true", help="skip the naive (before) run")
    p.add_argument("--load", type=int, default=d.load, metavar="N",
                   help="N busy processes beside the jobs, on any CPU: a machine that is "
                        "not idle, reproducibly (default: 0)")
    p.add_argument("--files", type=int, default=d.files, help="training files to create")
    p.add_argument("--global-batch", type=int, default=d.global_batch,
                   help="samples per step over all ranks")
    p.add_argument("--hidden", type=int, default=d.hidden,
                   help="width of the model's head (sets the checkpoint size)")
    p.add_argument("--keep-last", type=int, default=d.keep_last,
                   help="checkpoints to keep (retention)")
    p.add_argument("--failures-per-day", type=float, default=d.failures_per_day,
                   help="interruption rate of the long-run goodput projection")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="output directory: report, plot, logs, local cache (default: a new "
                        "temporary directory)")


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_storage_options(pairs: Sequence[str],
                          base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``, merged over ``base``."""
    out: dict[str, Any] = json.loads(json.dumps(dict(base or {})))  # a deep copy
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(
                f"--storage-option {pair!r}: expected KEY=VALUE, e.g. "
                "client_kwargs.endpoint_url=http://127.0.0.1:9000")
        *parents, leaf = key.strip().split(".")
        node = out
        for name in parents:
            child = node.setdefault(name, {})
            if not isinstance(child, dict):
                raise ConfigurationError(f"--storage-option {pair!r}: {name} is not an object")
            node = child
        node[leaf] = _value(text)
    return out


def config_from_args(args: argparse.Namespace, base_options: Mapping[str, Any]) -> DemoConfig:
    """The ``DemoConfig`` of parsed ``dcp-volumes demo`` arguments."""
    options = parse_storage_options(args.storage_option, base_options)
    if options and args.volume is None:
        raise ConfigurationError("--storage-option needs --volume (the embedded S3 server "
                                 "sets its own options).")
    return DemoConfig(
        nproc=args.nproc, steps=args.steps, save_every=args.save_every, crashes=args.crashes,
        seed=args.seed, shrink=args.shrink, quick=args.quick, files=args.files,
        global_batch=args.global_batch, hidden=args.hidden, keep_last=args.keep_last,
        volume=args.volume, storage_options=options, fresh=args.fresh, workdir=args.workdir,
        failures_per_day=args.failures_per_day, load=args.load,
    )
