"""The demo's launcher: a volume, a training set, the torchrun jobs, then the report.

``run_demo`` claims a location on a volume (by default an embedded S3 server,
moto, on 127.0.0.1), writes the training set there and runs, one after the
other:

1. the dcp_volumes job with the planned crashes (``_config.plan_crashes``);
2. the reference: the same job with no crash (with ``--shrink``, it changes
   world size at the step where the crashed job came back smaller);
3. the naive job with the same crashes (skipped by ``--quick``).

Each job is started with ``torchrun`` (``python -m torch.distributed.run``):
one agent per node, ``--max-restarts`` equal to the crashes, so the agents
restart the group after every kill and the job resumes by itself. This
module only starts torchrun, watches the ranks' event logs for progress, and
reads them when the job is done. Nothing here supervises a rank.

A node loss (a ``node`` crash) is the victim rank's to start: it SIGKILLs its
torchrun agent and its node's ranks. Here the launcher plays the rest: it
wipes the node's local directory (its disk: the checkpoints' local tier,
staging, the input cache). With ``--shrink`` the surviving agents bring the
job back on fewer ranks by themselves. Otherwise the launcher plays the
scheduler of a job that lost a node (SLURM's requeue, a Kubernetes JobSet's
restart): once the surviving ranks have failed, it stops the job's agents and
starts the job again on the same world, the lost node replaced by one with an
empty disk. (A new agent that joins agents still running deadlocks torch's
rendezvous over the shared store: ``docs/checkpoints.md``.)

A preemption is the scheduler's part, played here: once rank 0 has trained
the planned step, every agent of the job gets SIGTERM (what Kubernetes sends
to a pod, SLURM to a job step), forwards it to its ranks and waits its grace
period (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default) before SIGKILL.
torchrun does not restart after that; the scheduler requeues the job, and so
does ``run_job``: it starts the same leg again, which resumes from the newest
complete checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dcp_volumes._exceptions import ConfigurationError, DcpVolumesError, VolumeError
from dcp_volumes._extras import DEMO_MODULES, require
from dcp_volumes._progress import progress_bar
from dcp_volumes._volume import Volume
from dcp_volumes._world import cpu_ids
from dcp_volumes.demo._config import Crash, DemoConfig, plan_crashes

if TYPE_CHECKING:
    from dcp_volumes.demo._report import Report

logger = logging.getLogger(__name__)

#: The file that marks a location as a demo run's (and lists what the demo created).
MARKER = "dcp_volumes_demo.json"
#: Top-level prefixes a demo run writes below the volume root, besides the marker.
PREFIXES = ("train", "ckpt")

#: A job that takes longer than this is stopped (its agents' sessions are killed).
JOB_TIMEOUT_S = 1800.0
#: How long the surviving ranks of a lost node get to fail their next collective
#: before the scheduler's stop reaches them.
SURVIVORS_FAIL_S = 20.0

Say = Callable[[str], None]


@dataclass(frozen=True)
class Leg:
    """One torchrun launch of a job: its nodes (ranks each) and where it stops."""

    nodes: list[int]
    stop_at: int | None = None
    elastic: bool = False


@dataclass
class JobRecord:
    """What the launcher knows about a finished job; the ranks' events are in ``run_dir``."""

    name: str
    setup: str
    run_dir: str
    crashes: list[Crash]
    launches: list[float] = field(default_factory=list)
    exits: list[float] = field(default_factory=list)
    returncodes: list[list[int]] = field(default_factory=list)
    #: Per preemption: the SIGTERM the launcher sent (see ``_preempt``).
    preemptions: list[dict[str, Any]] = field(default_factory=list)


# -- the volume ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def embedded_s3() -> Iterator[tuple[str, dict[str, Any]]]:
    """An S3 bucket served by moto on 127.0.0.1 for the duration of the block."""
    require("demo", ("moto", "boto3"), needed_for="The demo's embedded S3 server (no --volume)")
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="demo",
                     aws_secret_access_key="demo", region_name="us-east-1"
                     ).create_bucket(Bucket="demo")
        yield "s3://demo", {"key": "demo", "secret": "demo",
                            "client_kwargs": {"endpoint_url": endpoint}}
    finally:
        server.stop()


