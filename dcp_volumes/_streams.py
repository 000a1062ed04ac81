"""Seekable read-only streams over part of a file or of memory, without copies.

``torch.load`` reads a checkpoint item from them: it wants a seekable file
object, and the whole range should not become one ``bytes`` first.
"""

from __future__ import annotations

import abc
import io
import os
from typing import Any


class RangeReader(io.RawIOBase):
    """A seekable read-only stream over ``length`` bytes; subclasses fill ``_fill``."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self._len = length
        self._pos = 0

    def __len__(self) -> int:
        return self._len

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        want = max(0, min(len(out), self._len - self._pos))
        got = self._fill(out[:want], self._pos) if want else 0
        self._pos += got
        return got

    @abc.abstractmethod
    def _fill(self, out: memoryview, pos: int) -> int:
        """Fill ``out`` with the bytes at ``pos``; returns how many (short at the end of data)."""


class MemoryReader(RangeReader):
    """A stream over a memoryview."""

    def __init__(self, view: memoryview) -> None:
        super().__init__(len(view))
        self._view = view

    def _fill(self, out: memoryview, pos: int) -> int:
        out[:] = self._view[pos : pos + len(out)]
        return len(out)

    def getbuffer(self) -> memoryview:
        """All its bytes, without a copy (as ``io.BytesIO.getbuffer``): for a decoder
        that reads an item whole (decryption)."""
        return self._view


class FileSlice(RangeReader):
    """``[offset, offset + length)`` of a file, by positioned reads into the caller's buffer.

    Takes an open file (left open) or a path (opened here, closed by
    ``close``). A file shorter than the slice reads short, as a truncated
    file must.
    """

    def __init__(self, file: Any, offset: int, length: int) -> None:
        super().__init__(length)
        self._owned = not hasattr(file, "fileno")
        self._fd = os.open(file, os.O_RDONLY) if self._owned else file.fileno()
        self._offset = offset

    def _fill(self, out: memoryview, pos: int) -> int:
        got = 0
        while got < len(out):
            n = os.preadv(self._fd, [out[got:]], self._offset + pos + got)
            if not n:
                break
            got += n
        return got

    def close(self) -> None:
        if self._owned and not self.closed:
            os.close(self._fd)
        super().close()
