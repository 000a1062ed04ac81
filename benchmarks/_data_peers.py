"""The datasets bench_data.py compares, as picklable module-level classes.

Every one yields the file's bytes as a uint8 tensor made the same way
(``to_tensor``), so only *how the bytes are fetched* differs. The loaders
collate them with torch's default collate: the files of a set have one size,
so a batch is one ``[batch, size]`` tensor built in shared memory by the
worker, as batches of decoded samples are in training.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from fsspec.core import split_protocol
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from benchmarks._raw import RawStore


def to_tensor(data: bytes | bytearray) -> torch.Tensor:
    """The sample: the file's bytes as a writable uint8 tensor."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def read_local(path: str) -> torch.Tensor:
    """Transform for a local path (the local-disk row and ``VolumeDataset``'s cached copy)."""
    with open(path, "rb") as f:
        return to_tensor(f.read())


def read_s3_reader(reader: Any) -> torch.Tensor:
    """Transform of s3torchconnector's datasets (they hand over an ``S3Reader``)."""
    return to_tensor(reader.read())


class LocalFiles(Dataset[torch.Tensor]):
    """The same files in a local directory, read with ``open`` (the local-disk floor)."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return read_local(self.paths[i])


def _protocol(urls: Sequence[str]) -> str:
    """The fsspec protocol of the URLs ("s3" -> s3fs, "az" -> adlfs)."""
    return (split_protocol(urls[0])[0] or "file") if urls else "file"


class _PerProcessFs:
    """An fsspec filesystem created lazily in each worker process (never shared over fork)."""

    def __init__(self, protocol: str, storage_options: dict[str, Any]) -> None:
        self.protocol = protocol
        self.storage_options = storage_options
        self._fs: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_pid": -1}

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            import fsspec

            self._fs = fsspec.filesystem(
                self.protocol, skip_instance_cache=True, **self.storage_options
            )
            self._pid = os.getpid()
        return self._fs


class NaiveFsspec(Dataset[torch.Tensor]):
    """Reads each file through fsspec on every access (what most custom datasets do)."""

    def __init__(self, urls: Sequence[str], storage_options: dict[str, Any]) -> None:
        self.urls = list(urls)
        self._fs = _PerProcessFs(_protocol(self.urls), storage_options)

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int) -> torch.Tensor:
        return to_tensor(self._fs.fs.cat_file(self.urls[i]))


class FsspecFileCache(Dataset[torch.Tensor]):
    """fsspec's ``filecache::`` protocol: downloads whole files on first open, then local."""

    def __init__(
        self, urls: Sequence[str], storage_options: dict[str, Any], cache_dir: str
    ) -> None:
        self.urls = list(urls)
        self.protocol = _protocol(self.urls)
        self.storage_options = storage_options
        self.cache_dir = cache_dir

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int) -> torch.Tensor:
        import fsspec

        with fsspec.open(
            "filecache::" + self.urls[i],
            mode="rb",
            filecache={"cache_storage": self.cache_dir},
            **{self.protocol: self.storage_options},
        ) as f:
            return to_tensor(f.read())


def raw_concurrent_gets(
    store: RawStore, keys: Sequence[str], threads: int, to_dir: str | None = None
) -> tuple[float, int]:
    """GET every key once with a thread pool; returns (seconds, bytes).

    ``store`` is the store's own SDK (``_raw.raw_store``: boto3 or
    azure-storage-blob) with a connection pool of at least ``threads``.

    With ``to_dir``, each body is written to a new file there instead of
    becoming a tensor: the least any read-through cache does on a miss (its
    cold epoch can be no faster), so this rate shows how much of the gap to
    plain GETs is the cost of keeping the bytes on local storage at all. It
    writes with ours' ``write_all`` (1 MiB pieces): one big write costs more
    CPU per byte on some machines.
    """
    from dcp_volumes._volume import write_all

    store.connect()  # connect and sign once outside the timing

    def get(key: str) -> int:
        body = store.get(key)
        if to_dir is None:
            return len(to_tensor(body))
        fd = os.open(os.path.join(to_dir, key.replace("/", "_")), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            write_all(fd, body)
        finally:
            os.close(fd)
        return len(body)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(get, keys))
    return time.perf_counter() - t0, total