def claim(volume: Volume, cfg: DemoConfig) -> None:
    """Make ``volume`` this run's: empty, or a demo run's with ``--fresh``; write the marker.

    Raises:
        ConfigurationError: the location holds files no demo run wrote, or holds
            another demo run and ``--fresh`` was not given.
    """
    files = volume.list("")
    if files:
        paths = [f.path for f in files]
        foreign = [p for p in paths if p != MARKER and p.split("/", 1)[0] not in PREFIXES]
        if MARKER not in paths or foreign:
            example = (foreign or paths)[0]
            raise ConfigurationError(
                f"{volume.display_url} already holds {len(paths)} file(s) that no demo run "
                f"wrote (e.g. {example}); the demo writes only to an empty location or to one "
                "that an earlier demo run created, and deletes nothing else. Fix: point "
                "--volume at an empty directory or prefix."
            )
        if not cfg.fresh:
            raise ConfigurationError(
                f"{volume.display_url} holds an earlier demo run. Fix: pass --fresh to delete "
                f"what that run created ({', '.join(p + '/' for p in PREFIXES)} and {MARKER}) "
                "and start again, or choose another --volume."
            )
        for prefix in PREFIXES:
            volume.delete_prefix(prefix)
    config = dict(cfg.to_json(), volume=volume.display_url)
    marker = {"tool": "dcp-volumes demo", "created": time.time(),
              "prefixes": list(PREFIXES), "config": config}
    volume.publish(MARKER, json.dumps(marker, indent=1).encode())


def write_training_set(volume: Volume, cfg: DemoConfig, progress: bool) -> None:
    """The samples of ``_workload.make_samples`` under ``train/``, in parallel."""
    from dcp_volumes.demo._workload import make_samples

    samples = make_samples(cfg.files, cfg.seed)
    with progress_bar(total=len(samples), desc="writing the training set", unit="file",
                      enabled=progress) as bar, \
            ThreadPoolExecutor(8) as pool:
        for _ in pool.map(lambda s: volume.publish(f"train/{s[0]}", s[1]), samples):
            bar.update(1)


# -- jobs ----------------------------------------------------------------------------------


