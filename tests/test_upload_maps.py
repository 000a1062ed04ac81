"""Upload maps of staged files: pages already sent leave the process's RSS, data stays exact."""

from __future__ import annotations

import gc
import os
import pickle
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes._volume._mapped import mapped, mapped_parts


def _resident_kib(view: memoryview) -> int:
    """Rss of the mapping that holds ``view``, from /proc/self/smaps."""
    import numpy as np

    address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("mapping not found")


def _dropped_after_reading(view: memoryview) -> int:
    assert bytes(view[:: 4096]) is not None  # touch every page, as a send does
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _resident_kib(view) > 1024:
        time.sleep(0.01)
    return _resident_kib(view)


def test_sent_pages_of_a_whole_file_map_leave_rss_and_read_back(tmp_path: Path) -> None:
    data = os.urandom(16 * 2**20)
    path = tmp_path / "staged"
    path.write_bytes(data)
    with open(path, "rb") as f, mapped(f, len(data)) as view:
        assert isinstance(view, memoryview)
        assert bytes(view) == data
        assert _dropped_after_reading(view) <= 1024  # of 16 MiB touched
        assert bytes(view) == data  # a retry faults the pages back in, unchanged


def test_part_maps_cover_the_file_exactly_and_drop_their_pages(tmp_path: Path) -> None:
    data = os.urandom(11 * 2**20 + 12345)
    path = tmp_path / "staged"
    path.write_bytes(data)
    part = 5 * 2**20 + 100  # not page-aligned: the maps start below and slice
    with open(path, "rb") as f:
        parts = list(mapped_parts(f, len(data), part))
    assert [len(p) for p in parts] == [part, part, len(data) - 2 * part]
    assert b"".join(bytes(p) for p in parts) == data
    assert _dropped_after_reading(parts[0]) <= 1024
    with open(path, "rb") as f, mapped(f, 0) as empty:
        assert empty == b""


# What a client may still hold of an upload's body once its request has ended: a buffer
# of the view itself (obstore's runtime takes one, and may drop it only after the request's
# error reached the caller; the view's release then refuses), or another view of the same
# memory (the map's close refuses).
_HOLDERS = {"a buffer of the body": pickle.PickleBuffer, "a view of its memory": memoryview}


@pytest.mark.parametrize("hold", list(_HOLDERS.values()), ids=list(_HOLDERS))
@pytest.mark.parametrize("fails", [True, False], ids=["request failed", "request succeeded"])
def test_a_map_a_client_still_holds_stays_valid_until_it_lets_go(
    tmp_path: Path, hold: Callable[[memoryview], Any], fails: bool
) -> None:
    data = os.urandom(2 * 2**20 + 7)
    path = tmp_path / "staged"
    path.write_bytes(data)
    holders: list[Any] = []
    maps: list[weakref.ref[Any]] = []

    def send() -> None:
        with open(path, "rb") as f, mapped(f, len(data)) as body:
            assert isinstance(body, memoryview)
            maps.append(weakref.ref(body.obj))
            holders.append(hold(body))
            if fails:
                raise ConnectionResetError("connection reset mid-request")

    if fails:
        # The request's own (transient) error comes out, never a BufferError of the close.
        with pytest.raises(ConnectionResetError):
            send()
    else:
        send()
    # Never unmapped under the holder (a read of an unmapped page would crash the process).
    assert bytes(holders[0]) == data
    holders.clear()
    gc.collect()
    assert maps[0]() is None  # closed once the holder let go
