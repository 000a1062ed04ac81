"""From the ranks' event logs to the goodput report, the checks and the table.

Accounting (from rank 0's clock; the gradient all-reduce keeps ranks in lockstep):

* ``startup``: launch -> the first batch of the first attempt in hand;
* ``restart``: a kill -> the first batch of the next attempt in hand
  (torchrun noticing, stopping the survivors and re-forming the group, the
  new interpreters importing torch, the process group, listing the data,
  the restore, the loader's first batch; each restart also records how long
  the restore took, from the last rank entering it to the last leaving it, and
  how many bytes it read from the local tier, a peer node and the volume);
  after a preemption, from the
  later of the SIGTERM and the end of the last step trained (a job that
  handles the signal trains on to the step it saves), through the commit
  wait, the exit and the requeued torchrun, to its first batch;
* ``lost``: from the end of the last step that the next attempt kept (the
  step it resumed from) to the kill: work that was done and then redone;
* for the steps that were kept: ``compute`` (batch in hand -> optimizer
  step done, the training thread's CPU time), ``stalled`` (the rest of that
  span: the gradient all-reduce waiting and the CPU going to other
  processes, loader workers, the embedded S3 server, other jobs),
  ``checkpoint blocking`` (how long each save call held the job up: from the
  last rank entering it to the last rank leaving it, see ``stall``) and
  ``input wait`` (the loader's ``fetch_seconds``; the measured wait for the
  naive loader);
* ``final wait``: the end of the job waiting for its last save to be on the
  volume (once per job, like the start-up; not a stall of training);
* ``other``: the rest of the wall time (rank skew: ranks that wait inside a
  save for a late rank; the loop's own bookkeeping).

``goodput = compute / wall``; "restart set apart" divides by wall minus
start-up and restarts, the costs of new processes that a few-minute demo
cannot amortise. The checks compare shares of the computation's *wall*
time (compute + stalled): contention from whatever else runs on the machine
slows saves, steps and redone work alike and cancels out, so two runs made
minutes apart compare on what they did. The goodput model projects a long
run from the measured costs (see ``project``).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_volumes._sizes import format_size
from dcp_volumes.checkpoint._discovery import parse_step
from dcp_volumes.demo._config import Crash, DemoConfig
from dcp_volumes.demo._events import read_events
from dcp_volumes.demo._faults import kill_marker
from dcp_volumes.demo._launcher import JobRecord
from dcp_volumes.demo._library import (
    CATEGORY_S,
    CATEGORY_SHARE,
    Comparison,
    compare,
    demo_figures,
)
from dcp_volumes.demo._library import render as render_library
from dcp_volumes.goodput._model import GoodputModel
from dcp_volumes.goodput._report import GoodputReport


@dataclass
class Attempt:
    """One attempt of a job: the processes that torchrun started together.

    ``signal``: the preemption the launcher sent this attempt (its kill marker), if any.
    """

    leg: int
    index: int
    ranks: dict[int, list[dict[str, Any]]]
    signal: dict[str, Any] | None = None

    def of(self, kind: str, rank: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.ranks.get(rank, []) if e["ev"] == kind]

    @property
    def start(self) -> dict[str, Any]:
        return self.of("start")[0]

    @property
    def world(self) -> int:
        return int(self.start["world"])

    @property
    def t_proc(self) -> float:
        return float(min(evs[0]["t_proc"] for evs in self.ranks.values()))

    @property
    def restored(self) -> int | None:
        found = self.of("restored")
        return found[0]["step"] if found else None

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.of("step")

    @property
    def kill(self) -> dict[str, Any] | None:
        """The crash that ended the attempt: a rank's kill event, or the preemption signal."""
        for evs in self.ranks.values():
            for e in evs:
                if e["ev"] == "kill":
                    return e
        return self.signal

    @property
    def preempted(self) -> bool:
        return self.signal is not None


def attempts_of(run_dir: str) -> list[Attempt]:
    """The attempts of a job, in order (legs, then crashes before each)."""
    groups: dict[tuple[int, int], dict[int, list[dict[str, Any]]]] = {}
    for evs in read_events(run_dir):
        s = evs[0]
        groups.setdefault((s["leg"], s["attempt"]), {})[s["rank"]] = evs
    signals = {}
    for (leg, index) in groups:
        path = kill_marker(run_dir, index)
        if os.path.exists(path):
            with open(path) as f:
                doc = json.load(f)
            if doc["crash"]["kind"] == "preempt" and doc.get("leg") == leg:
                signals[(leg, index)] = doc
    return [Attempt(leg, index, ranks, signals.get((leg, index)))
            for (leg, index), ranks in sorted(groups.items()) if 0 in ranks]


def next_attempt(attempts: list[Attempt], i: int) -> Attempt | None:
    """The attempt that continued ``attempts[i]``'s work: the next one of its leg, or
    after a crash that ended the leg (a preemption, a node loss) the requeued one (the
    first of the next leg)."""
    if i + 1 >= len(attempts):
        return None
    att, nxt = attempts[i], attempts[i + 1]
    return nxt if nxt.leg == att.leg or att.kill is not None else None


