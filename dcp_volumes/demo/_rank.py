"""One rank of a demo training job, started by torchrun: ``python -m dcp_volumes.demo rank SPEC``.

The training loop is the same for both setups; what differs is where inputs
come from and how checkpoints are taken:

* ``dcp_volumes``: ``VolumeDataset`` + ``DataLoader`` (read-through cache,
  prefetch, random augmentation seeded per sample, a global resumable
  position) and ``CheckpointManager`` (async saves every ``save_every`` steps
  through ``should_save``, retention, restore of the newest complete
  checkpoint, and on SIGTERM a save of the current step: ``reached_preemption``
  ends the loop and the rank exits 0; the local tier in the node's directory,
  with a replica on another node when the job runs on several), public API only;
* ``naive`` (``_naive.py``): a map-style dataset that reads every file from the
  volume on every access, and a synchronous ``torch.save`` on rank 0 followed
  by an upload; no preemption handling (a SIGTERM kills it).

The state holds the model, the optimiser, the LR scheduler, the step, the
loader's position and every rank's RNGs. Each rank records what it does in
an event log (``_events.py``); crashes come from the plan (``_faults.py``).
``SPEC`` is a JSON file the launcher writes; storage options (which may hold
credentials) come from the environment variable ``DCP_VOLUMES_DEMO_OPTIONS``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from dcp_volumes.demo._events import EventLog, process_start_time

T_PROC = process_start_time()

import torch  # noqa: E402 (the import is part of what a restart costs: timed)
import torch.distributed as dist  # noqa: E402

T_IMPORT = time.time()

from dcp_volumes._prompt_exit import leave_now  # noqa: E402
from dcp_volumes._world import cpu_ids  # noqa: E402
from dcp_volumes.demo._config import Crash  # noqa: E402
from dcp_volumes.demo._faults import CrashInjector, SavePhases, kills_so_far  # noqa: E402
from dcp_volumes.demo._workload import (  # noqa: E402
    build_model,
    capture_rngs,
    load_sample,
    params_digest,
    restore_rngs,
)

logger = logging.getLogger("dcp_volumes.demo")

OPTIONS_ENV = "DCP_VOLUMES_DEMO_OPTIONS"
NODE_ENV = "DCP_VOLUMES_DEMO_NODE"

Batch = tuple[torch.Tensor, torch.Tensor, list[str]]


class TrainState:
    """Model, optimiser, LR scheduler, step and this rank's RNGs as one DCP ``Stateful``.

    The RNG states go under a key of their own per rank (``rng_rank<r>``): DCP
    keeps each rank's, and a job that comes back on fewer ranks finds each
    surviving rank's generators. Everything else is the same on every rank (data
    parallel), and DCP writes one copy of it.
    """

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer,
                 sched: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.model, self.optim, self.sched = model, optim, sched
        self.step = 0
        self.rng_key = f"rng_rank{dist.get_rank()}"

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict(),
                "step": self.step, self.rng_key: pickle.dumps(capture_rngs())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.step = int(state["step"])
        restore_rngs(pickle.loads(state[self.rng_key]))  # written by this job's own rank


class Setup(Protocol):
    """Inputs and checkpoints of one setup."""

    def restore(self, state: TrainState) -> int | None: ...
    def restore_sources(self) -> dict[str, int]: ...
    def batches(self, start_step: int) -> Iterator[Batch]: ...
    def fetch_seconds(self, measured: float) -> float: ...
    def should_save(self, step: int) -> bool: ...
    def save(self, step: int, state: TrainState) -> None: ...
    def reached_preemption(self, step: int) -> bool: ...
    def close(self) -> None: ...
    def fail(self, exc: BaseException) -> None: ...


class LibrarySetup:
    """The dcp_volumes setup: VolumeDataset + DataLoader, CheckpointManager."""

    def __init__(self, spec: Mapping[str, Any], options: Mapping[str, Any],
                 injector: CrashInjector, local: str, marks: dict[str, float]) -> None:
        from dcp_volumes import CheckpointManager, DataLoader, VolumeDataset

        marks["t_import_dcpv"] = time.time()
        staging = os.path.join(local, "staging")
        os.makedirs(staging, exist_ok=True)
        dataset = VolumeDataset(spec["data_url"], cache_dir=os.path.join(local, "cache"),
                                cache_limit="1GB", shuffle=True, seed=spec["seed"],
                                transform=load_sample, storage_options=options,
                                last_batch="drop")
        marks["t_dataset"] = time.time()
        # A private generator: torch's DataLoader draws its workers' base seed from the
        # global RNG when an iterator starts, which would shift the dropout stream of a
        # resumed job (its iterator starts at the restored step, not at step 0).
        self.loader = DataLoader(dataset, global_batch_size=spec["global_batch"],
                                 num_workers=spec["num_workers"],
                                 generator=torch.Generator().manual_seed(spec["seed"]))
        marks["t_loader"] = time.time()
        self.mgr = CheckpointManager(
            spec["ckpt_url"], keep_last=spec["keep_last"], storage_options=options,
            staging_dir=staging,
            # Several shard files per rank, so an "upload" kill lands between two of them.
            writer_options={"file_size": spec["file_size"]},
            save_interval_steps=spec["save_every"],
            # A preemption (SIGTERM from torchrun's agent) saves the step the ranks agree on.
            preemption_signals=(signal.SIGTERM,),
            # The newest checkpoint stays on this node's disk, and on several nodes a copy
            # goes to another node: a restart reads it locally, a replaced node from a peer.
            keep_local=True, local_dir=os.path.join(local, "tier"),
            local_replicas=1 if len(spec["nodes"]) >= 2 else 0,
        )
        marks["t_manager"] = time.time()
        self.injector = injector
        injector.evidence = self._evidence

    def _state(self, state: TrainState) -> dict[str, Any]:
        return {"train": state, "data": self.loader}

    def restore(self, state: TrainState) -> int | None:
        return self.mgr.restore(self._state(state))

    def restore_sources(self) -> dict[str, int]:
        return self.mgr.restore_sources

    def batches(self, start_step: int) -> Iterator[Batch]:
        epoch = iter(self.loader)
        while True:  # one pass per epoch; a restored loader continues mid-epoch
            yield from epoch
            epoch = iter(self.loader)

    def fetch_seconds(self, measured: float) -> float:
        return float(self.loader.metrics.fetch_seconds[-1])

    def should_save(self, step: int) -> bool:
        return self.mgr.should_save(step)  # collective: every rank, every step

    def save(self, step: int, state: TrainState) -> None:
        self.injector.before_save(step)
        self.mgr.save(step, self._state(state))

    def reached_preemption(self, step: int) -> bool:
        return self.mgr.reached_preemption(step)

    def close(self) -> None:
        self.mgr.close()

    def fail(self, exc: BaseException) -> None:
        # As a with-block would: a stop signal now abandons the save in flight.
        self.mgr.__exit__(type(exc), exc, exc.__traceback__)

    def _evidence(self, step: int) -> dict[str, Any]:
        """What the volume holds for ``step`` right now (from the commit-window kill)."""
        info = next((i for i in self.mgr.list() if i.step == step), None)
        if info is None:
            return {"listed": False}
        return {"listed": True, "complete": info.complete, "files": info.num_files,
                "problems": list(info.problems[:2])}


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """Data parallelism: every rank's gradients replaced by their mean (one all-reduce).

    This is what DistributedDataParallel does, without overlapping the
    all-reduce with the backward pass; the demo's model is small enough that
    the overlap would not matter, and DDP's constructor imports torch._dynamo
    (seconds of start-up), which every restart of every rank would pay.
    """
    if world == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _logging(rank: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO)  # the checkpoint loggers run at debug for SavePhases
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _fresh_state(spec: Mapping[str, Any], rank: int) -> TrainState:
    """The model, optimiser and schedule before any step: the same on every rank."""
    torch.manual_seed(spec["seed"])  # the same initial weights everywhere
    model = build_model(spec["hidden"])
    optim = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=spec["lr"],
                                                total_steps=spec["steps"] + 1, pct_start=0.1)
    torch.manual_seed(spec["seed"] * 1000 + 1 + rank)  # dropout: a stream per rank
    return TrainState(model, optim, sched)


def _train_step(state: TrainState, x: torch.Tensor, y: torch.Tensor, world: int) -> torch.Tensor:
    """One data-parallel optimiser step on this rank's batch; returns its loss."""
    loss = torch.nn.functional.cross_entropy(state.model(x), y)
    state.optim.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    average_gradients(state.model, world)
    state.optim.step()
    state.sched.step()
    return loss


