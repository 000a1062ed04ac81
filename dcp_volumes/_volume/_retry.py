"""Retries and error translation for volume calls, in one place.

Transient failures (throttling, 5xx, resets, timeouts) are retried with
exponential backoff and full jitter; everything else, and the last transient
failure, becomes a ``dcp_volumes`` exception. Classification reads error codes
and types, never message text, and messages never carry credentials.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from dcp_volumes._exceptions import (
    BucketNotFoundError,
    ConfigurationError,
    DcpVolumesError,
    VolumeAccessError,
    VolumeError,
    VolumeExistsError,
    VolumeNotFoundError,
)

logger = logging.getLogger("dcp_volumes._volume")

T = TypeVar("T")

# storage_options keys whose values are secrets and must never reach a message or log.
_SECRET_KEYS = (
    "key",
    "secret",
    "token",
    "password",
    "account_key",
    "connection_string",
    "sas_token",
    "credential",
    "client_secret",
    "aws_secret_access_key",
    "aws_session_token",
    "secret_access_key",  # obstore's names
    "session_token",
    "sas_key",
    "bearer_token",
)
# Error codes (HTTP status or service code) that mean "try again later".
_TRANSIENT_CODES = frozenset(
    {
        "408",
        "429",
        "500",
        "502",
        "503",
        "504",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "ServerBusy",
        "OperationTimedOut",
    }
)
_ACCESS_CODES = frozenset(
    {
        "401",
        "403",
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "ExpiredToken",
        "InvalidToken",
    }
)
_CREDENTIAL_ERRORS = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "ClientAuthenticationError",
        "PermissionDeniedError",  # obstore
        "UnauthenticatedError",  # obstore
    }
)
# obstore's typed errors (it retried transient ones itself before raising them).
_OBSTORE_EXISTS = frozenset({"AlreadyExistsError", "PreconditionError"})
_OBSTORE_CONFIG = frozenset({"UnknownConfigurationKeyError", "InvalidPathError"})
# Raised by obstore for a key it cannot address: one with ".", ".." or empty segments.
_OBSTORE_BAD_KEY = "InvalidPathError"
_MISSING_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound", "BucketNotFound"})
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound", "BlobNotFound"})
_EXISTS_CODES = frozenset({"412", "PreconditionFailed", "BlobAlreadyExists", "ConditionNotMet"})
# How object_store's error text gives a status the server answered with (its
# untyped errors carry no status otherwise).
_STATUS_IN_TEXT = re.compile(r"status code: (\d{3})\b")


def answered_status(exc: BaseException) -> int | None:
    """The HTTP status that obstore's untyped error says the server answered, if any."""
    found = _STATUS_IN_TEXT.search(str(exc))
    return int(found.group(1)) if found else None
_TRANSIENT_ERRNOS = frozenset(
    {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT}
)


class FinalBackendError(Exception):
    """A backend's failure that its client has already dealt with as far as it should.

    Raised by a backend (from its client's error) for a request the client
    retried itself and gave up on, or one it can never send. The retry layer
    never retries it again (two layers of retries would multiply the wait);
    its message says what happened, and how to fix it.
    """


class EndpointUnreachableError(FinalBackendError, ConnectionError):
    """The store's endpoint refused or never took the connection, through the client's
    own retries. Becomes a ``VolumeError``."""


class UnsendableRequestError(FinalBackendError, ValueError):
    """The client cannot build the request from its settings (it is never sent: an
    ``http://`` endpoint with plain http switched off, a malformed URL or header).
    Becomes a ``ConfigurationError``."""


# How long a store's answers may lag its writes: some S3-compatible servers,
# caching gateways and NFS attribute caches list (or even find) an object only
# a moment after it was written. A file missing from a listing, or not found
# although a manifest or listing says it exists, is looked for again after
# each of these waits before it is called missing (about 4 s in all).
LAG_DELAYS_S = (0.25, 0.5, 1.0, 2.0)
LAG_TOTAL_S = sum(LAG_DELAYS_S)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry transient errors.

    Attributes:
        attempts: tries per request, the first included.
        base_delay_s, max_delay_s: exponential backoff between tries (full jitter).
        timeout_s: a request with no complete answer after this long (a hung
            server, a stalled proxy) is abandoned and tried again. Applies to
            S3 and Azure (obstore's client; ``storage_options={"timeout": ...}``
            overrides it); ``None``: the client's default (30 s). fsspec clients
            take their own timeout options in ``storage_options``.
    """

    attempts: int = 5
    base_delay_s: float = 0.1
    max_delay_s: float = 8.0
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigurationError(f"RetryPolicy.attempts={self.attempts} must be >= 1.")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ConfigurationError("RetryPolicy delays must be >= 0 seconds.")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigurationError(
                f"RetryPolicy.timeout_s={self.timeout_s} must be > 0 seconds (or None for the "
                "client's default)."
            )

    def delay(self, attempt: int) -> float:
        """Backoff before retry number ``attempt`` (1-based): exponential, full jitter."""
        cap = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return random.uniform(0.0, cap)


def redact_url(url: str) -> str:
    """The URL with any ``user:password@`` part and query string removed."""
    if "@" not in url and "?" not in url and "#" not in url:
        return url  # nothing to remove (and no parse: this runs once per cached file)
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if not parts.scheme:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def secret_values(options: Mapping[str, Any]) -> list[str]:
    found: list[str] = []
    for key, value in options.items():
        if isinstance(value, Mapping):
            found.extend(secret_values(value))
        elif isinstance(value, str) and len(value) >= 4 and key.lower() in _SECRET_KEYS:
            found.append(value)
    return found


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as a repr, log or message may show them: the value of every secret
    key (``secret_values``' keys, nested too) as ``***``, URLs without credentials
    (``redact_url``), and any other text with a secret in it scrubbed."""
    hidden = secret_values(options)

    def show(key: Any, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: show(k, v) for k, v in value.items()}
        if str(key).lower() in _SECRET_KEYS:
            return "***"
        if isinstance(value, (list, tuple)):
            return type(value)(show(None, v) for v in value)
        if isinstance(value, str):
            text = redact_url(value)
            for secret in hidden + url_secrets(value):
                text = text.replace(secret, "***")
            return text
        return value

    return {k: show(k, v) for k, v in options.items()}


def url_secrets(url: str) -> list[str]:
    """The secrets a URL may carry: its password and its query's values (``?sig=...``)."""
    if "@" not in url and "?" not in url:
        return []
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = [parts.password] if parts.password else []
    found += [v for _, v in parse_qsl(parts.query) if len(v) >= 4]
    if parts.query and not found:
        found.append(parts.query)  # not key=value pairs: hide it whole
    # Clients print URLs percent-encoded as well as plain.
    return found + [quote(v, safe="") for v in found if quote(v, safe="") != v]


def _error_codes(exc: BaseException) -> set[str]:
    """Service error codes and HTTP statuses found on ``exc`` and its causes (never its text)."""
    codes: set[str] = set()
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, Mapping):  # botocore ClientError
            err = response.get("Error", {})
            if err.get("Code"):
                codes.add(str(err["Code"]))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                codes.add(str(status))
        for attr in ("error_code", "status_code", "code", "status"):  # azure, gcsfs, aiohttp
            value = getattr(cur, attr, None)
            if isinstance(value, (int, str)) and not isinstance(value, bool) and value != "":
                codes.add(str(value))
        cur = cur.__cause__ or cur.__context__
    return codes


def _is_transient(exc: BaseException) -> bool:
    if isinstance(
        exc,
        (FileNotFoundError, PermissionError, FileExistsError, DcpVolumesError, FinalBackendError),
    ):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    codes = _error_codes(exc)
    if codes & _TRANSIENT_CODES:
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    status = answered_status(exc) if "GenericError" in names else None
    if "GenericError" in names and not (status is not None and 400 <= status < 500):
        # obstore's untyped error: a body cut mid-listing, a connection lost after
        # its own retries. A 4xx answer in its text is the request's fault: final.
        return True
    # Network-level failures of the HTTP stacks fsspec backends use.
    return bool(
        names
        & {
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "ResponseStreamingError",
            "IncompleteReadError",
            "IncompleteRead",  # http.client's, from bodies read off the socket directly
            "ClientConnectionError",
            "ClientPayloadError",
            "ServerDisconnectedError",
            "ServiceRequestError",
            "ServiceResponseError",
            "ProtocolError",
        }
    )


def _detail(exc: BaseException, scrub: Callable[[str], str]) -> str:
    """The error's type and first line, credentials removed (clients append pages of debug
    output and response bodies after it)."""
    text = str(exc).strip().split("\n", 1)[0]
    if len(text) > 400:
        text = text[:400] + "..."
    return scrub(f"{type(exc).__name__}: {text}")


def _server_said(exc: BaseException) -> str:
    """The status and the error code and message in the response body an error quotes
    (obstore's first line names its own reading of the status, not the server's)."""
    text = str(exc)
    parts = [f"status {status}"] if (status := answered_status(exc)) else []
    for tag in ("Code", "Message"):
        found = re.search(rf"<{tag}>([^<\n]*)", text)
        if found:
            parts.append(found.group(1).strip()[:300])
    return ": ".join(parts) if parts else _detail(exc, lambda t: t)


