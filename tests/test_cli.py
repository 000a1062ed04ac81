"""The `dcp-volumes` CLI against local and moto volumes.

A few calls run the installed ``dcp-volumes`` console script in a fresh
interpreter (exit codes, stderr, storage options from the environment);
the rest call ``main(argv)`` in this process, the same code without the
~3 s interpreter and torch start-up per call.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import select
import shlex
import struct
import subprocess
import sys
import termios
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import CheckpointManager
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from dcp_volumes.checkpoint._manifest import FileRecord, Manifest, checksum_bytes
from dcp_volumes.cli import EXIT_CLOSED_STDOUT, main
from testkit.emulators import repo_root

Location = tuple[str, dict[str, Any]]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli_process(options: dict[str, Any] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run the CLI in a fresh interpreter: the
    ``dcp-volumes`` console script (``python -m dcp_volumes.cli`` when not installed)."""
    env = dict(os.environ)
    env.pop("DCP_VOLUMES_STORAGE_OPTIONS", None)
    if options:
        env["DCP_VOLUMES_STORAGE_OPTIONS"] = json.dumps(options)
    env["PYTHONPATH"] = str(repo_root()) + os.pathsep + env.get("PYTHONPATH", "")
    script = Path(sys.executable).with_name("dcp-volumes")  # the installed console script
    command = [str(script)] if script.exists() else [sys.executable, "-m", "dcp_volumes.cli"]
    return command, env


def run_cli(*args: str, options: dict[str, Any] | None = None, subprocess_: bool = False
            ) -> Result:
    """Run the CLI: the ``dcp-volumes`` console script (``python -m dcp_volumes.cli`` when
    the package is not installed) in a fresh interpreter, or ``main(ARGS)`` in this
    process (same code, no interpreter start-up: most tests use this to stay fast)."""
    if subprocess_:
        command, env = cli_process(options)
        proc = subprocess.run(
            [*command, *args],
            capture_output=True, text=True, timeout=120, env=env, cwd=str(repo_root()),
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)
    argv = list(args)
    if options and "--storage-options" not in argv:
        argv += ["--storage-options", json.dumps(options)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
    return Result(code, out.getvalue(), err.getvalue())


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"weight": torch.randn(64, 32, generator=g), "bias": torch.zeros(32)},
        "step_count": torch.tensor([step], dtype=torch.int64),
        "meta": {"note": f"step {step}"},
    }


