"""Run a function on N gloo ranks in new processes, started the way torchrun starts them.

Our own small helper (not ``torch.testing._internal``)::

    def _body(rank: int, world_size: int, n: int) -> float:   # module level: pickled
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t.sum().item()

    assert run_ranks(_body, 2, 3) == [3.0, 3.0]

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR and MASTER_PORT in its environment (and, with more than one
rank, OMP_NUM_THREADS=1 unless set, as torchrun does; torch's thread count
follows it), calls ``init_process_group("gloo")`` through the
``env://`` method, runs ``fn(rank, world_size, *args)`` and destroys the group.

Ranks fork from a server that imported torch, torch.distributed and
dcp_volumes once (``forkserver_context``) instead of each importing them again;
each rank still gets the caller's environment and working directory as of the
call. ``fresh=True`` spawns a new interpreter per rank instead, for a test
about what happens at import.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from .ports import free_port

__all__ = ["PRELOAD", "RankError", "RankTimeoutError", "forkserver_context", "process_running",
           "run_ranks"]

# What the fork server imports before it forks any process.
PRELOAD = ("torch", "torch.distributed", "dcp_volumes", "s3fs")

# After the first rank fails, peers blocked in a collective get this long to
# fail or finish on their own before they are killed.
_GRACE_S = 10.0


class RankError(RuntimeError):
    """A rank raised, died, or did not report. ``rank`` is the first rank that failed."""

    def __init__(self, message: str, *, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class RankTimeoutError(RankError, TimeoutError):
    """Ranks were still running at the timeout and were killed (``ranks``)."""

    def __init__(self, message: str, *, ranks: list[int]) -> None:
        super().__init__(message, rank=ranks[0])
        self.ranks = ranks


def forkserver_context(*preload: str) -> Any:
    """multiprocessing's forkserver context; its server imports ``PRELOAD`` and ``preload``.

    There is one server per process, started at the first use of the context:
    the modules named then are the ones it holds.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])
    return ctx


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: Mapping[str, str] | None,
    caller: tuple[dict[str, str], str],
    results: Any,
) -> None:
    # A forked rank has the fork server's environment and directory: take the caller's.
    environ, cwd = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    # torchrun sets this for multi-process runs; without it N ranks oversubscribe the cores.
    if world_size > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if env:
        os.environ.update(env)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        # torch reads the variable when it is imported, and unpickling this rank's
        # function may have imported it already: apply it as torchrun's would be.
        torch.set_num_threads(int(threads))
    # The parent sends SIGUSR1 before killing a hung rank: its stacks then show in stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import torch.distributed as dist

    def report_failure(exc: BaseException) -> None:
        # The raise time lets the parent name the rank that failed first, not a
        # peer that failed later because this one left the group.
        summary = f"{type(exc).__name__}: {exc}"
        results.put((rank, False, (time.time(), summary), traceback.format_exc()))

    try:
        dist.init_process_group("gloo")
    except BaseException as exc:
        report_failure(exc)
        return
    try:
        result = fn(rank, world_size, *args)
        # Pickle here so an unpicklable result is reported as this rank's error.
        payload = pickle.dumps(result)
    except BaseException as exc:
        report_failure(exc)  # before leaving the group, which makes peers fail too
        return
    finally:
        dist.destroy_process_group()
    results.put((rank, True, payload, ""))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of ranks, all "local" (one node).
        *args: extra picklable arguments passed to every rank.
        timeout: seconds for the whole run; hung ranks are killed after it.
        env: extra environment variables for every rank.
        fresh: spawn each rank as a new interpreter (nothing imported yet) instead
            of forking it from the preloaded server.

    Returns:
        The ranks' return values, indexed by rank.

    Raises:
        RankError: a rank raised (its traceback text is in the message) or died.
        RankTimeoutError: ranks still ran at ``timeout``.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    ctx = mp.get_context("spawn") if fresh else forkserver_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, args, env, (dict(os.environ), os.getcwd()),
                  results),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    ok: dict[int, Any] = {}
    failures: list[tuple[float, int, str, str]] = []  # (raised at, rank, summary, traceback)
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(ok) + len(failures) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, success, payload, tb = results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                _note_silent_deaths(procs, ok, failures, dead_since)
                continue
            if success:
                ok[rank] = pickle.loads(payload)
            else:
                raised_at, summary = payload
                failures.append((raised_at, rank, summary, tb))
            if failures:
                # Peers may be stuck in a collective with the failed rank: give
                # them a short grace, not the whole timeout.
                deadline = min(deadline, time.monotonic() + _GRACE_S)
    finally:
        hung = _reap(procs, set(ok) | {r for _, r, _, _ in failures})
        results.close()

    if failures:
        failures.sort()
        _, rank, summary, tb = failures[0]
        others = ", ".join(f"rank {r}: {s}" for _, r, s, _ in failures[1:])
        extra = f"\n(also failed: {others})" if others else ""
        if hung:
            extra += f"\n(killed while hung: ranks {hung})"
        raise RankError(
            f"rank {rank} failed: {summary}{extra}\n\n--- rank {rank} traceback ---\n{tb}",
            rank=rank,
            remote_traceback=tb,
        )
    if len(ok) < world_size:
        missing = sorted(set(range(world_size)) - set(ok))
        raise RankTimeoutError(
            f"ranks {missing} did not finish within {timeout:.0f} s and were killed "
            "(their Python stacks were dumped to stderr)",
            ranks=missing,
        )
    return [ok[r] for r in range(world_size)]


def _note_silent_deaths(
    procs: list[Any],
    ok: dict[int, Any],
    failures: list[tuple[float, int, str, str]],
    dead_since: dict[int, float],
) -> None:
    """Record ranks that exited without reporting (killed, os._exit, segfault)."""
    reported = set(ok) | {r for _, r, _, _ in failures}
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if rank in reported or p.exitcode is None:
            continue
        # A report written just before exit may still sit in the pipe: wait a moment.
        if now - dead_since.setdefault(rank, now) < 1.0:
            continue
        code = p.exitcode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        # Died at an unknown time before now: rank it as early as possible.
        failures.append((0.0, rank, f"process died without a report ({how})", ""))


def _reap(procs: list[Any], reported: set[int]) -> list[int]:
    """Join ranks that reported; dump stacks of and kill the rest. Returns killed ranks."""
    deadline = time.monotonic() + 5.0  # reported ranks are on their way out
    for rank, p in enumerate(procs):
        if rank in reported:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in hung:
        pid = procs[rank].pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
    if hung:
        time.sleep(0.5)  # let faulthandler write the stacks
    for rank in hung:
        procs[rank].kill()
    for p in procs:
        p.join(timeout=5)
        if p.exitcode is not None:
            p.close()
    return hung


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux: reads ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
