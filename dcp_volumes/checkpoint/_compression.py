"""zstd compression of checkpoint items, in the format stock DCP's ``ZStandard`` writes.

Every item compressed here is one zstd frame recorded with the descriptor
``stream.zstd/1``, exactly what torch's ``ZStandard`` extension writes, so stock
``FileSystemReader``/``FsspecReader`` decode it with their default registry.
The level and the worker threads only change how hard the compressor works,
never the format (any zstd decoder reads any level).

The zstd library is the first of these that is installed: ``zstandard``
(``pip install 'dcp_volumes[zstd]'``, the one torch's ``ZStandard`` uses),
the standard library's ``compression.zstd`` (Python 3.14+) or its backport
``backports.zstd``.
"""

from __future__ import annotations

import importlib
import io
from types import ModuleType
from typing import IO, Any, cast

from dcp_volumes._exceptions import BackendNotInstalledError, ConfigurationError

# Torch's extension API appeared in 2.7 (experimental): without it compression
# is refused with a message, not an ImportError at import time.
from dcp_volumes._torch.checkpoint import EXTENSIONS_AVAILABLE, StreamTransformExtension, ZStandard
from dcp_volumes._world import available_cpus

REGISTRY_NAME = "stream.zstd"
DESCRIPTOR = f"{REGISTRY_NAME}/1"
# Level 1, not zstd's 3: on tensor data it compresses about twice as fast for
# the same ratio (better on integer tensors), and a save must outrun the link.
DEFAULT_LEVEL = 1
# zstd's fast levels go below -7 but buy little more speed; above 22 there is nothing.
MIN_LEVEL, MAX_LEVEL = -7, 22
# What the compressors write per call: large enough that a call costs little.
_WRITE_SIZE = 1 << 20


def _find_backend() -> tuple[str, ModuleType] | None:
    # backports.zstd: the standard library's compression.zstd for Python < 3.14.
    for name in ("zstandard", "compression.zstd", "backports.zstd"):
        try:
            return name, importlib.import_module(name)
        except ImportError:
            continue
    return None


_BACKEND = _find_backend()


def zstd_library() -> str | None:
    """Name of the zstd library in use (``zstandard``, ``compression.zstd``) or ``None``."""
    return _BACKEND[0] if _BACKEND is not None else None


def _require_backend() -> tuple[str, ModuleType]:
    if not EXTENSIONS_AVAILABLE:  # pragma: no cover - torch < 2.7
        raise ConfigurationError(
            "Checkpoint compression needs torch >= 2.7, whose DCP has stream extensions "
            "(torch.distributed.checkpoint._extension). Upgrade torch, or save without "
            "compression=."
        )
    if _BACKEND is None:
        raise BackendNotInstalledError(
            "compression='zstd' needs a zstd library and none is installed. Fix: "
            "pip install 'dcp_volumes[zstd]' (installs zstandard), or use Python 3.14+, "
            "whose standard library has compression.zstd."
        )
    return _BACKEND


class _NoClose(io.RawIOBase):
    """``output`` for a compressor: closing the compressor must not close the data file,
    which holds the items after this one."""

    def __init__(self, output: IO[bytes]) -> None:
        super().__init__()
        self._out = output

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._out.write(b)
        return len(memoryview(b))

    def close(self) -> None:
        self.flush()
        super().close()


class _StdlibWriter(io.RawIOBase):
    """A compressing stream over ``compression.zstd.ZstdCompressor`` (one frame)."""

    def __init__(self, zstd: ModuleType, output: IO[bytes], level: int, threads: int) -> None:
        super().__init__()
        # Either level= or options=, not both: the level goes into the options.
        options = {zstd.CompressionParameter.compression_level: level}
        if threads:
            options[zstd.CompressionParameter.nb_workers] = threads
        self._compressor = zstd.ZstdCompressor(options=options)
        self._end = zstd.ZstdCompressor.FLUSH_FRAME
        self._out = output

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = self._compressor.compress(b)
        if data:
            self._out.write(data)
        return len(memoryview(b))

    def close(self) -> None:
        if not self.closed:
            data = self._compressor.flush(self._end)
            if data:
                self._out.write(data)
            self._out.flush()
        super().close()


class ZstdCompression(StreamTransformExtension):
    """zstd compression of every checkpoint item, readable by stock DCP.

    Pass ``compression=ZstdCompression(level=..., threads=...)`` (or
    ``compression="zstd"``) to ``VolumeWriter``, or put it in ``_extensions=``
    like torch's ``ZStandard``, whose on-disk format it shares.

    Args:
        level: zstd level, -7 (fastest) to 22 (smallest); default 1, which on
            tensor data gives about level 3's ratio at twice its speed.
        threads: compressor worker threads per item: 0 compresses in the
            save's serialising thread; ``N >= 1`` uses N workers (helps large
            tensors); -1 one per CPU this process may run on.
    """

    def __init__(self, level: int = DEFAULT_LEVEL, threads: int = 0) -> None:
        super().__init__()
        if isinstance(level, bool) or not isinstance(level, int) or not (
            MIN_LEVEL <= level <= MAX_LEVEL
        ):
            raise ConfigurationError(
                f"zstd level={level!r} is out of range: use an integer from {MIN_LEVEL} "
                f"(fastest) to {MAX_LEVEL} (smallest); {DEFAULT_LEVEL} is the default."
            )
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < -1:
            raise ConfigurationError(
                f"zstd threads={threads!r}: use 0 (compress in the saving thread), a number "
                "of worker threads >= 1, or -1 (one per CPU this process may run on)."
            )
        _require_backend()
        self.level = level
        self.threads = threads

    def __repr__(self) -> str:
        return f"ZstdCompression(level={self.level}, threads={self.threads})"

    @staticmethod
    def registry_name() -> str:
        return REGISTRY_NAME

    @staticmethod
    def from_descriptor(version: str) -> Any:
        """The decoder for ``stream.zstd/<version>``; torch's own where no library of ours is."""
        if version.partition(".")[0] != "1":
            raise ValueError(
                f"Unknown {REGISTRY_NAME} version {version!r}: this checkpoint was written by a "
                "newer writer; upgrade torch and dcp_volumes to read it."
            )
        if _BACKEND is None and ZStandard is not None:
            return ZStandard.from_descriptor(version)  # e.g. only pyzstd is installed
        return ZstdCompression()

    def get_descriptor(self) -> str:
        return DESCRIPTOR

    def _workers(self) -> int:
        return available_cpus() if self.threads == -1 else self.threads

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        """A stream that compresses what is written to it into ``output`` (one frame)."""
        name, zstd = _require_backend()
        target = cast(IO[bytes], _NoClose(output))
        if name == "zstandard":
            compressor = zstd.ZstdCompressor(level=self.level, threads=self._workers())
            return cast(IO[bytes], compressor.stream_writer(target, write_size=_WRITE_SIZE))
        return cast(IO[bytes], _StdlibWriter(zstd, target, self.level, self._workers()))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        """``input`` (one stored item, read whole) decompressed into memory.

        Readers need the whole item in memory anyway (``torch.load`` seeks);
        one decompress call over it runs without the GIL, where a streaming
        reader takes it back for every block.
        """
        name, zstd = _require_backend()
        data = input.read()
        if name == "zstandard":
            out = zstd.ZstdDecompressor().decompressobj().decompress(data)
        else:
            out = zstd.decompress(data)
        return io.BytesIO(out)


def resolve(compression: str | ZstdCompression | None) -> ZstdCompression | None:
    """The extension for ``VolumeWriter(compression=...)``: ``"zstd"``, an instance, or None."""
    if compression is None or isinstance(compression, ZstdCompression):
        return compression
    if isinstance(compression, str) and compression.lower() in ("zstd", "zstandard"):
        return ZstdCompression()
    raise ConfigurationError(
        f"compression={compression!r} is not supported: use 'zstd', "
        "ZstdCompression(level=..., threads=...) for a level and threads, or None."
    )
