"""The Python blocks of README.md and docs/ (but recipes.md: ``test_recipes.py``), run as
written, each in a fresh interpreter.

The convention, so that what a reader copies is what runs here:

* Every ```` ```python ```` block carries a marker on the line above its fence
  (an HTML comment, which renderers hide): ``<!-- readme-test: NAME -->``, run
  by the test of that name below, or ``<!-- readme-test: skip: WHY -->`` for a
  block that is not meant to run. Shell commands and output are fenced as
  ``bash`` / ``text`` and never run; every fence names its language.
* A block runs as a script (``python block.py``) in a fresh temporary
  directory, so its relative paths (``runs/...``) land there;
  ``DCP_VOLUMES_CACHE`` and ``DCP_VOLUMES_STAGING`` point into it too.
* Blocks whose name ends in ``_s3`` talk to an S3-compatible server at
  ``http://127.0.0.1:9000`` with the credentials of the usual AWS
  variables. The test sets those variables to the moto server's, creates
  the buckets the block names (``s3://NAME/...``), and replaces that one
  endpoint string with the moto server's; nothing else in a block changes.
"""

from __future__ import annotations

import ast
import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from tests.doc_blocks import REPO, Block, code_blocks, run

README = REPO / "README.md"
# The user documents: the README and the pages it sends readers to for details.
DOCS = [README, *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "recipes.md")]
ENDPOINT = "http://127.0.0.1:9000"
_MARK = "readme-test:"
_BUCKET = re.compile(r"s3://([a-z0-9][a-z0-9.-]+)/")
# The blocks the tests below run; a block added to DOCS needs a test here.
TESTED = {"quickstart", "dcp_s3", "route_s3", "compression", "lifecycle", "data_s3",
          "file_cache_s3", "memory_store", "goodput"}
TESTED |= {"encryption", "sse_s3"}  # docs/checkpoints.md, docs/volumes.md


def _blocks() -> Iterator[tuple[str, Block]]:
    """Every fenced block of DOCS, with ``file:line`` for messages."""
    for doc in DOCS:
        for block in code_blocks(doc):
            yield f"{doc.relative_to(REPO)}:{block.line}", block


def _marked() -> dict[str, tuple[str, Block]]:
    """The Python blocks of DOCS that are marked to run, by name (with where they are)."""
    out: dict[str, tuple[str, Block]] = {}
    for where, block in _blocks():
        if block.lang != "python" or block.marker is None:
            continue
        name = block.marker.removeprefix(_MARK).strip()
        if not name.startswith("skip:"):
            assert name not in out, f"{where}: a second block named {name!r}"
            out[name] = (where, block)
    return out


def test_every_block_names_its_language() -> None:
    bare = [where for where, b in _blocks() if not b.lang]
    assert not bare, f"fences without a language (use bash/text/...): {bare}"


def test_every_python_block_is_run_or_marked_as_not_run() -> None:
    for where, block in _blocks():
        if block.lang != "python":
            continue
        assert block.marker is not None and block.marker.startswith(_MARK), (
            f"{where}: a python block without '<!-- {_MARK} NAME -->' "
            f"(or '<!-- {_MARK} skip: WHY -->') on the line above its fence"
        )
        ast.parse(block.code, filename=where)
    assert set(_marked()) == TESTED


@pytest.fixture
def s3(moto_server: Any) -> Iterator[Any]:
    """The moto server, wiped afterwards (the README's bucket names are fixed)."""
    yield moto_server
    moto_server.reset()


def _script(name: str, where: Path, moto: Any = None) -> Path:
    place, block = _marked()[name]
    code = block.code
    if name.endswith("_s3"):
        assert ENDPOINT in code, f"{place}: an S3 block names no {ENDPOINT}"
        for bucket in sorted(set(_BUCKET.findall(code))):
            moto.boto3_client().create_bucket(Bucket=bucket)
        code = code.replace(ENDPOINT, moto.endpoint)
    path = where / f"readme_{name}.py"
    path.write_text(code)
    return path


def _run_block(script: Path, cwd: Path, moto: Any = None) -> str:
    (cwd / "staging").mkdir(exist_ok=True)
    env = {"DCP_VOLUMES_CACHE": str(cwd / "cache"), "DCP_VOLUMES_STAGING": str(cwd / "staging")}
    if moto is not None:
        env.update({k: v for k, v in moto.env().items() if not k.startswith("AWS_ENDPOINT")})
    return run([sys.executable, str(script)], cwd=cwd, env=env)


def _keys(moto: Any, bucket: str, prefix: str) -> set[str]:
    listed = moto.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"] for o in listed.get("Contents", [])}


def test_quickstart_resumes_where_the_first_run_ended(tmp_path: Path) -> None:
    script = _script("quickstart", tmp_path)
    first = _run_block(script, tmp_path)
    assert "CheckpointInfo(step=100," in first and "complete=True" in first
    second = _run_block(script, tmp_path)
    assert "CheckpointInfo(step=200," in second
    # keep_last=2 of the saves at 125, 150, 175, 200
    assert sorted(p.name for p in (tmp_path / "runs" / "quickstart").iterdir()) == [
        "goodput", "step-00000175", "step-00000200"]


