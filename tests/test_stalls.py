"""Stalled requests cost seconds, not the client's timeout; slow transfers that move are never cut.

A stall: the proxy takes a request and never answers, or forwards part of the
answer and then holds the connection open with nothing more coming. Before
the stall detector (``dcp_volumes/_volume/_stall.py``) each cost obstore's 30 s
request timeout and a retry.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from dcp_volumes import ConfigurationError, RetryPolicy, VolumeWriter
from dcp_volumes._volume import _stall
from testkit.emulators import LatencyProxy, MotoServer
from testkit.states import load_into
from tests.checkpoint_helpers import assert_same, blank_like, sample_state

pytestmark = [pytest.mark.emulator, pytest.mark.timeout(90)]

BOUND_S = 10.0


@pytest.fixture
def state() -> dict[str, Any]:
    return sample_state(3, big_mib=16)  # two 16 MiB tensors: 32 MiB


def _save(url: str, opts: dict[str, Any], state: dict[str, Any], **kw: Any) -> float:
    started = time.monotonic()
    dcp.save(state, storage_writer=VolumeWriter(url, storage_options=opts, **kw))
    return time.monotonic() - started


def _timed_load(url: str, opts: dict[str, Any], state: dict[str, Any], **kw: Any) -> float:
    """Seconds to load ``state``'s checkpoint at ``url``, checked bit for bit."""
    started = time.monotonic()
    got = load_into(blank_like(state), url, opts, **kw)
    took = time.monotonic() - started
    assert_same(got, state)
    return took


@pytest.fixture
def stalling(moto_server: MotoServer, s3_bucket: tuple[str, Any]) -> Iterator[
    tuple[str, dict[str, Any], LatencyProxy]
]:
    """A proxy that stalls 5% of requests (never answered, or an answer held part-way)."""
    url, _ = s3_bucket
    with LatencyProxy.in_front_of(
        moto_server, fault_rate=0.05, fault_kinds=("stall", "hold"), seed=7
    ) as proxy:
        yield f"{url}/ck", moto_server.storage_options(proxy.endpoint), proxy


def test_a_save_through_stalled_requests_ends_within_seconds(
    stalling: tuple[str, dict[str, Any], LatencyProxy], state: dict[str, Any]
) -> None:
    url, opts, proxy = stalling
    proxy.stall_next(1, method="PUT")  # one for certain, beside the 5% drawn
    took = _save(url, opts, state)
    assert sum(proxy.stalled.values()) >= 1
    assert took < BOUND_S, f"save took {took:.1f}s through {dict(proxy.stalled)}"
    proxy.clear_faults()
    proxy.fault_rate = 0.0
    _timed_load(url, opts, state)


@pytest.mark.parametrize("after_bytes", [0, 4096], ids=["never-answered", "held-mid-body"])
def test_a_load_through_stalled_requests_ends_within_seconds(
    stalling: tuple[str, dict[str, Any], LatencyProxy], state: dict[str, Any], after_bytes: int
) -> None:
    url, opts, proxy = stalling
    rate, proxy.fault_rate = proxy.fault_rate, 0.0
    _save(url, opts, state)
    proxy.fault_rate = rate
    proxy.reset_counts()
    # The data files' first GET stalls for certain (beside the 5% drawn).
    for _ in range(2):
        proxy.stall_next(1, method="GET", after_bytes=after_bytes)
    took = _timed_load(url, opts, state)
    assert sum(proxy.stalled.values()) >= 2
    assert took < BOUND_S, f"load took {took:.1f}s through {dict(proxy.stalled)}"


def test_a_slow_transfer_that_moves_is_never_cut(
    moto_server: MotoServer, s3_bucket: tuple[str, Any], state: dict[str, Any]
) -> None:
    """Behind a 200 Mbit/s link the 32 MiB part of the save and the load's one 32 MiB
    GET take longer than ``stall_s``, and neither is cut: the same requests as over a
    fast link, none sent twice."""
    url, _ = s3_bucket
    policy = RetryPolicy(stall_s=1.0)
    one_get = {"read_concurrency": 1, "part_size": "64MiB"}  # each file in one GET
    link_s = 32 * 2**20 / (200e6 / 8)
    per_method = []
    for name, bandwidth in (("fast", None), ("slow", 200e6)):
        with LatencyProxy.in_front_of(moto_server, bandwidth_bps=bandwidth) as proxy:
            opts = moto_server.storage_options(proxy.endpoint)
            save_s = _save(f"{url}/{name}", opts, state, retry=policy, upload_concurrency=1)
            load_s = _timed_load(f"{url}/{name}", opts, state, retry=policy, **one_get)
            if name == "slow":  # the link was the limit: longer than stall_s
                assert min(save_s, load_s) > link_s > policy.stall_s
            assert not proxy.dropped and not proxy.stalled
            counts: Counter[str] = Counter()
            for (method, _), n in proxy.requests.items():
                counts[method] += n
            per_method.append(counts)
    # A cut request would have been sent again: the slow link made no more requests.
    assert per_method[0] == per_method[1]


# -- the settings: which store gets which timeouts ---------------------------------------------


