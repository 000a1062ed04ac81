"""Each backend maps its client's errors to the neutral kinds; retries read only those.

The retry layer once matched class-name strings of five client stacks and
regexes over messages; now a backend maps its own client's exceptions (by type
and structured attributes) at its boundary; ``_retry`` decides retry or final
and ``_errors.translate_error`` picks the ``dcp_volumes`` error, from the kind alone. The emulator
suites (test_volume, test_faults, test_endpoints...) check the mapping end to
end; these check the seam itself.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap

import pytest

from dcp_volumes import BucketNotFoundError, VolumeError, VolumeNotFoundError
from dcp_volumes._volume import RetryPolicy
from dcp_volumes._volume._errors import (
    AccessDenied,
    BucketNotFound,
    ConnectionFailed,
    NotFound,
    ServerError,
    Throttled,
    UploadGone,
)
from dcp_volumes._volume._retry import call_with_retries

NO_WAIT = RetryPolicy(attempts=3, base_delay_s=0.0, max_delay_s=0.0)


def _run(error: BaseException) -> tuple[int, BaseException]:
    """How often a call failing with ``error`` was tried, and what it raised in the end."""
    tries = []

    def fail() -> None:
        tries.append(1)
        raise error

    with pytest.raises(Exception) as raised:
        call_with_retries(fail, policy=NO_WAIT, op="read", where=lambda: "s3://b/k",
                          scrub=lambda text: text)
    return len(tries), raised.value


def test_a_client_error_is_classified_by_its_kind_never_by_its_name_or_text() -> None:
    """An error that reached the retry layer unmapped is final, whatever its class is called
    or its message says (the old layer retried a class named like botocore's, and read
    statuses out of text); the same failure as a neutral kind is retried."""

    class EndpointConnectionError(Exception):  # botocore's name, not botocore's type
        pass

    tries, final = _run(EndpointConnectionError("status code: 503 <Code>SlowDown</Code>"))
    assert tries == 1
    assert type(final) is VolumeError and "EndpointConnectionError" in str(final)

    for transient in (Throttled("SlowDown"), ServerError("503"), ConnectionFailed("reset")):
        tries, final = _run(transient)
        assert tries == NO_WAIT.attempts, transient
        assert type(final) is VolumeError and final.__cause__ is transient

    tries, final = _run(ConnectionFailed("refused, after the client's own retries",
                                         explained=True, transient=False))
    assert tries == 1 and "after the client's own retries" in str(final)

    tries, final = _run(BucketNotFound("no bucket"))
    assert tries == 1 and isinstance(final, BucketNotFoundError)


def test_fsspec_maps_botocore_errors_by_their_structured_codes() -> None:
    """s3fs raises an ``OSError`` whose cause is botocore's ``ClientError``: the code in its
    ``response`` decides, not the text."""
    from botocore.exceptions import ClientError, EndpointConnectionError

    from dcp_volumes._volume._fsspec import _neutral

    def wrapped(code: str, status: int) -> OSError:
        client = ClientError({"Error": {"Code": code, "Message": "no text is read"},
                              "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
        error = OSError(errno.EIO, "an I/O error")
        error.__cause__ = client
        return error

    assert isinstance(_neutral(wrapped("SlowDown", 503)), Throttled)
    assert isinstance(_neutral(wrapped("NoSuchBucket", 404)), BucketNotFound)
    assert isinstance(_neutral(wrapped("AccessDenied", 403)), AccessDenied)
    assert isinstance(_neutral(EndpointConnectionError(endpoint_url="http://127.0.0.1:9")),
                      ConnectionFailed)
    assert isinstance(_neutral(FileNotFoundError("k")), NotFound)
    assert _neutral(ValueError("status code: 503")) is None  # unknown: final, as raised


def test_obstore_maps_a_vanished_multipart_upload_to_a_transient_kind_not_a_missing_bucket(
) -> None:
    """A completion whose answer was lost, retried by the client, finds no such upload; the
    client's abort then raises "not found" (a ``FileNotFoundError``). That is neither the
    object nor the bucket missing: the volume sends the object again."""
    from dcp_volumes._volume._obstore import ObstoreBackend
    from dcp_volumes._volume._obstore_options import StoreSettings

    backend = ObstoreBackend("s3", StoreSettings())
    body = ('<?xml version="1.0" encoding="utf-8"?>\n<Error><Code>NoSuchUpload</Code><Message>'
            "The specified upload does not exist.</Message></Error>")
    # obstore's text (its Debug source abridged): the one client whose errors carry no codes.
    lost = FileNotFoundError(
        "Object at location k not found: Error performing DELETE http://127.0.0.1:9/b/k?"
        "uploadId=x in 3ms - Server returned non-2xx status code: 404 Not Found: " + body)
    kind = backend._neutral(lost)
    assert isinstance(kind, UploadGone) and kind.transient and kind.code == "NoSuchUpload"
    tries, final = _run(kind)
    assert tries == NO_WAIT.attempts
    assert type(final) is VolumeError and "multipart upload" in str(final)
    assert isinstance(backend._neutral(FileNotFoundError("Object at location k not found")),
                      NotFound)


def test_the_local_backend_maps_os_errors(tmp_path) -> None:
    from dcp_volumes._volume._local import LocalBackend

    with pytest.raises(NotFound) as err:
        LocalBackend().head(str(tmp_path / "absent"))
    assert isinstance(err.value.__cause__, FileNotFoundError)  # the original stays chained


def test_missing_local_file_is_still_volume_not_found(tmp_path) -> None:
    from dcp_volumes._volume import Volume

    with pytest.raises(VolumeNotFoundError, match="not found"):
        Volume(str(tmp_path)).read_bytes("absent")
    (tmp_path / "d").mkdir()
    with pytest.raises(VolumeNotFoundError, match="is a directory/prefix, not a file"):
        Volume(str(tmp_path)).info("d")


def test_each_backend_imports_and_maps_without_the_other_clients() -> None:
    """A backend's module imports, and maps errors, with no other client installed: the
    client libraries are looked for only once loaded."""
    code = textwrap.dedent(
        """
        import sys
        for name in ("botocore", "aiobotocore", "aiohttp", "azure", "gcsfs", "s3fs", "adlfs",
                     "urllib3"):
            sys.modules[name] = None  # import fails, as if not installed
        from dcp_volumes._volume import _fsspec, _local, _obstore
        from dcp_volumes._volume._errors import ConnectionFailed
        assert isinstance(_fsspec._neutral(ConnectionResetError()), ConnectionFailed)
        assert _fsspec._neutral(ValueError("x")) is None
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr
