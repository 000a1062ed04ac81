"""VolumeDataset: the files of a volume as a resumable, deterministic ``IterableDataset``.

The files are listed once (on rank 0, then broadcast when a process group is
up, so every rank holds the identical file table). Each epoch reads them in the
global order of ``_order.py``, split over ranks and over DataLoader workers
the way the DataLoader asks for batches; each worker fetches its next files
through the node's ``FileCache`` on a small thread pool while the transform
and the training step run.

Where the epoch starts (epoch, stream position, seed) is the *cursor*; it
lives in the main process and reaches the workers through a small shared
tensor (``_shared_plan.py``), read each time a worker starts an epoch. That works with
persistent workers, which keep the dataset copy they were started with.
"""

from __future__ import annotations

import logging
import os
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from dcp_volumes._exceptions import CacheError, ConfigurationError
from dcp_volumes._volume import Volume
from dcp_volumes._world import World, distributed
from dcp_volumes.data._cache import FileCache
from dcp_volumes.data._cache_options import DEFAULT_CACHE_LIMIT, resolve_cache_dir
from dcp_volumes.data._dataset_options import DatasetOptions
from dcp_volumes.data._hot import SharedHot
from dcp_volumes.data._listing import FileTable, build_file_table
from dcp_volumes.data._metrics import worker_stats
from dcp_volumes.data._order import Cursor, NextUse, Plan, epoch_permutation, sample_seeds
from dcp_volumes.data._prefetch import Prefetcher
from dcp_volumes.data._rng import SampleTransform
from dcp_volumes.data._shared_plan import SharedPlan

logger = logging.getLogger(__name__)

# ``VolumeDataset.manifest`` (the file table's old name) has warned in this process.
_MANIFEST_WARNED = False

def _ints(values: np.ndarray, chunk: int = 4096) -> Iterator[int]:
    """``values`` as Python ints, a chunk at a time: a worker's share of a large epoch as
    one list would cost it tens of bytes a file."""
    for lo in range(0, len(values), chunk):
        yield from values[lo : lo + chunk].tolist()


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class KeyIndex:
    """Cache key -> file index: two sorted arrays of 64-bit key prefixes (16 bytes a
    file, where a dict of key strings costs ten times that)."""

    def __init__(self, keys: Iterator[str], n: int) -> None:
        prefixes = np.fromiter((int(k[:16], 16) for k in keys), dtype=np.uint64, count=n)
        self._order = np.argsort(prefixes, kind="stable")
        self._sorted = prefixes[self._order]

    def get(self, key: str) -> int | None:
        prefix = np.uint64(int(key[:16], 16))
        at = int(np.searchsorted(self._sorted, prefix))
        if at < len(self._sorted) and self._sorted[at] == prefix:
            return int(self._order[at])
        return None


class _Schedule:
    """The cache's view of this worker's future (``CacheSchedule``): Belady by next use."""

    def __init__(self, next_use: NextUse, index_of: Callable[[], KeyIndex]) -> None:
        self.next_use = next_use
        self._index_of = index_of

    def eviction_priority(self, key: str) -> float | None:
        index = self._index_of().get(key)
        if index is None:
            return float("inf")  # not a file of this dataset
        return self.next_use.distance(index)


