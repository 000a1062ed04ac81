"""Checkpoints from someone else cannot run code or reach outside themselves.

``.metadata`` is unpickled with an allow-list of DCP's metadata types (reader, the
manager's discovery and the CLI alike), and every file name in ``.metadata`` and the
manifest must resolve inside the checkpoint."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_volumes import CheckpointCorruptError, CheckpointManager, VolumeReader, VolumeWriter


class _RunsCode:
    """What a hostile pickle does: call a function (here: create a marker file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.system, (f"touch {self.marker}",))


def _state() -> dict[str, object]:
    return {"w": torch.randn(6, 6), "b": torch.zeros(3, dtype=torch.bfloat16),
            "i": torch.arange(4), "extra": {"step": 3, "name": "run", "l": [1, 2.5]}}


@pytest.mark.parametrize("writer", [VolumeWriter, FileSystemWriter])
def test_real_metadata_loads_through_the_allow_list(tmp_path: Path, writer: type) -> None:
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer(tmp_path / "ck"), no_dist=True)
        out = {"w": torch.zeros(6, 6), "b": torch.ones(3, dtype=torch.bfloat16),
               "i": torch.zeros(4, dtype=torch.int64),
               "extra": {"step": 0, "name": "", "l": [0, 0.0]}}
        dcp.load(out, storage_reader=VolumeReader(tmp_path / "ck"), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and out["extra"] == state["extra"]


def _plant_hostile_metadata(ck: Path, marker: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=VolumeWriter(ck), no_dist=True)
    (ck / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))


def test_a_pickle_that_calls_a_function_is_refused_by_the_reader(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _plant_hostile_metadata(tmp_path / "ck", marker)
    with pytest.raises(CheckpointCorruptError, match=r"names posix\.system") as err:
        VolumeReader(tmp_path / "ck").read_metadata()
    assert "could run code" in str(err.value)
    assert not marker.exists()


def test_discovery_and_the_cli_refuse_it_too(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    root = tmp_path / "root"
    _plant_hostile_metadata(root / "step-00000001", marker)
    with CheckpointManager(root) as mgr:
        infos = mgr.list()  # listing reads manifests, not the pickle
        assert [i.step for i in infos] == [1]
        with pytest.raises(BaseException, match="could run code"):
            mgr.restore({"w": torch.zeros(6, 6)})
    cli = [sys.executable, "-m", "dcp_volumes.cli", "inspect", str(root / "step-00000001")]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "could run code" in done.stderr
    assert not marker.exists()


# -- every file name from .metadata and the manifest resolves inside the checkpoint --------


def _stock_checkpoint_naming(ck: Path, name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0)}, storage_writer=FileSystemWriter(ck), no_dist=True)
    md = pickle.loads((ck / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = name
    (ck / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", "a/../../x.distcp", ""])
def test_a_metadata_path_outside_the_checkpoint_is_refused(tmp_path: Path, name: str) -> None:
    ck = tmp_path / "ck"
    _stock_checkpoint_naming(ck, name)
    (tmp_path / "outside.distcp").write_bytes((ck / "__0_0.distcp").read_bytes())
    with pytest.raises(BaseException, match="not inside the checkpoint"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=VolumeReader(ck), no_dist=True)


def test_a_manifest_naming_files_outside_is_refused(tmp_path: Path) -> None:
    import json

    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0)}, storage_writer=VolumeWriter(ck), no_dist=True)
    manifest = next(p for p in ck.iterdir() if "manifest" in p.name)
    doc = json.loads(manifest.read_bytes())
    doc["files"]["../../victim"] = next(iter(doc["files"].values()))
    manifest.write_text(json.dumps(doc))
    with pytest.raises(BaseException, match="not inside the checkpoint"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=VolumeReader(ck), no_dist=True)
