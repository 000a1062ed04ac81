"""One rank of the preemption benchmark, run by torchrun (see bench_preemption.py).

Trains a stand-in step (``--step-s`` of sleep: the accelerator's time, during
which the CPU is free, plus a small gradient all-reduce as data parallelism
makes) with ``should_save`` / ``reached_preemption`` on a ``CheckpointManager``,
and writes what it saw as JSON lines to ``OUT/rank-R.jsonl``: each step's
``should_save`` time, the saves, and when the preemption's checkpoint
committed (wall-clock time, comparable with the launcher's). With ``--naive`` it
trains without the manager, as a job with no preemption handling does: SIGTERM ends
it at once, so the launcher's SIGTERM -> exit is torchrun's own shutdown.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from dcp_volumes import CheckpointManager

MiB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("out")
    p.add_argument("--size-mib", type=int, default=128)
    p.add_argument("--interval", type=int, default=1000)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--step-s", type=float, default=0.1)
    p.add_argument("--preemption-signals", default="SIGTERM", help="comma-separated; '' for none")
    p.add_argument("--options", default="{}", help="storage options, JSON")
    p.add_argument("--naive", action="store_true", help="no manager: SIGTERM ends the rank")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    tensors = max(1, args.size_mib // 16)
    state = {f"t{i}": torch.randn(args.size_mib * MiB // 4 // tensors, generator=g)
             for i in range(tensors)}
    grad = torch.zeros(1024)
    signals = tuple(getattr(signal, s) for s in args.preemption_signals.split(",") if s)
    log = open(os.path.join(args.out, f"rank-{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def event(kind: str, **data: object) -> None:
        log.write(json.dumps({"ev": kind, "t": time.time(), **data}) + "\n")

    if args.naive:
        event("start", pid=os.getpid())
        for step in range(1, args.steps + 1):
            time.sleep(args.step_s)
            dist.all_reduce(grad)
            event("step", step=step)
        return
    with CheckpointManager(args.root, keep_last=2, storage_options=json.loads(args.options),
                           save_interval_steps=args.interval,
                           preemption_signals=signals) as mgr:
        event("start", pid=os.getpid())
        polls: list[float] = []
        for step in range(1, args.steps + 1):
            time.sleep(args.step_s)
            dist.all_reduce(grad)
            started = time.perf_counter()
            save = mgr.should_save(step)
            polls.append(time.perf_counter() - started)
            if save:
                mgr.save(step, state)
                event("saved", step=step)
            if mgr.reached_preemption(step):
                event("committed", step=step)
                break
            event("step", step=step)
        event("polls", seconds=polls)
    event("exit")
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