@dataclass
class CrashOutcome:
    """What one crash cost."""

    crash: dict[str, Any]
    t_kill: float
    last_step: int
    resumed_from: int | None
    steps_lost: int
    lost_s: float
    restart_s: float
    restart_parts: dict[str, float]
    evidence: dict[str, Any]
    #: Preemptions: SIGTERM sent -> the saved step committed (None: no save committed,
    #: as for the naive job) and -> torchrun's agents exited.
    signal_to_commit_s: float | None = None
    signal_to_exit_s: float | None = None
    #: Preemptions: ranks that left the loop through ``reached_preemption`` (of ``world``).
    stopped_cleanly: int = 0
    world: int = 0
    #: The restore of the next attempt: last rank in -> last rank out, and the bytes
    #: all its ranks read from each source (``local``, ``peer``, ``volume``).
    restore_s: float = 0.0
    restore_sources: dict[str, int] = field(default_factory=dict)
    #: Node losses: the node that died; whether a new node took its place (the same
    #: world); the bytes that node's ranks read in the next attempt; whether another
    #: node held a complete replica of the restored checkpoint when it died.
    lost_node: int | None = None
    replaced: bool = False
    node_sources: dict[str, int] = field(default_factory=dict)
    replica_held: bool = False


@dataclass
class RunStats:
    """The measured breakdown of one job."""

    name: str
    setup: str
    worlds: list[int]
    wall: float = 0.0
    compute: float = 0.0
    stalled: float = 0.0
    blocking: float = 0.0
    final_wait: float = 0.0
    input_wait: float = 0.0
    lost: float = 0.0
    restart: float = 0.0
    startup: float = 0.0
    kept_steps: int = 0
    saves: int = 0
    committed: int = 0
    save_blocking: list[float] = field(default_factory=list)
    save_end_to_end: list[float] = field(default_factory=list)
    crashes: list[CrashOutcome] = field(default_factory=list)
    #: Per attempt: (step restored, steps seen committed before, steps saved before).
    restores: list[tuple[int | None, list[int], list[int]]] = field(default_factory=list)
    samples: dict[int, list[str]] = field(default_factory=dict)
    digest: str | None = None
    world_change: tuple[int, int | None] | None = None
    torn_restores: int = 0
    #: Whether any rank kept a complete replica of its peers' files (``local_replicas``).
    replicated: bool = False
    #: For the comparison with the library's records (``_library.py``): the first batch
    #: of each attempt (in ``restart``/``startup`` here), and the launcher's torchrun start
    #: to the first rank process's start (in ``startup``).
    first_batches: float = 0.0
    before_first_process: float = 0.0
    #: The kept steps as the library splits time, from this demo's own events (rank 0):
    #: from one step's end (or the restore's) to the next, less its input wait and the
    #: save before it.
    loop_compute: float = 0.0
    #: ``startup`` and ``restart`` here, split the library's way (rank 0, every attempt
    #: that trained): ``pre_restore``: process start -> the restore call (interpreter,
    #: torch import, process group, data listing); ``restore_span``: the restore call
    #: (else process start -> the first step's start); ``gaps``: a kill (or a preempted
    #: attempt's last step's end, or a leg's launch) -> the next attempt's process start.
    pre_restore: float = 0.0
    restore_span: float = 0.0
    gaps: float = 0.0
    #: The same span of an attempt whose every step was lost (restore -> first batch,
    #: in ``restart`` here): there it is part of a lost step, so lost work.
    lost_pre_loop: float = 0.0
    #: A preempted attempt's last step's end -> its exit (in ``restart`` here): there the
    #: attempt's own end (its last record), before the restart gap.
    preempt_tails: float = 0.0
    #: A leg's end -> the launcher's next launch (a planned stop, then a new torchrun:
    #: ``--shrink``), outside ``wall`` here; there a restart gap inside the run's window.
    between_legs: float = 0.0

    @property
    def other(self) -> float:
        return self.wall - (self.compute + self.stalled + self.blocking + self.final_wait
                            + self.input_wait + self.lost + self.restart + self.startup)

    @property
    def compute_wall(self) -> float:
        """The kept steps' computation on the wall clock (compute + stalled)."""
        return self.compute + self.stalled

    @property
    def goodput(self) -> float:
        return self.compute / self.wall if self.wall else 0.0

    @property
    def goodput_ex_restart(self) -> float:
        rest = self.wall - self.restart - self.startup
        return self.compute / rest if rest > 0 else 0.0

    @property
    def wall_share_ex_restart(self) -> float:
        """``goodput_ex_restart`` with the computation's wall time instead of its CPU time.

        CPU contention (what else ran on the machine) cancels out of it, so two runs
        made at different times compare on what they did, not on their neighbours.
        """
        rest = self.wall - self.restart - self.startup
        return self.compute_wall / rest if rest > 0 else 0.0


