"""S3 endpoints as users give them: from the environment as well as from storage_options, over
plain http, and wrong. An ``http://`` endpoint works wherever it comes from; a request the
client can never send is a configuration error at once; a refused connection is named as
such, with the endpoint and a fix, in bounded time and without credentials."""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import pytest

from dcp_volumes import CheckpointManager
from dcp_volumes._exceptions import ConfigurationError, VolumeError
from dcp_volumes._volume import Volume
from testkit.emulators import MotoServer
from testkit.ports import free_port
from testkit.states import differences, empty_state, state_for
from tests.test_cli import run_cli

pytestmark = pytest.mark.emulator

_SECRET = "SuperSecretValue123"
_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")


def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No endpoint, options or retry count from the environment running the tests."""
    for name in (*_ENDPOINT_VARIABLES, "DCP_VOLUMES_STORAGE_OPTIONS", "DCP_VOLUMES_MAX_RETRIES",
                 "DCP_VOLUMES_BACKEND", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)


def _use_environment(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    _clean_environment(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _everything_said(exc: BaseException) -> str:
    """The error's message and the whole chained traceback a user would see."""
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_an_http_endpoint_from_the_environment_saves_lists_and_loads(
    variable: str,
    moto_server: MotoServer,
    s3_bucket: tuple[str, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _ = s3_bucket
    env = moto_server.env()
    env[variable] = env.pop("AWS_ENDPOINT_URL")
    _use_environment(monkeypatch, env)  # credentials, region and endpoint: no options at all
    root = f"{url}/run"
    with CheckpointManager(root, keep_last=2) as mgr:
        mgr.save(3, state_for(3))
        mgr.wait()
    listed = run_cli("ls", root, subprocess_=True)  # as the user ran it: a fresh process
    assert listed.returncode == 0, listed.stderr
    assert "3" in listed.stdout
    assert "transient" not in listed.stderr
    got = empty_state()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(got) == 3
    assert differences(got, state_for(3)) == []


def test_the_s3_variable_wins_over_the_general_one(
    moto_server: MotoServer, s3_bucket: tuple[str, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _ = s3_bucket
    env = moto_server.env()
    env["AWS_ENDPOINT_URL_S3"] = env["AWS_ENDPOINT_URL"]
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    _use_environment(monkeypatch, env)
    vol = Volume(f"{url}/run")
    vol.publish("x", b"hello")
    assert vol.read_bytes("x") == b"hello"


def test_a_request_that_can_never_be_sent_is_a_configuration_error_at_once(
    moto_server: MotoServer, s3_bucket: tuple[str, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    url, _ = s3_bucket
    _use_environment(monkeypatch, moto_server.env())
    # Plain http switched off for an http:// endpoint: the client cannot build the request.
    vol = Volume(f"{url}/run", storage_options={"secret": _SECRET, "key": "AKIDEXAMPLE",
                                                "client_options": {"allow_http": False}})
    caplog.set_level(logging.WARNING, logger="dcp_volumes")
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as err:
        vol.check_root()
    took = time.monotonic() - started
    print(f"\n[endpoints] an unsendable request failed in {took:.3f}s: {err.value}")
    assert took < 0.5
    assert not [r for r in caplog.records if "transient" in r.getMessage()]  # never retried
    message = str(err.value)
    assert moto_server.endpoint in message
    assert "Fix:" in message and "allow_http" in message
    assert _SECRET not in _everything_said(err.value)


@pytest.mark.parametrize("source", ["storage_options", "AWS_ENDPOINT_URL"])
def test_a_refused_connection_is_named_with_its_endpoint_and_a_fix_in_bounded_time(
    source: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    _clean_environment(monkeypatch)  # default retries
    endpoint = f"http://127.0.0.1:{free_port()}"  # free a moment ago: nothing listens
    options: dict[str, Any] = {"key": "AKIDEXAMPLE", "secret": _SECRET}
    if source == "storage_options":
        options["endpoint_url"] = endpoint
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    vol = Volume("s3://some-bucket/run", storage_options=options)
    caplog.set_level(logging.WARNING, logger="dcp_volumes")
    started = time.monotonic()
    with pytest.raises(VolumeError) as err:
        vol.check_root()
    took = time.monotonic() - started
    print(f"\n[endpoints] a refused connection failed in {took:.2f}s: {err.value}")
    message = str(err.value)
    assert f"connection refused at {endpoint}" in message
    assert "Fix:" in message
    if source != "storage_options":
        assert source in message  # where to correct it
    assert took < 3.0
    assert not [r for r in caplog.records if "transient" in r.getMessage()]  # one layer retries
    assert _SECRET not in _everything_said(err.value)


def test_the_cli_names_a_refused_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_environment(monkeypatch)
    endpoint = f"http://127.0.0.1:{free_port()}"
    options = {"key": "AKIDEXAMPLE", "secret": _SECRET, "endpoint_url": endpoint}
    res = run_cli("ls", "s3://some-bucket/run", options=options)
    assert res.returncode != 0
    assert f"connection refused at {endpoint}" in res.stderr
    assert "Fix:" in res.stderr
    assert _SECRET not in res.stdout + res.stderr