def _train_steps(spec: Mapping[str, Any], setup: Setup, state: TrainState,
                 injector: CrashInjector, events: EventLog, world: int,
                 start: int) -> tuple[int, bool]:
    """Train from step ``start`` to ``stop_at`` (or the last step), saving as the manager
    says; stop early at a committed preemption. Returns the step reached and whether a
    preemption stopped it."""
    step = start
    stop = spec["stop_at"] or spec["steps"]
    batches = setup.batches(step)
    preempted = False
    while step < stop:
        t0 = time.time()
        x, y, names = next(batches)
        tf = time.time()
        fetch = setup.fetch_seconds(tf - t0)
        # This thread's CPU time over the computation: the useful work. The rest of the
        # step's wall time is the all-reduce wait and the CPU going to other processes.
        cpu0 = time.thread_time()
        loss = _train_step(state, x, y, world)
        step += 1
        state.step = step
        tc = time.time()
        cpu = time.thread_time() - cpu0
        injector.after_compute(step)
        saved = None
        if setup.should_save(step) or step == spec["steps"]:  # should_save: every step
            # The save call itself, as the library's records time it (should_save's
            # agreement, every step, is the step's).
            ts = time.time()
            setup.save(step, state)
            saved = [ts, time.time()]
        events.write("step", step=step, t0=t0, tf=tf, tc=tc, t1=time.time(), fetch=fetch,
                     cpu=cpu, save=saved, samples=list(names),
                     loss=round(float(loss.item()), 5))
        if setup.reached_preemption(step):  # the save of this step is committed
            events.write("preempted", step=step)
            preempted = True
            break
    return step, preempted


