"""The neutral errors every backend raises, whatever client it speaks through.

Each backend maps its own client's exceptions to these kinds at its boundary
(``map_exceptions``: httpx's ``map_httpcore_exceptions`` pattern), from the client's
exception types and structured attributes; the client's error stays the
``__cause__``. ``_retry.py`` decides "retry" or "final" and picks the
``dcp_volumes`` error from the kind alone (``isinstance``), so nothing above a
backend knows a client's class names, codes or message texts.

Python's own exceptions (``OSError`` and its errnos, ``ConnectionError``,
``TimeoutError``) are the local backend's client, and what code run inside a
volume call but outside a backend raises: ``from_builtin`` maps them.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator

from dcp_volumes._exceptions import DcpVolumesError


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
