"""Smoke test of the benchmark suite: ``python -m benchmarks ... --quick`` runs and reports.

Slow (a quick run takes a minute or two on 2 cores), so the runs are few: both
benchmarks on moto's loopback, the checkpoint matrix's remote link with a few
methods, Azurite, and the compression benchmark (``bench_compression.py``).
The benchmarks start their own servers; their JSON and plots go to a temp dir
(``DCP_VOLUMES_BENCH_RESULTS``), so committed results stay untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testkit.emulators import Azurite, repo_root

pytestmark = pytest.mark.soak

FIGURES = ("throughput", "blocking", "scaling", "goodput")
FEW_METHODS = "memcpy,raw_put,fsspec_t8,vw_sync,vw_async_fresh,load"


def _run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DCP_VOLUMES_BENCH_RESULTS": str(out), "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=repo_root(),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"python -m benchmarks {' '.join(args)} exited {proc.returncode}\n--- stdout ---\n"
        f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    )
    assert "|" in proc.stdout, "no table printed"
    return proc


def _report(out: Path, stem: str, *, figures: tuple[str, ...] = ()) -> dict[str, Any]:
    path = out / f"{stem}.json"
    assert path.exists(), f"the run wrote no {path.name}"
    for fig in figures:
        png = out / f"{stem}_{fig}.png"
        assert png.stat().st_size > 10_000, f"{png.name} is missing or empty"
    return json.loads(path.read_text())


def test_quick_suite_on_moto_loopback(tmp_path: Path) -> None:
    proc = _run(tmp_path, "all", "--quick", "--link", "loopback")
    assert "PASS" in proc.stdout or "MISS" in proc.stdout, "no verdict per cell"
    report = _report(tmp_path, "checkpoint_quick", figures=FIGURES)
    _check_checkpoint(report, links={"loopback"}, s3tc=True)
    assert (tmp_path / "checkpoint_quick.md").read_text().count("|") > 50
    _check_data(_report(tmp_path, "data_quick"), remote=False)


def test_quick_checkpoint_behind_the_remote_link(tmp_path: Path) -> None:
    _run(tmp_path, "checkpoint", "--quick", "--link", "remote", "--methods", FEW_METHODS,
         "--no-local-tier")
    report = _report(tmp_path, "checkpoint_quick", figures=FIGURES)
    _check_checkpoint(report, links={"remote"}, s3tc=False, local_tier=False)


@pytest.mark.emulator
def test_quick_checkpoint_on_azurite(tmp_path: Path) -> None:
    if Azurite.find_binary() is None:
        pytest.fail("azurite-blob is not installed (make test installs it into .tools/)")
    _run(tmp_path, "checkpoint", "--quick", "--target", "azurite", "--link", "loopback",
         "--methods", FEW_METHODS, "--no-local-tier",
         "--no-reshard")
    report = _report(tmp_path, "checkpoint_azurite_quick")
    assert report["config"]["target"] == "azurite"
    _check_checkpoint(report, links={"loopback"}, s3tc=False, local_tier=False, reshard=False)


def test_quick_compression_benchmark(tmp_path: Path) -> None:
    env = {**os.environ, "DCP_VOLUMES_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_compression", "--quick"],
        cwd=repo_root(), env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (
        f"bench_compression --quick exited {proc.returncode}\n--- stdout ---\n"
        f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    )
    _check_compression(_report(tmp_path, "compression_quick"))


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


def _check_checkpoint(
    report: dict[str, Any],
    *,
    links: set[str],
    s3tc: bool,
    local_tier: bool = True,
    reshard: bool = True,
) -> None:
    cells = report["cells"]
    assert {c["link"] for c in cells} == links
    for cell in cells:
        where = f"{cell['link']} {cell['world_size']} x {cell['size_mib']} MiB"
        for method, s in cell["saves"].items():
            assert not s["error"], f"{where} {method} failed: {s['error']}"
            # memcpy (no I/O, noisy at small sizes) makes at least the cell's repeats.
            repeats = report["config"]["repeats"]
            made = len(s["e2e_s"])
            assert made == repeats or (method == "memcpy" and made > repeats), (where, method)
            assert 0 < s["steady_blocking_s"] <= s["steady_e2e_s"] + 1e-6, (where, method)
            assert s["client_cpu_s_per_gib"] > 0, (where, method)
        assert {"vw_sync", "vw_async_fresh", "raw_put", "fsspec_t8"} <= set(cell["saves"])
        assert ("s3tc" in cell["saves"]) == s3tc
        # The server's CPU is measured where this package started the server.
        assert cell["saves"]["raw_put"]["server_cpu_s_per_gib"] > 0, where
        for reader, s in cell["loads"].items():
            assert not s["error"], f"{where} {reader} failed: {s['error']}"
            # Every load is checked against the saved values: nothing passes unread.
            assert s["verified"], f"{where} {reader} loaded wrong data"
        assert {"vw_reader", "raw_get"} <= set(cell["loads"])
        assert ("vw_reader_reshard" in cell["loads"]) == reshard
        checks = cell["targets"]["checks"]
        assert {"e2e_vs_floor", "speedup_vs_best_peer", "blocking_vs_memcpy",
                "first_vs_steady", "peak_extra_vs_state"} == set(checks["vw_async_fresh"])
        assert "load_vs_floor" in checks["vw_reader"]
    goodput = report["goodput"]["cells"]
    assert len(goodput) == len(cells)
    for g in goodput:
        for w in g["writers"].values():
            assert 0 < w["best_goodput"] < 1 and w["best_interval_s"] > 0
    if local_tier:
        for link in links:
            res = report["local_tier"][link]
            assert res["speedup_vs_remote"]["local tier"] > 0
            assert "met" in res["target"]


def _check_data(report: dict[str, Any], *, remote: bool) -> None:
    exps = report["experiments"]
    assert set(exps) == ({"throughput", "compute", "remote"} if remote
                         else {"throughput", "compute"})
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
    for set_name, paired in exps["throughput"]["paired"].items():
        for key in ("cold_vs_raw", "raw_to_files_vs_raw", "cold_vs_raw_to_files"):
            rounds = paired[key]["rounds"]
            assert rounds and all(r["ratio"] > 0 for r in rounds), (set_name, key)
    assert any("raw GETs to files" in name for name in report["targets"])
    startup = report["worker_startup"]
    assert startup["start_method"] == {"default": "forkserver", "fork": "fork"}
    for method, rounds in startup["rounds_s"].items():
        assert len(rounds) == 3 and all(t > 0 for t in rounds), method
