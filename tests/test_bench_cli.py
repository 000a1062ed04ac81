"""`dcp-volumes bench` argument handling, target resolution and the goodput model.

Nothing here starts a server or a rank: the runs themselves are in
``tests/test_benchmarks_smoke.py`` (soak).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest

from benchmarks import cli as bench_cli
from benchmarks._goodput import GoodputModel
from benchmarks._targets import TargetError, parse_storage_options, resolve
from dcp_volumes import cli
from testkit.emulators import repo_root


def _parse(*argv: str) -> argparse.Namespace:
    return bench_cli.build_parser().parse_args(list(argv))


def test_quick_profile_is_small() -> None:
    cfg = bench_cli.checkpoint_config(_parse("checkpoint", "--quick"), "cmd")
    assert cfg.quick and cfg.sizes_mib == (8,) and cfg.ranks == (2,)
    assert cfg.repeats == 2 and cfg.links == ("loopback", "remote")
    assert cfg.target.name == "moto" and "load" in cfg.methods
    full = bench_cli.checkpoint_config(_parse("checkpoint"), "cmd")
    assert full.sizes_mib == (32, 128, 512) and full.ranks == (1, 2, 4) and full.repeats == 3


def test_explicit_matrix_overrides_the_profile() -> None:
    args = _parse("all", "--quick", "--sizes", "16,64", "--ranks", "1,4", "--link", "remote",
                  "--repeats", "4", "--restart-s", "60")
    cfg = bench_cli.checkpoint_config(args, "cmd")
    assert cfg.sizes_mib == (16, 64) and cfg.ranks == (1, 4) and cfg.repeats == 4
    assert cfg.links == ("remote",) and cfg.goodput.restart_s == 60


def test_to_argv_round_trips() -> None:
    args = _parse("checkpoint", "--quick", "--target", "s3://b/p", "--endpoint", "http://x:9",
                  "--storage-option", "key=k", "--storage-option", "secret=s", "--sizes", "8,16")
    argv = bench_cli.to_argv(args)
    assert argv[0] == "checkpoint" and "--quick" in argv and "--link" not in argv  # default
    assert vars(_parse(*argv)) == vars(args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--quick"], "required: suite"),
        (["bench", "checkpoint", "--sizes", "0"], "must be >= 1"),
        (["bench", "checkpoint", "--link", "fast"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "checkpoint", "--quick", "--target", "nosuch"], "neither one of moto"),
        (["bench", "checkpoint", "--quick", "--target", "ftp://b/x"], "no benchmark client"),
        (["bench", "checkpoint", "--quick", "--repeats", "1"], "repeats must be >= 2"),
        (["bench", "checkpoint", "--quick", "--methods", "vw_fast"], "unknown methods"),
        (["bench", "checkpoint", "--quick", "--target", "dir"], "no server to put"),
        (["bench", "checkpoint", "--quick", "--storage-option", "novalue"], "not key=value"),
        (["bench", "checkpoint", "checkpoint.json", "--quick"], "result files are for `replot`"),
        (["bench", "replot", "no/such/result.json"], "no such result file"),
    ],
)
def test_configuration_errors_are_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("dcp-volumes bench: error:")
    assert "Traceback" not in err


def test_replot_draws_a_saved_run_again_beside_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A committed run of two cells; the figures come from its numbers alone.
    src = repo_root() / "benchmarks" / "results" / "checkpoint_gcs_quick.json"
    run = tmp_path / "checkpoint_gcs_quick.json"
    shutil.copy(src, run)
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "local_tier"}))
    assert cli.main(["bench", "replot", str(run)]) == 0
    for fig in ("throughput", "blocking", "scaling", "goodput"):
        assert (tmp_path / f"checkpoint_gcs_quick_{fig}.png").stat().st_size > 10_000
    assert "checkpoint_gcs_quick_goodput.png" in capsys.readouterr().out
    assert cli.main(["bench", "replot", str(tmp_path / "other.json")]) == 2
    assert "not a checkpoint or data result" in capsys.readouterr().err


def test_outside_a_checkout_says_how_to_run_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_benchmarks_cli", lambda: None)
    assert cli.main(["bench", "checkpoint", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "repository checkout" in err and "python -m benchmarks" in err


def test_url_targets_and_storage_options() -> None:
    t = resolve("s3://bucket/runs/a", endpoint="http://127.0.0.1:9000",
                options=["key=k", "secret=s", "client_kwargs.region_name=eu-1", "anon=false"])
    assert (t.scheme, t.bucket, t.prefix, t.external) == ("s3", "bucket", "runs/a", True)
    assert t.proxyable and t.s3torchconnector and t.multipart
    assert t.options == {"key": "k", "secret": "s", "anon": False,
                         "client_kwargs": {"region_name": "eu-1"}}
    assert t.url("bucket", "x") == "s3://bucket/runs/a/x"
    assert resolve("gs://b").multipart is False
    d = resolve("/mnt/shared/ckpt")
    assert (d.scheme, d.bucket, d.proxyable) == ("file", "/mnt/shared/ckpt", False)
    assert resolve("radosgw").s3torchconnector is False  # its writes fail on Ceph 16
    assert resolve("moto", endpoint="http://minio:9000").endpoint == "http://minio:9000"
    with pytest.raises(TargetError, match="names no bucket"):
        resolve("s3://")
    assert parse_storage_options(["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


def test_goodput_model() -> None:
    model = GoodputModel(failures_per_day=8.6, restart_s=300)
    assert model.mtbf_s == pytest.approx(86400 / 8.6)
    sync = model.best(blocking_s=10.0, e2e_s=10.0)
    # Young's first-order optimum is close to the exact best for a sync save.
    assert sync["best_interval_s"] == pytest.approx(math.sqrt(2 * 10 * model.mtbf_s), rel=0.1)
    async_ = model.best(blocking_s=0.5, e2e_s=10.0)
    assert async_["best_goodput"] > sync["best_goodput"]  # less stall, same commit
    assert async_["best_interval_s"] < sync["best_interval_s"]
    # An interval shorter than the commit lag stalls training (back-pressure).
    assert model.goodput(5.0, 0.5, 10.0) < model.goodput(10.0, 0.5, 10.0)
    # Failures cost the restart and the work since the last committed checkpoint.
    assert model.goodput(600, 1, 1) == pytest.approx(600 / 601 * (1 - (300 + 300.5) / model.mtbf_s))
    # Other time per second of compute (input waits) lengthens the cycle (the demo's use).
    assert model.goodput(600, 1, 1, overhead=0.5) == pytest.approx(
        600 / 901 * (1 - (300 + 450.5) / model.mtbf_s))
    with pytest.raises(ValueError, match="failures_per_day"):
        GoodputModel(failures_per_day=0)