def analyse(job: JobRecord) -> RunStats:
    """The breakdown of ``job`` from its ranks' events."""
    attempts = attempts_of(job.run_dir)
    stats = RunStats(name=job.name, setup=job.setup, worlds=[a.world for a in attempts])
    committed: set[int] = set()
    saved: set[int] = set()
    trained = [a for a in attempts if a.steps]
    launch = prev_end = 0.0  # the launch of the current leg chain; the last (re)start
    for i, att in enumerate(trained):
        steps = att.steps
        first_tf = steps[0]["tf"]
        if i == 0 or next_attempt(trained, i - 1) is None:  # a leg the launcher started
            launch = prev_end = job.launches[att.leg]
            ended = trained[i - 1].of("end") if i > 0 else []
            if ended:  # the job's planned stop, then its new launch: not in ``wall`` here
                stats.between_legs += max(0.0, launch - float(ended[0]["t"]))
            stats.startup += first_tf - prev_end
            if i > 0:  # the launch of a later leg -> its first process start
                stats.gaps += att.start["t_proc"] - launch
        else:
            stats.gaps += att.start["t_proc"] - prev_end
            stats.restart += first_tf - prev_end
            stats.crashes[-1].restart_s = first_tf - prev_end
            stats.crashes[-1].restart_parts = _restart_parts(att, prev_end,
                                                             trained[i - 1].preempted)
        loop_start = _loop_start(att, steps)
        restore_t0 = float(att.of("restored")[0]["t0"]) if att.of("restored") else loop_start
        stats.pre_restore += restore_t0 - att.start["t_proc"]
        stats.restore_span += loop_start - restore_t0
        stats.restores.append((att.restored, sorted(committed), sorted(saved)))
        committed |= {int(e["step"]) for e in att.of("committed")}
        saved |= {int(e["step"]) for e in steps if e["save"]}
        by_rank = {r: {e["step"]: e for e in evs if e["ev"] == "step"}
                   for r, evs in sorted(att.ranks.items())}
        _count_saves(stats, att, by_rank)
        nxt = next_attempt(trained, i)
        keep_to = (nxt.restored or 0) if nxt is not None else math.inf
        kept = [e for e in steps if e["step"] <= keep_to]
        _count_kept(stats, kept, by_rank)
        if kept:
            stats.first_batches += kept[0]["fetch"]
            _count_loop(stats, att, kept)
        elif nxt is not None:
            stats.lost_pre_loop += steps[0]["tf"] - _loop_start(att, steps)
        if nxt is not None and att.preempted and att.of("exit"):
            stats.preempt_tails += max(0.0, att.of("exit")[0]["t"] - steps[-1]["t1"])
        if nxt is None:
            _count_end(stats, att, launch)
            continue
        outcome, t_stop = _crash_outcome(job, att, nxt, kept)
        stats.lost += outcome.lost_s
        stats.crashes.append(outcome)
        prev_end = t_stop
    if trained:
        stats.before_first_process = trained[0].start["t_proc"] - job.launches[trained[0].leg]
    stats.committed = len(committed)
    stats.torn_restores = sum(len(a.of("torn")) for a in attempts)
    stats.replicated = any(_replicas(a) for a in attempts)
    changed = next((a for a in attempts if a.world != attempts[0].world), None) \
        if attempts else None
    if changed is not None:
        stats.world_change = (changed.world, changed.restored)
    return stats


def _count_kept(stats: RunStats, kept: list[dict[str, Any]],
                by_rank: Mapping[int, Mapping[int, dict[str, Any]]]) -> None:
    """Add an attempt's kept steps (those the next attempt did not redo) to ``stats``."""
    for j, e in enumerate(kept):
        wall = e["tc"] - e["tf"]
        cpu = min(wall, float(e.get("cpu", wall)))
        stats.compute += cpu
        stats.stalled += wall - cpu
        if e["save"]:
            stats.blocking += stall([r[e["step"]]["save"] for r in by_rank.values()
                                      if e["step"] in r])
        if j > 0:  # the first batch of an attempt is part of its (re)start
            stats.input_wait += e["fetch"]
    stats.kept_steps += len(kept)
    for e in kept:
        stats.samples[e["step"]] = [x for r in by_rank.values()
                                    for x in r.get(e["step"], {}).get("samples", [])]


def _count_loop(stats: RunStats, att: Attempt, kept: list[dict[str, Any]]) -> None:
    """Add an attempt's kept steps, split the library's way, to ``stats`` (rank 0)."""
    prev = _loop_start(att, kept)
    saved = 0.0
    for e in kept:
        stats.loop_compute += e["tc"] - prev - e["fetch"] - saved
        saved = e["save"][1] - e["save"][0] if e["save"] else 0.0
        prev = e["tc"]


def _loop_start(att: Attempt, steps: list[dict[str, Any]]) -> float:
    """Where an attempt's training begins on rank 0: its restore's end (else its first
    step's start)."""
    restored = att.of("restored")
    return float(restored[0]["t1"]) if restored else float(steps[0]["t0"])


def _count_end(stats: RunStats, att: Attempt, launch: float) -> None:
    """Add the end of the job (its last attempt) to ``stats``: final wait, wall, digest."""
    ends = [e for evs in att.ranks.values() for e in evs if e["ev"] == "end"]
    if att.of("end"):
        stats.final_wait += stall([e["final_wait"] for e in ends])
        stats.wall += att.of("end")[0]["t"] - launch
        stats.digest = att.of("end")[0]["digest"]


def _crash_outcome(job: JobRecord, att: Attempt, nxt: Attempt,
                   kept: list[dict[str, Any]]) -> tuple[CrashOutcome, float]:
    """How attempt ``att`` ended (a kill or a preemption) and what it lost, and when it
    stopped; ``nxt`` is the attempt that resumed after it."""
    steps = att.steps
    kill = att.kill
    t_kill = kill["t"] if kill is not None else steps[-1]["t1"]
    boundary = kept[-1]["t1"] if kept else steps[0]["tf"]
    if att.preempted:
        # Told, not killed: every step recorded was trained to its end (a job that
        # handles the signal trains on to the step it saves).
        done = [e["step"] for e in steps]
        t_stop = max(t_kill, steps[-1]["t1"])
    else:
        # The last step computed before the kill (a kill inside a save comes after its
        # step was computed, before that step's event was written).
        done = [e["step"] for e in steps if e["t1"] <= t_kill]
        if kill is not None:
            done.append(int(kill["step"]))
        t_stop = t_kill
    last = max(done) if done else (att.restored or 0)
    outcome = CrashOutcome(
        crash=kill["crash"] if kill is not None else {"index": -1, "kind": "unplanned"},
        t_kill=t_kill, last_step=last, resumed_from=nxt.restored,
        steps_lost=last - (nxt.restored or 0), lost_s=t_stop - boundary,
        restart_s=0.0, restart_parts={},
        evidence=kill["evidence"] if kill is not None else {},
    )
    if att.preempted and kill is not None:
        _preemption_times(outcome, att, job, t_kill)
    _restore_reads(outcome, nxt)
    if kill is not None and kill["crash"]["kind"] == "node" and "node" in kill["evidence"]:
        _node_loss(outcome, job, att, nxt, int(kill["evidence"]["node"]), t_kill)
    return outcome, t_stop