@pytest.mark.emulator
def test_dcp_block_commits_on_s3(tmp_path: Path, s3: Any) -> None:
    _run_block(_script("dcp_s3", tmp_path, s3), tmp_path, s3)
    keys = _keys(s3, "my-bucket", "run1/step-100/")
    assert {f"run1/step-100/{MANIFEST_NAME}", f"run1/step-100/{METADATA_NAME}"} <= keys


@pytest.mark.emulator
def test_routing_block_sends_only_the_routed_prefix_to_volume_writer(
    tmp_path: Path, s3: Any
) -> None:
    _run_block(_script("route_s3", tmp_path, s3), tmp_path, s3)
    assert f"run1/step-200/{MANIFEST_NAME}" in _keys(s3, "my-bucket", "run1/step-200/")
    local = tmp_path / "runs" / "local" / "step-200"
    assert (local / METADATA_NAME).exists() and not (local / MANIFEST_NAME).exists()


def test_compression_block_writes_a_zstd_checkpoint(tmp_path: Path) -> None:
    _run_block(_script("compression", tmp_path), tmp_path)
    ckpt = tmp_path / "runs" / "compressed" / "step-1"
    assert (ckpt / MANIFEST_NAME).exists()
    assert b"stream.zstd" in (ckpt / METADATA_NAME).read_bytes()


def test_memory_store_block_saves_and_restores_without_a_server(tmp_path: Path) -> None:
    _run_block(_script("memory_store", tmp_path), tmp_path)  # its asserts are the check


def test_lifecycle_block_lists_what_retention_kept(tmp_path: Path) -> None:
    script = _script("lifecycle", tmp_path)
    out = _run_block(script, tmp_path).splitlines()
    root = (tmp_path / "runs" / "run1").resolve()
    assert out == ["latest: 1000"] + [
        f"{s} True {root}/step-{s:08d}" for s in (500, 750, 1000)]
    assert _run_block(script, tmp_path).splitlines() == out  # restored at 1000: nothing to do


def test_goodput_block_reports_the_attempt_it_recorded(tmp_path: Path) -> None:
    script = _script("goodput", tmp_path)
    out = _run_block(script, tmp_path).splitlines()
    assert out[0].startswith("goodput so far: ") and out[0].endswith("%")
    assert out[1] == ("1 0 ['checkpoint_blocking', 'compute', 'input_wait', 'lost_work', "
                      "'other', 'restart_gap', 'restore', 'startup']")
    assert len(list((tmp_path / "runs" / "run2" / "goodput").iterdir())) == 1


def _summary(out: str) -> dict[str, Any]:
    last = out.strip().splitlines()[-1]
    summary: dict[str, Any] = ast.literal_eval(last)
    return summary


@pytest.mark.emulator
def test_data_block_trains_from_s3_and_resumes_mid_epoch(tmp_path: Path, s3: Any) -> None:
    script = _script("data_s3", tmp_path, s3)
    for i in range(64):  # 64 samples, 16 a batch: 4 batches an epoch
        buf = io.BytesIO()
        torch.save(torch.full((4,), float(i)), buf)
        s3.boto3_client().put_object(Bucket="my-bucket", Key=f"train/{i:05d}.pt",
                                     Body=buf.getvalue())
    first = _summary(_run_block(script, tmp_path, s3))
    assert first["batches"] == 12 and first["samples"] == 192  # 3 epochs
    # Saved at steps 5 and 10: the restart resumes at epoch 2's third batch.
    second = _summary(_run_block(script, tmp_path, s3))
    assert second["batches"] == 2


@pytest.mark.emulator
def test_file_cache_block_downloads_the_file(tmp_path: Path, s3: Any) -> None:
    script = _script("file_cache_s3", tmp_path, s3)  # creates the bucket
    s3.boto3_client().put_object(Bucket="my-bucket", Key="train/00000.pt", Body=b"sample")
    out = _run_block(script, tmp_path, s3)
    path = Path(out.strip().splitlines()[-1])
    assert path.read_bytes() == b"sample"
    assert path.is_relative_to(tmp_path / "cache")


def test_encryption_block_round_trips_rotates_and_leaves_no_plaintext(tmp_path: Path) -> None:
    _run_block(_script("encryption", tmp_path), tmp_path)  # its asserts are the check
    ckpt = tmp_path / "runs" / "secret" / "step-1"
    assert b"dcp_volumes.aes256gcm/1;key=2026-11" in (ckpt / METADATA_NAME).read_bytes()
    plain = torch.arange(1000.0).numpy().tobytes()[400:464]
    for path in (tmp_path / "runs").rglob("*.distcp"):
        assert plain not in path.read_bytes(), path


def test_sse_block_saves_and_loads_with_both_spellings(tmp_path: Path, s3: Any) -> None:
    _run_block(_script("sse_s3", tmp_path, s3), tmp_path, s3)
    assert METADATA_NAME.lstrip("/") in {k.rsplit("/", 1)[-1]
                                         for k in _keys(s3, "sse-bucket", "run/step-1/")}
