"""The data benchmark at scale (``--files N``), at a CI size: it runs end to end, and the
targets of issue 34 hold at that size (one inode a cached sample, a file table of bytes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from testkit.emulators import repo_root


def test_scale_run_at_ci_size(tmp_path: Path) -> None:
    env = {**os.environ, "DCP_VOLUMES_BENCH_RESULTS": str(tmp_path), "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "data", "--target", "dir", "--files", "400"],
        cwd=repo_root(), env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "construction / raw listing" in proc.stdout
    report = json.loads((tmp_path / "data_dir_scale_400.json").read_text())
    assert (tmp_path / "data_dir_scale_400.png").stat().st_size > 10_000
    cache = report["cache"]
    assert cache["files"] <= 400 + 2 and cache["dirs"] <= 257
    assert report["memory"]["table_bytes_per_file"] <= 100
    assert report["memory"]["loader_state_bytes"] < 400
    workers = report["memory"]["processes_mid_warm_epoch"]["workers"]
    assert len(workers) == 2 and all(w["rss"] > 0 for w in workers)
    assert all(v > 0 for v in report["throughput_files_s"].values())
    assert report["resume"]["first_batch_at_90pct_s"] > 0