def sum_sources(restored: list[dict[str, Any]]) -> dict[str, int]:
    total = {"local": 0, "peer": 0, "volume": 0}
    for e in restored:
        for k, v in (e.get("sources") or {}).items():
            total[k] = total.get(k, 0) + int(v)
    return total


def _restore_reads(outcome: CrashOutcome, nxt: Attempt) -> None:
    """The restore that followed a crash: its time and where its bytes came from."""
    restored = [e for evs in nxt.ranks.values() for e in evs if e["ev"] == "restored"]
    outcome.restore_s = stall([[e["t0"], e["t1"]] for e in restored])
    outcome.restore_sources = sum_sources(restored)


def _replicas(att: Attempt, *, before: float = math.inf,
              not_node: int | None = None) -> set[int | None]:
    """Steps of which a rank of ``att`` (on another node than ``not_node``) kept a
    complete replica of its peers' files, before ``before``."""
    held = set()
    for evs in att.ranks.values():
        if not_node is not None and int(evs[0].get("node", 0)) == not_node:
            continue
        held |= {parse_step(e["name"]) for e in evs if e["ev"] == "replicated"
                 and e["t"] < before and 0 < e["kept"] == e["of"]}
    return held


def _node_loss(outcome: CrashOutcome, job: JobRecord, att: Attempt, nxt: Attempt, node: int,
               t_kill: float) -> None:
    """A node loss: was it replaced, what did its replacement read, was a replica held."""
    outcome.lost_node = node
    outcome.replaced = nxt.world == att.world
    outcome.node_sources = sum_sources([
        e for evs in nxt.ranks.values() if int(evs[0].get("node", 0)) == node
        for e in evs if e["ev"] == "restored"])
    if nxt.restored is not None:
        # A replica made in any attempt before the loss is still on the surviving disks.
        earlier = [a for a in attempts_of(job.run_dir) if a.start["t"] <= att.start["t"]]
        outcome.replica_held = any(nxt.restored in _replicas(a, before=t_kill, not_node=node)
                                   for a in earlier)


def stall(spans: list[list[float]]) -> float:
    """How long a collective call held up the job: the last rank in -> the last rank out.

    Ranks that arrive early wait inside the call for the late one; that wait is
    rank skew, which the next all-reduce would have absorbed without the call.
    """
    return max(b for _, b in spans) - max(a for a, _ in spans) if spans else 0.0


def _count_saves(stats: RunStats, att: Attempt,
                 by_rank: Mapping[int, Mapping[int, dict[str, Any]]]) -> None:
    saves = [e for e in att.steps if e["save"]]
    kill = att.kill
    hit = kill is not None and kill["crash"]["kind"] in ("upload", "commit")
    stats.saves += len(saves) + int(hit)  # a save the kill interrupted was taken too
    stats.save_blocking += [stall([r[e["step"]]["save"] for r in by_rank.values()
                                    if e["step"] in r]) for e in saves]
    save_t0 = {e["step"]: e["save"][0] for e in saves}
    for e in att.of("committed"):
        if e["step"] in save_t0:
            stats.save_end_to_end.append(e["t"] - save_t0[e["step"]])


def _preemption_times(outcome: CrashOutcome, att: Attempt, job: JobRecord,
                      t_signal: float) -> None:
    """Signal -> commit and -> exit of a preempted attempt (the launcher sent the signal)."""
    stopped = [r for r, evs in att.ranks.items() if any(e["ev"] == "preempted" for e in evs)]
    outcome.stopped_cleanly, outcome.world = len(stopped), att.world
    at = att.of("preempted")
    if at:
        step = int(at[0]["step"])
        commits = [e["t"] for e in att.of("committed") if int(e["step"]) == step]
        if commits:
            outcome.signal_to_commit_s = commits[0] - t_signal
    if att.leg < len(job.exits):
        outcome.signal_to_exit_s = job.exits[att.leg] - t_signal


def _restart_parts(att: Attempt, since: float, requeued: bool = False) -> dict[str, float]:
    restored = att.of("restored")[0]
    first = ("preemption: last step -> commit, exit, requeue, new processes" if requeued
             else "torchrun: kill -> new processes")
    return {
        first: att.t_proc - since,
        "interpreter, torch import, process group": att.start["t_group"] - att.t_proc,
        "data listing, restore": restored["t1"] - att.start["t_group"],
        "first batch": att.steps[0]["tf"] - restored["t1"],
    }


# -- the goodput model ---------------------------------------------------------------------


