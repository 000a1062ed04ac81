"""Property-based tests (hypothesis) of the arithmetic: range coalescing, file splitting,
the epoch order and its split over ranks and workers, resume positions, retention
choice and eviction choice.

Each property is an invariant a user relies on (every byte asked for is fetched,
every sample is seen exactly once per epoch, a resume continues the same stream,
retention never deletes what it must keep, a pinned file is never evicted).
Runs are short (``max_examples`` 100-200, a few dozen for the ones on a real
cache directory) so the module stays well under 30 s.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dcp_volumes import FileCache
from dcp_volumes.checkpoint._discovery import CheckpointInfo, sort_key, step_dir
from dcp_volumes.checkpoint._file_reads import coalesce, find_span, split_range
from dcp_volumes.checkpoint._retention import retention_victims
from dcp_volumes.data._order import NextUse, Plan, epoch_permutation

FAST = settings(max_examples=200, deadline=None)
MEDIUM = settings(max_examples=100, deadline=None)
SLOW = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

# -- range coalescing -------------------------------------------------------------------------

ranges = st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(0, 2_000)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=40,
)


@FAST
@given(ranges, st.integers(0, 3_000))
def test_coalesce_covers_every_range_with_sorted_disjoint_spans(rs: list[tuple[int, int]],
                                                                 gap: int) -> None:
    spans = coalesce(rs, gap=gap)
    # Sorted, non-empty unless an input was empty there, and separated by more than `gap`.
    for (s0, e0), (s1, e1) in itertools.pairwise(spans):
        assert s0 <= e0 and s1 <= e1
        assert s1 > e0 + gap, "two spans closer than the gap were not merged"
    # Every input range lies inside exactly one span.
    starts = [s for s, _ in spans]
    for s, e in rs:
        i = find_span(starts, spans, s, e)
        assert spans[i][0] <= s and e <= spans[i][1]
    # Nothing is invented: each span starts at an input start and ends at an input end,
    # and holds no more than the inputs plus the gaps they were merged across.
    assert {s for s, _ in spans} <= {s for s, _ in rs}
    assert {e for _, e in spans} <= {e for _, e in rs}
    covered = sum(e - s for s, e in spans)
    assert covered <= _union_length(rs) + gap * max(0, len(rs) - len(spans))
    assert coalesce(spans, gap=gap) == spans  # idempotent


def _union_length(rs: list[tuple[int, int]]) -> int:
    return len({b for s, e in rs for b in range(s, e)})


@FAST
@given(ranges)
def test_coalesce_with_no_gap_merges_only_touching_ranges(rs: list[tuple[int, int]]) -> None:
    spans = coalesce(rs, gap=0)
    assert sum(e - s for s, e in spans) == _union_length(rs)  # exactly the bytes asked for


# -- file splitting ---------------------------------------------------------------------------


@FAST
# Part sizes from 16 KiB: the real ones are MiBs, and a tiny part of a 100 MB
# range would make millions of parts (the test then ran out of memory).
@given(st.integers(0, 10**9), st.integers(0, 10**8), st.integers(2**14, 64 * 2**20))
def test_split_range_cuts_into_contiguous_near_equal_parts(start: int, length: int,
                                                           part: int) -> None:
    end = start + length
    parts = split_range(start, end, part)
    assert parts[0][0] == start and parts[-1][1] == end
    for (_, e0), (s1, _) in itertools.pairwise(parts):
        assert e0 == s1  # contiguous: no byte twice, none skipped
    sizes = [e - s for s, e in parts]
    if length:
        assert min(sizes) >= 1
        assert max(sizes) - min(sizes) <= 1  # equal parts, not full parts and a tail
        assert max(sizes) <= part * 1.5 + 1  # never much above the part size
        assert len(parts) == 1 or min(sizes) >= part * 2 // 3  # and never many tiny ones
    else:
        assert parts == [(start, start)]
    capped = split_range(start, end, part, at_most=True)
    assert capped[0][0] == start and capped[-1][1] == end
    assert all(e0 == s1 for (_, e0), (s1, _) in itertools.pairwise(capped))
    assert max(e - s for s, e in capped) <= part  # a cap: no part above it
    assert len(capped) == max(1, -(-length // part))  # and no more parts than that takes


# -- the epoch order, its split over ranks and workers, resume ------------------------------

plans = st.fixed_dictionaries({
    "num_files": st.integers(1, 300),
    "epoch": st.integers(0, 5),
    "seed": st.integers(0, 2**63),
    "shuffle": st.booleans(),
    "batch_size": st.integers(1, 9),
    "world_size": st.integers(1, 6),
    "drop": st.booleans(),
})


def _plan(p: dict, rank: int = 0, start: int = 0, **over: int) -> Plan:
    return Plan(**{**p, **over}, rank=rank, start=start)


def _all_positions(p: dict, workers: int, start: int = 0, **over: int) -> list[int]:
    """Every position any (rank, worker) reads, in the global order: step by step,
    ranks concatenated, as the DataLoader of each rank asks its workers in turn."""
    world = over.get("world_size", p["world_size"])
    per = {}
    for r in range(world):
        plan = _plan(p, r, start, **over)
        for w in range(workers):
            pos = plan.worker_positions(w, workers).reshape(-1, plan.batch_size)
            for j, batch in enumerate(pos):
                per[(j * workers + w, r)] = batch.tolist()  # batch index, rank
    return [x for key in sorted(per) for x in per[key]]


@FAST
@given(plans, st.integers(1, 4))
def test_every_file_exactly_once_per_epoch_across_ranks_and_workers(p: dict,
                                                                    workers: int) -> None:
    plan = _plan(p)
    n, g = p["num_files"], plan.global_batch_size
    positions = _all_positions(p, workers)
    assert positions == list(range(plan.end))  # each position once, in stream order
    perm = epoch_permutation(n, seed=p["seed"], epoch=p["epoch"], shuffle=p["shuffle"])
    assert sorted(perm.tolist()) == list(range(n))  # a permutation
    files = [int(perm[i % n]) for i in positions]
    if p["drop"]:
        assert len(set(files)) == len(files)  # none twice
        assert n - len(files) < g  # and only the last partial global batch dropped
    else:
        assert set(files) == set(range(n))  # every file
        assert len(files) - n < g  # repeats only to pad the last global batch
    # Every rank yields the same number of batches (no rank waits on a collective).
    assert {_plan(p, r).num_batches for r in range(p["world_size"])} == {plan.num_batches}


@FAST
@given(plans, st.integers(1, 4), st.data())
def test_resume_continues_the_same_stream(p: dict, workers: int, data: st.DataObject) -> None:
    full = _plan(p)
    start = data.draw(st.integers(0, p["num_files"]), label="resume position")
    resumed = _plan(p, start=start)
    positions = _all_positions(p, data.draw(st.integers(1, 4), label="workers after"),
                               start=start)
    assert positions == list(range(start, resumed.end))
    # Resuming at a global-batch boundary of the uninterrupted run ends where it ends.
    if start % full.global_batch_size == 0 and start <= full.end:
        assert resumed.end == full.end
        assert positions == _all_positions(p, workers)[start:]


@FAST
@given(plans, st.data())
def test_the_global_stream_does_not_depend_on_the_world_size(p: dict,
                                                             data: st.DataObject) -> None:
    g = p["batch_size"] * p["world_size"]
    world = data.draw(st.sampled_from([w for w in range(1, g + 1) if g % w == 0]))
    start = data.draw(st.integers(0, p["num_files"]))
    a = _all_positions(p, 1, start=start)
    b = _all_positions(p, data.draw(st.integers(1, 3)), start=start,
                       world_size=world, batch_size=g // world)
    assert a == b


@MEDIUM
@given(plans, st.integers(0, 20), st.integers(0, 20), st.data())
def test_next_use_never_offers_a_file_inside_the_window(p: dict, ahead: int, behind: int,
                                                        data: st.DataObject) -> None:
    plan = _plan(p)
    assume(plan.end > 0)
    nu = NextUse(plan, ranks=range(p["world_size"]), ahead=ahead, behind=behind)
    nu.current = data.draw(st.integers(0, plan.end - 1))
    perm = epoch_permutation(p["num_files"], seed=p["seed"], epoch=p["epoch"],
                             shuffle=p["shuffle"])
    for pos in range(max(0, nu.current - behind), min(p["num_files"], nu.current + ahead + 1)):
        assert nu.distance(int(perm[pos])) is None  # being prefetched or just used
    for f in range(p["num_files"]):
        d = nu.distance(f)
        assert d is None or d > 0


# -- retention choice -------------------------------------------------------------------------

NOW = 1_800_000_000.0

checkpoint_sets = st.lists(
    # step, complete, canonical name, seconds since its files were last written
    st.tuples(st.integers(0, 60), st.booleans(), st.booleans(),
              st.one_of(st.none(), st.floats(0, 10_000))),
    max_size=25,
).map(lambda xs: _infos(xs))


def _infos(xs: list[tuple[int, bool, bool, float | None]]) -> list[CheckpointInfo]:
    seen, out = set(), []
    for step, complete, canonical, age in xs:
        name = step_dir(step) if canonical else f"ckpt_{step}"
        if name in seen:
            continue
        seen.add(name)
        out.append(CheckpointInfo(step=step, url=f"/r/{name}", complete=complete, name=name,
                                  modified=None if age is None else NOW - age))
    return sorted(out, key=sort_key)


@FAST
@given(checkpoint_sets, st.one_of(st.none(), st.integers(1, 6)), st.floats(0, 5_000),
       st.data())
def test_retention_keeps_the_newest_n_and_never_the_one_being_written(
    infos: list[CheckpointInfo], keep: int | None, grace: float, data: st.DataObject
) -> None:
    # The manager protects the checkpoint it is writing (complete or not yet).
    protect = data.draw(st.lists(st.sampled_from([i.name for i in infos]), max_size=3)
                        if infos else st.just([]))
    victims = retention_victims(infos, keep_last=keep, protect=protect,
                                partial_grace_s=grace, now=NOW)
    names = [v.name for v in victims]
    assert len(set(names)) == len(names) and set(names) <= {i.name for i in infos}
    assert victims == sorted(victims, key=sort_key)  # oldest first
    assert not set(names) & set(protect)
    complete = sorted((i for i in infos if i.complete), key=sort_key)
    if not complete:
        assert victims == []  # nothing to fall back on: delete nothing
        return
    newest = complete[-1]
    kept_complete = complete[-keep:] if keep is not None else complete
    assert newest.name not in names
    assert not {i.name for i in kept_complete} & set(names)
    for info in infos:
        if info.name in protect:
            continue
        if info.complete:
            # Older complete ones go exactly when there is a keep_last to hold.
            assert (info.name in names) == (info not in kept_complete)
        else:
            # A partial one goes only when older than the newest complete (at or after
            # it, a save may still be writing it) and not written to within the grace
            # period (another job may be writing it, whatever its step).
            recent = info.modified is not None and NOW - info.modified < grace
            assert (info.name in names) == (info.step < newest.step and not recent)


# -- eviction choice, on a real cache directory --------------------------------------------


@SLOW
@given(
    st.lists(st.integers(1, 4000), min_size=2, max_size=10),  # file sizes
    st.data(),
)
def test_eviction_never_takes_a_pinned_file_and_holds_the_limit(sizes: list[int],
                                                                data: st.DataObject) -> None:
    limit = data.draw(st.integers(max(sizes), sum(sizes) + 1), label="limit")
    order = data.draw(st.lists(st.integers(0, len(sizes) - 1), min_size=1, max_size=30),
                      label="fetch order")
    pinned = data.draw(st.sets(st.integers(0, len(sizes) - 1), max_size=len(sizes) // 2),
                       label="pinned")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "src")
        src.mkdir()
        urls = []
        for i, size in enumerate(sizes):
            path = src / f"f{i}.bin"
            path.write_bytes(bytes([i % 251]) * size)
            urls.append(str(path))
        cache = FileCache(os.path.join(tmp, "cache"), limit=limit, headroom=0)
        pins = {}
        for i in sorted(pinned):
            if sum(sizes[j] for j in pins) + sizes[i] <= limit:  # pins that fit together
                pins[i] = cache.pin(urls[i], size=sizes[i])
        held_before = sum(sizes[j] for j in pins)
        try:
            for i in order:
                misses = cache.counters.misses
                path = cache.fetch(urls[i], size=sizes[i])
                filled = cache.counters.misses > misses
                assert Path(path).read_bytes() == bytes([i % 251]) * sizes[i]
                for j, pin in pins.items():  # a pinned copy is never evicted
                    assert cache.contains(urls[j]), f"pinned file {j} was evicted"
                    assert Path(pin.path).read_bytes() == bytes([j % 251]) * sizes[j]
                held = sum(sizes[j] for j in range(len(sizes)) if cache.contains(urls[j]))
                # A fill brings the cache within its limit, or over it only by what
                # could not be evicted: the pins and the file just fetched. A hit
                # changes nothing (an overshoot waits for the next fill).
                if filled:
                    assert held <= max(limit, sum(sizes[j] for j in pins) + sizes[i])
                else:
                    assert held == held_before
                assert cache.usage() == held  # the shared byte count agrees with the disk
                held_before = held
        finally:
            for pin in pins.values():
                pin.release()


@MEDIUM
@given(st.integers(1, 50), st.integers(0, 2**32), st.integers(0, 3))
def test_epoch_permutation_is_a_fixed_function_of_seed_and_epoch(n: int, seed: int,
                                                                  epoch: int) -> None:
    a = epoch_permutation(n, seed=seed, epoch=epoch, shuffle=True)
    b = epoch_permutation(n, seed=seed, epoch=epoch, shuffle=True)
    assert np.array_equal(a, b) and sorted(a.tolist()) == list(range(n))
    assert a.dtype == np.int64
