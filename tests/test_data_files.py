"""A data file: stock ``torch.save`` bytes back to back, hashed whole, every tensor located."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from dcp_volumes.checkpoint._byte_format import HashingFile, plain_cpu_tensor
from dcp_volumes.checkpoint._manifest import checksum_bytes


def test_a_data_file_holds_stock_bytes_and_locates_every_tensor(tmp_path: Path) -> None:
    # Tiny and small items (their writes are gathered in memory) around larger ones.
    items: list[torch.Tensor | bytes] = [
        torch.full((1,), 1000.0),
        torch.arange(25_000, dtype=torch.float32),  # ~100 KiB
        b"an object item, as BYTE_IO",
        torch.rand(3, 2**18),  # 3 MiB
        torch.arange(7, dtype=torch.int64),
        torch.rand(40_000, dtype=torch.float64),  # ~312 KiB
    ]
    f = HashingFile(str(tmp_path / "data"))
    spans = []
    expected = io.BytesIO()
    for item in items:
        start = f.tell()
        if isinstance(item, bytes):
            f.write(item)
            expected.write(item)
        else:
            t = plain_cpu_tensor(item)
            f.expect_tensor(t)
            torch.save(t, f)
            torch.save(t, expected)
        spans.append((start, f.tell()))
    record = f.close(fsync=False)

    data = (tmp_path / "data").read_bytes()
    assert data == expected.getvalue() and record.size == len(data)
    assert record.checksum == checksum_bytes(data)
    tensor_spans = [s for s, item in zip(spans, items, strict=True) if not isinstance(item, bytes)]
    assert sorted(record.tensors) == [start for start, _ in tensor_spans]
    for (start, end), t in zip(tensor_spans, [i for i in items if not isinstance(i, bytes)],
                               strict=True):
        at, nbytes = record.tensors[start]
        assert data[at : at + nbytes] == t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert torch.equal(torch.load(io.BytesIO(data[start:end]), weights_only=True), t)
