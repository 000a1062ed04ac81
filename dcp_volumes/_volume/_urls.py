"""URLs of files on a store: protocol and path, the store's top and a file below it, a common
root, and a URL as messages show it.

``Volume`` takes a URL of a root and resolves the rest (buckets, Azure's
``container@account``, credentials); these helpers cut file URLs the same way
for callers that hold URLs of single files (the file cache) or of many files
(a dataset given a list). They only cut strings: building the ``Volume`` of
the result is what resolves it. ``redact_url`` is how every message and log
shows a URL: without the credentials or signature it may carry.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from fsspec.core import split_protocol

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes._volume._select import LOCAL_PROTOCOLS


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


def split_url(url: str) -> tuple[str, str]:
    """(protocol, path) of ``url``: the protocol in lower case (``file`` for a plain
    path); a local path made absolute, any other path as written after ``://``."""
    protocol, path = split_protocol(url)
    protocol = (protocol or "file").lower()
    if protocol in LOCAL_PROTOCOLS:
        return protocol, os.path.abspath(os.path.expanduser(path))
    return protocol, path


def _root_url(protocol: str, path: str) -> str:
    return path if protocol in LOCAL_PROTOCOLS else f"{protocol}://{path.strip('/')}"


def file_location(url: str) -> tuple[str, str]:
    """(URL of the store's top, path of the file below it) for the URL of one file.

    The top is the bucket or container (``s3://bucket``; Azure's
    ``az://container@account...`` keeps its account for ``Volume`` to resolve)
    or ``/`` for a local path; the path is ``/``-separated.

    Raises:
        ConfigurationError: the URL names a bucket or a root, not a file.
    """
    protocol, path = split_url(url)
    if protocol in LOCAL_PROTOCOLS:
        top, rel = os.sep, path.lstrip(os.sep).replace(os.sep, "/")
    else:
        bucket, _, rel = path.strip("/").partition("/")
        top = _root_url(protocol, bucket)
    if not rel:
        raise ConfigurationError(
            f"{redact_url(url)!r} names no file; pass the URL of one file, such as "
            "'s3://bucket/train/x.jpg'."
        )
    return top, rel


def common_root(urls: Sequence[str]) -> tuple[str, list[str]]:
    """(URL of the deepest folder holding all ``urls``, their paths below it, in order).

    Raises:
        ConfigurationError: the URLs are on different kinds of store.
    """
    protocols = set()
    paths = []
    for url in urls:
        protocol, path = split_url(url)
        protocols.add(protocol)
        paths.append(path if protocol in LOCAL_PROTOCOLS else "/" + path.strip("/"))
    if len(protocols) != 1:
        raise ConfigurationError(
            "All files must be on one kind of store; got URLs with protocols "
            f"{sorted(protocols)}. Fix: make one dataset per store."
        )
    protocol = protocols.pop()
    root = os.path.dirname(paths[0]) if len(paths) == 1 else os.path.commonpath(paths)
    if root in paths:  # one file given twice, or a file that is also a folder
        root = os.path.dirname(root)
    rels = [os.path.relpath(p, root).replace(os.sep, "/") for p in paths]
    return _root_url(protocol, root), rels