def project(*, blocking: float, in_flight: float, restart: float, overhead: float,
            failures_per_day: float) -> tuple[float, float]:
    """Goodput of a long run at the best checkpoint interval: ``(goodput, interval_s)``,
    from the library's goodput model (``dcp_volumes.goodput.GoodputModel``: a save blocks
    ``blocking`` and commits ``in_flight`` later; a failure costs the restart and the work
    since the last committed save; ``overhead``: the other time per unit of compute)."""
    model = GoodputModel(failures_per_day=failures_per_day, restart_s=max(0.0, restart))
    best = model.best(blocking, blocking + in_flight, overhead=overhead)
    return best["best_goodput"], best["best_interval_s"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def projection(s: RunStats, cfg: DemoConfig) -> dict[str, float]:
    """The long-run projection of ``s`` (measured costs, ``cfg.failures_per_day``)."""
    b = _mean(s.save_blocking)
    e2e = _mean(s.save_end_to_end)
    restart = _mean([c.restart_s for c in s.crashes]) or s.startup
    overhead = (s.input_wait + s.stalled + max(0.0, s.other)) / s.compute if s.compute else 0.0
    g, t = project(blocking=b, in_flight=max(0.0, e2e - b), restart=restart,
                   overhead=overhead, failures_per_day=cfg.failures_per_day)
    step_s = (s.compute_wall + s.input_wait + s.blocking) / max(1, s.kept_steps)
    return {"goodput": g, "interval_s": t, "interval_steps": t / step_s if step_s else 0.0,
            "blocking_s": b, "in_flight_s": max(0.0, e2e - b), "restart_s": restart,
            "overhead": overhead}


# -- checks --------------------------------------------------------------------------------


@dataclass
class Check:
    """One PASS/FAIL line; ``key`` names it for scripts (``--json``)."""

    key: str
    name: str
    ok: bool
    detail: str


def _epoch_check(samples: Mapping[int, list[str]], cfg: DemoConfig) -> tuple[bool, str]:
    per_epoch = cfg.files // cfg.global_batch
    epochs: dict[int, list[str]] = {}
    for step, names in samples.items():
        epochs.setdefault((step - 1) // per_epoch, []).extend(names)
    bad = []
    for e, names in sorted(epochs.items()):
        whole = len(names) == cfg.files
        if len(set(names)) != len(names) or (whole and len(set(names)) != cfg.files):
            bad.append(e)
    full = sum(1 for names in epochs.values() if len(names) == cfg.files)
    if bad:
        return False, f"epochs {bad} repeat or miss samples"
    return True, f"{full} whole epoch(s) + a partial one, each sample at most once per epoch"


def run_checks(cfg: DemoConfig, crashed: RunStats, ref: RunStats,
               planned: list[Crash]) -> list[Check]:
    """The demo's checks (PASS means all of them)."""
    checks = [_crashes_check(crashed, planned)]
    checks += _result_checks(cfg, crashed, ref)
    checks.append(_complete_check(crashed))
    checks.append(_lost_check(cfg, crashed))
    if any(c.kind == "preempt" for c in planned):
        checks.append(_preempt_check(crashed))
    if any(c.kind == "node" for c in planned) and not cfg.shrink:
        checks.append(_node_check(crashed))
    checks += _time_checks(crashed, ref)
    return checks


def _crashes_check(crashed: RunStats, planned: list[Crash]) -> Check:
    """Every planned fault fired, and torchrun (or the requeue) brought the job back."""
    fired = sorted(int(c.crash.get("index", -1)) for c in crashed.crashes)
    ends = [what for kind, what in (("node", "a node loss"), ("preempt", "a preemption"))
            if any(c.kind == kind for c in planned)
            and not (kind == "node" and crashed.world_change is not None)]
    requeue = f", the scheduler requeued it after {' and '.join(ends)}" if ends else ""
    return Check(
        "crashes", f"every planned crash happened, torchrun restarted the job each time{requeue}",
        fired == [c.index for c in planned],
        f"{len(fired)} of {len(planned)} crashes, {len(crashed.worlds)} attempts")


def _result_checks(cfg: DemoConfig, crashed: RunStats, ref: RunStats) -> list[Check]:
    """The crashed job ended where the reference did: weights, samples, epochs (and the
    world it shrank to)."""
    checks = []
    if cfg.shrink:
        change = crashed.world_change
        what = (f"weights bit-identical to a reference that went from {cfg.nproc} to "
                f"{cfg.nodes[0]} ranks at step {change[1] if change else '?'}, as this job did")
        ok = (crashed.worlds[-1] == cfg.nodes[0] and ref.world_change is not None
              and change is not None and ref.world_change[1] == change[1])
        checks.append(Check("shrink", "the last restart came back on fewer ranks", ok,
                            f"worlds {' -> '.join(map(str, crashed.worlds))}"))
    else:
        what = "weights bit-identical to an uninterrupted run"
    checks.append(Check("weights", f"final {what}", crashed.digest is not None
                        and crashed.digest == ref.digest,
                        f"sha256 {str(crashed.digest)[:12]} vs {str(ref.digest)[:12]}"))
    same = crashed.samples == ref.samples and len(crashed.samples) == cfg.steps
    mism = sorted(s for s in set(crashed.samples) | set(ref.samples)
                  if crashed.samples.get(s) != ref.samples.get(s))
    checks.append(Check("samples", "delivered sample sequence identical to the reference", same,
                        f"{len(crashed.samples)} steps x {cfg.global_batch} samples"
                        + (f"; differs at steps {mism[:5]}" if mism else "")))
    ok, detail = _epoch_check(crashed.samples, cfg)
    checks.append(Check("epochs", "each sample of an epoch exactly once", ok, detail))
    return checks


def _complete_check(crashed: RunStats) -> Check:
    """Each restore took the newest complete checkpoint, never one a crash left partial."""
    # A restore must load a step that was saved and is not older than the newest commit
    # seen (a commit's log line can be lost in a kill, so a newer one is fine: the
    # bit-identical weights show what it held). The save a crash hit must be skipped.
    bad_restores = [r for r, seen, saves in crashed.restores[1:]
                    if (r is None and seen) or (r is not None and (
                        r not in saves or (seen and r < max(seen))))]
    skipped = []
    for c in crashed.crashes:
        kind, step = c.crash.get("kind"), int(c.crash.get("step", 0))
        if kind in ("upload", "commit"):
            ok_skip = (c.resumed_from or 0) < step
            if kind == "commit":
                ev = c.evidence
                ok_skip = ok_skip and ev.get("ranks_with_all_shards_uploaded") == \
                    crashed.worlds[0] and not ev.get("complete", False)
            skipped.append((kind, step, ok_skip))
    detail = f"{len(crashed.restores) - 1} restore(s), each of the newest complete checkpoint"
    if bad_restores:
        detail += f"; WRONG restores of steps {bad_restores}"
    for kind, step, ok_skip in skipped:
        where = "in the commit window (all shards, no .metadata)" if kind == "commit" \
            else "mid-upload"
        detail += f"; step {step}, killed {where}, {'skipped' if ok_skip else 'TAKEN'}"
    return Check("complete", "no checkpoint taken for complete that was not",
                 not bad_restores and all(ok for *_, ok in skipped), detail)


def _lost_check(cfg: DemoConfig, crashed: RunStats) -> Check:
    """No crash cost more than one save interval plus the save in flight."""
    over = []
    for c in crashed.crashes:
        s_last = (c.last_step // cfg.save_every) * cfg.save_every
        allowed = cfg.save_every + (c.last_step - s_last)
        if c.steps_lost > allowed:
            over.append((c.steps_lost, allowed))
    return Check(
        "lost", "work lost per crash <= one save interval + the save in flight", not over,
        "steps lost: " + lost_by_kind(crashed.crashes)
        + f" (interval {cfg.save_every})" + (f"; over: {over}" if over else ""))


def _preempt_check(crashed: RunStats) -> Check:
    """A preemption lost nothing: the ranks saved the step they stopped at, then exited."""
    preempts = [c for c in crashed.crashes if c.crash.get("kind") == "preempt"]
    ok = bool(preempts) and all(
        c.steps_lost == 0 and c.signal_to_commit_s is not None
        and c.stopped_cleanly == c.world for c in preempts)
    details = [
        f"step {c.last_step}: {c.steps_lost} lost, SIGTERM -> commit "
        f"{_seconds(c.signal_to_commit_s)}, -> exit {_seconds(c.signal_to_exit_s)}, "
        f"{c.stopped_cleanly} of {c.world} ranks stopped through reached_preemption"
        for c in preempts]
    return Check("preempt", "preemption lost 0 steps: the ranks saved the step "
                 "they stopped at and exited", ok,
                 "; ".join(details) or "the preemption did not happen")


def _node_check(crashed: RunStats) -> Check:
    """After a node loss, the replacement node read its shards from a peer node, not from
    the volume, where another node held a complete replica of the restored checkpoint."""
    losses = [c for c in crashed.crashes if c.crash.get("kind") == "node" and c.replaced]
    details, ok = [], bool(losses)
    for c in losses:
        src = c.node_sources
        where = f"step {c.resumed_from}: node {c.lost_node} read {sources_text(src)}"
        if c.resumed_from is None:
            details.append(f"node {c.lost_node} lost before any checkpoint: nothing to read")
        elif c.replica_held:
            good = src.get("volume", 0) == 0 and src.get("peer", 0) > 0
            ok = ok and good
            details.append(where + ("" if good else
                                    " although another node held a complete replica"))
        else:
            # Lost while the newest checkpoint was being replicated: the volume serves it.
            ok = ok and crashed.replicated
            details.append(where + " (no complete replica of it was held yet"
                           + ("" if crashed.replicated else "; no replica was ever kept") + ")")
    return Check("node", "after the node loss the replacement node restored from a peer "
                 "node's replica, not the volume", ok,
                 "; ".join(details) or "the node loss did not happen")


def _time_checks(crashed: RunStats, ref: RunStats) -> list[Check]:
    """Checkpoint blocking, input wait and goodput against their targets."""
    # Time shares against the computation's wall time: CPU contention from whatever else
    # runs on the machine slows saves and steps alike, and cancels out.
    cw = crashed.compute_wall
    blk = crashed.blocking / cw if cw else 1.0
    inp = crashed.input_wait / cw if cw else 1.0
    g, g0 = crashed.wall_share_ex_restart, ref.wall_share_ex_restart
    cpu, cpu0 = crashed.goodput_ex_restart, ref.goodput_ex_restart
    return [
        Check("blocking", "checkpoint blocking <= 2% of compute time", blk <= 0.02,
              f"{blk:.2%}"),
        Check("input", "input wait <= 5% of compute time", inp <= 0.05, f"{inp:.2%}"),
        Check(
            "goodput", "goodput (restart set apart) >= 95% of the crash-free run's",
            g0 > 0 and g >= 0.95 * g0,
            f"{g:.1%} vs {g0:.1%} ({g / g0:.1%} of it) with compute on the wall clock, which "
            f"cancels CPU contention; on CPU time {cpu:.1%} vs {cpu0:.1%}" if g0
            else "no reference"),
    ]


# -- the report ----------------------------------------------------------------------------


@dataclass
class Report:
    """Everything the demo found; ``ok`` when every check passed."""

    ok: bool
    checks: list[Check]
    runs: dict[str, RunStats]
    projections: dict[str, dict[str, float]]
    table: str
    command: str
    volume: str
    workdir: str
    json_path: str
    plot_path: str | None
    seconds: float
    #: Per job: the library's goodput figures beside the demo's (``_library.py``).
    library: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        runs = {}
        for name, s in self.runs.items():
            doc = asdict(s)
            doc.pop("samples")
            doc.update(other=s.other, goodput=s.goodput, goodput_ex_restart=s.goodput_ex_restart)
            runs[name] = doc
        return {"ok": self.ok, "checks": [asdict(c) for c in self.checks], "runs": runs,
                "projections": self.projections, "table": self.table,
                "command": self.command, "volume": self.volume, "workdir": self.workdir,
                "json": self.json_path, "plot": self.plot_path, "seconds": self.seconds,
                "library": self.library}


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def lost_by_kind(crashes: list[CrashOutcome]) -> str:
    """``upload 4, commit 6, step 3, preempt 0``: steps lost per crash, in order."""
    return ", ".join(f"{c.crash.get('kind')} {c.steps_lost}" for c in crashes) or "-"


def sources_text(src: Mapping[str, int]) -> str:
    """``local 1.2 MiB, peer 0 B, volume 0 B``."""
    return ", ".join(f"{k} {format_size(src.get(k, 0))}" for k in ("local", "peer", "volume"))


def restart_lines(runs: Mapping[str, RunStats]) -> list[str]:
    """One line per restart: what ended the attempt, the restart's time, and the restore's
    time and where it read its bytes from (a node loss: also what the new node read)."""
    lines = []
    for name in (n for n in ("naive", "dcp_volumes") if n in runs):
        for i, c in enumerate(runs[name].crashes, 1):
            kind = str(c.crash.get("kind"))
            if c.lost_node is not None:
                kind += f" (node {c.lost_node} {'replaced' if c.replaced else 'not replaced'})"
            line = (f"  {name:<12} {i}. {kind}, step {c.last_step} -> resumed from "
                    f"{c.resumed_from if c.resumed_from is not None else 'the start'}: restart "
                    f"{c.restart_s:.1f} s; restore {c.restore_s:.2f} s reading "
                    f"{sources_text(c.restore_sources)}")
            if c.lost_node is not None and c.replaced:
                line += f" (node {c.lost_node}: {sources_text(c.node_sources)})"
            lines.append(line)
    if not lines:
        return []
    return ["restarts (kill -> first batch; the restore: last rank in -> last out, bytes "
            "read from the local tier, a peer node, the volume):", *lines]


def _pct(part: float, whole: float) -> str:
    return f"{part:7.1f} s {part / whole:6.1%}" if whole else f"{part:7.1f} s"


def render_table(runs: Mapping[str, RunStats], proj: Mapping[str, dict[str, float]],
                 cfg: DemoConfig) -> str:
    """The before/after goodput table (plain text)."""
    order = [n for n in ("naive", "dcp_volumes", "reference") if n in runs]
    heads = {"naive": "naive (before)", "dcp_volumes": "dcp_volumes (after)",
             "reference": "dcp_volumes, no crash"}
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, fn: Any) -> None:
        rows.append((label, [fn(runs[n]) for n in order]))

    row("wall time", lambda s: f"{s.wall:7.1f} s")
    row("  compute (CPU time of the steps)", lambda s: _pct(s.compute, s.wall))
    row("  stalled (all-reduce, CPU used elsewhere)", lambda s: _pct(s.stalled, s.wall))
    row("  checkpoint blocking", lambda s: _pct(s.blocking, s.wall))
    row("  end of job: the last save's upload", lambda s: _pct(s.final_wait, s.wall))
    row("  input wait (fetch_seconds)", lambda s: _pct(s.input_wait, s.wall))
    row("  work lost and redone", lambda s: _pct(s.lost, s.wall))
    row("  restart (kill -> first batch)", lambda s: _pct(s.restart, s.wall))
    row("  start-up (launch -> first batch)", lambda s: _pct(s.startup, s.wall))
    row("  other (rank skew, bookkeeping)", lambda s: _pct(s.other, s.wall))
    row("goodput = compute / wall", lambda s: f"{s.goodput:.1%}")
    row("goodput, restart + start-up set apart", lambda s: f"{s.goodput_ex_restart:.1%}")
    row("checkpoints taken / committed", lambda s: f"{s.saves} / {s.committed}")
    row("blocking per save, mean / max",
        lambda s: f"{_mean(s.save_blocking):.3f} / {max(s.save_blocking, default=0):.3f} s")
    row("save end-to-end, mean / max",
        lambda s: f"{_mean(s.save_end_to_end):.3f} / {max(s.save_end_to_end, default=0):.3f} s")
    row("steps lost per crash, by kind", lambda s: lost_by_kind(s.crashes))
    if any(c.crash.get("kind") == "preempt" for s in runs.values() for c in s.crashes):
        def preempt(s: RunStats) -> str:
            ps = [c for c in s.crashes if c.crash.get("kind") == "preempt"]
            return ", ".join(f"{_seconds(c.signal_to_commit_s)} / {_seconds(c.signal_to_exit_s)}"
                             for c in ps) or "-"
        row("preemption: SIGTERM -> commit / -> exit", preempt)
    if any(s.torn_restores for s in runs.values()):
        row("torn checkpoints met by a restore", lambda s: str(s.torn_restores))
    row("restart per crash, mean",
        lambda s: f"{_mean([c.restart_s for c in s.crashes]):.1f} s" if s.crashes else "-")
    rows.append((f"long run: goodput model, {cfg.failures_per_day:g} failures/day",
                 [f"{proj[n]['goodput']:.1%}" for n in order]))
    rows.append(("  at the best interval",
                 [f"{proj[n]['interval_s']:.0f} s (~{proj[n]['interval_steps']:.0f} steps)"
                  for n in order]))
    width = max(len(r[0]) for r in rows) + 2
    cols = [max(len(heads[n]), *(len(r[1][i]) for r in rows)) + 2 for i, n in enumerate(order)]
    lines = ["".ljust(width) + "".join(heads[n].rjust(c) for n, c in zip(order, cols,
                                                                         strict=True))]
    for label, cells in rows:
        lines.append(label.ljust(width) + "".join(v.rjust(c) for v, c in zip(cells, cols,
                                                                             strict=True)))
    return "\n".join(lines)


def command_line(cfg: DemoConfig, volume: str | None = None) -> str:
    """The command that reproduces this configuration."""
    default = DemoConfig()
    parts = ["dcp-volumes demo"]
    for name in ("nproc", "steps", "save_every", "crashes", "seed", "files", "global_batch",
                 "hidden", "keep_last", "load"):
        if getattr(cfg, name) != getattr(default, name):
            parts.append(f"--{name.replace('_', '-')} {getattr(cfg, name)}")
    for flag in ("shrink", "quick", "fresh"):
        if getattr(cfg, flag):
            parts.append(f"--{flag}")
    if cfg.volume:
        parts.append(f"--volume {volume or cfg.volume}")
    return " ".join(parts)


def compare_with_library(runs: Mapping[str, RunStats],
                         library: Mapping[str, GoodputReport]) -> dict[str, Comparison]:
    """The library's report of each job beside the demo's own figures (``_library.py``)."""
    out = {}
    for name, lib in library.items():
        s = runs.get(name)
        if s is None or not lib.attempts:
            continue
        out[name] = compare(name, lib, demo_figures(
            wall=s.wall, loop_compute=s.loop_compute, blocking=s.blocking,
            input_wait=s.input_wait, first_batches=s.first_batches,
            pre_restore=s.pre_restore, restore=s.restore_span, gaps=s.gaps,
            before_first_process=s.before_first_process, lost=s.lost,
            lost_pre_loop=s.lost_pre_loop, preempt_tails=s.preempt_tails,
            between_legs=s.between_legs))
    return out


def library_check(jobs: Mapping[str, JobRecord],
                  comparisons: Mapping[str, Comparison]) -> Check:
    """The library's goodput figures of each job that ran it agree with the demo's own
    (goodput within 1 percentage point, each category within 10% or 0.5 s)."""
    wanted = [name for name, job in jobs.items() if job.setup == "dcp_volumes"]
    missing = [name for name in wanted if name not in comparisons]
    bad = [f"{name}: {'; '.join(c.disagreements)}" for name, c in comparisons.items()
           if c.disagreements]
    bad += [f"{name}: no goodput records of the library" for name in missing]
    agreed = ", ".join(f"{name} {c.goodput[0]:.1%} / {c.goodput[1]:.1%}"
                       for name, c in comparisons.items())
    detail = "; ".join(bad) if bad else (
        f"goodput (library / demo) {agreed}; every category within "
        f"{CATEGORY_SHARE:.0%} or {CATEGORY_S:g} s")
    return Check("library", "the library's goodput report agrees with the demo's own figures",
                 not bad, detail)


def build_report(cfg: DemoConfig, jobs: Mapping[str, JobRecord], workdir: str, volume: str,
                 *, started: float, library: Mapping[str, GoodputReport] | None = None) -> Report:
    """Analyse every job, run the checks, write the JSON and the plot."""
    runs = {name: analyse(job) for name, job in jobs.items()}
    proj = {name: projection(s, cfg) for name, s in runs.items()}
    checks = run_checks(cfg, runs["dcp_volumes"], runs["reference"],
                        jobs["dcp_volumes"].crashes)
    comparisons = compare_with_library(runs, library or {})
    checks.append(library_check(jobs, comparisons))
    table = "\n".join([render_table(runs, proj, cfg), "", *restart_lines(runs), "",
                       render_library(comparisons)]).rstrip()
    plot_path = os.path.join(workdir, "timeline.png")
    from dcp_volumes.demo._plot import plot_timeline  # matplotlib: checked as the demo starts

    plot_timeline(jobs, runs, plot_path, title=command_line(cfg, volume))
    json_path = os.path.join(workdir, "report.json")
    report = Report(ok=all(c.ok for c in checks), checks=checks, runs=runs, projections=proj,
                    library={n: {**c.to_json(), "report": (library or {})[n].to_json()}
                             for n, c in comparisons.items()},
                    table=table, command=command_line(cfg, volume), volume=volume,
                    workdir=workdir,
                    json_path=json_path, plot_path=plot_path, seconds=time.time() - started)
    with open(json_path, "w") as f:
        json.dump(report.to_json(), f, indent=1, default=str)
    return report
