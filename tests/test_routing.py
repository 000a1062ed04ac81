"""Routing: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` reach VolumeWriter/VolumeReader
for routed URL prefixes, and stock DCP for everything else; on, off, config from env or file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_loader as dcp_loader
import torch.distributed.checkpoint.state_dict_saver as dcp_saver

import dcp_volumes
from dcp_volumes import (
    CheckpointCorruptError,
    CheckpointExistsError,
    ConfigurationError,
    VolumeReader,
    VolumeWriter,
)
from dcp_volumes.checkpoint._layout import MANIFEST_NAME, METADATA_NAME
from dcp_volumes.checkpoint._routing import TARGETS
from testkit.proxy import LatencyProxy
from testkit.states import seeded_state
from tests.checkpoint_helpers import assert_same, blank_like, failure_of, join

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
STOCK = {(m, n): getattr(sys.modules[m], n) for m, n, _ in TARGETS}


def _state(seed: int = 0) -> dict[str, Any]:
    return seeded_state(seed, {"w": (64, 8)}, b=torch.arange(10) + seed, step=seed)


@pytest.fixture(autouse=True)
def _clean_routing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("DCP_VOLUMES_ROUTE", "DCP_VOLUMES_ROUTE_CONFIG", "DCP_VOLUMES_STORAGE_OPTIONS"):
        monkeypatch.delenv(name, raising=False)
    yield
    dcp_volumes.unroute()
    for (module, name), original in STOCK.items():
        assert getattr(sys.modules[module], name) is original, f"{module}.{name} not restored"


def _managed(path: Path | str) -> bool:
    """Written by VolumeWriter (a manifest beside .metadata), not by a stock writer."""
    return os.path.exists(os.path.join(path, METADATA_NAME)) and os.path.exists(
        os.path.join(path, MANIFEST_NAME)
    )


def test_routed_save_and_load_use_volume_classes(tmp_path: Path) -> None:
    state = _state(1)
    ckpt = tmp_path / "routed" / "step-1"
    with dcp_volumes.route([str(tmp_path / "routed")], reader_options={"verify": True}):
        for module, name, _ in TARGETS:
            assert getattr(sys.modules[module], name) is not STOCK[(module, name)]
        dcp.save(state, checkpoint_id=str(ckpt))
        assert _managed(ckpt)
        target = blank_like(state)
        dcp.load(target, checkpoint_id=str(ckpt))
        assert_same(target, state)
        # The routed reader has verify=True: a flipped byte (same size) is caught, where
        # stock FileSystemReader would load the changed tensor without a word.
        data = next(ckpt.glob("*.distcp"))
        raw = bytearray(data.read_bytes())
        raw[-10] ^= 0xFF
        data.write_bytes(bytes(raw))
        with pytest.raises(BaseException) as info:
            dcp.load(blank_like(state), checkpoint_id=str(ckpt))
        error = failure_of(info.value)
        assert isinstance(error, CheckpointCorruptError), error
        assert "fails its checksum" in str(error)
    # Off again: the stock reader loads the damaged file.
    dcp.load(blank_like(state), checkpoint_id=str(ckpt))


def test_unrouted_prefix_and_routing_off_go_to_stock_dcp(tmp_path: Path) -> None:
    state = _state(2)
    handle = dcp_volumes.route([str(tmp_path / "fast")])
    dcp.save(state, checkpoint_id=str(tmp_path / "other" / "a"))
    assert not _managed(tmp_path / "other" / "a")
    # A prefix is matched at a path boundary: "fast" does not route "fast2".
    dcp.save(state, checkpoint_id=str(tmp_path / "fast2" / "a"))
    assert not _managed(tmp_path / "fast2" / "a")
    dcp.save(state, checkpoint_id=str(tmp_path / "fast" / "a"))
    assert _managed(tmp_path / "fast" / "a")
    handle.remove()
    assert dcp.save is STOCK[("torch.distributed.checkpoint", "save")]
    dcp.save(state, checkpoint_id=str(tmp_path / "fast" / "b"))
    assert not _managed(tmp_path / "fast" / "b")


def test_explicit_storage_writer_is_never_replaced(tmp_path: Path) -> None:
    with dcp_volumes.route([str(tmp_path)]):
        writer = dcp.FileSystemWriter(str(tmp_path / "x"))
        dcp.save(_state(), checkpoint_id=str(tmp_path / "x"), storage_writer=writer)
        assert not _managed(tmp_path / "x")


def test_reference_taken_before_routing_is_not_affected(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import save as early_save

    with dcp_volumes.route([str(tmp_path)]):
        early_save(_state(), checkpoint_id=str(tmp_path / "early"))
        assert not _managed(tmp_path / "early")
        from torch.distributed.checkpoint import save as late_save
        from torch.distributed.checkpoint.state_dict_saver import save as module_save

        module_save(_state(), checkpoint_id=str(tmp_path / "module"))
        assert _managed(tmp_path / "module")
    # A reference taken while routing was on passes through once it is off.
    late_save(_state(), checkpoint_id=str(tmp_path / "late"))
    assert not _managed(tmp_path / "late")


def test_routed_async_save(tmp_path: Path) -> None:
    state = _state(3)
    ckpt = str(tmp_path / "step-3")
    with dcp_volumes.route([str(tmp_path)]):
        response = dcp.async_save(state, checkpoint_id=ckpt)
        upload = getattr(response, "upload_completion", response)
        upload.result(timeout=60)
        assert _managed(ckpt)
        target = blank_like(state)
        dcp.load(target, checkpoint_id=ckpt)
    assert_same(target, state)


def test_routed_save_overwrites_like_stock(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "latest")
    with dcp_volumes.route([str(tmp_path)]):
        dcp.save(_state(1), checkpoint_id=ckpt)
        dcp.save(_state(2), checkpoint_id=ckpt)
        target = blank_like(_state(2))
        dcp.load(target, checkpoint_id=ckpt)
    assert_same(target, _state(2))
    with dcp_volumes.route([str(tmp_path)], overwrite=False):
        with pytest.raises(BaseException) as info:
            dcp.save(_state(3), checkpoint_id=ckpt)
        assert isinstance(failure_of(info.value), CheckpointExistsError)


def test_longest_prefix_wins_and_options_per_prefix(tmp_path: Path) -> None:
    dcp_volumes.route([str(tmp_path)], upload_concurrency=3)
    dcp_volumes.route({str(tmp_path / "deep"): {"auto_mkdir": True}}, read_concurrency=5)
    table = {r.prefix: r for r in dcp_volumes.active_routes()}
    assert table[str(tmp_path)].upload_concurrency == 3
    deep = table[str(tmp_path / "deep")]
    assert deep.read_concurrency == 5 and dict(deep.storage_options) == {"auto_mkdir": True}
    writer = deep.writer(str(tmp_path / "deep" / "s"))
    assert isinstance(writer, VolumeWriter) and writer.options.overwrite
    writer.close()
    reader = deep.reader(str(tmp_path / "deep" / "s"))
    assert isinstance(reader, VolumeReader) and reader.options.read_concurrency == 5


@pytest.mark.emulator
def test_storage_options_per_prefix_on_s3(moto_server: Any) -> None:
    # Bucket A is reached through a counting proxy, bucket B directly: the proxy sees
    # exactly bucket A's requests, so each prefix used its own storage options.
    a, b = f"route-a-{uuid.uuid4().hex[:8]}", f"route-b-{uuid.uuid4().hex[:8]}"
    url_a, url_b = moto_server.create_bucket(a), moto_server.create_bucket(b)
    try:
        with LatencyProxy.in_front_of(moto_server) as proxy, dcp_volumes.route(
            {url_a + "/": moto_server.storage_options(proxy.endpoint),
             url_b + "/": moto_server.storage_options()}
        ):
            for url in (url_a, url_b):
                dcp.save(_state(4), checkpoint_id=join(url, "step-4"))
                target = blank_like(_state(4))
                dcp.load(target, checkpoint_id=join(url, "step-4"))
                assert_same(target, _state(4))
            seen = {path.split("/")[1] for (_, path) in proxy.requests if path.count("/") >= 1}
        assert a in seen and b not in seen
        for bucket in (a, b):
            listed = moto_server.boto3_client().list_objects_v2(Bucket=bucket)["Contents"]
            keys = {o["Key"] for o in listed}
            assert f"step-4/{MANIFEST_NAME}" in keys and f"step-4/{METADATA_NAME}" in keys
    finally:
        moto_server.reset()


@pytest.mark.emulator
@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_config_from_environment(
    fmt: str,
    moto_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    url = moto_server.create_bucket(f"route-env-{fmt}-{uuid.uuid4().hex[:8]}")
    opts = moto_server.storage_options()
    staging = tmp_path / "staging"
    staging.mkdir()
    doc = {
        "staging_dir": str(staging),
        "upload_concurrency": 2,
        "routes": {url + "/": {"storage_options": opts, "writer_options": {"keep_staging": True}}},
    }
    if fmt == "json":
        config = tmp_path / "routes.json"
        config.write_text(json.dumps(doc))
    else:
        config = tmp_path / "routes.toml"
        endpoint = opts["client_kwargs"]["endpoint_url"]
        config.write_text(
            f'staging_dir = "{staging}"\nupload_concurrency = 2\n'
            f'[routes."{url}/"]\n'
            f'storage_options = {{ key = "{opts["key"]}", secret = "{opts["secret"]}", '
            f'client_kwargs = {{ endpoint_url = "{endpoint}" }} }}\n'
            "writer_options = { keep_staging = true }\n"
        )
    request.addfinalizer(moto_server.reset)
    monkeypatch.setenv("DCP_VOLUMES_ROUTE_CONFIG", str(config))
    monkeypatch.setenv("DCP_VOLUMES_ROUTE", "gs://never-used/")  # the file's prefixes win
    handle = dcp_volumes.route()
    assert [r.prefix for r in handle.routes] == [url + "/"]
    (route,) = handle.routes
    assert route.upload_concurrency == 2 and route.staging_dir == str(staging)
    dcp.save(_state(5), checkpoint_id=join(url, "step-5"))
    # keep_staging from the file: the staged files stay in the configured staging dir.
    assert any(p.suffix == ".distcp" for p in staging.rglob("*"))
    target = blank_like(_state(5))
    dcp.load(target, checkpoint_id=join(url, "step-5"))
    assert_same(target, _state(5))


def test_prefixes_and_storage_options_from_env_vars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCP_VOLUMES_ROUTE", f"{tmp_path / 'a'}, {tmp_path / 'b'}")
    monkeypatch.setenv("DCP_VOLUMES_STORAGE_OPTIONS", '{"auto_mkdir": true}')
    handle = dcp_volumes.route()
    assert [r.prefix for r in handle.routes] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert all(dict(r.storage_options) == {"auto_mkdir": True} for r in handle.routes)
    dcp.save(_state(), checkpoint_id=str(tmp_path / "b" / "s"))
    assert _managed(tmp_path / "b" / "s")


@pytest.mark.parametrize(
    ("kwargs", "text", "match"),
    [
        ({}, None, "no URL prefix to route"),
        ({"prefixes": []}, None, "empty list"),
        ({"prefixes": ["s3://b/"], "upload_concurrency": 0}, None, "must be an integer >= 1"),
        ({"prefixes": ["s3://b/"], "writer_options": {"partsize": 1}}, None, "does not take"),
        ({"prefixes": ["s3://b/"], "writer_options": {"overwrite": True}}, None, "sets itself"),
        ({"prefixes": None}, "stagingdir = 1\n", "unknown key"),
        ({"prefixes": None}, "staging_dir = [", "not valid TOML"),
        ({"prefixes": None}, '[routes."s3://b/"]\nconcurrency = 1\n', "unknown key"),
    ],
)
def test_configuration_errors(
    kwargs: dict[str, Any], text: str | None, match: str, tmp_path: Path
) -> None:
    if text is not None:
        config = tmp_path / "r.toml"
        config.write_text(text)
        kwargs = {**kwargs, "config": config}
    with pytest.raises(ConfigurationError, match=match):
        dcp_volumes.route(**kwargs)
    assert dcp_volumes.active_routes() == ()
    assert dcp.save is STOCK[("torch.distributed.checkpoint", "save")]


def test_unroute_leaves_a_later_wrapper_in_place(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dcp_volumes.route([str(tmp_path)])
    ours = dcp.save
    calls = []

    def theirs(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("checkpoint_id"))
        return ours(*args, **kwargs)

    dcp.save = theirs
    try:
        dcp_volumes.unroute()
        assert dcp.save is theirs
        assert "replaced by someone else" in caplog.text
        assert dcp_saver.save is STOCK[("torch.distributed.checkpoint.state_dict_saver", "save")]
        assert dcp_loader.load is STOCK[("torch.distributed.checkpoint.state_dict_loader", "load")]
        dcp.save(_state(), checkpoint_id=str(tmp_path / "after"))
        assert calls == [str(tmp_path / "after")]
        assert not _managed(tmp_path / "after")  # ours passes through: routing is off
        # Routing again reuses our wrapper under theirs.
        dcp_volumes.route([str(tmp_path)])
        dcp.save(_state(), checkpoint_id=str(tmp_path / "again"))
        assert _managed(tmp_path / "again")
        dcp_volumes.unroute()
    finally:
        dcp.save = STOCK[("torch.distributed.checkpoint", "save")]
    # They put the stock function back: routing again wraps it again (it used to
    # skip the name, still noted as wrapped, and every later dcp.save went to stock DCP).
    with dcp_volumes.route([str(tmp_path)]):
        dcp.save(_state(), checkpoint_id=str(tmp_path / "restored"))
    assert _managed(tmp_path / "restored")


def test_runner_routes_an_unchanged_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "dcp.save({'w': torch.ones(3)}, checkpoint_id=sys.argv[1])\n"
        "t = {'w': torch.zeros(3)}\n"
        "dcp.load(t, checkpoint_id=sys.argv[1])\n"
        "assert t['w'].sum().item() == 3\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "DCP_VOLUMES_ROUTE": str(tmp_path / "ckpt")}
    run = [sys.executable, "-m", "dcp_volumes.run", str(script)]
    subprocess.run([*run, str(tmp_path / "ckpt" / "s1")], env=env, check=True, timeout=120)
    assert _managed(tmp_path / "ckpt" / "s1")
    subprocess.run([*run, str(tmp_path / "plain" / "s1")], env=env, check=True, timeout=120)
    assert not _managed(tmp_path / "plain" / "s1")
    # -m MODULE, with the prefix from --route instead of the environment.
    (tmp_path / "trainmod.py").write_text(script.read_text())
    env = {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    del env["DCP_VOLUMES_ROUTE"]
    subprocess.run([sys.executable, "-m", "dcp_volumes.run", "--route", str(tmp_path / "m"),
                    "-m", "trainmod", str(tmp_path / "m" / "s1")], env=env, check=True,
                   timeout=120)
    assert _managed(tmp_path / "m" / "s1")
