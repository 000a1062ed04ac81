"""The neutral errors every backend raises, whatever client it speaks through, and the
``dcp_volumes`` error each one becomes.

Each backend maps its own client's exceptions to these kinds at its boundary
(``map_exceptions``: httpx's ``map_httpcore_exceptions`` pattern), from the client's
exception types and structured attributes; the client's error stays the
``__cause__``. ``_retry.py`` decides "retry" or "final" from the kind alone
(``transient``), and ``translate_error`` picks the ``dcp_volumes`` error from it
(``isinstance``), so nothing above a backend knows a client's class names, codes
or message texts.

Python's own exceptions (``OSError`` and its errnos, ``ConnectionError``,
``TimeoutError``) are the local backend's client, and what code run inside a
volume call but outside a backend raises: ``from_builtin`` maps them.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator

from dcp_volumes._exceptions import (
    BucketNotFoundError,
    ConfigurationError,
    DcpVolumesError,
    VolumeAccessError,
    VolumeEncryptionError,
    VolumeError,
    VolumeExistsError,
    VolumeNotFoundError,
)


class BackendError(Exception):
    """A backend's failure, in the terms the retry layer decides on.

    Attributes:
        transient: retrying the same request may succeed (each kind's default;
            the constructor's ``transient`` overrides it).
        explained: the message is a whole explanation (what, why, "Fix: ..."),
            shown as is; otherwise it is the client's own detail, which the
            translation puts in its own sentence.
        status: the HTTP status the server answered, where the client says it.
        code: the service's error code (``NoSuchBucket``, ``SlowDown``...).
        endpoint: the address the request went to (scheme, host, port: no
            credentials, no path).
        server_said: what the server's answer says (its status, code and
            message), for errors whose reason is the server's to give.
    """

    transient: bool = False

    def __init__(
        self,
        message: str,
        *,
        explained: bool = False,
        status: int | None = None,
        code: str | None = None,
        endpoint: str | None = None,
        server_said: str | None = None,
        transient: bool | None = None,
    ) -> None:
        super().__init__(message)
        if transient is not None:
            self.transient = transient
        self.explained = explained
        self.status = status
        self.code = code
        self.endpoint = endpoint
        self.server_said = server_said


class NotFound(BackendError):
    """The object (or prefix) does not exist."""


class BucketNotFound(NotFound):
    """The bucket or container does not exist."""


class NotAFile(BackendError):
    """The location is a directory or prefix where a file was asked for."""


class PreconditionFailed(BackendError):
    """A conditional write was refused (412, or a conflict such as Azure's 409).

    It means "the object exists" only for a create-only write: a plain write
    that gets one met another conflict (a lease, a full store).
    """


class AlreadyExists(PreconditionFailed):
    """The object exists, and the client says so unambiguously."""


class AccessDenied(BackendError):
    """Credentials are missing or wrong, or they do not grant the operation."""


class Throttled(BackendError):
    """The store asked to slow down (429, ``SlowDown``, ``ServerBusy``)."""

    transient = True


class ServerError(BackendError):
    """The store failed to answer the request (5xx, ``InternalError``)."""

    transient = True


class Timeout(BackendError):
    """No complete answer in time (a request or a connection timed out)."""

    transient = True


class ConnectionFailed(BackendError):
    """The connection could not be made, or broke before the answer was whole.

    Transient, unless raised with ``transient=False``: the client already
    retried it as far as the volume's policy allows (a second layer of retries
    would multiply the wait).
    """

    transient = True


class UploadGone(BackendError):
    """A multipart upload this client started is no longer on the store (S3's
    ``NoSuchUpload``): a try whose answer was lost on the way completed it, or it
    was aborted. The object's bytes are still here: sending them again is safe."""

    transient = True


class RequestFailed(BackendError):
    """The server refused the request for a reason no other kind names (a 4xx)."""


class InvalidKey(BackendError):
    """The client cannot address a key (``.``, ``..`` or empty path segments)."""


class Misconfigured(BackendError):
    """The client refused its settings, or cannot build a request from them (never sent)."""


def describe(exc: BaseException) -> str:
    """A client error as a detail: its type and first line, at most 400 characters
    (clients append pages of debug output and response bodies after it)."""
    text = str(exc).strip().split("\n", 1)[0]
    if len(text) > 400:
        text = text[:400] + "..."
    return f"{type(exc).__name__}: {text}"


# Errnos of a connection that broke or never came (network mounts, sockets).
_CONNECTION_ERRNOS = frozenset(
    {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE}
)


