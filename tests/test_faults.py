"""Saves, loads and cold epochs through a link that fails 15% of requests complete exactly.

A seeded proxy in front of the S3 emulator answers 503 SlowDown or 500, resets
connections before they reach the server, and cuts responses part-way. Every
save must commit and load back bit-equal, every load of a committed checkpoint
must succeed (a transient error is never a "missing" or "damaged" file), and a
cold VolumeDataset epoch must deliver every sample exactly once, byte-equal.
The counts (trials, faults by kind, failures, anything lost) are printed.

Uploads are also put through a reset at every stage of each of their requests
(before the server sees it, in its head or body, in the answer), twice in a row
so the volume's retry runs too: single PUTs and multipart uploads, from a mapped
file and from memory. Every one must land whole.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from dcp_volumes import CheckpointManager, DataLoader, VolumeDataset, VolumeReader
from dcp_volumes._volume import RetryPolicy, Volume
from testkit.emulators import LatencyProxy, MotoServer
from testkit.ranks import run_ranks
from testkit.states import differences, empty_state, state_for
from tests.test_data_support import payload, read_id, write_samples

pytestmark = pytest.mark.emulator

FAULT_RATE = 0.15
_SIZE = 128  # 64 KiB tensors: several requests per save and load


@pytest.fixture
def faulty_s3(moto_server: MotoServer, s3_bucket: tuple[str, Any]
              ) -> Iterator[tuple[str, dict[str, Any], LatencyProxy]]:
    url, _ = s3_bucket
    with LatencyProxy.in_front_of(moto_server, fault_rate=FAULT_RATE, seed=15) as proxy:
        yield url, moto_server.storage_options(proxy.endpoint), proxy


def _saves_and_restores(rank: int, world: int, root: str, opts: dict[str, Any],
                        steps: int) -> list[str]:
    problems = []
    with CheckpointManager(root, keep_last=2, storage_options=opts) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, state_for(step, rank=rank, size=_SIZE))
        mgr.wait()
    with CheckpointManager(root, keep_last=2, storage_options=opts) as mgr:
        state = empty_state(rank=rank, size=_SIZE)
        restored = mgr.restore(state)
        if restored != steps:
            problems.append(f"rank {rank} restored {restored}, not {steps}")
        problems += differences(state, state_for(steps, rank=rank, size=_SIZE))
    dist.barrier()
    return problems


def _report(what: str, proxy: LatencyProxy, trials: int, failures: list[str]) -> None:
    faults = Counter(proxy.faults)
    print(f"\n[faults {what}] trials={trials} requests={sum(proxy.requests.values())} "
          f"faults injected={sum(faults.values())} ({dict(sorted(faults.items()))}) "
          f"failures={len(failures)} lost=0" if not failures else f"failures: {failures[:5]}")


def test_two_rank_saves_and_restores_through_15_percent_faults(
    faulty_s3: tuple[str, dict[str, Any], LatencyProxy], capsys: pytest.CaptureFixture[str]
) -> None:
    url, opts, proxy = faulty_s3
    steps = 4
    problems = run_ranks(_saves_and_restores, 2, f"{url}/run", opts, steps, timeout=240)
    failures = [p for rank_problems in problems for p in rank_problems]
    with capsys.disabled():
        _report("2-rank CheckpointManager saves + restore", proxy, steps * 2, failures)
    assert failures == []
    # The link really failed, often: 15% of requests are faulted, so well over 5% of
    # however many the save made (a commit that lists nothing makes fewer).
    requests = sum(proxy.requests.values())
    assert requests > 20
    assert sum(proxy.faults.values()) >= 0.05 * requests


def test_loads_of_a_committed_checkpoint_never_report_a_missing_file(
    faulty_s3: tuple[str, dict[str, Any], LatencyProxy], moto_server: MotoServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter

    url, opts, proxy = faulty_s3
    want = state_for(3, size=_SIZE)
    dcp.save(want, storage_writer=VolumeWriter(f"{url}/ck", storage_options=opts,
                                               file_size="32KiB"), no_dist=True)
    failures = []
    trials = 10
    for _ in range(trials):
        got = empty_state(size=_SIZE)
        try:
            dcp.load(got, storage_reader=VolumeReader(f"{url}/ck", storage_options=opts),
                     no_dist=True)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            failures.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        failures += differences(got, want)
    with capsys.disabled():
        _report("VolumeReader loads", proxy, trials, failures)
    assert failures == []


def test_a_cold_epoch_delivers_every_sample_exactly(
    faulty_s3: tuple[str, dict[str, Any], LatencyProxy], moto_server: MotoServer,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    url, opts, proxy = faulty_s3
    n, size = 200, 16384
    write_samples(f"{url}/data", moto_server.storage_options(), n, size=size)
    ds = VolumeDataset(f"{url}/data", storage_options=opts, cache_dir=tmp_path / "cache",
                       transform=_read_checked, shuffle=True, seed=2)
    seen: list[int] = []
    for batch in DataLoader(ds, batch_size=8, num_workers=2, timeout=120):
        seen += [int(x) for x in batch]
    failures = [] if sorted(seen) == list(range(n)) else [f"{len(seen)} samples, not {n}"]
    with capsys.disabled():
        _report("cold VolumeDataset epoch", proxy, n, failures)
    assert failures == []


def _read_checked(path: str) -> int:
    # The cached bytes must be exactly what was written, not just the right length.
    file_id = read_id(path)
    with open(path, "rb") as f:
        if f.read() != payload(file_id, 16384):
            raise AssertionError(f"sample {file_id} differs from what was written")
    return file_id


# -- connection resets at every stage of an upload -------------------------------------------

_PART = 5 * 2**20
# Where a reset lands in one request (``LatencyProxy.drop_next``'s arguments), and whether
# only requests with a large body (an object's or a part's bytes: PUT) have that stage.
_STAGES: dict[str, tuple[dict[str, int], bool]] = {
    "before the server sees it": ({"after_bytes": 0}, False),
    "in the request's head": ({"request_bytes": 64}, False),
    "in the request's body": ({"request_bytes": 2 * 2**20}, True),
    "as the answer starts": ({"after_bytes": 1}, False),
    "in the answer's head": ({"after_bytes": 20}, False),
}


@pytest.fixture
def resetting_s3(moto_server: MotoServer, s3_bucket: tuple[str, Any]
                 ) -> Iterator[tuple[Volume, LatencyProxy]]:
    url, _ = s3_bucket
    with LatencyProxy.in_front_of(moto_server) as proxy:
        policy = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)
        yield Volume(url, storage_options=moto_server.storage_options(proxy.endpoint),
                     retry=policy), proxy


def _reset_at(proxy: LatencyProxy, index: int, method: str, where: dict[str, int]) -> None:
    """Reset the ``index``-th request from now (0-based) at ``where``, and the client's
    own retry of it: the client gives up, so the volume's retry runs as well."""
    for _ in range(index):
        proxy.call_next(lambda: None)
    proxy.call_next(lambda: proxy.drop_next(2, method=method, **where))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", ["file", "bytes"])  # mmap-backed (put_file) or in memory
