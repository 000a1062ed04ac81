"""A shard upload that stalls (the server takes the request and never answers).

Training is not held up beyond the async contract (``save`` returns after
staging), the stalled request is abandoned after ``RetryPolicy.timeout_s`` and
tried again, and an upload that stalls every time fails in bounded time with
an error that names the operation and the object, raised at the next
``wait()``/``save()``; no ``.metadata`` is written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dcp_volumes import CheckpointError, CheckpointManager, RetryPolicy
from dcp_volumes._volume import Volume
from testkit.emulators import LatencyProxy, MotoServer
from testkit.states import seeded_state

pytestmark = [pytest.mark.emulator, pytest.mark.timeout(60)]

TIMEOUT_S = 2.0
_MODEL = {f"w{i}": (128, 128) for i in range(4)}  # the state's tensors, by name


@pytest.fixture
def stalling_s3(moto_server: MotoServer, s3_bucket: tuple[str, Any]
                ) -> Iterator[tuple[str, dict[str, Any], dict[str, Any], LatencyProxy]]:
    """(root url, direct options, options through the proxy, proxy)."""
    url, direct = s3_bucket
    with LatencyProxy.in_front_of(moto_server) as proxy:
        yield f"{url}/run", direct, moto_server.storage_options(proxy.endpoint), proxy


def _manager(root: str, opts: dict[str, Any], attempts: int) -> CheckpointManager:
    return CheckpointManager(
        root,
        storage_options=opts,
        keep_last=None,
        # 64 KiB files: one PUT per tensor, so one shard stalls while the others land.
        writer_options={"file_size": "64KiB", "staging_headroom": 0},
        retry=RetryPolicy(attempts=attempts, base_delay_s=0.05, max_delay_s=0.2,
                          timeout_s=TIMEOUT_S),
    )


def test_a_stalled_shard_is_retried_after_the_timeout_without_blocking_training(
    stalling_s3: tuple[str, dict[str, Any], dict[str, Any], LatencyProxy],
) -> None:
    root, _, opts, proxy = stalling_s3
    with _manager(root, opts, attempts=3) as mgr:
        proxy.stall_next(1, method="PUT")  # the first data file's upload hangs
        started = time.monotonic()
        mgr.save(1, {"model": seeded_state(1, _MODEL)})
        returned = time.monotonic() - started
        mgr.wait()
        committed = time.monotonic() - started
        stalled = dict(proxy.stalled)
        assert len(stalled) == 1
        (_, path), = stalled
        assert path.endswith(".distcp")
        assert proxy.count("PUT", path) == 2  # abandoned after the timeout, then sent again
        assert returned < TIMEOUT_S < committed  # training went on while it hung
        latest = mgr.latest()
        assert latest is not None and latest.step == 1 and latest.complete
        got = {"model": {f"w{i}": torch.zeros(128, 128) for i in range(4)}}
        assert mgr.restore(got) == 1
        for name, want in seeded_state(1, _MODEL).items():
            assert torch.equal(got["model"][name], want), name


def test_an_upload_that_always_stalls_fails_at_the_next_save_in_bounded_time(
    stalling_s3: tuple[str, dict[str, Any], dict[str, Any], LatencyProxy],
) -> None:
    root, direct, opts, proxy = stalling_s3
    with _manager(root, opts, attempts=2) as mgr:
        proxy.stall_next(10_000, method="PUT")  # every upload hangs
        started = time.monotonic()
        mgr.save(1, {"model": seeded_state(1, _MODEL)})
        assert time.monotonic() - started < TIMEOUT_S
        with pytest.raises(CheckpointError) as caught:
            # step 1's failure surfaces here; step 2 is not started
            mgr.save(2, {"model": seeded_state(2, _MODEL)})
        failed_after = time.monotonic() - started
        proxy.clear_faults()  # the link is healthy again
        text = str(caught.value)
        assert "step 1" in text and "upload" in text and ".distcp" in text, text
        assert "No .metadata was written" in text
        # Bounded: 2 tries of TIMEOUT_S each, plus backoff and the commit's checks.
        assert 2 * TIMEOUT_S <= failed_after < 4 * TIMEOUT_S + 5
        assert not Volume(root, storage_options=direct).exists("step-00000001/.metadata")
        assert mgr.latest() is None

        mgr.save(3, {"model": seeded_state(3, _MODEL)})
        mgr.wait()
        # (step 1's partial files went with retention once step 3 committed)
        assert [(i.step, i.complete) for i in mgr.list()] == [(3, True)]
