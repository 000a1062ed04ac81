"""DataLoader: torch's DataLoader with tuned defaults, a delivered-position state and metrics.

State: ``state_dict()`` records what the training loop has *received*
(epoch, stream position, seed, ...), never what workers have prefetched. It
is global: every rank holds the same values at the same step, so DCP's
de-duplication of replicated entries keeps it, and a resume on another world
size or ``num_workers`` continues the same sample stream (see ``_order.py``).
It holds only ints and strings, so it drops into a DCP state dict
(``{"model": ..., "data": loader}``; DCP treats objects with
``state_dict``/``load_state_dict`` as ``Stateful``) and into
``CheckpointManager``.

Batch size semantics: ``batch_size`` is per rank (as in torch) and the global
batch is ``batch_size * world_size``; or pass ``global_batch_size`` and each
rank gets ``global_batch_size // world_size`` (it must divide evenly). To
resume on a different world size with the same batches, keep
``global_batch_size`` fixed; with another global batch size the resume still
continues the same *sample* stream, regrouped into the new batch size.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import pickle
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.data
from torch.utils.data import default_collate

from dcp_volumes._exceptions import ConfigurationError, DatasetChangedError
from dcp_volumes._prompt_exit import skip_final_collection
from dcp_volumes._torch.data import pin_batch
from dcp_volumes._volume import choose_fsspec_after_fork
from dcp_volumes._world import World, available_cpus
from dcp_volumes.data import _batch_sharing
from dcp_volumes.data._dataset import VolumeDataset
from dcp_volumes.data._metrics import LoaderMetrics, worker_stats
from dcp_volumes.data._order import ORDER_ALGORITHM, Plan
from dcp_volumes.data._worker_exit import ExitWithTrainingProcess, starting_workers
from dcp_volumes.goodput._recorder import note_input_wait

logger = logging.getLogger(__name__)

STATE_VERSION = 1
STATE_KEYS = (
    "version",
    "epoch",
    "position",
    "seed",
    "shuffle",
    "global_batch_size",
    "last_batch",
    "num_files",
    "file_table",
    "order",
    "step",
)


def default_num_workers(local_world_size: int) -> int:
    """Workers per rank: the rank's share of the CPUs minus one for the training loop, <= 8."""
    per_rank = available_cpus() // max(1, local_world_size)
    return max(1, min(8, per_rank - 1))


class _Delivery:
    """A batch plus the counters its worker accumulated since its previous batch."""

    __slots__ = ("batch", "stats")

    def __init__(self, batch: Any, stats: dict[str, float]) -> None:
        self.batch = batch
        self.stats = stats

    def pin_memory(self) -> _Delivery:
        # torch's pin-memory thread calls this; pin the batch, keep the counters.
        return _Delivery(pin_batch(self.batch), self.stats)


class _CollateWithStats:
    """Wraps ``collate_fn`` in the worker so counters travel with each batch."""

    def __init__(self, collate: Callable[[list[Any]], Any], dataset_id: str) -> None:
        self.collate = collate
        self.dataset_id = dataset_id

    def __call__(self, samples: list[Any]) -> _Delivery:
        return _Delivery(self.collate(samples), worker_stats(self.dataset_id).take())


def _forkserver() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server preloading torch and this package.

    Each worker is forked from the server: without the preload every worker
    imports torch itself (seconds of CPU per loader start); with it
    only the server does, once per process, and starts the shared-memory
    manager the workers share. It takes effect where the server has not
    started yet (the first loader of a process).
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["__main__", "torch", __name__, "dcp_volumes.data._forkserver_preload"]
    )
    return ctx


def _worker_defaults(
    workers: int,
    prefetch_factor: int | None,
    persistent_workers: bool | None,
    pin_memory: bool | None,
) -> tuple[int | None, bool, bool]:
    """(prefetch_factor, persistent_workers, pin_memory) with the tuned defaults filled in."""
    if workers > 0:
        prefetch_factor = 4 if prefetch_factor is None else prefetch_factor
        persistent_workers = True if persistent_workers is None else persistent_workers
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return prefetch_factor, bool(persistent_workers), pin_memory


def _our_forkserver_if_chosen(kwargs: dict[str, Any]) -> bool:
    """Whether the user chose the workers' start method; a chosen "forkserver" becomes
    ours: the one fork server of the process, whose preload leaves the training
    process's group as the loader's own choice of it does."""
    chosen = kwargs.get("multiprocessing_context")
    if chosen == "forkserver" or (
        isinstance(chosen, multiprocessing.context.BaseContext)
        and chosen.get_start_method() == "forkserver"
    ):
        kwargs["multiprocessing_context"] = _forkserver()
    return chosen is not None


class DataLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A ``torch.utils.data.DataLoader`` with tuned defaults, a global state and metrics.

    Args:
        dataset: a ``VolumeDataset`` (any dataset works, but only a
            ``VolumeDataset`` has a resumable state).
        batch_size: samples per batch on each rank (default 1).
        global_batch_size: samples per step over all ranks, instead of
            ``batch_size``; must be a multiple of the world size.
        num_workers: default: this rank's share of the CPUs minus one (1..8).
        pin_memory: default: whether CUDA is available.
        persistent_workers: default: True when there are workers.
        prefetch_factor: batches each worker prepares ahead; default 4.
        drop_last: default: the dataset's ``last_batch`` ("drop" or "pad").
        rank, world_size: default: the process group, else torchrun's env.
        metrics_window_s: seconds per metrics window (logged, sent to MLflow).
        mlflow: send windows to MLflow when it is installed and a run is active.
        sharing_strategy: how workers hand batches over (torch's sharing
            strategies); default "file_system" where available: by the
            shared-memory segment's name, not a file descriptor passed over a
            new connection per batch (see ``_batch_sharing.py``). Set in the
            workers only, before ``worker_init_fn``; forked workers share the
            training process's ``torch_shm_manager``.
        **kwargs: passed to ``torch.utils.data.DataLoader``. Explicit
            arguments always win over the tuned defaults.

    Workers start with torch's default method (fork on Linux before Python
    3.14), except where that is unsafe: once a process has done I/O through
    obstore (S3 and Azure volumes: a checkpoint save, a listing), a child it
    forks could not use it, so workers of a dataset on such a volume start with
    "forkserver" (the dataset is pickled to them; the stream and state are the
    same). Its server starts as the loader is built, so its imports run beside
    a restore rather than before the first batch. A rank with fewer than two
    CPUs has none to spare for the server's imports (a second torch import,
    once per process, in the way of every restart's restore): its workers are
    forked and fetch cache misses through fsspec (the ``fsspec-clients``
    extra; without it, forkserver). A transform that cannot be
    pickled keeps fork, and its workers fetch through fsspec once this process
    used obstore (slower; logged). Pass ``multiprocessing_context`` to choose.
    A forked worker also inherits the parent's locks as they were at the fork:
    if another thread was inside OpenSSL then, the worker blocks at its first
    TLS call; "forkserver" avoids that too. Epochs:
    an exhausted epoch moves the state to the next one; ``set_epoch(e)`` with
    another epoch than the current starts ``e`` at its beginning, with the
    same epoch it keeps a restored position.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[Any],
        batch_size: int | None = None,
        *,
        global_batch_size: int | None = None,
        num_workers: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool | None = None,
        drop_last: bool | None = None,
        persistent_workers: bool | None = None,
        prefetch_factor: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        metrics_window_s: float = 10.0,
        mlflow: bool = True,
        sharing_strategy: str | None = None,
        **kwargs: Any,
    ) -> None:
        local_world = self._place(dataset, rank, world_size)
        self._cpus_per_rank = available_cpus() // max(1, local_world)
        per_rank = self._resolve_batch(batch_size, global_batch_size)
        self._volume = isinstance(dataset, VolumeDataset)
        collate, torch_drop_last = self._collation(dataset, collate_fn, drop_last, kwargs)
        workers = default_num_workers(local_world) if num_workers is None else num_workers
        prefetch_factor, persistent_workers, pin_memory = _worker_defaults(
            workers, prefetch_factor, persistent_workers, pin_memory
        )
        self.sharing_strategy = _batch_sharing.resolve(sharing_strategy) if workers else None
        self._wrap_worker_init(kwargs, workers)
        self._context_chosen_by_user = _our_forkserver_if_chosen(kwargs)
        self._token = 0
        self._step = 0
        # Persistent workers started by an earlier iteration (and still serving).
        self._workers_running = False
        # The fork server was started when the loader was built (see _start_fork_server_now).
        self._fork_server_ahead = False
        self.metrics = LoaderMetrics(rank=self._rank, window_s=metrics_window_s, mlflow=mlflow)
        super().__init__(
            dataset,
            batch_size=per_rank,
            num_workers=workers,
            collate_fn=collate,
            pin_memory=pin_memory,
            drop_last=torch_drop_last,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            **kwargs,
        )
        self._log_settings()
        self._start_fork_server_now()
        skip_final_collection()  # a restart waits for this process's exit

    def _log_settings(self) -> None:
        per_rank = int(self.batch_size or 1)
        logger.info(
            "DataLoader rank %d/%d: batch %d per rank (%d global), %d workers, prefetch_factor "
            "%s, persistent_workers %s, pin_memory %s, batches shared by %s",
            self._rank,
            self._world,
            per_rank,
            per_rank * self._world,
            self.num_workers,
            self.prefetch_factor,
            self.persistent_workers,
            self.pin_memory,
            self.sharing_strategy or "torch's default",
        )

    def _place(
        self, dataset: torch.utils.data.Dataset[Any], rank: int | None, world_size: int | None
    ) -> int:
        """Set this loader's rank and world size (explicit, else the dataset's, else the
        process group's); returns the local world size."""
        world = World.current()
        det_rank, det_world = world.rank, world.size
        if isinstance(dataset, VolumeDataset):
            det_rank, det_world = dataset.rank, dataset.world_size
        self._rank = det_rank if rank is None else rank
        self._world = det_world if world_size is None else world_size
        if self._world < 1 or not 0 <= self._rank < self._world:
            raise ConfigurationError(f"rank={self._rank} / world_size={self._world} is invalid.")
        return world.local_size

    def _collation(
        self,
        dataset: torch.utils.data.Dataset[Any],
        collate_fn: Callable[[list[Any]], Any] | None,
        drop_last: bool | None,
        kwargs: Mapping[str, Any],
    ) -> tuple[Callable[[list[Any]], Any], bool]:
        """Set ``_drop``; returns (the collate function torch calls, torch's drop_last)."""
        if not isinstance(dataset, VolumeDataset):
            self._drop = bool(drop_last)
            return collate_fn or default_collate, self._drop
        if kwargs.get("in_order") is False:
            raise ConfigurationError(
                "in_order=False would deliver batches out of the global order that resumes "
                "and multi-rank runs rely on; leave it True with a VolumeDataset."
            )
        self._drop = (dataset.options.last_batch == "drop") if drop_last is None else drop_last
        collate = _CollateWithStats(collate_fn or default_collate, dataset.dataset_id)
        return collate, False  # batches are always full: the plan pads or drops

    def _wrap_worker_init(self, kwargs: dict[str, Any], workers: int) -> None:
        """The workers' init: leave the training process's group and watch it, set the
        sharing strategy, then the user's ``worker_init_fn``."""
        if workers:
            kwargs["worker_init_fn"] = ExitWithTrainingProcess(kwargs.get("worker_init_fn"))
        if self.sharing_strategy is not None:
            kwargs["worker_init_fn"] = _batch_sharing.WorkerInit(
                self.sharing_strategy, kwargs.get("worker_init_fn")
            )

    def _resolve_batch(self, batch_size: int | None, global_batch_size: int | None) -> int:
        for name, value in (("batch_size", batch_size), ("global_batch_size", global_batch_size)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigurationError(f"{name}={value!r} must be an int >= 1.")
        if global_batch_size is None:
            return batch_size or 1
        if global_batch_size % self._world:
            raise ConfigurationError(
                f"global_batch_size={global_batch_size} cannot be split evenly over "
                f"{self._world} ranks. Fix: use a multiple of {self._world}, or pass the "
                "per-rank batch_size= instead."
            )
        per_rank = global_batch_size // self._world
        if batch_size is not None and batch_size != per_rank:
            raise ConfigurationError(
                f"batch_size={batch_size} and global_batch_size={global_batch_size} disagree on "
                f"{self._world} ranks (that would be batch_size={per_rank}). Pass only one."
            )
        return per_rank

    # -- introspection --------------------------------------------------------------------

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks."""
        return int(self.batch_size or 1) * self._world

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return self._dataset().epoch

    @property
    def step(self) -> int:
        """Global batches delivered so far (restored from the state on resume)."""
        return self._step

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` next; the same epoch as now keeps a resumed position."""
        self._dataset().set_epoch(epoch)

    def _dataset(self) -> VolumeDataset:
        if not self._volume:
            raise ConfigurationError(
                "Epochs and a resumable state need a VolumeDataset; this DataLoader wraps a "
                f"{type(self.dataset).__name__}. Fix: use VolumeDataset, or use the state "
                "support of your own dataset/sampler."
            )
        return self.dataset  # type: ignore[return-value]

    def _plan(self) -> Plan:
        return self._dataset().plan(
            batch_size=int(self.batch_size or 1),
            world_size=self._world,
            rank=self._rank,
            drop=self._drop,
        )

    def __len__(self) -> int:
        if not self._volume:
            return super().__len__()
        ds = self._dataset()
        full = Plan.whole_epoch(num_files=ds.num_files, batch_size=int(self.batch_size or 1),
                                world_size=self._world, rank=self._rank, drop=self._drop)
        return full.num_batches

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._token += 1
        if not self._workers_running:  # workers start now
            self._choose_start_method()
            _batch_sharing.start_manager_for_workers(
                self.sharing_strategy, self.multiprocessing_context
            )
        plan = None
        if self._volume:
            plan = self._plan()
            self._dataset().publish_plan(
                plan, num_workers=self.num_workers, prefetch_factor=self.prefetch_factor or 2
            )
        with starting_workers():  # worker processes may start here
            inner = super().__iter__()
        # torch keeps persistent workers (its iterator) from here on, for the loader's life.
        self._workers_running = bool(self.persistent_workers and self.num_workers)
        return self._deliver(inner, plan, self._token)

    def _start_fork_server_now(self) -> None:
        """Start the fork server as the loader is built, where its workers will need one.

        The server imports torch and this package before it forks a worker (its
        preload): most of a new process's time to its first batch. Started here,
        that runs beside what the training process does between building the
        loader and iterating it, a checkpoint restore above all. The workers
        themselves start at the first ``iter()``, from the position a restore set.
        Without a choice of the user's, that is a dataset on a volume whose client
        does not survive a fork (S3, Azure): its workers then start from the server
        from the first epoch on, whether or not this process has used the client yet.
        """
        if self.num_workers == 0:
            return
        if self._context_chosen_by_user:
            ctx = self.multiprocessing_context
            if ctx is None or ctx.get_start_method() != "forkserver":
                return
        elif not self._volume or self._dataset().volume.capabilities.survives_fork:
            return
        elif self._fork_server_costs_more():
            return  # forked at iter() (see _choose_start_method)
        elif self._pickle_error() is not None:
            return  # forked at iter() (see _choose_start_method), which logs why
        else:
            self.multiprocessing_context = _forkserver()
        with starting_workers():  # the server leaves the group first thing (its preload)
            multiprocessing.forkserver.ensure_running()
        self._fork_server_ahead = True

    def _fork_server_costs_more(self) -> bool:
        """Whether forked workers that fetch through fsspec cost this rank less than
        forkserver workers that keep obstore.

        The server is a second interpreter importing torch: seconds of CPU once per
        process, which run beside the training process only where the rank has a CPU
        to spare. With fewer, they delay the restore and the first step of every
        restart; fsspec in the workers costs more per cache miss and nothing on a warm
        cache. Needs the fsspec client for the volume's protocol, and one that honours
        every storage option.
        """
        return self._cpus_per_rank < 2 and self._dataset().volume.fsspec_fallback_usable()

    def _pickle_error(self) -> Exception | None:
        """Why the dataset cannot go to forkserver workers (it is pickled), or None."""
        try:
            pickle.dumps(self.dataset)
        except Exception as exc:  # what a transform may raise is open-ended
            return exc
        return None

    def _choose_start_method(self) -> None:
        """Forkserver instead of fork where a forked worker could not use the volume's client."""
        if self.num_workers == 0 or not self._volume or self._context_chosen_by_user:
            return
        if self._fork_server_ahead:
            return  # started with the loader: the workers start from it
        volume = self._dataset().volume
        if volume.forks_cleanly():
            self.multiprocessing_context = None  # torch's default (fork): fastest to start
            return
        if self._fork_server_costs_more():
            logger.info(
                "DataLoader workers are forked, and fetch what the cache misses through "
                "fsspec (this process used obstore, which a forked child cannot): this rank "
                "has %d CPU(s), too few to start a fork server beside it. Pass "
                "multiprocessing_context='forkserver' to keep obstore in the workers.",
                self._cpus_per_rank,
            )
            choose_fsspec_after_fork()
            self.multiprocessing_context = multiprocessing.get_context("fork")
            return
        exc = self._pickle_error()
        if exc is not None:
            logger.warning(
                "DataLoader workers are forked although this process already used obstore, "
                "because the dataset cannot be pickled for forkserver (%s: %s); they fetch "
                "through fsspec instead (slower). Fix: use a picklable transform (a module-"
                "level function, not a lambda).",
                type(exc).__name__,
                exc,
            )
            self.multiprocessing_context = None
            return
        self.multiprocessing_context = _forkserver()

    def _deliver(self, inner: Iterator[Any], plan: Plan | None, token: int) -> Iterator[Any]:
        delivered = 0
        handed: float | None = None
        try:
            while token == self._token:  # a newer iteration took over the workers: stop
                started = time.perf_counter()
                between = None if handed is None else started - handed
                try:
                    item = next(inner)
                except StopIteration:
                    if plan is not None and delivered >= plan.num_batches:
                        self._dataset().set_cursor(epoch=plan.epoch + 1, start=0)
                    return
                fetched = time.perf_counter()
                stats = None
                if isinstance(item, _Delivery):
                    item, stats = item.batch, item.stats
                delivered += 1
                self._step += 1
                if plan is not None:
                    # The cursor moves when a batch is handed over: the state is what
                    # the training loop has received.
                    if delivered >= plan.num_batches:
                        self._dataset().set_cursor(epoch=plan.epoch + 1, start=0)
                    else:
                        position = plan.start + delivered * plan.global_batch_size
                        self._dataset().set_cursor(epoch=plan.epoch, start=position)
                self.metrics.record(
                    fetch_s=fetched - started, between_s=between, worker=stats, step=self._step
                )
                note_input_wait(fetched - started)  # the job's goodput record, if one is kept
                handed = time.perf_counter()
                yield item
        finally:
            self.metrics.flush()  # epoch end, a break, or the iterator being collected

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the training loop has received: global, identical on every rank."""
        ds = self._dataset()
        return {
            "version": STATE_VERSION,
            "epoch": ds.epoch,
            "position": ds.position,
            "seed": ds.seed,
            "shuffle": int(ds.shuffle),
            "global_batch_size": self.global_batch_size,
            "last_batch": "drop" if self._drop else "pad",
            "num_files": ds.num_files,
            "file_table": ds.file_table.digest,
            "order": ORDER_ALGORITHM,
            "step": self._step,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue where the saved state left off (call before iterating).

        Raises:
            DatasetChangedError: the listing differs from the saved one (unless
                the dataset was built with ``on_data_change="warn"``).
            ConfigurationError: the state is not a loader state of this version.
        """
        ds = self._dataset()
        state = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in state_dict.items()}
        if "file_table" not in state and "manifest" in state:
            state["file_table"] = state.pop("manifest")  # the key's name in earlier states
        missing = [k for k in STATE_KEYS if k not in state]
        if missing or state.get("version") != STATE_VERSION:
            raise ConfigurationError(
                f"Not a dcp_volumes DataLoader state of version {STATE_VERSION} (missing "
                f"{missing}, version {state.get('version')!r}). Fix: pass the dict that "
                "DataLoader.state_dict() returned."
            )
        if state["order"] != ORDER_ALGORITHM:
            raise DatasetChangedError(
                f"The state was saved with sample order {state['order']!r}; this version uses "
                f"{ORDER_ALGORITHM!r}, so the resumed order would differ. Fix: resume with the "
                "dcp_volumes version that saved it."
            )
        table = ds.file_table
        if state["num_files"] != ds.num_files or not table.matches(str(state["file_table"])):
            message = (
                f"The data under {ds.volume.display_url} changed since the loader state was "
                f"saved: {state['num_files']} files (file table {str(state['file_table'])[:12]}) "
                f"then, {ds.num_files} (file table {table.digest[:12]}) now. Resuming would "
                "not continue the interrupted sample stream. Fix: restore the data as it was, "
                "or build the VolumeDataset with on_data_change='warn' to resume anyway at the "
                "same position of a new order."
            )
            if ds.options.on_data_change == "error":
                raise DatasetChangedError(message)
            logger.warning(message)
        drop = state["last_batch"] == "drop"
        if drop != self._drop:
            logger.warning(
                "resuming with last_batch=%r as saved (this loader was set to %r)",
                state["last_batch"],
                "drop" if self._drop else "pad",
            )
            self._drop = drop
        if state["global_batch_size"] != self.global_batch_size:
            logger.warning(
                "resuming with global batch size %d (saved with %d): the sample stream "
                "continues unchanged, regrouped into batches of the new size",
                self.global_batch_size,
                state["global_batch_size"],
            )
        if state["seed"] != ds.options.seed or bool(state["shuffle"]) != ds.options.shuffle:
            logger.info(
                "resuming with the saved seed=%d shuffle=%s", state["seed"], bool(state["shuffle"])
            )
        ds.set_cursor(
            epoch=int(state["epoch"]),
            start=int(state["position"]),
            seed=int(state["seed"]),
            shuffle=bool(state["shuffle"]),
        )
        self._step = int(state["step"])