def from_builtin(exc: BaseException) -> BackendError | None:
    """The neutral kind of one of Python's own exceptions, or ``None`` for any other."""
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, DcpVolumesError):
        return None  # already ours (e.g. a FileNotFoundError subclass): never remapped
    detail = describe(exc)
    if isinstance(exc, FileNotFoundError):
        return NotFound(detail)
    if isinstance(exc, FileExistsError):
        return AlreadyExists(detail)
    if isinstance(exc, PermissionError):
        return AccessDenied(detail)
    if isinstance(exc, IsADirectoryError):
        return NotAFile(detail)
    if isinstance(exc, TimeoutError) or (isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT):
        return Timeout(detail)
    if isinstance(exc, ConnectionError) or (
        isinstance(exc, OSError) and exc.errno in _CONNECTION_ERRNOS
    ):
        return ConnectionFailed(detail)
    return None


@contextlib.contextmanager
def map_exceptions(to_neutral: Callable[[Exception], BackendError | None]) -> Iterator[None]:
    """Raise a client's exception as its neutral kind (``to_neutral``), chained to it.

    Errors that are already neutral or ours pass unchanged; one that
    ``to_neutral`` does not know (``None``) too: the retry layer reports it as
    a final failure, with its detail.
    """
    try:
        yield
    except (BackendError, DcpVolumesError):
        raise
    except Exception as exc:
        neutral = to_neutral(exc)
        if neutral is None or neutral is exc:
            raise
        raise neutral from exc


def client_detail(exc: BaseException, scrub: Callable[[str], str]) -> str:
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
    encryption: str | None = None,
) -> DcpVolumesError:
    """The ``dcp_volumes`` exception for a backend error on ``where``, by its neutral kind;
    ``exc`` and what it chains lose their secrets (``scrub``) in place, as ours chains it.

    ``create_only``: the operation was a write that must not replace an object,
    the only kind for which a refused precondition (412, or obstore's reading of
    any 409) means the object is there; a plain write that gets one met another
    conflict (e.g. Azure's 409 for a full in-memory store or a leased blob).

    ``encryption``: the server-side encryption the volume asks for
    (``_options.server_side_encryption``), which tells a refused key apart.
    """
    scrub_chain(exc, scrub)
    if isinstance(exc, DcpVolumesError):
        return exc
    kind = from_builtin(exc)
    detail = client_detail(exc, scrub)
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
    refused = encryption_refusal(kind, op, where, detail, encryption)
    if refused is not None:
        return refused
    if isinstance(kind, AccessDenied):
        hint = (
            " If the bucket's policy requires server-side encryption, writes without its "
            "headers are refused this way: pass server_side_encryption='aws:kms' (and "
            "sse_kms_key_id=...) or 'AES256' in storage_options."
            if op in _WRITES and encryption is None else ""
        )
        return VolumeAccessError(
            f"Cannot {op} {where}: access denied or credentials missing/invalid ({detail}). "
            "Fix: check the credentials in storage_options or the environment and that "
            f"they grant this operation.{hint}"
        )
    return VolumeError(f"Cannot {op} {where}: {_sentence(detail)}")


_READS = ("read", "stat")
_WRITES = ("upload", "publish", "copy")
# The S3 error codes of a request refused for its encryption headers (a HEAD has no body:
# no code at all).
_SSE_CODES = (None, "InvalidArgument", "InvalidRequest")


def encryption_refusal(
    kind: BackendError | None, op: str, where: str, detail: str, encryption: str | None
) -> VolumeEncryptionError | None:
    """The error for a request the store refused for its server-side encryption (which
    one, and the fix), or ``None`` for a refusal of another kind."""
    if kind is None or kind.status not in (400, 403):
        return None
    status = kind.status
    if encryption in ("sse-c", "customer-key") and op in _READS + _WRITES:
        return VolumeEncryptionError(
            f"Cannot {op} {where}: the store refused the customer-provided encryption key "
            f"given for it ({detail}): the object was written with another key, or without "
            "one. Fix: pass the key it was written with (S3: sse_customer_key_base64, or "
            "s3fs's s3_additional_kwargs={'SSECustomerKey': ...}; Azure: encryption_key); "
            "read objects written without a customer key through a volume without one."
        )
    if encryption is None and op in _READS and status == 400 and kind.code in _SSE_CODES:
        return VolumeEncryptionError(
            f"Cannot {op} {where}: the store refused to read it ({detail}), as S3 answers "
            "for an object encrypted with a customer-provided key (SSE-C) that is read "
            "without it. Fix: pass server_side_encryption='sse-c' and "
            "sse_customer_key_base64=<the key, base64> in storage_options."
        )
    if encryption in ("aws:kms", "aws:kms:dsse") and op in _WRITES:
        return VolumeEncryptionError(
            f"Cannot {op} {where}: the store refused the write with server-side encryption "
            f"{encryption!r} ({detail}). Fix: check that sse_kms_key_id names a KMS key "
            "that exists and that these credentials may use, or drop it to use the "
            "bucket's default key."
        )
    return None


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
