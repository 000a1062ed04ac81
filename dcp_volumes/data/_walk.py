"""A directory tree walked into columns: its visible files sorted by path, with sizes and
mtimes, packed a folder at a time (no Python object per file outlives its folder's read).

Standard library only: besides being imported, this file runs as a script in worker
processes (``python -I -S _walk.py``), which read a large tree's folders on several
cores without importing torch or this package. Where metadata is in memory a walk is
a stat per file plus the interpreter's work around it, so one thread is as fast as
it gets in one process (threads only pass the GIL around); processes divide it.
Folders on a mount the kernel waits for (a network file system) go to threads as
well, where those waits overlap (``_Walk``).

Order: siblings are ordered by name, a folder's name with ``/`` after it
("a-1.bin" < "a/"), which is the order of the full paths. Hidden files and folders
(a name starting with ".") are skipped. A missing root walks as empty.
"""

from __future__ import annotations

import os
import stat
import struct
import sys
import time
from array import array

# (What only the importing process needs, a worker process does not import: typing,
# logging, subprocess and concurrent.futures would double its start-up.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from concurrent.futures import Future, ThreadPoolExecutor

#: A run of files in path order: their paths' UTF-8 back to back, each path's length in
#: bytes (uint32), sizes (int64), mtimes (float64), each as machine-order bytes.
Part = tuple[bytes, "array[int]", "array[int]", "array[float]"]

# Folders whose entries took longer than this each, beyond the walking thread's own
# CPU, are on a disk or mount the kernel waits for: threads overlap those waits.
_WAIT_PER_ENTRY_S = 50e-6
# A tree estimated to hold at least this many files is divided among processes
# (a worker process starts in tens of milliseconds; this many stats take longer).
PARALLEL_FROM = 20_000
# A worker's message: folder index, files, bytes of their paths (then the columns).
_HEADER = struct.Struct("<IQQ")
_END = 0xFFFFFFFF  # the index of the last message: the worker read every folder


def walk(root: str, wanted: tuple[str, ...] | None, *, threads: int,
         processes: int) -> list[Part]:
    """The files below ``root`` (suffixes ``wanted``, lower case; None: all) as runs.

    ``threads``: at most this many threads for folders that wait on the kernel;
    ``processes``: at most this many worker processes for a large tree (1: none).
    """
    run = _Walk(wanted, threads)
    try:
        top = run.read(root, "", defer=True)
        # Down to the first level with several folders ("data/train/<class>/...").
        while len(top.parts) == 1 and isinstance(top.parts[0], _Later):
            later = top.parts[0]
            top = run.read(later.path, later.rel, defer=True)
        slots = [p for p in top.parts if isinstance(p, _Later)]
        if slots:
            first = run.read(slots[0].path, slots[0].rel)
            slots[0].result = first
            files = sum(len(part[1]) for part in _flatten(first))
            if processes > 1 and len(slots) > 2 and files * len(slots) >= PARALLEL_FROM:
                _in_processes(slots[1:], wanted, threads, processes)
            for slot in slots[1:]:
                if slot.parts is None:  # (not read by a worker process)
                    slot.result = run.read_or_submit(slot.path, slot.rel)
        return _flatten(top)
    finally:
        run.close()