def translate_error(
    exc: BaseException,
    op: str,
    where: str,
    scrub: Callable[[str], str],
    *,
    create_only: bool = False,
) -> DcpVolumesError:
    """The ``dcp_volumes`` exception for a backend error on ``where``.

    ``create_only``: the operation was a write that must not replace an object,
    the only kind for which "already exists" (412, or obstore's reading of any
    409) means the object is there; a plain write that gets them met another
    conflict (e.g. Azure's 409 for a full in-memory store or a leased blob).
    """
    if isinstance(exc, DcpVolumesError):
        return exc
    if isinstance(exc, UnsendableRequestError):
        return ConfigurationError(f"Cannot {op} {where}: {scrub(str(exc))}")
    if isinstance(exc, FinalBackendError):
        return VolumeError(f"Cannot {op} {where}: {scrub(str(exc))}")
    detail = _detail(exc, scrub)
    codes = _error_codes(exc)
    if codes & _MISSING_BUCKET_CODES:
        return BucketNotFoundError(
            f"Cannot {op} {where}: the bucket or container does not exist ({detail}). "
            "Fix: create it first, or correct the URL."
        )
    names = {cls.__name__ for cls in type(exc).__mro__}
    if op == "list" and _OBSTORE_BAD_KEY in names:
        # The store holds a key (someone else's upload) that names a path segment
        # "." or "..": not a settings problem, and serving it could reach outside.
        return VolumeError(
            f"Cannot {op} {where}: the store holds an object whose key has a '.', '..' or "
            f"empty path segment ({detail}). Such keys are refused, since they could name "
            "files outside this prefix. Fix: rename or delete that object, or use a prefix "
            "that does not contain it."
        )
    if names & _OBSTORE_CONFIG:
        return ConfigurationError(
            f"Cannot {op} {where}: the object-store client refused its settings ({detail}). "
            "Fix: correct storage_options (the message names the setting)."
        )
    if isinstance(exc, FileExistsError) or codes & _EXISTS_CODES or names & _OBSTORE_EXISTS:
        if create_only or isinstance(exc, FileExistsError):
            return VolumeExistsError(
                f"Cannot {op} {where}: it already exists and this write must not replace it."
            )
        return VolumeError(
            f"Cannot {op} {where}: the store refused it with a conflict "
            f"({scrub(_server_said(exc))}). Nothing was replaced. Fix: as the store's "
            "message says; e.g. a lease held by another client, or a server out of space."
        )
    if isinstance(exc, FileNotFoundError) or codes & _NOT_FOUND_CODES:
        return VolumeNotFoundError(f"Cannot {op} {where}: not found ({detail}).")
    if isinstance(exc, PermissionError) or codes & _ACCESS_CODES or names & _CREDENTIAL_ERRORS:
        return VolumeAccessError(
            f"Cannot {op} {where}: access denied or credentials missing/invalid ({detail}). "
            "Fix: check the credentials in storage_options or the environment and that "
            "they grant this operation."
        )
    return VolumeError(f"Cannot {op} {where}: {detail}.")


def scrub_chain(exc: BaseException, scrub: Callable[[str], str]) -> None:
    """Remove secrets from the texts of ``exc`` and what it chains, in place.

    A backend's error stays the ``__cause__`` of ours (tracebacks show it), and
    clients put the URL they were given, signature and all, into their messages.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        with contextlib.suppress(Exception):  # exotic exception types: best effort
            cur.args = tuple(scrub(a) if isinstance(a, str) else a for a in cur.args)
            if isinstance(cur, OSError):
                for attr in ("filename", "filename2", "strerror"):
                    value = getattr(cur, attr, None)
                    if isinstance(value, str):
                        setattr(cur, attr, scrub(value))
        cur = cur.__cause__ or cur.__context__


def call_with_retries(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    op: str,
    where: Callable[[], str],
    scrub: Callable[[str], str],
    create_only: bool = False,
) -> T:
    """Run ``fn``; retry transient errors per ``policy``; translate the final failure
    (``create_only``: see ``translate_error``)."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt < policy.attempts and _is_transient(exc):
                delay = policy.delay(attempt)
                logger.warning(
                    "transient error on %s %s (attempt %d/%d, retrying in %.2fs): %s",
                    op,
                    where(),
                    attempt,
                    policy.attempts,
                    delay,
                    _detail(exc, scrub),
                )
                time.sleep(delay)
                continue
            scrub_chain(exc, scrub)
            raise translate_error(exc, op, where(), scrub, create_only=create_only) from exc
    raise AssertionError("unreachable")  # pragma: no cover
