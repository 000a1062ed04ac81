"""What is secret, and keeping it out of every message, log and repr.

``storage_options`` name their secrets by key (``SECRET_KEYS``, nested
mappings too); a URL carries its password and its query's values (a signed
``?sig=...``). ``Volume`` collects both once and scrubs them from what the
backends' clients say (``_errors.translate_error``), which repeats the URL and
settings it was given.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

from dcp_volumes._volume._urls import redact_url

# storage_options keys whose values are secrets and must never reach a message or log.
SECRET_KEYS = (
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
    # server-side encryption keys: S3's SSE-C (obstore's and botocore's names), Azure's
    # customer-provided key
    "sse_customer_key_base64",
    "ssecustomerkey",
    "encryption_key",
)


def secret_values(options: Mapping[str, Any]) -> list[str]:
    """The values of ``options``' secret keys (nested too), those long enough to scrub."""
    found: list[str] = []
    for key, value in options.items():
        if isinstance(value, Mapping):
            found.extend(secret_values(value))
        elif isinstance(value, str) and len(value) >= 4 and key.lower() in SECRET_KEYS:
            found.append(value)
        elif isinstance(value, (bytes, bytearray)) and len(value) >= 4 and (
                key.lower() in SECRET_KEYS):
            # A key given as bytes (botocore's SSECustomerKey) as messages could show it.
            raw = bytes(value)
            found += [repr(raw)[2:-1], raw.hex(), base64.b64encode(raw).decode()]
    return found


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as a repr, log or message may show them: the value of every secret
    key (``SECRET_KEYS``, nested too) as ``***``, URLs without credentials
    (``redact_url``), and any other text with a secret in it scrubbed."""
    hidden = secret_values(options)

    def show(key: Any, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: show(k, v) for k, v in value.items()}
        if str(key).lower() in SECRET_KEYS:
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

