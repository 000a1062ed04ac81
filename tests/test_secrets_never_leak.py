"""Credentials never appear in exceptions, reprs, logs or CLI output.

A recognisable fake secret goes into ``storage_options`` (S3 key/secret/token,
Azure account_key/sas_token/connection_string) and into URLs (``user:pass@``,
``?sig=`` query strings), then every error path runs: missing bucket, missing
file, refused credentials (moto checking signatures), an unreachable endpoint
(retried: warnings logged), a bad option, a corrupt checkpoint, the CLI. Each
case collects the str and repr of the error, of everything it chains (causes,
contexts, DCP's per-rank failures), the formatted traceback, every log record
at DEBUG, and the repr of the objects involved; the secret must be in none.
"""

from __future__ import annotations

import json
import logging
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_volumes
from dcp_volumes import (
    CheckpointInfo,
    CheckpointManager,
    DataLoader,
    FileCache,
    Route,
    Routing,
    VolumeDataset,
    VolumeReader,
    VolumeWriter,
    ZstdCompression,
)
from dcp_volumes._volume import RetryPolicy, Volume
from testkit.emulators import MotoServer
from testkit.states import load_into
from tests.test_cli import run_cli
from tests.test_data_support import write_samples

pytestmark = [pytest.mark.emulator, pytest.mark.filterwarnings("ignore::UserWarning")]

SECRET = "LEAKME" + uuid.uuid4().hex  # recognisable, and in no real message by chance
FAST = RetryPolicy(attempts=2, base_delay_s=0.0, max_delay_s=0.0)
CLOSED = "http://127.0.0.1:9"  # nothing listens: connection refused, retried


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and everything it carries: causes, contexts, DCP's per-rank failures."""
    todo, seen = [exc], set()
    while todo:
        cur = todo.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        todo += [e for e in (cur.__cause__, cur.__context__) if e is not None]
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            for wrapped in failures.values():
                inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
                if isinstance(inner, BaseException):
                    todo.append(inner)


def _texts(exc: BaseException) -> list[str]:
    out = ["".join(traceback.format_exception(exc))]
    for e in _chain(exc):
        out += [str(e), repr(e), repr(e.args)]
    return out


# fsspec's HTTP filesystem logs every URL it is given at DEBUG, signed query included:
# its logger, not ours (see the module's note); every other logger is checked.
_THIRD_PARTY_URL_LOGGERS = ("fsspec.http",)


def _log_texts(caplog: pytest.LogCaptureFixture) -> list[str]:
    out = []
    for r in caplog.records:
        if r.name.startswith(_THIRD_PARTY_URL_LOGGERS):
            continue
        out.append(r.getMessage())
        if r.exc_info and r.exc_info[1] is not None:
            out += _texts(r.exc_info[1])
    return out


def _assert_hidden(texts: list[str], where: str) -> None:
    for text in texts:
        assert SECRET not in text, f"the secret leaked in {where}: ...{_around(text)}..."


def _around(text: str) -> str:
    i = text.find(SECRET)
    return text[max(0, i - 200): i + 60]


@pytest.fixture(scope="module")
def moto_auth() -> Iterator[MotoServer]:
    """A moto server that checks signatures (the shared one accepts any key)."""
    server = MotoServer(mode="process", auth_after=0).start()
    yield server
    server.stop()


def _s3_opts(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"key": "AKIAIOSFODNN7EXAMPLE", "secret": SECRET,
            "client_kwargs": {"endpoint_url": endpoint}, **extra}


def _state() -> dict[str, Any]:
    return {"w": torch.arange(16.0), "s": 1}


def _save(url: str, opts: dict[str, Any], tmp: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), no_dist=True, storage_writer=VolumeWriter(
            url, storage_options=opts, staging_dir=tmp, retry=FAST))


def _dcp_load(url: str, opts: dict[str, Any], tmp: Path) -> None:
    load_into({"w": torch.zeros(16), "s": 0}, url, opts, retry=FAST)


def _restore(url: str, opts: dict[str, Any], tmp: Path) -> None:
    with CheckpointManager(url, storage_options=opts, staging_dir=tmp, retry=FAST) as mgr:
        mgr.restore(_state())


