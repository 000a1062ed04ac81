"""testkit/ranks.py: real gloo process groups started the torchrun way."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from testkit.ranks import RankError, RankTimeoutError, run_ranks


def _all_reduce(rank: int, world_size: int, n: int) -> dict[str, object]:
    t = torch.full((n,), float(rank + 1))
    dist.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")}
    return {"sum": t.tolist(), "rank": dist.get_rank(), "env": env}


def _fail_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 waits on the failed peer; the helper must not hang
    return rank


def _hang_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_all_reduce_on_two_ranks() -> None:
    results = run_ranks(_all_reduce, 2, 3)
    assert [r["sum"] for r in results] == [[3.0, 3.0, 3.0]] * 2
    assert [r["rank"] for r in results] == [0, 1]
    assert results[1]["env"] == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "GROUP_RANK": "0",
    }


def _thread_count(rank: int, world_size: int) -> int:
    return torch.get_num_threads()


def test_each_of_several_ranks_computes_on_one_thread_as_under_torchrun() -> None:
    # torch was already imported when the rank set OMP_NUM_THREADS (unpickling the
    # function imports it): before the fix each rank ran one thread per core.
    assert run_ranks(_thread_count, 2, env={"OMP_NUM_THREADS": "1"}) == [1, 1]
    if "OMP_NUM_THREADS" not in os.environ:  # the default, as torchrun's
        assert run_ranks(_thread_count, 2) == [1, 1]


def _where(rank: int, world_size: int, name: str) -> tuple[str | None, str, bool]:
    import sys

    return os.environ.get(name), os.getcwd(), "dcp_volumes" in sys.modules


def test_ranks_see_the_callers_environment_and_directory_as_of_the_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run_ranks(_thread_count, 1)  # the fork server starts with the environment of now
    monkeypatch.setenv("TESTKIT_PROBE", "set later")
    monkeypatch.chdir(tmp_path)
    # Forked from the server, which imported dcp_volumes once for every rank.
    assert run_ranks(_where, 2, "TESTKIT_PROBE") == [("set later", str(tmp_path), True)] * 2
    # fresh: a new interpreter per rank, with nothing of the library imported.
    assert run_ranks(_where, 1, "TESTKIT_PROBE", fresh=True) == [("set later", str(tmp_path),
                                                                   False)]


def test_exception_in_rank_surfaces_with_traceback() -> None:
    with pytest.raises(RankError, match="boom from rank one") as info:
        run_ranks(_fail_on_rank1, 2, timeout=60)
    assert info.value.rank == 1
    assert "_fail_on_rank1" in str(info.value)  # the remote traceback text
    assert "ValueError" in info.value.remote_traceback


def test_hung_rank_is_killed_at_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match="did not finish") as info:
        run_ranks(_hang_on_rank1, 2, timeout=6)
    assert 1 in info.value.ranks
    assert time.monotonic() - start < 6 + 10  # killed, not waited for
