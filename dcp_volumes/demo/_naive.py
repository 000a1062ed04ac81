"""The naive setup the demo compares against: what a first version of the job does.

* Inputs: a map-style ``Dataset`` whose ``__getitem__`` reads the sample file
  from the volume (fsspec) on every access, every epoch, through a stock
  ``torch.utils.data.DataLoader`` with as many workers as the library's loader
  gets. A batch sampler draws each epoch's order from the seed and resumes at
  the restored step (it skips what was trained without reading it).
* Checkpoints: every ``save_every`` steps rank 0 ``torch.save``s the full
  state to local disk and then uploads it to the volume, while every rank
  waits at a barrier; it keeps the newest ``keep_last``. A restart loads the
  newest file that loads, falling back past torn ones (a crash in the middle
  of an upload leaves one on a plain directory).

Nothing here uses dcp_volumes (fsspec is what such a job would use) but the one mend
every job restarted under torchrun's defaults needs, which the library's manager makes
for its jobs: the killed attempt's process-group addresses cleared from torchrun's shared
store (``dcp_volumes._torchrun``, torch #135712). Without it the naive job's restarts
would fail in ``init_process_group``, and there would be nothing to compare.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.utils.data

from dcp_volumes.demo._faults import CrashInjector
from dcp_volumes.demo._rank import Batch, TrainState
from dcp_volumes.demo._workload import augment, capture_rngs, decode, restore_rngs

logger = logging.getLogger("dcp_volumes.demo.naive")

_CHUNK = 1 << 20


def _fs(url: str, options: Mapping[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url, **dict(options))
    return fs, path.rstrip("/")


class NaiveDataset(torch.utils.data.Dataset[tuple[torch.Tensor, int, str]]):
    """Sample ``i`` read from the volume each time it is asked for."""

    def __init__(self, url: str, names: list[str], options: Mapping[str, Any]) -> None:
        self.url, self.names, self.options = url, names, dict(options)
        self._fs: tuple[int, fsspec.AbstractFileSystem, str] | None = None

    def _filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        if self._fs is None or self._fs[0] != os.getpid():  # one client per (forked) worker
            fs, root = _fs(self.url, self.options)
            self._fs = (os.getpid(), fs, root)
        return self._fs[1], self._fs[2]

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        fs, root = self._filesystem()
        image, label = decode(fs.cat_file(f"{root}/{self.names[i]}"))
        return augment(image, None), label, self.names[i]


class ResumableBatches(torch.utils.data.Sampler[list[int]]):
    """This rank's slice of every global batch from ``start_step`` on, epoch after epoch."""

    def __init__(self, n: int, global_batch: int, rank: int, world: int, seed: int,
                 start_step: int) -> None:
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self.per_rank = global_batch // world
        self.rank, self.start_step = rank, start_step

    def __iter__(self) -> Iterator[list[int]]:
        per_epoch = self.n // self.global_batch
        step = self.start_step
        while True:
            epoch, pos = divmod(step, per_epoch)
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(
                self.seed * 1000 + epoch))
            batch = order[pos * self.global_batch : (pos + 1) * self.global_batch]
            mine = batch[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
            yield mine.tolist()
            step += 1


class NaiveSetup:
    """Reads through ``NaiveDataset``; saves with ``torch.save`` + upload on rank 0."""

    def __init__(self, spec: Mapping[str, Any], options: Mapping[str, Any],
                 injector: CrashInjector, local: str) -> None:
        from dcp_volumes._torchrun import forget_stale_addresses

        forget_stale_addresses()  # see the module's docstring
        self.spec, self.options, self.injector = spec, dict(options), injector
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        data_fs, data_root = _fs(spec["data_url"], options)
        names = sorted(os.path.basename(p) for p in data_fs.find(data_root))
        self.dataset = NaiveDataset(spec["data_url"], names, options)
        self.fs, self.root = _fs(spec["ckpt_url"], options)
        if self.rank == 0:
            self.fs.makedirs(self.root, exist_ok=True)  # a plain directory needs it
        self.local = os.path.join(local, "naive-staging")
        os.makedirs(self.local, exist_ok=True)
        self._restored_bytes = 0

    # -- checkpoints --------------------------------------------------------------------

    def _name(self, step: int) -> str:
        return f"{self.root}/step-{step:08d}.pt"

    def _steps(self) -> list[int]:
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for p in found:
            base = os.path.basename(p.rstrip("/"))
            if base.startswith("step-") and base.endswith(".pt"):
                steps.append(int(base[5:-3]))
        return sorted(steps)

    def _plain(self, state: TrainState) -> dict[str, Any]:
        model = state.model
        rngs: list[Any] = [None] * self.world
        dist.all_gather_object(rngs, capture_rngs())  # every rank's generators, on rank 0
        return {"model": model.state_dict(), "optim": state.optim.state_dict(),
                "sched": state.sched.state_dict(), "step": state.step, "rng": rngs}

    def should_save(self, step: int) -> bool:
        return step % int(self.spec["save_every"]) == 0

    def reached_preemption(self, step: int) -> bool:
        return False  # no handler: a SIGTERM kills the rank (its default action)

    def save(self, step: int, state: TrainState) -> None:
        plain = self._plain(state)
        if self.rank == 0:
            local = os.path.join(self.local, "checkpoint.pt")
            torch.save(plain, local)
            size = os.path.getsize(local)
            total = max(1, -(-size // _CHUNK))
            with open(local, "rb") as src, self.fs.open(self._name(step), "wb") as dst:
                for done in range(1, total + 1):
                    dst.write(src.read(_CHUNK))
                    self.injector.in_naive_upload(step, done, total)
            for old in self._steps()[: -self.spec["keep_last"]]:
                self.fs.rm_file(self._name(old))
        dist.barrier()
        if self.rank == 0:
            self.injector.events.write("committed", step=step)  # on the volume, synchronously

    def restore(self, state: TrainState) -> int | None:
        for step in reversed(self._steps()):
            try:
                with self.fs.open(self._name(step), "rb") as f:
                    data = f.read()
                self._restored_bytes += len(data)
                plain = torch.load(io.BytesIO(data), weights_only=False)
            except Exception as exc:  # a torn file from a crash mid-upload: try an older one
                logger.warning("naive restore: %s does not load (%s); trying an older one",
                               self._name(step), exc)
                self.injector.events.write("torn", step=step, error=repr(exc)[:200])
                continue
            state.model.load_state_dict(plain["model"])
            state.optim.load_state_dict(plain["optim"])
            state.sched.load_state_dict(plain["sched"])
            state.step = int(plain["step"])
            restore_rngs(plain["rng"][self.rank])
            return state.step
        return None

    def restore_sources(self) -> dict[str, int]:
        """Bytes the last restore read: all from the volume (no local tier)."""
        return {"local": 0, "peer": 0, "volume": self._restored_bytes}

    def close(self) -> None:
        pass  # saves are synchronous: nothing in flight

    def fail(self, exc: BaseException) -> None:
        pass  # nothing in flight to give up

    # -- inputs ---------------------------------------------------------------------------

    def batches(self, start_step: int) -> Iterator[Batch]:
        sampler = ResumableBatches(len(self.dataset), self.spec["global_batch"], self.rank,
                                   self.world, self.spec["seed"], start_step)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=sampler, num_workers=self.spec["num_workers"],
            generator=torch.Generator().manual_seed(self.spec["seed"]))
        yield from loader

    def fetch_seconds(self, measured: float) -> float:
        return measured