def write_stock(url: str, options: dict[str, Any], name: str, step: int) -> None:
    """A checkpoint written by stock DCP (no manifest)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if url.startswith("s3://"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer: Any = FsspecWriter(f"{url}/{name}", **options)
        else:
            writer = dcp.FileSystemWriter(os.path.join(url, name))
        dcp.save(state_for(step), storage_writer=writer, no_dist=True)


def add_manifest(url: str, options: dict[str, Any], name: str) -> None:
    """Give a stock checkpoint a dcp_volumes manifest (as VolumeWriter writes it)."""
    vol = Volume(url, storage_options=options).child(name)
    files = {
        f.path: FileRecord(size=f.size, checksum=checksum_bytes(vol.read_bytes(f.path)))
        for f in vol.list("")
        if f.path not in (METADATA_NAME, MANIFEST_NAME)
    }
    vol.publish(MANIFEST_NAME, Manifest(files=files).to_json())


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.emulator)])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """A run root holding: stock step_100 and 200, managed step-00000300, a partial 400."""
    if request.param == "local":
        url, options = str(tmp_path / "run"), {}
        os.makedirs(url)
    else:
        bucket, options = request.getfixturevalue("s3_bucket")
        url = f"{bucket}/run"
    write_stock(url, options, "step_100", 100)
    write_stock(url, options, "200", 200)
    write_stock(url, options, "step-00000300", 300)
    add_manifest(url, options, "step-00000300")
    vol = Volume(url, storage_options=options)
    vol.publish("step-00000400/__0_0.distcp", b"half written")
    vol.publish("notes/readme.txt", b"not a checkpoint")
    return url, options


def test_ls_table_and_json(root: Location) -> None:
    url, options = root
    res = run_cli("ls", url, options=options, subprocess_=url.startswith("s3://"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "SIZE", "FILES", "AGE", "NAME"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"100", "200", "300", "400"}
    assert "complete" in rows["300"] and "partial" in rows["400"]
    assert "stock DCP" in rows["100"] and "stock DCP" not in rows["300"]

    res = run_cli("ls", url, "--json", options=options)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    got = {(c["step"], c["name"], c["complete"], c["managed"]) for c in doc["checkpoints"]}
    assert got == {
        (100, "step_100", True, False),
        (200, "200", True, False),
        (300, "step-00000300", True, True),
        (400, "step-00000400", False, False),
    }
    c300 = next(c for c in doc["checkpoints"] if c["step"] == 300)
    assert c300["files"] >= 3 and c300["size"] > 64 * 32 * 4


def _flip_byte(url: str, options: dict[str, Any], rel: str) -> None:
    vol = Volume(url, storage_options=options)
    data = bytearray(vol.read_bytes(rel))
    data[len(data) // 2] ^= 0xFF
    vol.publish(rel, bytes(data))


def test_verify_ok_then_flipped_byte_names_the_file(root: Location) -> None:
    url, options = root
    res = run_cli("verify", f"{url}/step-00000300", options=options)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("OK")
    assert res.stderr == ""  # no bar: stderr is not a terminal (test_progress_* below)

    data_file = next(
        f.path for f in Volume(url, storage_options=options).child("step-00000300").list("")
        if f.path.endswith(".distcp")
    )
    _flip_byte(url, options, f"step-00000300/{data_file}")
    res = run_cli("verify", f"{url}/300", "--no-progress", options=options)
    assert res.returncode == 1
    assert "FAILED" in res.stdout and data_file in res.stdout and "checksum" in res.stdout
    assert res.stderr == ""
    res = run_cli("verify", f"{url}/300", "--json", options=options,
                  subprocess_=url.startswith("s3://"))
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["ok"] is False
    assert any(data_file in p for p in doc["checkpoints"][0]["problems"])


def test_verify_root_checks_every_complete_and_skips_partial(root: Location) -> None:
    url, options = root
    res = run_cli("verify", url, "--json", options=options)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    status = {c["step"]: (c["status"], c.get("checksums")) for c in doc["checkpoints"]}
    assert status == {100: ("ok", False), 200: ("ok", False), 300: ("ok", True),
                      400: ("skipped", None)}
    # Named directly, a partial checkpoint fails verification.
    res = run_cli("verify", f"{url}/step-00000400", "--no-progress", options=options)
    assert res.returncode == 1
    assert "FAILED" in res.stdout and ".metadata: missing" in res.stdout


def test_verify_stock_checkpoint_with_a_missing_file_fails(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    write_stock(url, {}, "step_7", 7)
    data = next(p for p in os.listdir(os.path.join(url, "step_7")) if p.endswith(".distcp"))
    os.remove(os.path.join(url, "step_7", data))
    res = run_cli("verify", os.path.join(url, "step_7"), "--no-progress")
    assert res.returncode == 1
    assert data in res.stdout and "missing" in res.stdout


def test_gc_dry_run_changes_nothing_then_deletes(root: Location) -> None:
    url, options = root
    vol = Volume(url, storage_options=options)
    before = [f.path for f in vol.list("")]
    res = run_cli("gc", url, "--keep-last", "2", "--dry-run", "--json", options=options)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["dry_run"] is True and doc["deleted"] == []
    assert [c["name"] for c in doc["would_delete"]] == ["step_100"]
    assert [f.path for f in vol.list("")] == before

    res = run_cli("gc", url, "--keep-last", "1", options=options)
    assert res.returncode == 0, res.stderr
    assert "deleted 2, kept 2" in res.stdout
    # Kept: the newest complete (300), the partial newer than it (400, maybe being
    # written), and everything that is not a checkpoint.
    assert vol.list_dirs("") == ["notes", "step-00000300", "step-00000400"]


def test_gc_removes_partials_older_than_the_newest_complete(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    write_stock(url, {}, "step-00000005", 5)
    vol = Volume(url)
    vol.publish("step-00000003/__0_0.distcp", b"crashed save")
    vol.publish("step-00000004/.dcp_volumes.manifest.json", b"{}")  # crashed before .metadata
    # Written just now, they may be another job's saves in progress: kept.
    res = run_cli("gc", url, "--keep-last", "3", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["deleted"] == []
    for rel in ("step-00000003/__0_0.distcp", "step-00000004/.dcp_volumes.manifest.json"):
        old = time.time() - 7200  # older than the default grace of an hour
        os.utime(os.path.join(url, rel), (old, old))
    res = run_cli("gc", url, "--keep-last", "3", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert sorted(c["name"] for c in doc["deleted"]) == ["step-00000003", "step-00000004"]
    assert vol.list_dirs("") == ["step-00000005"]


def test_inspect_names_shapes_dtypes(root: Location) -> None:
    url, options = root
    res = run_cli("inspect", f"{url}/200", options=options)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()[2:]}
    assert rows["model.weight"] == ["float32", "64x32", "1"]
    assert rows["step_count"] == ["int64", "1", "1"]
    assert rows["meta.note"][0] == "(object)"

    res = run_cli("inspect", f"{url}/step-00000300", "--json", options=options)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["step"] == 300 and doc["complete"] is True
    entries = {e["name"]: e for e in doc["entries"]}
    assert entries["model.bias"]["shape"] == [32] and entries["model.bias"]["dtype"] == "float32"
    assert doc["tensor_bytes"] == (64 * 32 + 32) * 4 + 8


@pytest.mark.parametrize(
    ("args", "code", "needle", "in_subprocess"),
    [
        (["gc", "{root}"], 2, "--keep-last", True),  # argparse usage error
        (["gc", "{root}", "--keep-last", "0"], 2, "must be >= 1", False),
        (["ls", "{root}", "--storage-options", "{{bad"], 2, "not valid JSON", False),
        (["ls", "{root}", "--storage-options", "[1]"], 2, "JSON object", False),
        (["ls", "{root}/missing"], 1, "does not exist", False),
        (["inspect", "{root}"], 1, "not a checkpoint", False),
        (["inspect", "{root}/123"], 1, "No checkpoint of step 123", False),
        (["ls", "nosuchproto://x/y"], 2, "protocol", False),
        (["frobnicate"], 2, "invalid choice", False),
    ],
)
def test_errors_are_one_line_with_exit_codes(
    tmp_path: Path, args: list[str], code: int, needle: str, in_subprocess: bool
) -> None:
    root_dir = tmp_path / "run"
    root_dir.mkdir()
    res = run_cli(*[a.format(root=root_dir) for a in args], subprocess_=in_subprocess)
    assert res.returncode == code, res.stdout + res.stderr
    assert needle in res.stderr
    assert "Traceback" not in res.stderr
    if code == 1 or "protocol" in needle or "JSON" in needle:
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_env_storage_options_are_used(s3_bucket: Location) -> None:
    bucket, options = s3_bucket
    write_stock(f"{bucket}/run", options, "step_1", 1)
    old = os.environ.get("DCP_VOLUMES_STORAGE_OPTIONS")
    os.environ["DCP_VOLUMES_STORAGE_OPTIONS"] = json.dumps(options)
    try:
        res = run_cli("ls", f"{bucket}/run", "--json")
    finally:
        if old is None:
            del os.environ["DCP_VOLUMES_STORAGE_OPTIONS"]
        else:
            os.environ["DCP_VOLUMES_STORAGE_OPTIONS"] = old
    assert res.returncode == 0, res.stderr
    assert [c["step"] for c in json.loads(res.stdout)["checkpoints"]] == [1]


@pytest.mark.emulator
def test_missing_bucket_fails_cleanly(s3_bucket: Location) -> None:
    _, options = s3_bucket
    res = run_cli("ls", "s3://no-such-bucket-dcpv/run", options=options)
    assert res.returncode == 1
    assert "no-such-bucket-dcpv" in res.stderr and "Traceback" not in res.stderr
    assert options["secret"] not in res.stderr


# -- issue 30: step-less checkpoints, nothing to verify, closed stdout, progress ---------------


def test_checkpoints_whose_name_has_no_step_are_listed(root: Location) -> None:
    # Issue 30: `zvol/s1` verified OK, but `ls zvol` said "no checkpoints under" and
    # `inspect` called it "step 0".
    url, options = root
    write_stock(url, options, "final", 7)
    res = run_cli("ls", url, options=options)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line for line in res.stdout.splitlines()[1:]}
    assert set(rows) == {"-", "100", "200", "300", "400"}
    assert "complete" in rows["-"] and "final" in rows["-"]
    res = run_cli("ls", url, "--json", options=options)
    final = next(c for c in json.loads(res.stdout)["checkpoints"] if c["name"] == "final")
    assert final["step"] is None and final["complete"] is True

    res = run_cli("inspect", f"{url}/final", options=options)
    assert res.returncode == 0, res.stderr
    assert "  step -  complete" in res.stdout.splitlines()[0]
    res = run_cli("inspect", f"{url}/final", "--json", options=options)
    assert json.loads(res.stdout)["step"] is None

    res = run_cli("verify", url, "--json", "--no-progress", options=options)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert {c["url"].rsplit("/", 1)[-1]: c["status"] for c in doc["checkpoints"]}["final"] == "ok"

    # Retention and the manager keep to step-named checkpoints: "final" is never pruned.
    res = run_cli("gc", url, "--keep-last", "1", "--dry-run", "--json", options=options)
    assert "final" not in {c["name"] for c in json.loads(res.stdout)["would_delete"]}
    with CheckpointManager(url, storage_options=options) as mgr:
        assert "final" not in {i.name for i in mgr.list()}
        latest = mgr.latest()
        assert latest is not None and latest.name == "step-00000300"


@pytest.mark.parametrize("content", ["empty", "other files", "partial only",
                                     pytest.param("s3 prefix", marks=pytest.mark.emulator)])
def test_verify_with_nothing_to_verify_fails(
    tmp_path: Path, request: pytest.FixtureRequest, content: str
) -> None:
    # Issue 30: `verify /etc` and `verify emptydir` said "no checkpoints under ..." and exit 0,
    # so a CI job with a wrong path passed.
    url, options = str(tmp_path / "run"), {}
    os.makedirs(url)
    if content == "other files":
        Path(url, "notes.txt").write_text("not a checkpoint")
    elif content == "partial only":
        Volume(url).publish("step-00000004/__0_0.distcp", b"a crashed save")
    elif content == "s3 prefix":
        bucket, options = request.getfixturevalue("s3_bucket")
        url = f"{bucket}/nothing-here"
    res = run_cli("verify", url, options=options)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.startswith("dcp-volumes verify: error: nothing verified: no ")
    assert url in res.stderr and "--allow-empty" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    if content == "partial only":
        assert "1 partial skipped" in res.stderr
    res = run_cli("verify", url, "--json", options=options)
    assert res.returncode == 1 and json.loads(res.stdout)["ok"] is False
    res = run_cli("verify", url, "--allow-empty", options=options)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1].startswith("no ") and res.stderr == ""


def _stock_run(tmp_path: Path) -> str:
    url = str(tmp_path / "run")
    write_stock(url, {}, "step_100", 100)
    write_stock(url, {}, "200", 200)
    return url


@pytest.mark.parametrize("args", [["ls", "{root}"], ["gc", "{root}", "--keep-last", "1",
                                                    "--dry-run"]], ids=lambda a: a[0])
def test_closed_stdout_ends_quietly(tmp_path: Path, args: list[str]) -> None:
    # Issue 30: `dcp-volumes inspect ... | head -3` ended with "dcp-volumes inspect: error:
    # [Errno 32] Broken pipe". Here the reader of stdout is gone before the first line
    # (main handles it for every subcommand; these two start without torch: fast).
    url = _stock_run(tmp_path)
    command, env = cli_process()
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([*command, *[a.format(root=url) for a in args]],
                              stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120, env=env, cwd=str(repo_root()))
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == EXIT_CLOSED_STDOUT == 141


def test_head_of_a_long_listing_ends_quietly(tmp_path: Path) -> None:
    # The issue's own pipeline; the output (~250 KB) outgrows the pipe after head leaves.
    ck = tmp_path / "big"
    state = {f"layer_{i:04d}.attention.weight": torch.zeros(1) for i in range(1500)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ck)), no_dist=True)
    command, env = cli_process()
    line = " ".join(shlex.quote(c) for c in [*command, "inspect", str(ck), "--json"])
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {line} | head -3"],
                          capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(repo_root()))
    assert proc.stdout.splitlines()[0] == "{"
    assert proc.stderr == ""
    assert proc.returncode == EXIT_CLOSED_STDOUT


def test_progress_bars_only_on_a_terminal(tmp_path: Path) -> None:
    # Issue 30: `verify ... 2>file` left the bar's \r updates in the file.
    url = _stock_run(tmp_path)
    add_manifest(url, {}, "200")  # its checksums make the bar count bytes
    with (tmp_path / "stderr").open("w") as err, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        assert main(["verify", f"{url}/200"]) == 0
    written = (tmp_path / "stderr").read_text()
    assert "\r" not in written and "%|" not in written

    # On a terminal the bar is drawn (and --no-progress turns it off there too).
    def on_a_terminal(*args: str) -> str:
        master, replica = os.openpty()
        # A real terminal's size: tqdm fits its bar into stderr's width (0 on a new pty).
        fcntl.ioctl(replica, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        drawn = b""
        try:
            with os.fdopen(replica, "w") as tty:
                with contextlib.redirect_stderr(tty), contextlib.redirect_stdout(io.StringIO()):
                    assert main(["verify", f"{url}/200", *args]) == 0
                # Read while the terminal is open: Linux drops what is unread when it closes.
                while select.select([master], [], [], 0.5)[0]:
                    drawn += os.read(master, 65536)
        finally:
            os.close(master)
        return drawn.decode(errors="replace")

    assert "%|" in on_a_terminal() and "200" in on_a_terminal()
    assert on_a_terminal("--no-progress") == ""
