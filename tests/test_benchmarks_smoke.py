"""Smoke test of the benchmarks: every ``benchmarks/bench_*.py --quick`` runs and reports.

Slow (each quick run takes up to a minute on 2 cores). The benchmarks start
their own servers; their JSON and plots go to a temp dir here
(``DCP_VOLUMES_BENCH_RESULTS``), so the committed results stay untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.emulators import Azurite, repo_root

BENCH_DIR = repo_root() / "benchmarks"
BENCHES = sorted(p.name for p in BENCH_DIR.glob("bench_*.py"))
# The JSON each of ours writes in --quick mode (others: exit code and output only).
QUICK_JSON = {"bench_checkpoint.py": "checkpoint_quick.json", "bench_data.py": "data_quick.json",
              "bench_compression.py": "compression_quick.json"}
AZURITE_JSON = {"bench_checkpoint.py": "checkpoint_azurite_quick.json",
                "bench_data.py": "data_azurite_quick.json"}

pytestmark = pytest.mark.slow


def _run_quick(name: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DCP_VOLUMES_BENCH_RESULTS": str(out)}
    return subprocess.run(
        [sys.executable, str(BENCH_DIR / name), "--quick", *extra],
        cwd=repo_root(),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _load(out: Path, filename: str) -> dict[str, Any]:
    path = out / filename
    assert path.exists(), f"the --quick run wrote no {path.name}"
    assert path.with_suffix(".png").stat().st_size > 10_000, "the plot is missing or empty"
    return json.loads(path.read_text())


def test_every_benchmark_is_covered() -> None:
    assert {"bench_checkpoint.py", "bench_data.py"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_quick_run(name: str, tmp_path: Path) -> None:
    proc = _run_quick(name, tmp_path)
    assert proc.returncode == 0, (
        f"{name} --quick exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}"
        f"\n--- stderr ---\n{proc.stderr[-5000:]}"
    )
    assert "|" in proc.stdout, "no table printed"
    if name == "bench_checkpoint.py":
        _check_checkpoint(_load(tmp_path, QUICK_JSON[name]))
    elif name == "bench_data.py":
        _check_data(_load(tmp_path, QUICK_JSON[name]))
    elif name == "bench_compression.py":
        _check_compression(_load(tmp_path, QUICK_JSON[name]))


@pytest.mark.emulator
@pytest.mark.parametrize("name", sorted(AZURITE_JSON))
def test_quick_run_azurite(name: str, tmp_path: Path) -> None:
    if Azurite.find_binary() is None:
        pytest.fail("azurite-blob is not installed (make test installs it into .tools/)")
    proc = _run_quick(name, tmp_path, "--target", "azurite")
    assert proc.returncode == 0, (
        f"{name} --quick --target azurite exited {proc.returncode}\n--- stdout ---\n"
        f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    )
    assert "|" in proc.stdout, "no table printed"
    report = _load(tmp_path, AZURITE_JSON[name])
    assert report["config"]["target"] == "azurite"
    if name == "bench_checkpoint.py":
        _check_checkpoint(report, s3=False)
    else:
        _check_data(report)
        for exp in report["experiments"].values():
            for rows in exp["sets"].values():
                assert "s3tc" not in rows  # s3torchconnector speaks S3 only


def _check_checkpoint(report: dict[str, Any], *, s3: bool = True) -> None:
    assert set(report["links"]) == {"loopback", "remote"}
    for link, res in report["links"].items():
        for method, s in res["saves"].items():
            assert not s["error"], f"{link}/{method} failed: {s['error']}"
            assert s["e2e_s"] and all(t > 0 for t in s["e2e_s"]), (link, method)
            assert 0 < s["steady_blocking_s"] <= s["steady_e2e_s"] + 1e-6, (link, method)
        expected = {"vw_sync", "vw_async", "raw_put", "raw_multipart", "fsspec_t8"}
        assert expected | ({"s3tc"} if s3 else set()) <= set(res["saves"])
        if not s3:
            assert "s3tc" not in res["saves"] and "s3tc_reader" not in res["loads"]
        for reader, s in res["loads"].items():
            assert not s["error"], f"{link}/{reader} failed: {s['error']}"
            # Every load is checked against the saved values: nothing passes unread.
            assert s["verified"], f"{link}/{reader} loaded wrong data"
        assert {"vw_reader", "fsspec_reader", "raw_get"} <= set(res["loads"])
        checks = res["targets"]["checks"]
        assert {"vw_sync", "vw_async", "vw_reader"} <= set(checks)


def _check_compression(report: dict[str, Any]) -> None:
    rows = report["rows"]
    assert {(r["link"], r["method"]) for r in rows} >= {
        ("loopback", "ours"), ("loopback", "ours + zstd"), ("remote", "ours"),
        ("remote", "ours + zstd")}
    assert all(r["save_median_s"] > 0 and r["load_median_s"] > 0 for r in rows)
    ratio = {r["state"]: r["ratio"] for r in rows if r["method"] == "ours + zstd"}
    # Deterministic states: noise barely compresses, integers and zeros a lot.
    assert 1.0 <= ratio["fp32 random"] < 1.2 < ratio["int + sparse"]
    assert ratio["fp32 random"] < ratio["bf16 + Adam"] < ratio["int + sparse"]
    # Uncompressed files hold the raw bytes plus torch.save's headers.
    assert all(0.95 < r["ratio"] <= 1.0 for r in rows if not r["method"].endswith("zstd"))


def _check_data(report: dict[str, Any]) -> None:
    exps = report["experiments"]
    assert set(exps) == {"throughput", "compute", "remote"}
    for exp_name, exp in exps.items():
        for set_name, rows in exp["sets"].items():
            for row, res in rows.items():
                where = f"{exp_name}/{set_name}/{row}"
                assert not res["error"], f"{where} failed: {res['error']}"
                assert res["epochs"], where
                for epoch in res["epochs"]:
                    # Every loader delivers every file of its set once per epoch
                    # (ours may pad the last global batch).
                    assert epoch["samples"] >= res["files"], where
                    assert epoch["bytes"] >= res["files"] * res["file_bytes"], where
    assert "ours" in exps["throughput"]["sets"]["small"]
    # Each cold comparison also measured the cache ceiling (raw GETs written to files).
    for exp_name in ("throughput", "remote"):
        for set_name, paired in exps[exp_name]["paired"].items():
            for key in ("cold_vs_raw", "raw_to_files_vs_raw", "cold_vs_raw_to_files"):
                rounds = paired[key]["rounds"]
                assert rounds and all(r["ratio"] > 0 for r in rounds), (exp_name, set_name, key)
    assert report["targets"], "no target was evaluated"
    startup = report["worker_startup"]
    assert startup["start_method"] == {"default": "forkserver", "fork": "fork"}
    for method, rounds in startup["rounds_s"].items():
        assert len(rounds) == 3 and all(t > 0 for t in rounds), method