def _manager_save(url: str, opts: dict[str, Any], tmp: Path) -> None:
    with CheckpointManager(url, storage_options=opts, staging_dir=tmp, retry=FAST,
                           async_save=False) as mgr:
        mgr.save(1, _state())


def _dataset(url: str, opts: dict[str, Any], tmp: Path) -> None:
    ds = VolumeDataset(url, storage_options=opts, cache_dir=tmp / "cache", shuffle=False)
    list(iter(ds))


def _fetch(url: str, opts: dict[str, Any], tmp: Path) -> None:
    FileCache(tmp / "cache").fetch(f"{url.rstrip('/')}/no-such-file.bin", storage_options=opts)


def _routed_save(url: str, opts: dict[str, Any], tmp: Path) -> None:
    # route() logs its prefixes and each routed call: they must not show the secret either.
    with dcp_volumes.route([url], storage_options=opts, staging_dir=tmp,
                           writer_options={"retry": FAST}), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), checkpoint_id=url, no_dist=True)


OPERATIONS: dict[str, Callable[[str, dict[str, Any], Path], None]] = {
    "save": _save, "load": _dcp_load, "restore": _restore, "manager save": _manager_save,
    "dataset": _dataset, "cache fetch": _fetch, "routed save": _routed_save,
}

# (case, how to build (url, storage_options) from the fixtures).
CASES = {
    "missing bucket": lambda s: ("s3://no-such-bucket-here/run", _s3_opts(s["moto"])),
    "missing file": lambda s: (s["bucket"] + "/empty/prefix", _s3_opts(s["moto"])),
    "refused credentials": lambda s: ("s3://locked/run", _s3_opts(s["auth"])),
    "session token refused": lambda s: ("s3://locked/run", {
        **_s3_opts(s["auth"]), "secret": "wrong", "token": SECRET}),
    "unreachable endpoint": lambda s: ("s3://bucket/run", _s3_opts(CLOSED)),
    "bad option": lambda s: ("s3://bucket/run", _s3_opts(s["moto"], no_such_option=SECRET)),
    "secret in URL userinfo": lambda s: (
        f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@{s['bucket'][5:]}/run",
        {"client_kwargs": {"endpoint_url": s["moto"]}}),
    "sig in URL query": lambda s: (
        f"{s['bucket']}/run?X-Amz-Signature={SECRET}&sig={SECRET}", _s3_opts(s["moto"])),
    "azure account_key": lambda s: ("az://container/run", {
        "account_name": "devstoreaccount1", "account_key": SECRET,
        "client_kwargs": {"endpoint_url": CLOSED}}),
    "azure sas_token": lambda s: ("az://container/run", {
        "account_name": "devstoreaccount1", "sas_token": f"sv=2022-11-02&sig={SECRET}",
        "connection_string": f"BlobEndpoint={CLOSED}/devstoreaccount1;"
                             f"SharedAccessSignature=sv=2022-11-02&sig={SECRET}"}),
    "https signed URL": lambda s: (f"{CLOSED}/data/run?sv=2022&sig={SECRET}", {}),
}


@pytest.fixture
def servers(moto_server: MotoServer, moto_auth: MotoServer,
            s3_bucket: tuple[str, dict[str, Any]]) -> dict[str, str]:
    return {"moto": moto_server.endpoint, "auth": moto_auth.endpoint, "bucket": s3_bucket[0]}


