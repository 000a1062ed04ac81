"""Signed S3 GETs without botocore's per-call machinery.

A botocore ``get_object`` costs ~2 ms of client CPU on a small machine:
endpoint rules, event hooks, the user-agent string, parameter validation and
response parsing, for every request. Reading thousands of small training
files, that is most of the client's CPU. ``SignedGet`` builds the same request
itself: the object's URL and signing region from botocore's own endpoint
rules (learnt once per bucket from a GET that botocore prepares and signs but
that is never sent), a SigV4 signature by hand (the signing key cached per
day), sent through the client's own HTTP session (its connection pool,
proxies, TLS settings and timeouts). It costs ~0.7 ms.

Only the plain success path is handled here: any other answer (an error, a
redirect to another region) is left to botocore, which raises the error its
callers translate. A bucket that answers with a redirect, or where botocore
succeeds after a signed GET did not, keeps using botocore.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from typing import Any
from urllib.parse import quote, urlsplit

from botocore.awsrequest import AWSPreparedRequest, AWSResponse

logger = logging.getLogger(__name__)

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_PROBE_KEY = "dcp-volumes-probe"
_SIGNED = "host;x-amz-content-sha256;x-amz-date"
_SIGNED_WITH_TOKEN = _SIGNED + ";x-amz-security-token"
# Answers that mean this bucket needs botocore (another region, another endpoint).
_REDIRECTS = frozenset({301, 302, 307, 308, 400})


def signing_key(secret: str, date: str, region: str) -> bytes:
    """The SigV4 key for ``date`` (YYYYMMDD) and ``region``, service s3."""
    key = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
    for part in (region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def sign_get(
    *,
    host: str,
    path: str,
    region: str,
    access_key: str,
    key: bytes,
    amz_date: str,
    token: str | None = None,
) -> dict[str, str]:
    """Headers of a SigV4-signed GET of ``path`` (already percent-encoded) on ``host``.

    ``key`` is ``signing_key(secret, amz_date[:8], region)``. Headers other
    than these (``Range``) may be added unsigned.
    """
    date = amz_date[:8]
    headers = [f"host:{host}", f"x-amz-content-sha256:{_EMPTY_SHA256}", f"x-amz-date:{amz_date}"]
    signed = _SIGNED
    if token:
        headers.append(f"x-amz-security-token:{token}")
        signed = _SIGNED_WITH_TOKEN
    canonical = "\n".join(("GET", path, "", *headers, "", signed, _EMPTY_SHA256))
    scope = f"{date}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ("AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest())
    )
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out = {
        "Host": host,
        "x-amz-content-sha256": _EMPTY_SHA256,
        "x-amz-date": amz_date,
        "Authorization": (
            f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, "
            f"Signature={signature}"
        ),
    }
    if token:
        out["x-amz-security-token"] = token
    return out


class SignedGet:
    """Signed GETs through one botocore client's HTTP session (thread-safe)."""

    def __init__(self, client: Any, credentials: Any) -> None:
        self._client = client
        self._credentials = credentials
        self._http = client._endpoint.http_session
        self._mu = threading.Lock()
        self._local = threading.local()  # per thread: the probe's capture, last refusal
        # bucket -> (origin, host, path prefix, signing region), or None: botocore only.
        self._bases: dict[str, tuple[str, str, str, str] | None] = {}
        self._keys: dict[tuple[str, str, str], bytes] = {}
        self._unavailable = False  # this botocore's HTTP session refused our request
        client.meta.events.register("before-send.s3.GetObject", self._capture)

    @classmethod
    def for_client(cls, client: Any) -> SignedGet | None:
        """A signer for ``client``, or ``None`` where botocore must sign (anonymous, SigV2...)."""
        try:
            version = client.meta.config.signature_version
            credentials = client._request_signer._credentials
            client._endpoint.http_session.send  # noqa: B018 - present?
        except AttributeError:
            return None
        if credentials is None or version not in (None, "s3v4", "v4"):
            return None
        return cls(client, credentials)

    def open(self, bucket: str, key: str, range_header: str | None) -> Any | None:
        """Send the GET; the urllib3 response when it is a 200/206, else ``None`` (use botocore).

        The caller reads the response and releases its connection.
        """
        self._local.refused = None
        if self._unavailable:
            return None
        base = self._bases[bucket] if bucket in self._bases else self._learn(bucket)
        if base is None:
            return None
        origin, host, prefix, region = base
        path = prefix + quote(key, safe="/~")
        creds = self._credentials.get_frozen_credentials()
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        headers = sign_get(
            host=host,
            path=path,
            region=region,
            access_key=creds.access_key,
            key=self._signing_key(creds.secret_key, amz_date[:8], region),
            amz_date=amz_date,
            token=creds.token,
        )
        if range_header is not None:
            headers["Range"] = range_header
        request = AWSPreparedRequest("GET", origin + path, headers, None, True)
        try:
            response = self._http.send(request)
        except (AttributeError, TypeError, KeyError):
            # Another botocore wants more of a prepared request than this one: its own
            # path works, so use it from now on (network errors are not caught here:
            # they are retried like botocore's).
            logger.info("signed GETs unavailable with this botocore: using botocore's path")
            self._unavailable = True
            return None
        status = response.status_code
        if status in (200, 206):
            return response.raw
        response.raw.close()
        self._local.refused = status
        if status in _REDIRECTS:
            self._disable(bucket)  # botocore follows it, every time
        return None

    def botocore_succeeded(self, bucket: str) -> None:
        """Botocore's GET succeeded after ``open`` returned None on this thread.

        If the signed GET was refused (403: a signature the server does not
        take), the bucket keeps using botocore; not after a server error.
        """
        if getattr(self._local, "refused", None) == 403:
            self._disable(bucket)
        self._local.refused = None

    def _disable(self, bucket: str) -> None:
        with self._mu:
            if self._bases.get(bucket) is not None:
                logger.info("GETs of bucket %s go through botocore from now on", bucket)
            self._bases[bucket] = None

    def _learn(self, bucket: str) -> tuple[str, str, str, str] | None:
        """Where botocore sends a GET of ``bucket`` and for which region it signs it."""
        self._local.seen = None
        self._local.active = True
        try:
            self._client.get_object(Bucket=bucket, Key=_PROBE_KEY)
        except Exception:  # the probe's stand-in answer is an error: expected
            pass
        finally:
            self._local.active = False
        seen, base = self._local.seen, None
        if seen is not None:
            url, authorization = seen
            parts = urlsplit(url)
            scope = authorization.partition("Credential=")[2].split(",")[0].split("/")
            if parts.path.endswith("/" + _PROBE_KEY) and not parts.query and len(scope) == 5:
                host = parts.netloc
                default_port = {"http": ":80", "https": ":443"}.get(parts.scheme, "")
                if default_port and host.endswith(default_port):
                    host = host[: -len(default_port)]
                prefix = parts.path[: -len(_PROBE_KEY)]
                base = (f"{parts.scheme}://{parts.netloc}", host, prefix, scope[2])
        with self._mu:
            self._bases[bucket] = base
        return base

    def _capture(self, request: Any, **_: Any) -> Any:
        if not getattr(self._local, "active", False):
            return None  # a real request: send it
        authorization = request.headers.get("Authorization", b"")
        if isinstance(authorization, bytes):
            authorization = authorization.decode()
        self._local.seen = (request.url, authorization)
        return AWSResponse(request.url, 404, {}, None)  # stand-in: nothing is sent

    def _signing_key(self, secret: str, date: str, region: str) -> bytes:
        # Keyed by the secret too: refreshed credentials get a fresh key.
        cache_key = (secret, date, region)
        key = self._keys.get(cache_key)
        if key is None:
            key = signing_key(secret, date, region)
            with self._mu:
                if len(self._keys) > 8:
                    self._keys.clear()
                self._keys[cache_key] = key
        return key
