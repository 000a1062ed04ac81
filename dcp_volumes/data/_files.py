"""What the cache hands out (``CachedFile``) and what a listing promises (``Expected``)."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_volumes._volume import FileInfo
from dcp_volumes.data._locks import EntryLock


@dataclass(frozen=True)
class Expected:
    """What a listing says about a file; ``None`` fields are not checked."""

    size: int | None = None
    etag: str | None = None
    mtime: float | None = None

    @classmethod
    def of(cls, info: FileInfo) -> Expected:
        return cls(size=info.size, etag=info.etag, mtime=info.mtime)


class CachedFile:
    """A file in the cache: ``path`` is local; a pinned one is not evicted until released.

    Use as a context manager (or call ``release()``) to drop the pin. It is
    path-like, so ``open(cached)`` works.
    """

    __slots__ = ("_pin", "download_seconds", "hit", "key", "path", "size", "url")

    def __init__(
        self,
        *,
        path: str,
        url: str,
        key: str,
        size: int,
        hit: bool,
        download_seconds: float,
        pin: EntryLock | None,
    ) -> None:
        self.path = path
        self.url = url
        self.key = key
        self.size = size
        self.hit = hit
        self.download_seconds = download_seconds
        self._pin = pin

    @property
    def pinned(self) -> bool:
        return self._pin is not None and self._pin.held

    def release(self) -> None:
        """Drop the pin (idempotent)."""
        pin, self._pin = self._pin, None
        if pin is not None:
            pin.release()

    def __fspath__(self) -> str:
        return self.path

    def __enter__(self) -> CachedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"CachedFile({self.path!r}, hit={self.hit}, pinned={self.pinned})"
