"""Costs that grow no faster than the job: the simulation harness at a CI size, and a real restore.

``benchmarks/bench_scale.py`` drives N simulated ranks (real writers, readers
and DCP planners, with DCP's collectives handed over in one process) through
a counting proxy; here it runs at a few ranks and its counts are checked
against what the design promises: a commit whose requests do not grow with
the ranks, a restore that reads ``.metadata`` and
the manifest once, and a load in which no rank lists every rank's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from benchmarks import bench_scale
from dcp_volumes import CheckpointManager
from dcp_volumes.checkpoint import _reader
from testkit.emulators import LatencyProxy, MotoServer
from testkit.ranks import run_ranks

pytestmark = [pytest.mark.emulator, pytest.mark.timeout(240)]


def _requests(phases: dict[str, Any], kind: str) -> int:
    return sum(p["requests"].get(kind, 0) for p in phases.values())


@pytest.fixture(scope="module")
def simulated() -> dict[int, dict[str, Any]]:
    """Ours and stock DCP at 4 and 16 ranks x 2 files."""
    result = bench_scale.run((4, 16), files=2, parallel=4)
    by_n: dict[int, dict[str, Any]] = {}
    for row in result["rows"]:
        by_n.setdefault(row["ranks"], {})[row["method"]] = row
    assert bench_scale.table(result)  # the report renders
    return by_n


def test_the_commit_makes_the_same_requests_at_4_and_16_ranks(
    simulated: dict[int, dict[str, Any]],
) -> None:
    small, large = (simulated[n]["ours"]["save"]["commit"]["requests"] for n in (4, 16))
    # The manifest and .metadata, nothing per rank: S3 lists every write that returned,
    # so the ranks' write results vouch for their files and no listing (whose pages
    # grow with the ranks, one after another) checks them.
    assert small == large == {"PUT .metadata": 1, "PUT manifest": 1}, (small, large)


def test_a_restore_reads_metadata_and_manifest_once_where_dcp_load_reads_them_per_rank(
    simulated: dict[int, dict[str, Any]],
) -> None:
    ours = simulated[16]["ours"]
    assert _requests(ours["load"], "GET .metadata") == 1
    assert _requests(ours["load"], "GET manifest") == 1
    # dcp.load with a VolumeReader alone, and stock DCP: each rank reads for itself.
    assert _requests(ours["load_dcp"], "GET .metadata") == 16
    assert _requests(simulated[16]["stock"]["load"], "GET .metadata") == 16


def test_no_rank_lists_every_ranks_files_on_many_ranks(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Where a rank reads fewer files than the checkpoint's listing has pages (many
    ranks), it checks the sizes of its own files (a HEAD each), not a listing of all."""
    monkeypatch.setattr(_reader, "_LISTING_PAGE", 4)  # 8 ranks x 2 files: 4+ pages
    url, _ = s3_bucket
    with LatencyProxy.in_front_of(moto_server) as proxy:
        opts = moto_server.storage_options(proxy.endpoint)
        counting = bench_scale.Counting(proxy)
        bench_scale.save("ours", f"{url}/ck", opts, 8, 2, 4, str(tmp_path), counting)
        phases = bench_scale.load("ours", f"{url}/ck", opts, 8, 2, 4, counting, read_once=True)
    read = phases["read"].requests
    assert read.get("GET list", 0) == 0, read
    assert read.get("HEAD data") == 16, read  # each rank: its own 2 files


def _restore_through_proxy(rank: int, world: int, url: str, target: tuple[str, int],
                           options: dict[str, Any]) -> dict[str, int]:
    proxy = LatencyProxy(*target).start() if rank == 0 else None
    port = [proxy.port if proxy else 0]
    dist.broadcast_object_list(port, group_src=0)
    opts = {**options, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port[0]}"}}
    state = {f"w{rank}": torch.full((64,), float(rank)), "step": 1}  # w: one per rank
    with CheckpointManager(url, keep_last=None, storage_options=opts) as mgr:
        mgr.save(1, state)
        mgr.wait()
        dist.barrier()
        if proxy is not None:
            proxy.reset_counts()
        dist.barrier()
        got = {f"w{rank}": torch.zeros(64), "step": 0}
        assert mgr.restore(got) == 1
        assert torch.equal(got[f"w{rank}"], state[f"w{rank}"]) and got["step"] == 1
        dist.barrier()
    counts: dict[str, int] = {}
    if proxy is not None:
        counts = bench_scale.Counting(proxy).take()
        proxy.stop()
    return counts


def test_a_restore_on_two_ranks_gets_metadata_and_manifest_once(
    moto_server: MotoServer, s3_bucket: tuple[str, Any]
) -> None:
    url, options = s3_bucket
    counts = run_ranks(_restore_through_proxy, 2, f"{url}/run",
                       (moto_server.host, moto_server.port), options, timeout=180)[0]
    assert counts.get("GET .metadata") == 1, counts
    assert counts.get("GET manifest") == 1, counts
