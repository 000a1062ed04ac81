"""``DCP_VOLUMES_STORAGE_OPTIONS`` is the default of every entry point that takes
``storage_options``: used for a remote URL when the caller passes none (``None``),
replaced whole by options given explicitly (``{}`` included), ignored by local paths.
``Volume`` applies the rule, so each entry point below gets it from there.
(The same under two gloo ranks: ``test_manager.py``'s
``test_two_ranks_take_storage_options_from_the_environment``.)"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_volumes
from dcp_volumes import (
    CheckpointManager,
    FileCache,
    VolumeDataset,
    VolumeReader,
    VolumeWriter,
)
from dcp_volumes._volume import Volume
from tests.test_data_support import write_samples

ENV = "DCP_VOLUMES_STORAGE_OPTIONS"


def test_the_variable_is_used_only_where_no_options_are_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    monkeypatch.setenv(ENV, json.dumps(options))
    assert Volume("s3://bucket/run").storage_options == options
    assert Volume("s3://bucket/run", storage_options={}).storage_options == {}  # no options
    explicit = {"key": "other", "secret": "other"}
    assert Volume("s3://bucket/run", storage_options=explicit).storage_options == explicit
    # Local paths take no options: even a variable that is not JSON leaves them alone.
    monkeypatch.setenv(ENV, "{not json")
    assert Volume(str(tmp_path)).storage_options == {}
    with pytest.raises(dcp_volumes.ConfigurationError, match=ENV):
        Volume("s3://bucket/run")


@pytest.mark.emulator
def test_every_entry_point_honours_the_variable(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, options = s3_bucket
    write_samples(f"{bucket}/train", options, 4)  # explicit options: before the variable
    monkeypatch.setenv(ENV, json.dumps(options))  # moto's endpoint: nowhere else below
    state: dict[str, Any] = {"w": torch.arange(32.0), "step": 7}
    (tmp_path / "staging").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group" notes
        dcp.save(state, no_dist=True, storage_writer=VolumeWriter(
            f"{bucket}/plain", staging_dir=tmp_path / "staging"))
        loaded: dict[str, Any] = {"w": torch.zeros(32), "step": 0}
        dcp.load(loaded, no_dist=True, storage_reader=VolumeReader(f"{bucket}/plain"))
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7

    with CheckpointManager(f"{bucket}/run", async_save=False,
                           staging_dir=tmp_path / "staging") as mgr:
        mgr.save(3, state)
        assert [i.step for i in mgr.list()] == [3]
        restored: dict[str, Any] = {"w": torch.zeros(32), "step": 0}
        assert mgr.restore(restored) == 3
    assert torch.equal(restored["w"], state["w"])

    ds = VolumeDataset(f"{bucket}/train", cache_dir=tmp_path / "cache", shuffle=False)
    assert len(list(iter(ds))) == 4
    cache = FileCache(tmp_path / "cache2")
    first = Volume(f"{bucket}/train", storage_options=options).list()[0].path
    assert Path(cache.fetch(f"{bucket}/train/{first}")).stat().st_size > 0

    with dcp_volumes.route([f"{bucket}/routed"]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=f"{bucket}/routed/step-1", no_dist=True)
    assert Volume(f"{bucket}/routed/step-1", storage_options=options).exists(".metadata")