class _Folder:
    """One folder of a walk: runs of its files and its subfolders (read, being read on
    the pool, or left for later), in path order."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[Part | _Folder | Future[_Folder] | _Later] = []


class _Later:
    """A subfolder not read yet: read later here (``result``), or by a worker process
    (``parts``)."""

    __slots__ = ("parts", "path", "rel", "result")

    def __init__(self, path: str, rel: str) -> None:
        self.path, self.rel = path, rel
        self.result: _Folder | Future[_Folder] | None = None
        self.parts: list[Part] | None = None


class _Walk:
    """A directory walk: one thread while folders read fast, a pool once they read slowly.

    The decision is taken on what the folders read so far waited, from the second on
    (the first read of a walk also resolves its path). Until the pool starts every
    folder is read on the calling thread, so only that thread decides; no task waits
    for another, so a busy pool cannot deadlock.
    """

    def __init__(self, wanted: tuple[str, ...] | None, threads: int) -> None:
        self.wanted = wanted
        self.threads = threads
        self.pool: ThreadPoolExecutor | None = None
        self._folders = self._entries = 0
        self._waited = 0.0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _timed_entries(self, folder: str, rel: str) -> tuple[_Files, list[str]]:
        if self.pool is not None or self.threads <= 1:
            return read_entries(folder, rel, self.wanted)
        wall, cpu = time.perf_counter(), time.thread_time()
        files, dirs = read_entries(folder, rel, self.wanted)
        self._waited += (time.perf_counter() - wall) - (time.thread_time() - cpu)
        self._entries += len(files[0]) + len(dirs) + 1
        self._folders += 1
        if self._folders >= 2 and self._waited > _WAIT_PER_ENTRY_S * self._entries:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dcpv-walk")
        return files, dirs

    def read(self, folder: str, rel: str, *, defer: bool = False) -> _Folder:
        """The files of ``folder`` (``rel``: its path in the walk) and its subfolders:
        read here, handed to the pool, or (``defer``) left for the caller."""
        out = _Folder()
        try:
            files, dirs = self._timed_entries(folder, rel)
        except (FileNotFoundError, NotADirectoryError):
            return out  # a missing prefix lists as empty
        if not dirs:  # (most folders of a dataset: files only)
            if files[0]:
                out.parts.append(_pack(*files))
            return out
        named = sorted([(path[len(rel):], i) for i, path in enumerate(files[0])]
                       + [(name + "/", -1) for name in dirs])
        run: list[int] = []
        for key, i in named:
            if i >= 0:
                run.append(i)
                continue
            if run:
                out.parts.append(_pick(files, run))
                run = []
            path = os.path.join(folder, key[:-1])
            out.parts.append(_Later(path, rel + key) if defer
                             else self.read_or_submit(path, rel + key))
        if run:
            out.parts.append(_pick(files, run))
        return out

    def read_or_submit(self, folder: str, rel: str) -> _Folder | Future[_Folder]:
        """``read`` here, or on the pool once there is one (folders that wait)."""
        if self.pool is None:
            return self.read(folder, rel)
        return self.pool.submit(self.read, folder, rel)


_Files = tuple[list[str], list[int], list[float]]


def read_entries(folder: str, rel: str, wanted: tuple[str, ...] | None) -> tuple[_Files, list[str]]:
    """The visible files of ``folder`` (paths ``rel + name``, sizes, mtimes), sorted by
    name, and its subfolders.

    Each name is stat'ed relative to the open folder: one path component to resolve,
    where a stat of the full path resolves every folder above it again. Links are
    followed; an entry removed meanwhile (or a dangling link) is left out, as a
    store's listing would not show it.
    """
    paths: list[str] = []
    sizes: list[int] = []
    mtimes: list[float] = []
    dirs: list[str] = []
    # (Bound methods and one join to look for hidden names: this loop runs once a file.)
    add_path, add_size, add_mtime = paths.append, sizes.append, mtimes.append
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = os.listdir(fd)
        names.sort()
        if "\0." in "\0" + "\0".join(names):
            names = [name for name in names if name[0] != "."]  # hidden: not data
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                path = rel + name
                if wanted is None or path.lower().endswith(wanted):
                    add_path(path)
                    add_size(st.st_size)
                    add_mtime(st.st_mtime)
            elif stat.S_ISDIR(st.st_mode):
                dirs.append(name)
    finally:
        os.close(fd)
    return (paths, sizes, mtimes), dirs


def utf8_joined(strings: Sequence[str]) -> tuple[bytes, list[int]]:
    """The UTF-8 of ``strings`` back to back, and each one's length in bytes."""
    joined = "".join(strings)
    if joined.isascii():  # one byte a character: the lengths without encoding each
        return joined.encode("ascii"), list(map(len, strings))
    encoded = [s.encode() for s in strings]
    return b"".join(encoded), list(map(len, encoded))


def _pack(paths: list[str], sizes: list[int], mtimes: list[float]) -> Part:
    blob, lengths = utf8_joined(paths)
    return blob, array("I", lengths), array("q", sizes), array("d", mtimes)


def _pick(files: _Files, rows: list[int]) -> Part:
    paths, sizes, mtimes = files
    return _pack([paths[i] for i in rows], [sizes[i] for i in rows], [mtimes[i] for i in rows])


