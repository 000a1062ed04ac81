"""What writing new data into the page cache costs on this machine.

A cold cache epoch writes every file it downloads; the raw GETs it is
compared with only fill memory that the process reuses. This probe writes
``--files`` x ``--mib`` MiB files from one reused buffer into a fresh
directory, reads them back, deletes them, and repeats: once right after the
deletion (the freed pages are reused at once) and once after ``--idle``
seconds (long enough for a VM with free-page reporting to hand the freed
memory back to its host, so every page is new to the guest again). Files are
written with one ``write`` each or in 1 MiB writes (the kernel sizes page-cache
folios by the write; ``WRITE_PIECE`` in ``dcp_volumes/_local_fs.py``). It also
writes the same bytes with ``O_DIRECT`` (no page-cache pages of ours; the
read-back fills them by DMA).

    python benchmarks/probes/page_cache_growth.py [--dir DIR] [--files 64] [--mib 8]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time


def write_files(folder: str, view: memoryview, count: int, direct: bool, piece: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    for i in range(count):
        fd = os.open(os.path.join(folder, f"f{i:04d}"), flags, 0o644)
        try:
            for start in range(0, len(view), piece):
                os.write(fd, view[start : start + piece])
        finally:
            os.close(fd)


def read_files(folder: str, count: int) -> None:
    for i in range(count):
        with open(os.path.join(folder, f"f{i:04d}"), "rb") as f:
            f.read()


def one_round(
    root: str, view: memoryview, count: int, direct: bool, piece: int
) -> tuple[float, ...]:
    """(write s, write CPU s, read-back s, read-back CPU s) for a fresh directory."""
    folder = tempfile.mkdtemp(prefix="pcg-", dir=root)
    try:
        t, c = time.perf_counter(), time.process_time()
        write_files(folder, view, count, direct, piece)
        w, wc = time.perf_counter() - t, time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        read_files(folder, count)
        return w, wc, time.perf_counter() - t, time.process_time() - c
    finally:
        shutil.rmtree(folder)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--mib", type=int, default=8)
    p.add_argument("--idle", type=float, default=6.0, help="seconds before the 'idle' rounds")
    args = p.parse_args()
    size = args.mib << 20
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(size))
    view = memoryview(buf)
    total = args.files * args.mib
    root = tempfile.mkdtemp(prefix="page-cache-growth-", dir=args.dir)
    print(f"{args.files} x {args.mib} MiB files in {root}")
    heads = ("write MiB/s", "write CPU s", "read MiB/s", "read CPU s")
    print(f"{'case':38s} " + " ".join(f"{h:>11s}" for h in heads))
    try:
        one, mib = size, 1 << 20  # one write per file / 1 MiB writes
        cases = [
            ("one write, after idle (new pages)", False, args.idle, one),
            ("1 MiB writes, after idle (new pages)", False, args.idle, mib),
            ("one write, right after a deletion", False, 0.0, one),
            ("1 MiB writes, after idle (new pages)", False, args.idle, mib),
            ("one write, after idle (new pages)", False, args.idle, one),
            ("O_DIRECT write, after idle", True, args.idle, one),
        ]
        for name, direct, idle, piece in cases:
            time.sleep(idle)
            try:
                w, wc, r, rc = one_round(root, view, args.files, direct, piece)
            except OSError as exc:  # e.g. O_DIRECT on tmpfs
                print(f"{name:38s} not possible here: {exc}")
                continue
            print(f"{name:38s} {total / w:11.0f} {wc:11.2f} {total / r:11.0f} {rc:11.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
