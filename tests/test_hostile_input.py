"""Hostile and damaged input: broken ``.metadata`` and manifests, names that reach outside,
odd key characters, a newer format, traversal in a dataset listing, files that change.

Complements ``test_untrusted_checkpoints.py`` (pickles that run code, ``..`` in
``.metadata``) and ``test_checkpoint_errors.py`` (one corrupt ``.metadata``,
damaged shards). Each test checks that the error is ours and says what to do,
and that nothing is written outside the volume, staging and cache directories.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointVersionError,
    DataLoader,
    DcpVolumesError,
    FileCache,
    VolumeDataset,
    VolumeError,
    VolumeReader,
    VolumeWriter,
    storage_error,
)
from dcp_volumes._volume import Volume
from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from testkit.emulators import MotoServer
from testkit.states import seeded_state
from tests.test_cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

Location = tuple[str, dict[str, Any]]


def _state(seed: int = 0) -> dict[str, Any]:
    return seeded_state(seed, {"w": (8, 8)}, n=torch.arange(10) + seed, meta={"s": seed})


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(8, 8), "n": torch.zeros(10, dtype=torch.int64), "meta": {"s": -1}}


def _files(top: Path) -> dict[str, int]:
    """Every file below ``top`` with its size (a snapshot to compare)."""
    out = {}
    for dirpath, _, names in os.walk(top):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, top)] = os.path.getsize(p)
    return out


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path`` with a canary file beside the volume; it must stay untouched, and
    nothing may appear outside ``volume/``, ``staging/`` and ``cache/``."""
    for d in ("volume", "staging", "cache"):
        (tmp_path / d).mkdir()
    (tmp_path / "victim").write_bytes(b"do not touch")
    before = _files(tmp_path)
    yield tmp_path
    after = _files(tmp_path)
    allowed = ("volume" + os.sep, "staging" + os.sep, "cache" + os.sep)
    outside = {k: v for k, v in after.items() if not k.startswith(allowed)}
    expected = {k: v for k, v in before.items() if not k.startswith(allowed)}
    assert outside == expected, "files appeared or changed outside the allowed directories"
    assert (tmp_path / "victim").read_bytes() == b"do not touch"


def _save(url: str, opts: dict[str, Any] | None = None, *, staging: Path | None = None,
          seed: int = 0) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(seed), no_dist=True, storage_writer=VolumeWriter(
            url, storage_options=opts, staging_dir=staging))


def _load_error(url: str, opts: dict[str, Any] | None = None) -> DcpVolumesError:
    with pytest.raises(BaseException) as excinfo:
        dcp.load(_blank(), no_dist=True,
                 storage_reader=VolumeReader(url, storage_options=opts))
    found = storage_error(excinfo.value)
    assert found is not None, f"not a dcp_volumes error: {excinfo.value!r}"
    return found


# -- truncated or garbage .metadata ---------------------------------------------------------

