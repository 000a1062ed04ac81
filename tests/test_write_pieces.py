"""Local writes go out in pieces of at most 1 MiB (see ``WRITE_PIECE``), whole and in place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dcp_volumes import FileCache
from dcp_volumes._volume import WRITE_PIECE, write_all


@pytest.fixture
def short_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """os.write / os.pwrite that take at most 300 KiB per call; records what was asked."""
    asked: list[int] = []
    real_write, real_pwrite = os.write, os.pwrite

    def write(fd: int, data: bytes) -> int:
        asked.append(len(data))
        return real_write(fd, memoryview(data)[: 300 * 1024])

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        asked.append(len(data))
        return real_pwrite(fd, memoryview(data)[: 300 * 1024], offset)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    return asked


def test_write_all_writes_everything_in_pieces(tmp_path: Path, short_writes: list[int]) -> None:
    payload = os.urandom(3 * WRITE_PIECE + 12345)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        write_all(fd, payload)
        # At an offset: what is before it stays, the rest lands after it.
        write_all(fd, payload[:WRITE_PIECE + 7], offset=len(payload) + 10)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[: len(payload)] == payload
    assert data[len(payload) : len(payload) + 10] == bytes(10)
    assert data[len(payload) + 10 :] == payload[: WRITE_PIECE + 7]
    assert max(short_writes) == WRITE_PIECE and sum(short_writes) > len(payload)


def test_a_cache_fill_writes_in_pieces(tmp_path: Path, short_writes: list[int]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    payload = os.urandom(5 * WRITE_PIECE + 1)
    (src / "big.bin").write_bytes(payload)
    short_writes.clear()
    cache = FileCache(str(tmp_path / "cache"))
    local = cache.fetch(str(src / "big.bin"))
    assert Path(local).read_bytes() == payload and str(tmp_path / "cache") in local
    assert sum(short_writes) >= len(payload) and max(short_writes) <= WRITE_PIECE