def train(spec: Mapping[str, Any]) -> None:
    """Run (or resume) the job described by ``spec`` until ``stop_at`` or the last step."""
    from datetime import timedelta

    torch.set_num_threads(1)  # one CPU per rank; also keeps the arithmetic reproducible
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    t_group = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    _logging(rank)
    run_dir = spec["run_dir"]
    attempt = kills_so_far(run_dir)
    node = int(os.environ.get(NODE_ENV, "0"))
    events = EventLog(run_dir)
    events.write("start", t_proc=T_PROC, t_import=T_IMPORT, t_group=t_group, rank=rank,
                 world=world, node=node, attempt=attempt, leg=spec["leg"],
                 setup=spec["setup"], pid=os.getpid(),
                 restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                 cpus=cpu_ids())
    crashes = [Crash(**c) for c in spec["crashes"]]
    # A node loss takes down the last node (never node 0, which hosts the rendezvous).
    last = len(spec["nodes"]) - 1
    victim = last > 0 and node == last and os.environ.get("LOCAL_RANK", "0") == "0"
    injector = CrashInjector(crashes, attempt=attempt, rank=rank, world=world,
                             setup=spec["setup"], events=events, run_dir=run_dir, node=node,
                             node_victim=victim)
    options = json.loads(os.environ.get(OPTIONS_ENV, "{}"))
    local = os.path.join(spec["local_dir"], f"node-{node}")

    marks = {"t_group": t_group}
    # The inputs and checkpoints first: the library's DataLoader starts its workers' fork
    # server as it is built, and the server's imports run while the model is built and
    # the checkpoint restored (the same order for both setups).
    setup: Setup
    if spec["setup"] == "naive":
        from dcp_volumes.demo._naive import NaiveSetup

        setup = NaiveSetup(spec, options, injector, local)
    else:
        SavePhases.install(injector)
        setup = LibrarySetup(spec, options, injector, local, marks)
    state = _fresh_state(spec, rank)
    model = state.model
    marks["t_model"] = time.time()
    t0 = time.time()
    restored = setup.restore(state)
    events.write("restored", step=restored, t0=t0, t1=time.time(), marks=marks,
                 sources=setup.restore_sources())
    if rank == 0:
        logger.info("attempt %d on %d ranks: %s", attempt, world,
                    f"resumed from step {restored}" if restored else "starting fresh")
    try:
        step, preempted = _train_steps(spec, setup, state, injector, events, world,
                                       start=restored or 0)
    except BaseException as exc:  # a dead peer's collective, or a kill's signal
        setup.fail(exc)
        raise
    w0 = time.time()
    setup.close()
    if preempted:  # the job is requeued and resumes; it has not ended
        dist.destroy_process_group()
        events.write("exit", step=step)
        # The step is committed and the manager closed: nothing is left to do, and the
        # requeue waits for this process's end. Leave without the interpreter's teardown
        # (torch's modules, the loader's iterator; its workers follow this process out).
        leave_now(0)
    digest = params_digest(model) if rank == 0 else None
    events.write("end", step=step, digest=digest, final_wait=[w0, time.time()])
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """Entry point (``python -m dcp_volumes.demo rank SPEC.json``)."""
    with open(argv[0]) as f:
        spec = json.load(f)
    train(spec)