@pytest.mark.parametrize("size", [4 * 2**20, 2 * _PART], ids=["single PUT", "multipart"])
def test_connection_resets_at_every_stage_of_an_upload_never_fail_it(
    resetting_s3: tuple[Volume, LatencyProxy], tmp_path: Path, source: str, size: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    volume, proxy = resetting_s3
    data = random.Random(size).randbytes(size)
    src = tmp_path / "staged"
    src.write_bytes(data)

    def upload(key: str) -> None:
        if source == "file":  # sent from a map of the file (parts in order, one at a time)
            volume.put_file(src, key, part_size=_PART, concurrency=1)
        else:  # sent from the bytes object
            volume.publish(key, data)

    upload("clean")
    requests = [method for method, _ in proxy.log]  # the upload's requests, in order
    assert ("POST" in requests) == (size > _PART)  # the shape this case is about
    trials, failures = 0, []
    for index, method in enumerate(requests):
        for n, (stage, (where, bodies_only)) in enumerate(_STAGES.items()):
            if bodies_only and method != "PUT":
                continue
            trials += 1
            key = f"request{index}-stage{n}"
            _reset_at(proxy, index, method, where)
            try:
                upload(key)
            except Exception as exc:  # every one must commit: collect them for the report
                failures.append(f"request {index} ({method}) reset {stage}: {exc}")
                proxy.clear_faults()
                continue
            if proxy.pending_drops:
                failures.append(f"request {index} ({method}) {stage}: the resets never came")
                proxy.clear_faults()
            elif volume.read_bytes(key) != data:
                failures.append(f"request {index} ({method}) reset {stage}: other bytes")
    with capsys.disabled():
        print(f"\n[resets in an upload, {source}, {size >> 20} MiB] requests={requests} "
              f"uploads={trials} resets={sum(proxy.dropped.values())} "
              f"committed={trials - len(failures)} failures={failures[:3]}")
    assert failures == []
    assert sum(proxy.dropped.values()) >= 2 * trials