class VolumeDataset(IterableDataset[Any]):
    """The files below a URL (or a list of file URLs), read through a node-local cache.

    Args:
        url_or_file_list: a prefix/directory URL (``s3://bucket/train/``,
            ``/mnt/nfs/train``), or a list of file URLs on one store.
        cache_dir: the node-local cache (see ``FileCache``); default
            ``DCP_VOLUMES_CACHE`` or ``~/.cache/dcp_volumes``.
        cache_limit: bytes the cache may hold (``"100GB"``); ``None``: the disk.
        shuffle: a new permutation every epoch (from ``seed`` and the epoch).
        seed: the order and augmentation seed.
        transform: ``transform(local_path)`` (or ``(local_path, rng)``) runs in
            the worker and makes the sample; default: the local path itself.
        storage_options: client options (endpoint, credentials...); ``None``:
            ``DCP_VOLUMES_STORAGE_OPTIONS``, if set.
        suffixes: only files ending with one of these (e.g. ``(".jpg",)``).
        last_batch: ``"pad"`` or ``"drop"`` the last partial *global* batch, so
            every rank yields the same number of batches (DDP never hangs).
        batch_size: per-rank batch size, only needed with a stock
            ``torch.utils.data.DataLoader`` (``dcp_volumes.DataLoader`` sets it).
        prefetch: files each worker fetches ahead.
        prefetch_threads: download threads per worker.
        seed_rngs: seed torch/numpy/random around each transform call.
        on_data_change: ``"error"`` (default) refuses to restore a loader state
            saved on a different listing; ``"warn"`` resumes with a warning.
        cache_local: also cache files of local/mounted paths (NFS, FUSE);
            ``False`` reads them in place.
        share_listing: with a process group up, list on rank 0 and broadcast
            (every rank must then construct the dataset).
        list_concurrency: parallel listing/stat requests.
    """

    def __init__(
        self,
        url_or_file_list: str | os.PathLike[str] | Sequence[str],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = DEFAULT_CACHE_LIMIT,
        shuffle: bool = True,
        seed: int = 0,
        transform: Callable[..., Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        suffixes: Sequence[str] | None = None,
        last_batch: str = "pad",
        batch_size: int = 1,
        prefetch: int = 16,
        prefetch_threads: int = 8,
        seed_rngs: bool = True,
        on_data_change: str = "error",
        cache_local: bool = True,
        share_listing: bool = True,
        list_concurrency: int = 16,
    ) -> None:
        super().__init__()
        self.options = DatasetOptions(
            cache_dir=os.fspath(cache_dir) if cache_dir is not None else None,
            cache_limit=cache_limit,
            shuffle=bool(shuffle),
            seed=seed,
            suffixes=tuple(suffixes) if suffixes is not None else None,
            last_batch=last_batch,
            batch_size=batch_size,
            prefetch=prefetch,
            prefetch_threads=prefetch_threads,
            seed_rngs=seed_rngs,
            on_data_change=on_data_change,
            cache_local=cache_local,
            share_listing=share_listing,
            list_concurrency=list_concurrency,
        )
        opts = self.options
        if isinstance(url_or_file_list, str) and not url_or_file_list.strip():
            raise ConfigurationError("The dataset URL is empty; pass e.g. 's3://bucket/train/'.")
        world = World.current()
        self.rank, self.world_size, self.local_world_size = world.rank, world.size, world.local_size
        probe = None
        if isinstance(url_or_file_list, (str, os.PathLike)):
            probe = Volume(os.fspath(url_or_file_list), storage_options=storage_options)
        in_place = probe is not None and probe.capabilities.local_files and not opts.cache_local
        if not in_place and probe is not None and probe.capabilities.local_files:
            chosen = resolve_cache_dir(opts.cache_dir)
            if _inside(chosen, probe.root):
                raise ConfigurationError(
                    f"The cache directory {chosen} is inside the dataset directory "
                    f"{probe.root}, so the dataset would read its own cache. Fix: pass a "
                    "cache_dir= outside it."
                )
        self.cache: FileCache | None = None
        with ThreadPoolExecutor(max_workers=1) as pool:
            # The cache's set-up (its directory checked, a reused one reconciled) runs
            # while the files are listed.
            made = (
                None if in_place else pool.submit(FileCache, opts.cache_dir, limit=opts.cache_limit)
            )
            try:
                # The files, listed once (a FileTable; its digest is the state's "file_table").
                self.volume, self.file_table = self._list(url_or_file_list, storage_options)
            finally:
                self.cache = made.result() if made is not None else None
        # Workers map the table instead of copying it (see FileTable.share).
        self.file_table.share()
        if self.cache is not None and self.volume.capabilities.local_files and not opts.cache_local:
            self.cache = None  # a list of local files, read in place
        if self.cache is not None and self.cache.limit is not None:
            largest = int(self.file_table.sizes.max())
            if largest > self.cache.limit:
                raise CacheError(
                    f"cache_limit={self.cache.limit} bytes is smaller than the largest file of "
                    f"the dataset ({largest} bytes). Fix: raise cache_limit."
                )
        self.transform = transform
        self._transform = SampleTransform(transform, seed_rngs=opts.seed_rngs)
        self._id = uuid.uuid4().hex
        self._cursor = Cursor(epoch=0, start=0, seed=opts.seed, shuffle=opts.shuffle)
        # The plan the workers read at each epoch start (see _shared_plan.py).
        self._plan = SharedPlan()
        self.set_cursor(epoch=0, start=0)
        self._key_index: KeyIndex | None = None
        # Copies verified by any worker of this dataset are hits in all of them.
        self._shared_hot = SharedHot(len(self.file_table)) if self.cache is not None else None
        logger.info(
            "dataset %s: %d files, %.1f MiB",
            self.volume.display_url,
            len(self.file_table),
            self.file_table.total_bytes / 2**20,
        )

    def _list(
        self, source: Any, storage_options: Mapping[str, Any] | None
    ) -> tuple[Volume, FileTable]:
        dist = torch.distributed
        opts = self.options
        shared = opts.share_listing and self.world_size > 1 and distributed()
        if not shared:
            return build_file_table(
                source,
                storage_options=storage_options,
                suffixes=opts.suffixes,
                concurrency=opts.list_concurrency,
            )
        # One listing for the whole job: every rank gets the identical file table (ranks
        # listing separately could see different files while an upload is running).
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = (
                    "ok",
                    build_file_table(
                        source,
                        storage_options=storage_options,
                        suffixes=opts.suffixes,
                        concurrency=opts.list_concurrency,
                    ),
                )
            except Exception as exc:  # every rank must raise it, not hang in the broadcast
                box[0] = ("error", exc)
        dist.broadcast_object_list(box, src=0)
        status, payload = box[0]
        if status == "error":
            raise payload
        return payload  # type: ignore[no-any-return]

    # -- cursor (main process) ------------------------------------------------------------

    @property
    def dataset_id(self) -> str:
        """This dataset object's id (its copies in the workers share it): keys its counters."""
        return self._id

    @property
    def num_files(self) -> int:
        return len(self.file_table)

    @property
    def manifest(self) -> FileTable:
        """Deprecated name of ``file_table`` (warns once per process)."""
        global _MANIFEST_WARNED
        if not _MANIFEST_WARNED:
            _MANIFEST_WARNED = True
            warnings.warn(
                "VolumeDataset.manifest is deprecated; use VolumeDataset.file_table.",
                DeprecationWarning,
                stacklevel=2,
            )
        return self.file_table

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return self._cursor.epoch

    @property
    def position(self) -> int:
        """The global stream position in ``epoch`` where the next iteration starts."""
        return self._cursor.start

    @property
    def seed(self) -> int:
        return self._cursor.seed

    @property
    def shuffle(self) -> bool:
        return self._cursor.shuffle

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next; a different epoch than the current starts at its beginning."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigurationError(f"epoch={epoch!r} must be an int >= 0.")
        if epoch != self._cursor.epoch:
            self.set_cursor(epoch=epoch, start=0)

    def plan(self, *, batch_size: int, world_size: int, rank: int, drop: bool) -> Plan:
        """The plan of the next iteration from the current cursor."""
        return Plan.from_cursor(self._cursor, num_files=self.num_files, batch_size=batch_size,
                                world_size=world_size, rank=rank, drop=drop)

    def publish_plan(self, plan: Plan, *, num_workers: int, prefetch_factor: int) -> None:
        """Make ``plan`` what every worker reads when it starts its next epoch."""
        self._plan.publish(
            plan,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            local_world_size=self.local_world_size,
        )

    def set_cursor(
        self, *, epoch: int, start: int, seed: int | None = None, shuffle: bool | None = None
    ) -> None:
        """Start the next iteration at stream position ``start`` of ``epoch`` (the loader
        moves it as batches are delivered and restores it from a state); ``seed`` and
        ``shuffle``, when given, replace the order's."""
        old = self._cursor
        self._cursor = Cursor(
            epoch=epoch,
            start=start,
            seed=old.seed if seed is None else seed,
            shuffle=old.shuffle if shuffle is None else shuffle,
        )
        # Workers of a stock DataLoader (no published plan) read the cursor from there.
        self._plan.set_cursor(self._cursor)

    def _read_plan(self) -> tuple[Plan, int, int]:
        """(plan, prefetch_factor, local_world_size) as published, or from defaults."""
        published, cursor = self._plan.read(self.num_files)
        if published is not None:
            return published.plan, published.prefetch_factor, published.local_world_size
        # A stock DataLoader (or plain iteration): the dataset's own settings and cursor.
        plan = Plan.from_cursor(cursor, num_files=self.num_files,
                                batch_size=self.options.batch_size, world_size=self.world_size,
                                rank=self.rank, drop=self.options.last_batch == "drop")
        return plan, 2, self.local_world_size

    def __len__(self) -> int:
        """Samples this rank yields in a whole epoch."""
        plan = Plan.whole_epoch(num_files=self.num_files, batch_size=self.options.batch_size,
                                world_size=self.world_size, rank=self.rank,
                                drop=self.options.last_batch == "drop")
        return plan.num_batches * plan.batch_size

    # -- iteration (in each worker) -------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        plan, prefetch_factor, local_world = self._read_plan()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        positions = plan.worker_positions(worker, workers)
        perm = epoch_permutation(
            plan.num_files, seed=plan.seed, epoch=plan.epoch, shuffle=plan.shuffle
        )
        file_ids = perm[positions % plan.num_files]
        if self.cache is None:
            return self._read_in_place(plan, positions, file_ids)
        return self._read_cached(plan, positions, file_ids, workers, prefetch_factor, local_world)

    def _read_in_place(
        self, plan: Plan, positions: np.ndarray, file_ids: np.ndarray
    ) -> Iterator[Any]:
        stats = worker_stats(self._id)
        files = self.file_table
        seeds = self._seeds(plan, positions)
        for k, fid in enumerate(_ints(file_ids)):
            path = self.volume.full_path(files.path(fid))
            sample = self._transform(path, int(seeds[k]) if seeds is not None else 0)
            stats.samples += 1
            yield sample

    def _seeds(self, plan: Plan, positions: np.ndarray) -> np.ndarray | None:
        """The samples' augmentation seeds, or None when the transform takes none."""
        if not self._transform.uses_seed:
            return None
        return sample_seeds(plan.seed, plan.epoch, positions)

    def _key_index_map(self) -> KeyIndex:
        # Built on first eviction only: one hash per file.
        if self._key_index is None:
            cache, volume = self.cache, self.volume
            table = self.file_table
            keys = (cache.key_of(volume, p) for p in table.paths()) if cache else iter(())
            self._key_index = KeyIndex(keys, len(table) if cache else 0)
        return self._key_index

    def _schedule_evictions(
        self, cache: FileCache, plan: Plan, workers: int, prefetch_factor: int, local_world: int
    ) -> NextUse | None:
        """Tell the cache this node's future reads (Belady eviction); the schedule's
        ``NextUse``, whose ``current`` the reader moves, or None without a limit."""
        if cache.limit is None:
            return None
        opts = self.options
        g = plan.global_batch_size
        # Never evict what the node's workers are about to prefetch (their next
        # `prefetch` samples span that many of their batches, W*G positions apart),
        # nor, with the default transform, the paths of batches handed out but
        # maybe not read yet (queued in the DataLoader or in the current step).
        ahead = (-(-opts.prefetch // plan.batch_size) * workers + 1) * g
        behind = (workers * prefetch_factor + 2) * g if self.transform is None else g
        node = plan.rank // local_world
        ranks = range(node * local_world, min(plan.world_size, (node + 1) * local_world))
        next_use = NextUse(plan, ranks=ranks, ahead=ahead, behind=behind)
        cache.set_schedule(_Schedule(next_use, self._key_index_map))
        return next_use

    def _prefetcher(self, cache: FileCache, file_ids: np.ndarray) -> Prefetcher[int, int, Any]:
        """The worker's files, fetched ahead on a thread pool; each taken item is pinned
        (a miss) or a verified hit (unpinned)."""
        files, volume, shared = self.file_table, self.volume, self._shared_hot

        def fetch(fid: int) -> Any:  # on the pool, for an item whose `fast` said None
            info = files.info(fid)  # the listing's entry: the expected size/etag
            return cache.fetch_cold(
                volume, info.path, expected=info, pin=True, shared=shared, slot=fid
            )

        # Hits skip the pin (a shared lock costs as much as reading a small file):
        # this job's own workers never evict inside their prefetch window (the
        # schedule), and a copy that another job evicts meanwhile is fetched
        # again, pinned, when the transform finds it gone (``_transform_cached``).
        def fast(fid: int) -> Any:
            info = files.info(fid)
            return cache.fetch_hot(
                volume, info.path, expected=info, pin=False, shared=shared, slot=fid
            )

        return Prefetcher(
            ((fid, fid) for fid in _ints(file_ids)),
            fetch,
            lambda cached: cached.release(),
            depth=self.options.prefetch,
            threads=self.options.prefetch_threads,
            fast=fast,
        )

    def _transform_cached(self, cache: FileCache, fid: int, cached: Any, seed: int) -> Any:
        """The sample of a cached file; a hit evicted by another job before the transform
        read it is fetched again, pinned this time."""
        try:
            return self._transform(cached.path, seed)
        except FileNotFoundError:
            if cached.pinned or os.path.exists(cached.path):
                raise
        info = self.file_table.info(fid)
        with cache.fetch_from(
            self.volume, info.path, expected=info, pin=True, shared=self._shared_hot, slot=fid
        ) as again:
            return self._transform(again.path, seed)

    def _read_cached(
        self,
        plan: Plan,
        positions: np.ndarray,
        file_ids: np.ndarray,
        workers: int,
        prefetch_factor: int,
        local_world: int,
    ) -> Iterator[Any]:
        cache = self.cache
        if cache is None:
            raise RuntimeError("unreachable: no cache")
        stats = worker_stats(self._id)
        next_use = self._schedule_evictions(cache, plan, workers, prefetch_factor, local_world)
        prefetcher = self._prefetcher(cache, file_ids)
        seeds = self._seeds(plan, positions)
        try:
            for k, taken in enumerate(prefetcher):
                if next_use is not None:
                    next_use.current = int(positions[k])
                cached = taken.value
                seed = int(seeds[k]) if seeds is not None else 0
                sample = self._transform_cached(cache, taken.key, cached, seed)
                stats.samples += 1
                stats.wait_seconds += taken.wait_seconds
                stats.ready_ahead += taken.ready_ahead
                if taken.first and not cached.hit:
                    stats.misses += 1
                    stats.bytes_fetched += cached.size
                    stats.download_seconds += cached.download_seconds
                else:
                    stats.hits += 1
                yield sample
        finally:
            prefetcher.close()
