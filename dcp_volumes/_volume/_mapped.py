"""Staged files as memory maps for uploads, holding in RAM only what is on its way out.

obstore sends a buffer without copying it, so an upload hands it a
read-only map of the staged file. A page of that map counts in the
process's RSS from the moment the HTTP stack reads it until the map is
closed, i.e. for the whole request: every file in flight would sit in RAM
whole. Pages already written to the socket are needed again only for a
retry, which faults them back in from the page cache. So a background thread
drops the pages of every open upload map from this process every 10 ms
(``MADV_DONTNEED``: the page cache keeps them); what an upload holds in RSS
is then about what it sends (or hashes, for a signed payload) in that time,
not the file. The kernel maps a file's large folios whole on the first touch
(their size is the filesystem's), so that is the least an upload in flight
holds; a shorter period bought little RSS for more CPU (benchmarks/HISTORY.md).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import IO

logger = logging.getLogger("dcp_volumes._volume")

# How often the pages of open upload maps are dropped.
_DROP_EVERY_S = 0.01


class _SentPages:
    """The open upload maps of this process, and the thread that drops their pages."""

    def __init__(self) -> None:
        self._maps: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def add(self, mapping: mmap.mmap) -> None:
        if not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return  # not Linux: the pages stay until the map closes
        with self._lock:
            self._maps.add(mapping)
            if self._thread is None or self._pid != os.getpid():  # none yet, or forked
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, name="dcpv-upload-pages", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if not self._drop_pages():
                self._wake.clear()
            time.sleep(_DROP_EVERY_S)

    def _drop_pages(self) -> bool:
        """One pass over the open maps (whose references end with this call); any left?"""
        with self._lock:
            maps = list(self._maps)
        for mapping in maps:
            # A map closed meanwhile raises ValueError: nothing to drop then.
            with contextlib.suppress(ValueError, OSError):
                mapping.madvise(mmap.MADV_DONTNEED)
        return bool(maps)


_SENT = _SentPages()


def _open_map(f: IO[bytes], length: int, offset: int) -> mmap.mmap:
    mapping = mmap.mmap(f.fileno(), length, offset=offset, access=mmap.ACCESS_READ)
    _SENT.add(mapping)
    return mapping


@contextlib.contextmanager
def mapped(f: IO[bytes], size: int) -> Iterator[memoryview | bytes]:
    """The bytes of the open file ``f`` as one read-only map (``b""`` when empty).

    On leaving, the map is closed unless a client still holds the buffer: a
    request that failed or was cancelled can hand its error back before the
    client's runtime has let go of the body (obstore drops it on one of its
    threads, later). Such a map is left to close itself when the last holder
    lets go, never unmapped under it, and the block's own outcome (the
    request's error, which may be a transient one) is what propagates. A retry
    maps the file again: it never shares a buffer with an abandoned request.
    """
    if size == 0:
        yield b""
        return
    mapping = _open_map(f, size, 0)
    view = memoryview(mapping)
    try:
        yield view
    finally:
        _let_go(view, mapping)
        # The request's error keeps this frame in its traceback: not the map too.
        del view, mapping


def _let_go(view: memoryview, mapping: mmap.mmap) -> None:
    """Release ``view`` and close ``mapping``, or leave both to close when their holders let go.

    A client's buffer of ``view`` refuses its release, and a buffer of ``mapping``
    its close (``BufferError``); either is no failure of the upload. The holder's
    buffer keeps ``view`` (and ``view`` keeps ``mapping``) alive: once it is
    released, reference counting releases the view and unmaps the file.
    """
    try:
        view.release()
        mapping.close()
    except BufferError:
        logger.debug(
            "a finished or abandoned request still holds its upload buffer (%d bytes): "
            "the map closes when the client lets go of it",
            len(mapping),
        )


def mapped_parts(f: IO[bytes], size: int, part_size: int) -> Iterator[memoryview]:
    """The bytes of the open file ``f`` as read-only maps of ``part_size`` each.

    Nothing here keeps a part once it is yielded: its map closes when the
    consumer releases the buffer.
    """
    grain = mmap.ALLOCATIONGRANULARITY
    for start in range(0, size, part_size):
        length = min(part_size, size - start)
        aligned = start - start % grain  # map offsets must be page-aligned
        part = _open_map(f, length + start - aligned, aligned)
        view = memoryview(part)[start - aligned :]
        del part
        yield view
        del view
