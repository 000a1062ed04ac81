"""A consumer snippet type-checks against the shipped `py.typed` package."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SNIPPET = textwrap.dedent(
    """
    import torch.distributed.checkpoint as dcp
    from dcp_volumes import (CheckpointInfo, CheckpointManager, DataLoader, FileCache,
                             VolumeDataset, VolumeReader, VolumeWriter)

    def run(state: dict[str, object]) -> int | None:
        writer = VolumeWriter("s3://bucket/run/step-1", storage_options={"anon": True})
        dcp.save(state, storage_writer=writer)
        dcp.load(state, storage_reader=VolumeReader("s3://bucket/run/step-1"))
        mgr = CheckpointManager("s3://bucket/run", keep_last=2)
        latest: CheckpointInfo | None = mgr.latest()
        if latest is not None:
            print(latest.step + 1, latest.url.upper(), latest.complete is True)
        cache = FileCache("/tmp/cache", limit="1GB")
        path: str = str(cache.fetch("s3://bucket/x.bin"))
        ds = VolumeDataset("s3://bucket/train/", shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=4)
        loader.load_state_dict(loader.state_dict())
        print(path)
        return mgr.restore(state)
    """
)


def test_consumer_snippet_type_checks(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    import dcp_volumes

    assert (Path(dcp_volumes.__file__).parent / "py.typed").exists()
    snippet = tmp_path / "consumer.py"
    snippet.write_text(SNIPPET)
    # Check our annotations only: following torch's own sources takes minutes.
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\nignore_missing_imports = True\nfollow_imports = skip\n"
        "[mypy-dcp_volumes.*]\nfollow_imports = silent\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--no-error-summary",
            "--cache-dir",
            str(tmp_path / ".mypy"),
            str(snippet),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