def _settings(options: dict[str, Any], policy: RetryPolicy) -> Any:
    from dcp_volumes._volume._obstore_options import s3_settings

    return s3_settings({"key": "k", "secret": "s-1234", "endpoint_url": "http://127.0.0.1:9",
                        **options}, policy)


def test_reads_wait_stall_s_per_piece_and_uploads_get_their_size_over_the_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = _settings({}, RetryPolicy(stall_s=2.0, min_rate=8 * 2**20))
    assert out.client_options["read_timeout"] == timedelta(seconds=2)
    assert out.stall is not None
    # 32 MiB at 8 MiB/s: 4 s to send, then 2 s for the answer; sizes round up to 2**k.
    assert out.stall.upload_deadline_s(32 * 2**20) == 6.0
    assert out.stall.upload_deadline_s(20 * 2**20) == 6.0
    assert out.stall.upload_deadline_s(10) == 2.125  # the smallest class: 1 MiB
    upload = out.kwargs(("upload", 6.0))
    assert upload["client_options"]["read_timeout"] == timedelta(seconds=6)
    assert upload["client_options"]["timeout"] == timedelta(seconds=30)  # >= 2 x deadline
    assert upload["retry_config"]["max_retries"] == 1  # then the volume's loop, longer
    # Work the server does before it answers (a listing, a copy): no read timeout.
    assert "read_timeout" not in out.kwargs(("server", math.inf))["client_options"]
    # A timed-out request doubles every later request's time (bounded), once per wave.
    assert out.stall.read_timeout_s() == 2.0
    out.stall.saw_timeout(0)
    out.stall.saw_timeout(0)  # sent before the first doubling: no second one
    assert out.stall.upload_deadline_s(32 * 2**20) == 10.0
    assert out.stall.read_timeout_s() == 4.0
    for level in range(1, 20):
        out.stall.saw_timeout(level)
    assert out.stall.upload_deadline_s(32 * 2**20) == 2.0 + 4.0 * 2**6
    # A success long after the last timeout halves it again (random stalls do not
    # ratchet it up for good); one soon after does not.
    out.stall.saw_success()
    assert out.stall.level == 6
    monkeypatch.setattr(_stall, "_SETTLE_S", 0.0)
    out.stall.saw_success()
    assert out.stall.level == 5


def test_the_users_read_timeout_wins_and_stall_s_none_turns_detection_off() -> None:
    mine = _settings({"read_timeout": "45s"}, RetryPolicy())
    assert mine.client_options["read_timeout"] == "45s" and mine.stall is None
    off = _settings({}, RetryPolicy(stall_s=None))
    assert "read_timeout" not in off.client_options and off.stall is None
    assert off.kwargs()["retry_config"] == off.retry_config


@pytest.mark.parametrize("bad", [{"stall_s": 0}, {"stall_s": -1.0}, {"min_rate": 0}])
def test_a_policy_with_no_time_for_a_request_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError, match="RetryPolicy"):
        RetryPolicy(**bad)  # type: ignore[arg-type]


# -- the stores: one per bucket and request class, reused, bounded ------------------------------


def test_stores_are_kept_by_recent_use_and_made_once_while_kept() -> None:
    from dcp_volumes._volume._obstore_stores import Stores

    made: list[str] = []

    def make(key: str) -> Any:
        made.append(key)
        return object()

    stores = Stores(bound=2)
    a = stores.get("a", lambda: make("a"))
    stores.get("b", lambda: make("b"))
    assert stores.get("a", lambda: make("a")) is a  # reused: made once
    stores.get("c", lambda: make("c"))  # drops b, the least recently used
    assert len(stores) == 2
    assert stores.get("a", lambda: make("a")) is a
    stores.get("b", lambda: make("b"))
    assert made == ["a", "b", "c", "b"]


def test_many_buckets_and_deadlines_never_grow_the_stores_past_the_bound() -> None:
    from dcp_volumes._volume._errors import BackendError
    from dcp_volumes._volume._obstore import ObstoreBackend
    from dcp_volumes._volume._obstore_stores import MAX_STORES

    # Nothing listens at the endpoint: every request fails at once, after its store
    # (its client) was made or reused.
    settings = _settings({}, RetryPolicy(attempts=1, stall_s=2.0))
    assert settings.stall is not None
    backend = ObstoreBackend("s3", settings)

    def requests(bucket: str) -> None:
        for request in (
            lambda: backend.head(f"{bucket}/k"),  # a read
            lambda: backend.put(f"{bucket}/k", b"x", create_only=False),  # an upload
            lambda: backend.put(f"{bucket}/k", bytes(3 * 2**20), create_only=False),
            lambda: backend.delete([f"{bucket}/k"]),  # the server's work
        ):
            with pytest.raises(BackendError):
                request()

    requests("one")
    per_bucket = len(backend.stores)
    assert per_bucket == 4  # a read, two upload sizes, the server's work
    requests("one")
    assert len(backend.stores) == per_bucket  # the same classes: the same stores
    for level in range(8):  # every deadline the detector can learn, and past it
        for bucket in range(12):
            requests(f"bucket-{bucket}")
        settings.stall.saw_timeout(level)
    assert len(backend.stores) == MAX_STORES
