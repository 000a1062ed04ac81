"""Retries and error translation for volume calls, in one place.

Transient failures (throttling, 5xx, resets, timeouts) are retried with
exponential backoff and full jitter; everything else, and the last transient
failure, becomes a ``dcp_volumes`` exception. Classification and translation read
only the neutral kinds the backends raise (``_errors.py``: each backend maps
its own client's exceptions there), never a client's types, codes or message
text; messages never carry credentials.
"""

from __future__ import annotations

import contextlib
import logging
import random
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
from dcp_volumes._volume._errors import (
    AccessDenied,
    AlreadyExists,
    BackendError,
    BucketNotFound,
    InvalidKey,
    Misconfigured,
    NotAFile,
    NotFound,
    PreconditionFailed,
    describe,
    from_builtin,
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
        stall_s: a request that receives nothing for this long is stalled, and
            abandoned and tried again (S3 and Azure): a read waits this long for
            each next piece of its answer, so a slow read that moves is never
            cut; an upload waits this long beyond its sending time at
            ``min_rate`` (``_stall.py``). ``None``: only ``timeout_s`` applies.
        min_rate: bytes per second per stream an upload is given before it
            counts as stalled; a timed-out upload doubles the time given to later
            ones (a slow link is learnt, not cut forever).
    """

    attempts: int = 5
    base_delay_s: float = 0.1
    max_delay_s: float = 8.0
    timeout_s: float | None = None
    stall_s: float | None = 3.0
    min_rate: float = 16 * 2**20

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
        if self.stall_s is not None and not self.stall_s > 0:
            raise ConfigurationError(
                f"RetryPolicy.stall_s={self.stall_s} must be > 0 seconds (or None to detect "
                "stalls by timeout_s alone)."
            )
        if not self.min_rate > 0:
            raise ConfigurationError(
                f"RetryPolicy.min_rate={self.min_rate} must be > 0 bytes per second."
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


def _neutral(exc: BaseException) -> BackendError | None:
    """The neutral kind of a failure: what the backend raised, or (for code run in a
    volume call outside a backend) Python's own exception mapped the same way."""
    return exc if isinstance(exc, BackendError) else from_builtin(exc)


def _is_transient(exc: BaseException) -> bool:
    kind = _neutral(exc)
    return kind is not None and kind.transient


def _detail(exc: BaseException, scrub: Callable[[str], str]) -> str:
    """What went wrong, as the client said it (credentials removed)."""
    if isinstance(exc, BackendError):
        text = str(exc) if exc.explained else str(exc).split("\n", 1)[0]
        return scrub(text)
    return scrub(describe(exc))


def _sentence(text: str) -> str:
    return text if text.endswith(".") else f"{text}."


def translate_error(
    exc: BaseException,
    op: str,
    where: str,
    scrub: Callable[[str], str],
    *,
    create_only: bool = False,
) -> DcpVolumesError:
    """The ``dcp_volumes`` exception for a backend error on ``where``, by its neutral kind.

    ``create_only``: the operation was a write that must not replace an object,
    the only kind for which a refused precondition (412, or obstore's reading of
    any 409) means the object is there; a plain write that gets one met another
    conflict (e.g. Azure's 409 for a full in-memory store or a leased blob).
    """
    if isinstance(exc, DcpVolumesError):
        return exc
    kind = _neutral(exc)
    detail = _detail(exc, scrub)
    if isinstance(kind, Misconfigured) and kind.explained:
        return ConfigurationError(f"Cannot {op} {where}: {detail}")
    if isinstance(kind, Misconfigured) or (isinstance(kind, InvalidKey) and op != "list"):
        return ConfigurationError(
            f"Cannot {op} {where}: the object-store client refused its settings ({detail}). "
            "Fix: correct storage_options (the message names the setting)."
        )
    # A write names a key that need not exist: its "not found" is the bucket's (S3's
    # NoSuchBucket, Azure's ContainerNotFound), whether or not the answer says which.
    if isinstance(kind, BucketNotFound) or (
        isinstance(kind, NotFound) and op in ("upload", "publish")
    ):
        return BucketNotFoundError(
            f"Cannot {op} {where}: the bucket or container does not exist ({detail}). "
            "Fix: create it first, or correct the URL."
        )
    if isinstance(kind, InvalidKey):
        # The store holds a key (someone else's upload) that names a path segment
        # "." or "..": not a settings problem, and serving it could reach outside.
        return VolumeError(
            f"Cannot {op} {where}: the store holds an object whose key has a '.', '..' or "
            f"empty path segment ({detail}). Such keys are refused, since they could name "
            "files outside this prefix. Fix: rename or delete that object, or use a prefix "
            "that does not contain it."
        )
    if isinstance(kind, PreconditionFailed):
        if create_only or isinstance(kind, AlreadyExists):
            return VolumeExistsError(
                f"Cannot {op} {where}: it already exists and this write must not replace it."
            )
        said = scrub(kind.server_said) if kind.server_said else detail
        return VolumeError(
            f"Cannot {op} {where}: the store refused it with a conflict ({said}). Nothing "
            "was replaced. Fix: as the store's message says; e.g. a lease held by another "
            "client, or a server out of space."
        )
    if isinstance(kind, NotAFile) and op == "stat":
        return VolumeNotFoundError(f"{where} is a directory/prefix, not a file.")
    if isinstance(kind, NotFound):
        return VolumeNotFoundError(f"Cannot {op} {where}: not found ({detail}).")
    if isinstance(kind, AccessDenied):
        return VolumeAccessError(
            f"Cannot {op} {where}: access denied or credentials missing/invalid ({detail}). "
            "Fix: check the credentials in storage_options or the environment and that "
            "they grant this operation."
        )
    return VolumeError(f"Cannot {op} {where}: {_sentence(detail)}")


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