GARBAGE = {
    "empty": lambda b: b"",
    "truncated": lambda b: b[: len(b) // 2],
    "one byte": lambda b: b[:1],
    "random": lambda b: os.urandom(len(b)),
    "json": lambda b: b'{"not": "a pickle"}',
    "a pickled list": lambda b: b"\x80\x04]\x94.",  # a valid pickle, of the wrong thing
}


@pytest.mark.parametrize("damage", list(GARBAGE), ids=list(GARBAGE))
def test_damaged_metadata_is_a_clear_error_everywhere(sandbox: Path, damage: str) -> None:
    root = sandbox / "volume"
    ck = root / "step-00000002"
    _save(str(root / "step-00000001"), staging=sandbox / "staging", seed=1)
    _save(str(ck), staging=sandbox / "staging", seed=2)
    md = ck / METADATA_NAME
    md.write_bytes(GARBAGE[damage](md.read_bytes()))

    with pytest.raises(CheckpointCorruptError, match="older checkpoint") as err:
        VolumeReader(ck).read_metadata()
    assert METADATA_NAME in str(err.value)
    # dcp.load keeps only the texts of .metadata errors (its AssertionError joins them):
    # the text must name the damaged file, never call it missing.
    with pytest.raises(BaseException) as excinfo:
        dcp.load(_blank(), no_dist=True, storage_reader=VolumeReader(ck))
    assert str(err.value) in str(excinfo.value)
    assert "incomplete" not in str(excinfo.value) and "nothing is there" not in str(excinfo.value)

    # The manager names it too and restores nothing silently; the CLI exits non-zero.
    with CheckpointManager(root, staging_dir=sandbox / "staging") as mgr:
        with pytest.raises(CheckpointCorruptError, match=r"\.metadata"):
            mgr.restore(_blank())
        assert mgr.restore(_blank(), step=1) == 1  # an older one still loads
    res = run_cli("inspect", str(ck))
    assert res.returncode != 0 and METADATA_NAME in res.stderr, res.stderr
    res = run_cli("verify", str(ck), "--no-progress")
    assert res.returncode != 0 and METADATA_NAME in res.stdout + res.stderr


# -- truncated or garbage manifest ----------------------------------------------------------

MANIFEST_DAMAGE = {
    "empty": lambda d: b"",
    "truncated": lambda d: json.dumps(d).encode()[:40],
    "not json": lambda d: os.urandom(64),
    "a list": lambda d: b"[1, 2]",
    "files a list": lambda d: json.dumps({**d, "files": ["x"]}).encode(),
    "size a string": lambda d: json.dumps(
        {**d, "files": {k: {**v, "size": "big"} for k, v in d["files"].items()}}).encode(),
    "no format": lambda d: json.dumps({k: v for k, v in d.items() if k != "format"}).encode(),
}


@pytest.mark.parametrize("damage", list(MANIFEST_DAMAGE), ids=list(MANIFEST_DAMAGE))
def test_damaged_manifest_is_a_clear_error(sandbox: Path, damage: str) -> None:
    root = sandbox / "volume"
    ck = root / "step-00000001"
    _save(str(ck), staging=sandbox / "staging")
    doc = json.loads((ck / MANIFEST_NAME).read_bytes())
    (ck / MANIFEST_NAME).write_bytes(MANIFEST_DAMAGE[damage](doc))

    err = _load_error(str(ck))
    assert isinstance(err, CheckpointCorruptError), err
    assert "unreadable" in str(err) and "dcp-volumes verify" in str(err)
    with CheckpointManager(root, staging_dir=sandbox / "staging") as mgr:
        (info,) = mgr.list()
        assert not info.complete and "unreadable" in info.problems[0]
        assert mgr.restore(_blank()) is None  # the only checkpoint is not complete
    res = run_cli("verify", str(ck), "--no-progress")
    assert res.returncode != 0 and "unreadable" in res.stdout + res.stderr


@pytest.mark.parametrize("name", ["../victim", "/etc/hostname", "a/../../victim", "./x",
                                  "C:/x", "a\\..\\b", "a//b"])
def test_a_manifest_naming_a_file_outside_is_refused_by_every_reader(
    sandbox: Path, name: str
) -> None:
    root = sandbox / "volume"
    ck = root / "step-00000001"
    _save(str(ck), staging=sandbox / "staging")
    doc = json.loads((ck / MANIFEST_NAME).read_bytes())
    doc["files"][name] = {"size": 12, "checksum": "0" * 16}
    (ck / MANIFEST_NAME).write_text(json.dumps(doc))

    err = _load_error(str(ck))
    assert isinstance(err, CheckpointCorruptError) and "not inside the checkpoint" in str(err)
    res = run_cli("verify", str(ck), "--no-progress")  # verify would read the file it names
    assert res.returncode != 0 and "not inside the checkpoint" in res.stdout + res.stderr
    with CheckpointManager(root, staging_dir=sandbox / "staging") as mgr:
        (info,) = mgr.list()
        assert not info.complete


# -- a checkpoint from a newer format version -------------------------------------------------


def _make_newer(ck: Path) -> None:
    doc = json.loads((ck / MANIFEST_NAME).read_bytes())
    doc["format"] = "dcp_volumes.manifest/2"
    doc["files"] = {k: {**v, "layout": "v2"} for k, v in doc["files"].items()}
    (ck / MANIFEST_NAME).write_text(json.dumps(doc))


def test_a_newer_format_says_upgrade_and_is_never_deleted(sandbox: Path) -> None:
    root = sandbox / "volume"
    _save(str(root / "step-00000001"), staging=sandbox / "staging", seed=1)
    _save(str(root / "step-00000002"), staging=sandbox / "staging", seed=2)
    _make_newer(root / "step-00000002")

    err = _load_error(str(root / "step-00000002"))
    assert isinstance(err, CheckpointVersionError), err
    assert "newer" in str(err) and "upgrade dcp_volumes" in str(err)
    assert not isinstance(err, CheckpointCorruptError)  # it is not damaged

    with CheckpointManager(root, keep_last=1, staging_dir=sandbox / "staging",
                           async_save=False) as mgr:
        infos = {i.step: i for i in mgr.list()}
        assert infos[2].newer_format and not infos[2].complete
        assert "upgrade" in infos[2].problems[0]
        out = _blank()
        assert mgr.restore(out) == 1 and out["meta"] == {"s": 1}
        # Retention after a new save: step 1 goes (keep_last=1), the newer-format
        # step 2 stays, though it counts as an old partial one here.
        mgr.save(3, _state(3))
        mgr.wait()  # retention runs after the commit
        assert sorted(i.step for i in mgr.list()) == [2, 3]
    res = run_cli("gc", str(root), "--keep-last", "1")
    assert res.returncode == 0, res.stderr
    assert (root / "step-00000002" / MANIFEST_NAME).exists()
    res = run_cli("verify", str(root / "step-00000002"), "--no-progress")
    assert res.returncode != 0 and "upgrade" in res.stdout + res.stderr


# -- odd characters in keys: spaces, unicode, percent -----------------------------------------

ODD = ["with space", "ünïcødé-日本", "100%", "a%20b", "%2F..%2F", "plus+and&amp;", "semi;colon=x"]


@pytest.fixture(params=["local", "s3"])
def odd_root(request: pytest.FixtureRequest, sandbox: Path) -> Iterator[Location]:
    if request.param == "local":
        yield str(sandbox / "volume"), {}
        return
    yield request.getfixturevalue("s3_bucket")


@pytest.mark.parametrize("odd", ODD)
def test_odd_checkpoint_names_round_trip(odd_root: Location, sandbox: Path, odd: str) -> None:
    url, opts = odd_root
    ck = f"{url}/run {odd}/ck {odd}"
    _save(ck, opts, staging=sandbox / "staging", seed=3)
    out = _blank()
    dcp.load(out, no_dist=True, storage_reader=VolumeReader(ck, storage_options=opts))
    assert torch.equal(out["w"], _state(3)["w"]) and out["meta"] == {"s": 3}
    names = {f.path for f in Volume(ck, storage_options=opts).list()}
    assert {METADATA_NAME, MANIFEST_NAME} <= names  # stored under the name given, not escaped

    root = f"{url}/mgr {odd}"
    with CheckpointManager(root, storage_options=opts, staging_dir=sandbox / "staging",
                           async_save=False) as mgr:
        mgr.save(5, _state(5))
        mgr.wait()
        out = _blank()
        assert mgr.restore(out) == 5 and out["meta"] == {"s": 5}
        assert [i.step for i in mgr.list() if i.complete] == [5]
    res = run_cli("ls", root, "--json", options=opts)
    assert res.returncode == 0, res.stderr
    assert [c["step"] for c in json.loads(res.stdout)["checkpoints"]] == [5]


def test_odd_dataset_keys_are_listed_and_cached(odd_root: Location, sandbox: Path) -> None:
    url, opts = odd_root
    data = f"{url}/data set"
    vol = Volume(data, storage_options=opts)
    if vol.capabilities.local_files:
        os.makedirs(vol.root)
    files = {f"{odd}/{odd}.bin": odd.encode() * 3 for odd in ODD}
    for rel, payload in files.items():
        vol.publish(rel, payload)
    cache = sandbox / "cache"

    def read(path: str) -> tuple[str, bytes]:
        with open(path, "rb") as f:
            return path, f.read()

    for _ in range(2):  # cold, then from the cache
        ds = VolumeDataset(data, storage_options=opts, cache_dir=cache, shuffle=False,
                           transform=read)
        got = [sample for batch in DataLoader(ds, batch_size=1, num_workers=0,
                                              collate_fn=lambda b: b) for sample in batch]
        assert sorted(b for _, b in got) == sorted(files.values())
        for path, _ in got:
            inside = os.path.realpath(path).startswith(str(cache) + os.sep)
            assert inside or vol.capabilities.local_files, path
    if not vol.capabilities.local_files:
        c = FileCache(cache)
        for rel, payload in files.items():
            assert c.contains(f"{data}/{rel}", storage_options=opts)
            assert Path(c.fetch(f"{data}/{rel}", storage_options=opts)).read_bytes() == payload


# -- path traversal in a dataset listing ------------------------------------------------------

TRAVERSAL_KEYS = ["train/a/../../x.bin", "train/../escape.bin", "train/./dot.bin",
                  "train//double.bin"]


def _put_raw(server: MotoServer, bucket: str, key: str, body: bytes) -> None:
    server.boto3_client().put_object(Bucket=bucket, Key=key, Body=body)


@pytest.mark.emulator
@pytest.mark.parametrize("key", TRAVERSAL_KEYS)
@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
def test_traversal_keys_in_a_listing_never_write_outside_the_cache(
    moto_server: MotoServer, s3_bucket: Location, sandbox: Path, key: str, backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, opts = s3_bucket
    if backend == "fsspec":  # s3fs lists such keys; the options make a backend of its own
        monkeypatch.setenv("DCP_VOLUMES_BACKEND", "fsspec")
        opts = {**opts, "use_listings_cache": False}
    bucket = url.removeprefix("s3://")
    for i in range(3):
        _put_raw(moto_server, bucket, f"train/ok-{i}.bin", b"good%d" % i)
    _put_raw(moto_server, bucket, key, b"evil")
    cache = sandbox / "cache"
    try:
        ds = VolumeDataset(f"{url}/train", storage_options=opts, cache_dir=cache,
                           shuffle=False)
        paths = [p for batch in DataLoader(ds, batch_size=1, num_workers=0,
                                           collate_fn=lambda b: b) for p in batch]
    except VolumeError as exc:
        # Refused whole (obstore cannot address the key): say which key and what to do.
        assert "'.', '..' or empty path segment" in str(exc) and "Fix:" in str(exc), exc
        assert backend == "obstore"
        return
    # Listed (fsspec): every copy lives inside the cache, whatever the key says.
    assert len(paths) >= 3
    for p in paths:
        assert os.path.realpath(p).startswith(str(cache) + os.sep), p
    # The same through FileCache directly, with the traversal in the URL itself.
    c = FileCache(cache)
    p = c.fetch(f"{url}/{key}", storage_options=opts)
    assert os.path.realpath(p).startswith(str(cache) + os.sep), p


def test_file_cache_paths_stay_inside_for_any_url(sandbox: Path) -> None:
    cache = FileCache(sandbox / "cache")
    for url in ["s3://b/../../../../etc/passwd", "s3://b/a/../../x", "s3://b//abs",
                "s3://b/..", "s3://b/%2e%2e/%2e%2e/x", "gs://b/..\\..\\x", "s3://b/x\x00y"]:
        path = cache.path_of(url)
        assert os.path.realpath(path).startswith(str(sandbox / "cache") + os.sep), (url, path)


# -- a dataset file that changes while cached ---------------------------------------------


def test_a_file_that_changes_size_while_cached(s3_bucket: Location, sandbox: Path) -> None:
    url, opts = s3_bucket
    vol = Volume(f"{url}/train", storage_options=opts)
    for i in range(4):
        vol.publish(f"f{i}.bin", bytes([i]) * 50)
    cache = sandbox / "cache"

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def epoch(ds: VolumeDataset) -> list[bytes]:
        return [s for b in DataLoader(ds, batch_size=1, num_workers=0, collate_fn=lambda b: b)
                for s in b]

    first = VolumeDataset(f"{url}/train", storage_options=opts, cache_dir=cache,
                          shuffle=False, transform=read)
    assert epoch(first) == [bytes([i]) * 50 for i in range(4)]
    vol.publish("f1.bin", b"grown" * 30)  # 150 bytes now
    vol.publish("f2.bin", b"x")  # 1 byte now
    # The dataset that listed the old sizes keeps serving the copies it listed: one
    # consistent epoch, never a mix of old listing and new bytes.
    assert epoch(first) == [bytes([i]) * 50 for i in range(4)]
    # A new listing sees the change and the cache refetches what changed.
    second = VolumeDataset(f"{url}/train", storage_options=opts, cache_dir=cache,
                           shuffle=False, transform=read)
    assert epoch(second) == [bytes([0]) * 50, b"grown" * 30, b"x", bytes([3]) * 50]
    # A copy truncated on local disk behind the cache's back is not served.
    c = FileCache(cache)
    local = Path(c.path_of(f"{url}/train/f3.bin", storage_options=opts))
    local.write_bytes(b"torn")
    third = VolumeDataset(f"{url}/train", storage_options=opts, cache_dir=cache,
                          shuffle=False, transform=read)
    assert epoch(third)[3] == bytes([3]) * 50