@pytest.mark.parametrize("op", list(OPERATIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_no_error_path_prints_the_secret(
    servers: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture,
    case: str, op: str,
) -> None:
    url, opts = CASES[case](servers)
    caught: BaseException | None = None
    with caplog.at_level(logging.DEBUG):
        try:
            OPERATIONS[op](url, opts, tmp_path)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            caught = exc
    if caught is not None and isinstance(caught, (KeyboardInterrupt, SystemExit)):
        raise caught
    _assert_hidden(_log_texts(caplog), f"the logs of {op} ({case})")
    if caught is None:  # saving to (or restoring from) an empty prefix is no error
        assert case == "missing file" and op != "load", f"{op} ({case}) did not fail"
        return
    _assert_hidden(_texts(caught), f"the error of {op} ({case})")


@pytest.mark.parametrize("case", list(CASES))
def test_reprs_never_show_the_secret(servers: dict[str, str], tmp_path: Path,
                                     case: str) -> None:
    url, opts = CASES[case](servers)
    objects: list[Any] = []
    for make in (lambda: Volume(url, storage_options=opts),
                 lambda: VolumeWriter(url, storage_options=opts, staging_dir=tmp_path),
                 lambda: VolumeReader(url, storage_options=opts),
                 lambda: CheckpointManager(url, storage_options=opts, staging_dir=tmp_path,
                                           retry=FAST),
                 lambda: CheckpointInfo(step=1, url=url, complete=True)):
        try:
            objects.append(make())
        except Exception as exc:  # refused at construction: then the error must hide it
            _assert_hidden(_texts(exc), f"constructing for {case}")
    # Routing: what route() and active_routes() return (a Route is a dataclass whose
    # default repr printed storage_options whole).
    with dcp_volumes.route([url], storage_options=opts) as routing:
        objects += [routing, *routing.routes, dcp_volumes.active_routes()]
    with dcp_volumes.route({url: opts}) as routing:
        objects += [routing, *routing.routes, dcp_volumes.active_routes()]
    for obj in objects:
        texts = [repr(obj), str(obj)]
        for attr in ("checkpoint_id", "display_url"):
            if hasattr(obj, attr):
                texts.append(str(getattr(obj, attr)))
        _assert_hidden(texts, f"repr of {type(obj).__name__} ({case})")


def test_a_corrupt_checkpoint_on_s3_never_prints_the_secret(
    moto_server: MotoServer, s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, good = s3_bucket
    # The shared moto accepts any key pair: the secret is used for real here.
    opts = {**good, "secret": SECRET}
    _save(f"{url}/step-00000001", opts, tmp_path)
    vol = Volume(f"{url}/step-00000001", storage_options=opts)
    vol.publish(".metadata", b"garbage")
    shard = next(f.path for f in vol.list() if f.path.endswith(".distcp"))
    vol.publish(shard, b"short")
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(BaseException) as err:
            _dcp_load(f"{url}/step-00000001", opts, tmp_path)
        _assert_hidden(_texts(err.value), "a load of a corrupt checkpoint")
        with CheckpointManager(url, storage_options=opts, staging_dir=tmp_path) as mgr:
            assert mgr.restore(_state()) is None  # not complete: skipped, with a warning
            with pytest.raises(BaseException) as err:
                mgr.restore(_state(), step=1)
        _assert_hidden(_texts(err.value), "a restore of a corrupt checkpoint")
    _assert_hidden(_log_texts(caplog), "the logs of a corrupt load")


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "gc"])
@pytest.mark.parametrize("case", ["missing bucket", "refused credentials",
                                  "secret in URL userinfo", "sig in URL query",
                                  "unreachable endpoint", "corrupt"])
def test_cli_output_never_shows_the_secret(
    servers: dict[str, str], tmp_path: Path, command: str, case: str,
) -> None:
    if case == "corrupt":
        url = servers["bucket"] + "/step-00000001"
        opts = _s3_opts(servers["moto"])
        _save(url, opts, tmp_path)
        Volume(url, storage_options=opts).publish(".metadata", b"garbage")
    else:
        url, opts = CASES[case](servers)
    args = [command, url, "--verbose", "--no-progress"]
    if command == "gc":
        args += ["--keep-last", "1", "--dry-run"]
    in_options = run_cli(*args, options=opts)
    assert in_options.returncode != 0 or command in ("ls", "gc"), in_options
    _assert_hidden([in_options.stdout, in_options.stderr], f"`dcp-volumes {command}` ({case})")
    # Through the environment, as a user would set it once.
    via_env = run_cli(*args[:2], "--no-progress", *args[4:], options=opts, subprocess_=True)
    _assert_hidden([via_env.stdout, via_env.stderr],
                   f"`dcp-volumes {command}` via the environment ({case})")


def test_bad_storage_options_json_never_echoes_it(tmp_path: Path) -> None:
    text = json.dumps({"secret": SECRET})[:-1]  # broken JSON holding a secret
    res = run_cli("ls", str(tmp_path), "--storage-options", text)
    assert res.returncode != 0
    _assert_hidden([res.stdout, res.stderr], "the CLI's bad-JSON error")


# Every public type that holds storage options (or a URL that may carry a secret), as a
# user builds it: a guard below makes a new public type join this list.
HOLDERS = {"CheckpointInfo", "CheckpointManager", "DataLoader", "Encryption", "FileCache",
           "Route", "Routing", "VolumeDataset", "VolumeReader", "VolumeWriter",
           "SafetensorsReader", "SafetensorsWriter"}
# Public types that hold neither.
NO_OPTIONS = {"RetryPolicy", "ZstdCompression",
              # its root is the redacted display URL (tests/test_goodput_torchrun.py reads
              # the records themselves for credentials)
              "GoodputReport"}


def test_every_public_type_is_checked_below() -> None:
    types = {name for name in dcp_volumes.__all__
             if isinstance(getattr(dcp_volumes, name), type)
             and not issubclass(getattr(dcp_volumes, name), BaseException)}
    assert types == HOLDERS | NO_OPTIONS, "add the new public type to HOLDERS or NO_OPTIONS"


def test_no_public_object_shows_the_secret(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    bucket, good = s3_bucket
    # The shared moto accepts any key pair: every object below really uses the secret.
    opts = {**good, "secret": SECRET, "token": SECRET}
    write_samples(f"{bucket}/train", opts, 4)
    objects: dict[str, list[Any]] = {name: [] for name in HOLDERS | NO_OPTIONS}
    with caplog.at_level(logging.DEBUG):
        with CheckpointManager(f"{bucket}/run", storage_options=opts, staging_dir=tmp_path,
                               async_save=False) as mgr:
            mgr.save(1, _state())
            objects["CheckpointManager"].append(mgr)
            objects["CheckpointInfo"] += mgr.list()
            objects["GoodputReport"].append(mgr.goodput())
        objects["GoodputReport"].append(
            dcp_volumes.goodput_report(f"{bucket}/run", storage_options=opts))
        signed = f"{bucket}/run/step-00000001?X-Amz-Signature={SECRET}"
        objects["CheckpointInfo"].append(CheckpointInfo(step=1, url=signed, complete=True))
        objects["VolumeWriter"].append(VolumeWriter(f"{bucket}/w", storage_options=opts,
                                                    staging_dir=tmp_path))
        objects["VolumeReader"].append(VolumeReader(f"{bucket}/run/step-00000001",
                                                    storage_options=opts))
        objects["SafetensorsWriter"].append(dcp_volumes.SafetensorsWriter(
            f"{bucket}/hf", storage_options=opts, staging_dir=tmp_path))
        objects["SafetensorsReader"].append(dcp_volumes.SafetensorsReader(
            f"{bucket}/hf", storage_options=opts))
        ds = VolumeDataset(f"{bucket}/train", storage_options=opts,
                           cache_dir=tmp_path / "cache", shuffle=False)
        loader = DataLoader(ds, batch_size=2, num_workers=0)
        assert len(list(loader)) == 2
        objects["VolumeDataset"].append(ds)
        objects["DataLoader"].append(loader)
        cache = FileCache(tmp_path / "cache2")
        first = Volume(f"{bucket}/train", storage_options=opts).list()[0].path
        cache.fetch(f"{bucket}/train/{first}", storage_options=opts)
        objects["FileCache"].append(cache)
        with dcp_volumes.route([f"{bucket}/routed/"], storage_options=opts) as routing:
            objects["Routing"].append(routing)
            objects["Route"] += [*routing.routes, dcp_volumes.active_routes()]
        objects["RetryPolicy"].append(FAST)
        objects["ZstdCompression"].append(ZstdCompression())
        # A key made of the secret's text: its repr must not show it (tests/test_encryption).
        key = SECRET.encode()[:32].ljust(32, b"k")
        objects["Encryption"].append(dcp_volumes.Encryption(key=key, key_id="k"))
    for name, found in objects.items():
        assert found, f"no {name} was built"
        for obj in found:
            _assert_hidden([repr(obj), str(obj)], f"the repr of {name}")
    _assert_hidden(_log_texts(caplog), "the logs of building the public objects")
    route = objects["Route"][0]
    assert isinstance(route, Route) and isinstance(objects["Routing"][0], Routing)
    assert "'secret': '***'" in repr(route)  # hidden, yet the key is there to see
