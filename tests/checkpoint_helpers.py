"""State dicts and comparisons shared by the checkpoint tests (module level: picklable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException


def data_file(ck: Path, index: int, *, rank: int = 0) -> Path:
    """The ``index``-th data file of ``rank`` in the local checkpoint ``ck``.

    VolumeWriter names them ``__{rank}_{save tag}_{index}.distcp``; the tag is
    new per save, so tests find a file by its rank and index.
    """
    found = [p for p in ck.rglob("*.distcp")
             if p.name.startswith(f"__{rank}_") and p.stem.rsplit("_", 1)[-1] == str(index)]
    if len(found) != 1:
        raise LookupError(f"{len(found)} data files of rank {rank} with index {index} in {ck}")
    return found[0]


def sample_state(seed: int = 0, *, big_mib: int = 2) -> dict[str, Any]:
    """Tensors of many dtypes (non-contiguous, 0-d, two of ``big_mib`` MiB) and objects."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 48, generator=g)
    n_big = big_mib * 2**20 // 4
    return {
        "f32": torch.randn(17, 5, generator=g),
        "f16": torch.randn(33, generator=g).half(),
        "bf16": torch.randn(4, 4, generator=g).bfloat16(),
        "f64": torch.randn(3, 2, generator=g).double(),
        "i64": torch.arange(100, dtype=torch.int64) * (seed + 1),
        "u8": torch.randint(0, 255, (77,), dtype=torch.uint8, generator=g),
        "flags": torch.rand(9, generator=g) > 0.5,
        "strided": base[:, ::3],  # a view: non-contiguous, storage larger than its data
        "transposed": base.t(),
        "scalar": torch.tensor(2.5 + seed, dtype=torch.float64),
        "big1": torch.randn(n_big, generator=g),
        "big2": torch.randn(n_big // 256, 256, generator=g),
        "nested": {
            "inner": {"t": torch.full((3, 3), float(seed))},
            "step": 12 + seed,
            "name": "run-日本",
            "mixed": [1, 2.5, "x"],
        },
        "epoch": 7,
        "tag": "hello",
        "list": [1, 2, 3],
    }


def blank_like(obj: Any) -> Any:
    """A ``dcp.load`` target shaped like ``obj``: zero tensors, placeholder objects."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: blank_like(v) for k, v in obj.items()}
    if isinstance(obj, str):
        return ""
    if isinstance(obj, list):
        return []
    return 0


def assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Bit-equal tensors (same dtype and shape) and equal objects, recursively."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual)} is not a tensor"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        a = actual.contiguous().view(-1).view(torch.uint8) if actual.numel() else actual
        e = expected.contiguous().view(-1).view(torch.uint8) if expected.numel() else expected
        assert torch.equal(a, e), f"{path}: tensor bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), path
        for k in expected:
            assert_same(actual[k], expected[k], f"{path}.{k}")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def failure_of(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException`` (or ``exc`` itself)."""
    if isinstance(exc, CheckpointException):
        return next(iter(exc.failures.values()))[0]
    return exc


def join(url: str, *parts: str) -> str:
    """``url/part/part`` for URLs and local paths alike."""
    return "/".join([url.rstrip("/"), *parts])


def stock_reader(url: str, opts: dict[str, Any], registry: Any = None) -> Any:
    """Stock DCP's reader for ``url``: ``FsspecReader`` for s3://, else ``FileSystemReader``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    if url.startswith("s3://"):
        reader = FsspecReader(url, **opts)
        if registry is not None:  # FsspecReader takes no registry argument
            reader.transforms.extension_registry = registry
        return reader
    return FileSystemReader(url, _extension_registry=registry)