def _flatten(folder: _Folder) -> list[Part]:
    """The runs of ``folder`` and of its subfolders, in path order."""
    out: list[Part] = []
    for part in folder.parts:
        if isinstance(part, _Later):
            if part.parts is not None:
                out += part.parts
                continue
            if part.result is None:
                raise RuntimeError(f"the walk left {part.path} unread")
            part = part.result
        if not isinstance(part, (tuple, _Folder)):  # a pool's future
            part = part.result()
        if isinstance(part, _Folder):
            out += _flatten(part)
        else:
            out.append(part)
    return out


# -- worker processes -------------------------------------------------------------------------


def _in_processes(slots: Sequence[_Later], wanted: tuple[str, ...] | None, threads: int,
                  processes: int) -> None:
    """Read ``slots`` in worker processes, the ``k``-th of ``n`` taking every ``n``-th
    (folders of a dataset are alike: interleaving balances them). A worker that fails
    to start or to finish leaves its folders unread (``parts`` None): the caller reads
    them here, with the errors a walk here gives."""
    import logging
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    logger = logging.getLogger(__name__)
    n = min(processes, len(slots))
    shares = [list(range(k, len(slots), n)) for k in range(n)]

    def one(share: list[int]) -> None:
        fields = [str(threads), "\x01".join(wanted or ())]
        for i in share:
            fields += [slots[i].path, slots[i].rel]
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-S", os.path.abspath(__file__)],
                input=b"\0".join(map(os.fsencode, fields)), capture_output=True, check=False,
            )
        except OSError as exc:  # (no interpreter to start, e.g. an embedded one)
            logger.debug("walk: no worker process (%s); its folders are read here", exc)
            return
        parts = _unpack(done.stdout) if done.returncode == 0 else None
        if parts is None:
            why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no end"]
            logger.debug("walk: a worker process failed (exit %s: %s); its folders are read "
                         "here", done.returncode, why[0])
            return
        for index, folder_parts in parts.items():
            slots[share[index]].parts = folder_parts
        for i in share:
            if slots[i].parts is None:
                slots[i].parts = []  # (a folder without files sends nothing)

    if sys.executable and os.path.isfile(__file__):
        with ThreadPoolExecutor(n, thread_name_prefix="dcpv-walk-proc") as pool:
            list(pool.map(one, shares))


def _unpack(data: bytes) -> dict[int, list[Part]] | None:
    """A worker's messages by folder; None unless they end with the end message."""
    parts: dict[int, list[Part]] = {}
    view, pos = memoryview(data), 0
    while pos + _HEADER.size <= len(data):
        index, n, blob = _HEADER.unpack_from(data, pos)
        pos += _HEADER.size
        if index == _END:
            return parts
        ends = [pos + blob, pos + blob + 4 * n, pos + blob + 12 * n, pos + blob + 20 * n]
        if ends[-1] > len(data):
            return None
        lengths, sizes, mtimes = array("I"), array("q"), array("d")
        lengths.frombytes(view[ends[0]:ends[1]])
        sizes.frombytes(view[ends[1]:ends[2]])
        mtimes.frombytes(view[ends[2]:ends[3]])
        parts.setdefault(index, []).append((bytes(view[pos:ends[0]]), lengths, sizes, mtimes))
        pos = ends[-1]
    return None


def _serve() -> None:
    """A worker process: the request on stdin (threads, the suffixes, then each folder's
    path and path in the walk, NUL-separated), each folder's runs on stdout."""
    threads, suffixes, *folders = map(os.fsdecode, sys.stdin.buffer.read().split(b"\0"))
    wanted = tuple(suffixes.split("\x01")) if suffixes else None
    out = sys.stdout.buffer
    run = _Walk(wanted, int(threads))
    try:
        for index, (path, rel) in enumerate(zip(folders[::2], folders[1::2], strict=True)):
            for blob, lengths, sizes, mtimes in _flatten(run.read(path, rel)):
                out.write(_HEADER.pack(index, len(sizes), len(blob)))
                for column in (blob, lengths, sizes, mtimes):
                    out.write(column)
    finally:
        run.close()
    out.write(_HEADER.pack(_END, 0, 0))
    out.flush()


if __name__ == "__main__":
    _serve()
