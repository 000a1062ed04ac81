"""A save holds off young collections while DCP builds its per-item objects, and gives
the collector back afterwards, also when the save fails."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import VolumeReader, VolumeWriter
from dcp_volumes.checkpoint._collector_hold import HELD_THRESHOLD, CollectorHold

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class RecordingPlanner(DefaultSavePlanner):
    """Notes the collector's young threshold while DCP plans."""

    seen: list[int]

    def create_local_plan(self) -> Any:
        self.seen = [gc.get_threshold()[0]]
        return super().create_local_plan()


@pytest.fixture(autouse=True)
def default_thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def _state() -> dict[str, Any]:
    return {f"t{i}": torch.full((4,), float(i)) for i in range(32)}


def test_a_save_raises_the_threshold_while_it_plans_and_restores_it(tmp_path: Path) -> None:
    planner = RecordingPlanner()
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "ck"), planner=planner)
    assert planner.seen == [HELD_THRESHOLD]
    # The hold ends with the save's planner (it keeps the plans and metadata).
    del planner
    assert gc.get_threshold() == (700, 10, 10)


def test_async_save_holds_from_staging_and_restores(tmp_path: Path) -> None:
    writer = VolumeWriter(tmp_path / "ck")
    fut = dcp.async_save(_state(), storage_writer=writer)
    fut.result()
    del fut, writer
    gc.collect()
    assert gc.get_threshold() == (700, 10, 10)
    loaded = {k: torch.zeros(4) for k in _state()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ck"))
    assert all(torch.equal(loaded[k], v) for k, v in _state().items())


def test_a_failed_save_gives_the_collector_back(tmp_path: Path) -> None:
    blocker = tmp_path / "ck"
    blocker.write_text("a file where the checkpoint directory should be")
    writer = VolumeWriter(blocker)
    with pytest.raises(CheckpointException, match="is a file"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=writer)
    del writer
    assert gc.get_threshold() == (700, 10, 10)


def test_holds_nest_and_a_disabled_collector_stays_disabled() -> None:
    first, second = CollectorHold(), CollectorHold()
    assert gc.get_threshold()[0] == HELD_THRESHOLD
    first.release()
    first.release()  # twice: no effect
    assert gc.get_threshold()[0] == HELD_THRESHOLD
    second.release()
    assert gc.get_threshold() == (700, 10, 10)

    gc.set_threshold(0)
    hold = CollectorHold()
    assert gc.get_threshold()[0] == 0
    hold.release()
    assert gc.get_threshold()[0] == 0


def test_a_planner_kept_across_saves_holds_only_until_the_next_save_ends(tmp_path: Path) -> None:
    kept = DefaultSavePlanner()
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "a"), planner=kept)
    assert gc.get_threshold()[0] == HELD_THRESHOLD  # the planner still holds the plans
    other = DefaultSavePlanner()
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "b"), planner=other)
    del other
    assert gc.get_threshold() == (700, 10, 10)  # the kept planner's hold ended too


class RecordingLoadPlanner(DefaultLoadPlanner):
    seen: list[int]

    def create_local_plan(self) -> Any:
        self.seen = [gc.get_threshold()[0]]
        return super().create_local_plan()


def test_a_load_holds_while_it_plans_and_restores(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=VolumeWriter(tmp_path / "ck"))
    gc.collect()
    planner = RecordingLoadPlanner()
    loaded = {k: torch.zeros(4) for k in _state()}
    dcp.load(loaded, storage_reader=VolumeReader(tmp_path / "ck"), planner=planner)
    assert planner.seen == [HELD_THRESHOLD]
    assert all(torch.equal(loaded[k], v) for k, v in _state().items())
    del planner
    assert gc.get_threshold() == (700, 10, 10)


def test_a_failed_load_gives_the_collector_back(tmp_path: Path) -> None:
    reader = VolumeReader(tmp_path / "nothing-here")
    with pytest.raises(CheckpointException, match="nothing-here"):
        dcp.load({"t": torch.zeros(4)}, storage_reader=reader)
    assert gc.get_threshold() == (700, 10, 10)