class _Progress:
    """Follows a job's event logs: a progress bar, and a line per crash and restart."""

    def __init__(self, run_dir: str, total: int, desc: str, say: Say, progress: bool,
                 crashes: int) -> None:
        self.run_dir, self.say, self.crashes = run_dir, say, crashes
        self.offsets: dict[str, int] = {}
        self.starts: dict[str, dict[str, Any]] = {}
        #: Rank 0's newest step per (leg, attempt); the legs whose rank 0 ended the job.
        self.steps: dict[tuple[int, int], int] = {}
        self.ended: set[int] = set()
        #: The ranks' start and restored events per (leg, attempt), until all are in.
        self.restored: dict[tuple[int, int], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        self.bar = progress_bar(total=total, desc=desc, unit="step", enabled=progress)

    def poll(self) -> None:
        try:
            names = sorted(os.listdir(self.run_dir))
        except FileNotFoundError:
            return
        for name in names:
            if not (name.startswith("events-") and name.endswith(".jsonl")):
                continue
            path = os.path.join(self.run_dir, name)
            with open(path) as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    self._event(path, json.loads(line))

    def _event(self, path: str, ev: dict[str, Any]) -> None:
        kind = ev.get("ev")
        if kind == "start":
            self.starts[path] = ev
        start = self.starts.get(path, {})
        if kind == "step" and start.get("rank") == 0:
            self.steps[(start["leg"], start["attempt"])] = int(ev["step"])
            self.bar.n = ev["step"]  # goes back after a restart: the redone steps
            self.bar.refresh()
        elif kind == "end" and start.get("rank") == 0:
            self.ended.add(int(start["leg"]))
        elif kind == "kill":
            crash = Crash(**ev["crash"])
            self.say(f"  crash {crash.index + 1}/{self.crashes} at {time.strftime('%X')}: "
                     f"{ev.get('what') or crash.describe()}")
        elif kind == "restored" and start.get("attempt", 0) > 0:
            # One line once every rank of the attempt has restored: where the bytes came from.
            key = (start["leg"], start["attempt"])
            self.restored.setdefault(key, []).append((start, ev))
            if len(self.restored[key]) == start["world"]:
                self._restarted(self.restored[key])

    def _restarted(self, ranks: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        from dcp_volumes.demo._report import sources_text, stall, sum_sources

        start, ev = next(((s, e) for s, e in ranks if s["rank"] == 0), ranks[0])
        step = ev["step"]
        # A requeue starts a new leg (torchrun's restart count says nothing: a restart for
        # a node that joins, as after a node loss, does not count as one).
        requeued = start["leg"] > 0 and not any(
            leg == start["leg"] and attempt < start["attempt"] for leg, attempt in self.restored)
        who = "the requeued job started" if requeued else "torchrun restarted the job"
        restored = [e for _, e in ranks]
        took = stall([[e["t0"], e["t1"]] for e in restored])
        self.say(f"  {who} on {start['world']} rank(s); it resumed "
                 f"from {'step ' + str(step) if step is not None else 'the start'} (restore "
                 f"{took:.2f} s: {sources_text(sum_sources(restored))})")

    def close(self) -> None:
        self.poll()
        self.bar.close()


def _local_dir(workdir: str, job: JobRecord) -> str:
    """The job's local disks: ``<this>/node-<n>`` is node ``n``'s."""
    return os.path.join(workdir, "local", job.name)


def _spec(cfg: DemoConfig, job: JobRecord, leg: int, nodes: list[int], stop_at: int | None,
          root: str, workdir: str) -> dict[str, Any]:
    from dcp_volumes.demo._workload import state_bytes

    per_rank = state_bytes(cfg.hidden) // cfg.nproc
    return {
        "setup": job.setup, "run": job.name, "leg": leg, "run_dir": job.run_dir,
        "local_dir": _local_dir(workdir, job), "nodes": nodes,
        "data_url": f"{root}/train", "ckpt_url": f"{root}/ckpt/{job.name}",
        "steps": cfg.steps, "stop_at": stop_at, "save_every": cfg.save_every,
        "keep_last": cfg.keep_last, "global_batch": cfg.global_batch, "hidden": cfg.hidden,
        "seed": cfg.seed, "lr": 3e-3, "num_workers": 1,
        "crashes": [asdict(c) for c in job.crashes],
        # About three shard files per rank: an "upload" kill then lands between two.
        "file_size": max(1 << 18, per_rank // 3),
    }


def node_cpus(nodes: list[int]) -> list[str]:
    """Each simulated node's own CPUs, a share by its ranks (``DCP_VOLUMES_DEMO_CPUS``).

    Nodes on one machine would otherwise run on each other's CPUs, which real nodes
    never do, and a rank would see the machine's CPUs as its node's (the DataLoader
    sizes its workers and chooses their start method by them). Empty (no pinning) for
    one node, or with fewer CPUs than nodes.
    """
    cpus = cpu_ids()
    if cpus is None or len(nodes) < 2 or len(cpus) < len(nodes):
        return [""] * len(nodes)
    shares, start, total = [], 0, sum(nodes)
    for i, ranks in enumerate(nodes):
        later = len(nodes) - 1 - i  # nodes still to come: a CPU each at least
        end = start + max(1, len(cpus) * ranks // total)
        end = len(cpus) if later == 0 else min(end, len(cpus) - later)
        shares.append(",".join(str(c) for c in cpus[start:end]))
        start = end
    return shares


def _agent_cmd(leg: Leg, node: int, port: int, run_id: str, restarts: int,
               spec_path: str) -> list[str]:
    n = len(leg.nodes)
    nnodes = f"1:{n}" if leg.elastic else str(n)
    # last_call_timeout: how long agents wait for more nodes once the minimum is there
    # (only matters when a node is lost); keep-alive: how soon a dead node is dropped.
    conf = (f"is_host={'true' if node == 0 else 'false'},last_call_timeout=5,"
            "keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120")
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={leg.nodes[node]}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}", f"--max-restarts={restarts}", "--monitor-interval=0.5",
            "-m", "dcp_volumes.demo", "rank", spec_path]


def _stop(procs: list[subprocess.Popen[bytes]], run_dir: str) -> None:
    """End what is left of a job's processes (nothing, after a normal exit).

    torchrun starts each rank in a session of its own, so ending an agent's
    session does not reach its ranks: a running agent is asked first (SIGTERM:
    it stops its ranks and exits), then any rank this job recorded that is
    still alive is killed with its session (its loader workers). After a node
    loss, loader workers of killed ranks may still be winding down too; they
    must not compete with the next job for the CPUs.
    """
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + 15
    for p in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # the session started for this agent
        p.wait()
    for pid in _rank_pids(run_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _rank_pids(run_dir: str, node: int | None = None) -> list[int]:
    """Ranks of this job (of node ``node``) that are still alive (by the pids their
    events recorded)."""
    from dcp_volumes.demo._events import read_events

    alive = []
    for evs in read_events(run_dir):
        if node is not None and int(evs[0].get("node", 0)) != node:
            continue
        pid = int(evs[0]["pid"])
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"dcp_volumes.demo" in cmdline and run_dir.encode() in cmdline:  # not a reused pid
            alive.append(pid)
    return alive


def _preempt(job: JobRecord, procs: list[subprocess.Popen[bytes]], crash: Crash, leg: int,
             step: int, say: Say) -> None:
    """The scheduler's notice: SIGTERM to every agent of the job, recorded first.

    The record is the crash's kill marker (``_faults.kills_so_far`` counts it, so
    the requeued attempt knows this crash fired) with the time the signal was sent.
    """
    from dcp_volumes.demo._faults import kill_marker

    t = time.time()
    doc = {"crash": asdict(crash), "step": step, "t": t, "pid": os.getpid(), "leg": leg,
           "evidence": {"signal": "SIGTERM", "agents": len(procs), "sent_by": "launcher"}}
    path = kill_marker(job.run_dir, crash.index)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)
    job.preemptions.append(doc)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    say(f"  crash {crash.index + 1}/{len(job.crashes)} at {time.strftime('%X')}: "
        f"{crash.describe(job.setup)} (sent at step {step})")


def run_job(cfg: DemoConfig, job: JobRecord, legs: list[Leg], root: str,
            options: Mapping[str, Any], workdir: str, say: Say, progress: bool) -> None:
    """Run ``job``'s legs one after the other under torchrun; raise if one fails.

    A leg that was preempted before it finished is started again (requeued).
    """
    os.makedirs(job.run_dir, exist_ok=True)
    base_env = dict(os.environ, DCP_VOLUMES_DEMO_OPTIONS=json.dumps(dict(options)),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    monitor = _Progress(job.run_dir, cfg.steps, job.name, say, progress, len(job.crashes))
    # With --shrink the lost node stays lost (its agent's exit code is the kill's).
    lost_nodes = {len(cfg.nodes) - 1} if cfg.shrink and any(
        c.kind == "node" for c in job.crashes) else set()
    queue = list(legs)
    preempts = [c for c in job.crashes if c.kind == "preempt"]
    i = -1
    try:
        while queue:
            leg = queue.pop(0)
            i += 1
            spec_path = os.path.join(job.run_dir, f"spec-{i}.json")
            with open(spec_path, "w") as f:
                json.dump(_spec(cfg, job, i, leg.nodes, leg.stop_at, root, workdir), f,
                          indent=1)
            port = _free_port()
            procs: list[subprocess.Popen[bytes]] = []
            job.launches.append(time.time())
            cpus = node_cpus(leg.nodes)

            def start(node: int, leg: Leg = leg, i: int = i, spec_path: str = spec_path,
                      port: int = port, cpus: list[str] = cpus) -> subprocess.Popen[bytes]:
                log = open(os.path.join(job.run_dir, f"node-{node}.log"), "ab")  # noqa: SIM115
                with log:
                    return subprocess.Popen(
                        _agent_cmd(leg, node, port, f"{job.name}-{i}", len(job.crashes),
                                   spec_path),
                        env=dict(base_env, DCP_VOLUMES_DEMO_NODE=str(node),
                                 DCP_VOLUMES_DEMO_CPUS=cpus[node]),
                        cwd=job.run_dir, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True)

            losses = None if cfg.shrink else _NodeLosses(job, workdir, say)
            try:
                for node in range(len(leg.nodes)):
                    procs.append(start(node))
                requeue = _wait_for_leg(job, i, procs, monitor, preempts, say, losses)
            finally:
                _stop(procs, job.run_dir)
            job.exits.append(time.time())
            codes = [int(p.returncode) for p in procs]
            job.returncodes.append(codes)
            monitor.poll()
            if requeue and i not in monitor.ended:
                # Preempted or a node lost (agents that got SIGTERM exit non-zero): the
                # scheduler's requeue. Whether the ranks stopped cleanly is the report's.
                queue.insert(0, leg)
                continue
            failed = [n for n, rc in enumerate(codes) if rc != 0 and n not in lost_nodes]
            if failed or codes[0] != 0:
                raise DcpVolumesError(
                    f"the {job.name} job failed (torchrun exit codes {codes}). Its logs: "
                    f"{os.path.join(job.run_dir, 'node-*.log')}\n" + _log_tail(job.run_dir))
    finally:
        monitor.close()


def _wait_for_leg(job: JobRecord, leg_index: int, procs: list[subprocess.Popen[bytes]],
                  monitor: _Progress, preempts: list[Crash], say: Say,
                  losses: _NodeLosses | None = None) -> bool:
    """Wait for a leg's agents to exit, showing progress, sending the leg's planned
    preemption when its step comes and ending the leg when a node is lost
    (``losses``); returns whether the scheduler requeues the leg (preempted, or a node
    lost)."""
    from dcp_volumes.demo._faults import kills_so_far

    watch_losses = losses is not None and any(c.kind == "node" for c in job.crashes)
    preempted = False
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise DcpVolumesError(
                f"the {job.name} job did not finish in {JOB_TIMEOUT_S:.0f}s; its "
                f"logs are in {job.run_dir}")
        monitor.poll()
        if watch_losses and losses is not None and losses.lost(procs):
            return True
        if not preempted and preempts:
            attempt = kills_so_far(job.run_dir)
            crash = next((c for c in preempts if c.index == attempt), None)
            step = monitor.steps.get((leg_index, attempt), 0)
            if crash is not None and step >= crash.step:
                _preempt(job, procs, crash, leg_index, step, say)
                preempted = True
        time.sleep(0.05 if preempts or watch_losses else 0.25)
    return preempted


class _NodeLosses:
    """Sees each node a ``node`` crash took down, as the scheduler does, and wipes its disk.

    ``lost`` sees the crash's kill marker (the victim writes it before it SIGKILLs its
    agent and its node's ranks); once that agent is gone and no rank of the job is left
    (the survivors fail their next collective), the node's local directory is removed
    and the leg is to be requeued: its agents stopped, all started again, the lost
    node's on an empty disk.
    """

    def __init__(self, job: JobRecord, workdir: str, say: Say) -> None:
        from dcp_volumes.demo._faults import kill_marker

        self.job, self.say = job, say
        self.local_dir = _local_dir(workdir, job)
        # Node losses still to come (a requeued leg does not see one of an earlier leg).
        self.pending = {c.index for c in job.crashes if c.kind == "node"
                        and not os.path.exists(kill_marker(job.run_dir, c.index))}
        self.since: float | None = None

    def lost(self, procs: list[subprocess.Popen[bytes]]) -> bool:
        from dcp_volumes.demo._faults import kill_marker

        for index in sorted(self.pending):
            path = kill_marker(self.job.run_dir, index)
            if not os.path.exists(path):
                continue
            with open(path) as f:
                node = int(json.load(f)["node"])
            if procs[node].poll() is None:
                return False  # the agent is being killed
            self.since = self.since or time.monotonic()
            for pid in _rank_pids(self.job.run_dir, node=node):  # the victim kills them
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            if _rank_pids(self.job.run_dir) and time.monotonic() - self.since < SURVIVORS_FAIL_S:
                return False
            self.pending.discard(index)
            shutil.rmtree(os.path.join(self.local_dir, f"node-{node}"), ignore_errors=True)
            self.say(f"  node {node} lost at {time.strftime('%X')}: the job is stopped and "
                     f"requeued, node {node} replaced by one with an empty disk")
            return True
        return False


def _log_tail(run_dir: str, lines: int = 25) -> str:
    out = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("node-") and name.endswith(".log"):
            with open(os.path.join(run_dir, name), errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
            out.append(f"--- {name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(out)


def _shrink_step(job: JobRecord) -> int | None:
    """The step the crashed job resumed from when it came back on fewer ranks."""
    from dcp_volumes.demo._events import read_events

    procs = read_events(job.run_dir)
    last = max((p for p in procs if p[0]["rank"] == 0), key=lambda p: p[0]["attempt"])
    restored = next((e for e in last if e["ev"] == "restored"), None)
    return None if restored is None else restored["step"]


# -- the whole demo ------------------------------------------------------------------------


def run_demo(cfg: DemoConfig, say: Say, *, progress: bool = True) -> Report:
    """Run the demo and return its ``Report`` (``ok`` when every check passed).

    Raises:
        ConfigurationError: the location holds files that are not a demo run's, or
            an earlier run without ``--fresh``.
        VolumeError: the volume cannot be reached or used.
        DcpVolumesError: a job failed or took too long (its logs are named).
    """
    started = time.time()
    # Checked before minutes of training, not when the report is drawn.
    require("demo", DEMO_MODULES if cfg.volume is None else ("matplotlib",),
            needed_for="dcp-volumes demo")
    with _terminate_as_interrupt():
        return _run_demo(cfg, say, progress=progress, started=started)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the agents' sessions are ended, not orphaned."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that spin on a CPU while the block runs (``--load``). Each
    also stops by itself after ``JOB_TIMEOUT_S`` for every job, should nothing stop it."""
    limit = 3 * JOB_TIMEOUT_S
    code = f"import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
             for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _run_demo(cfg: DemoConfig, say: Say, *, progress: bool, started: float) -> Report:
    from dcp_volumes.demo._library import library_reports
    from dcp_volumes.demo._report import build_report

    workdir = cfg.workdir or tempfile.mkdtemp(prefix="dcp-volumes-demo-")
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    crashes = plan_crashes(cfg)
    with contextlib.ExitStack() as stack:
        if cfg.volume is None:
            root, options = stack.enter_context(embedded_s3())
        else:
            root, options = cfg.volume.rstrip("/"), dict(cfg.storage_options)
        volume = Volume(root, storage_options=options)
        shown = volume.display_url
        try:
            volume.check_root(create=True)
        except DcpVolumesError as exc:
            raise VolumeError(f"cannot use the volume {shown}: {exc}") from exc
        claim(volume, cfg)
        say(f"volume: {shown}{'  (embedded S3 server, moto)' if cfg.volume is None else ''}")
        say(f"output: {workdir}")
        say(f"writing {cfg.files} training files to {shown}/train ...")
        write_training_set(volume, cfg, progress)
        worlds = " -> ".join(str(w) for w in cfg.worlds)
        say(f"job: {cfg.steps} steps on {worlds} ranks, global batch {cfg.global_batch}, "
            f"a save every {cfg.save_every} steps, {len(crashes)} crash(es) (seed {cfg.seed}):")
        for c in crashes:
            say(f"  {c.index + 1}. {c.describe()}")
        if cfg.load:
            stack.enter_context(busy_processes(cfg.load))
            say(f"load: {cfg.load} busy process(es) beside the jobs, on any CPU")
        shares = node_cpus(cfg.nodes)
        if all(shares):
            say(f"nodes: {len(shares)} on this machine, each on CPUs of its own: "
                + " | ".join(shares))
        elastic = cfg.shrink
        jobs: dict[str, JobRecord] = {}

        def run(name: str, setup: str, planned: list[Crash], legs: list[Leg]) -> None:
            job = JobRecord(name=name, setup=setup, crashes=planned,
                            run_dir=os.path.join(workdir, "runs", name))
            jobs[name] = job
            note = f"{len(planned)} crash(es)" if planned else "no crash"
            say(f"\n== {name}: {setup} setup, {note}")
            run_job(cfg, job, legs, root, options, workdir, say, progress)

        run("dcp_volumes", "dcp_volumes", crashes, [Leg(cfg.nodes, elastic=elastic)])
        if cfg.shrink:
            at = _shrink_step(jobs["dcp_volumes"])
            legs = [Leg([cfg.nodes[0]])]
            if at:
                legs.insert(0, Leg(cfg.nodes, stop_at=at))
            say(f"(the reference changes from {cfg.nproc} to {cfg.nodes[0]} ranks at step "
                f"{at or 0}, where the crashed job did)")
        else:
            legs = [Leg(cfg.nodes)]
        run("reference", "dcp_volumes", [], legs)
        if not cfg.quick:
            run("naive", "naive", crashes, [Leg(cfg.nodes, elastic=elastic)])
        # While the volume is up (the embedded server stops with the stack).
        library = library_reports(jobs, root, options)
    return build_report(cfg, jobs, workdir, shown, started=started, library=library)
