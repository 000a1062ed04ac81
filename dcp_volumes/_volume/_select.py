"""Which backend serves a URL's protocol, one instance per process and set of options.

S3 and Azure go through obstore, GCS and every other protocol through fsspec,
local paths and mounts through the local backend, ``dcp-memory://`` (tests) through
the in-memory store (``_memory.py``). ``DCP_VOLUMES_BACKEND=fsspec``
sends S3 and Azure through s3fs / adlfs instead (options obstore cannot take).
A process forked after obstore did I/O cannot use obstore (see ``_obstore.py``):
it gets the fsspec backend, with one warning saying how to avoid the slower path
(a debug line where the parent forked it so on purpose: ``choose_fsspec_after_fork``).
Each client gets the same options in its own spelling (``_options.py``), checked
when the volume is built (``check_options``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.registry import known_implementations

from dcp_volumes import _env
from dcp_volumes._exceptions import BackendNotInstalledError, ConfigurationError
from dcp_volumes._volume import _obstore
from dcp_volumes._volume._backend import Backend
from dcp_volumes._volume._fsspec import FsspecBackend
from dcp_volumes._volume._local import LocalBackend
from dcp_volumes._volume._memory import MEMORY_PROTOCOL, MemoryBackend
from dcp_volumes._volume._obstore_options import azure_settings, s3_settings
from dcp_volumes._volume._options import (
    fallback_refusal,
    fsspec_client,
    fsspec_kwargs,
    other_fsspec_kwargs,
    refuse,
    spell,
    split_ours,
)
from dcp_volumes._volume._retry import RetryPolicy

logger = logging.getLogger("dcp_volumes._volume")

LOCAL_PROTOCOLS = frozenset({"file", "local"})
# URL protocol -> obstore store kind.
OBSTORE_PROTOCOLS = {"s3": "s3", "s3a": "s3", "az": "azure", "abfs": "azure", "abfss": "azure"}

_BACKENDS: dict[tuple[int, str, str, RetryPolicy, str, str], Backend] = {}
_LOCK = threading.Lock()
_LOCAL = LocalBackend()
_warned_fork = False
# Set in a parent that forks on purpose after its obstore I/O (the DataLoader where a
# fork server would cost more than fsspec in the workers); its children inherit it.
_fsspec_after_fork_chosen = False


def _new_lock_in_child() -> None:
    global _LOCK  # another thread may have held it at the fork
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def backend_for(protocol: str, storage_options: Mapping[str, Any], retry: RetryPolicy) -> Backend:
    """This process's backend for ``protocol`` and ``storage_options``."""
    if protocol in LOCAL_PROTOCOLS:
        return _LOCAL
    # The environment's endpoint is part of an S3 client's settings (see s3_settings),
    # and DCP_VOLUMES_BACKEND decides which client serves S3 and Azure.
    obstore_protocol = protocol in OBSTORE_PROTOCOLS
    key = (
        os.getpid(),
        protocol,
        fsspec.utils.tokenize(storage_options),
        retry,
        _env.aws_endpoint() if obstore_protocol else "",
        _env.backend() if obstore_protocol else "",
    )
    backend = _BACKENDS.get(key)
    if backend is None:
        with _LOCK:
            backend = _BACKENDS.get(key)
            if backend is None:
                backend = _BACKENDS[key] = _create(protocol, storage_options, retry)
    return backend


def _create(protocol: str, options: Mapping[str, Any], retry: RetryPolicy) -> Backend:
    ours, options = split_ours(options)
    backend = _client_backend(protocol, options, retry)
    if ours:
        backend.capabilities = dataclasses.replace(backend.capabilities, **ours)
    return backend


def _client_backend(protocol: str, options: Mapping[str, Any], retry: RetryPolicy) -> Backend:
    if protocol == MEMORY_PROTOCOL:  # no client: other options are the real store's, unused
        return MemoryBackend(retry.stall_s if retry.stall_s is not None else retry.timeout_s)
    kind = OBSTORE_PROTOCOLS.get(protocol)
    if kind is None:
        return FsspecBackend(protocol, other_fsspec_kwargs(options))
    if _env.backend() == "fsspec":
        return FsspecBackend(protocol, fsspec_kwargs(kind, options, _CHOSEN))
    if not _obstore.usable_here():
        return _after_fork(protocol, kind, options)
    _obstore.require()  # "not installed" before any complaint about the options
    settings = s3_settings(options, retry) if kind == "s3" else azure_settings(options, retry)
    return _obstore.ObstoreBackend(kind, settings)


_CHOSEN = "which serves this volume here (DCP_VOLUMES_BACKEND=fsspec)"
_FORKED = (
    "which serves this volume in this process: it was forked after its parent did I/O "
    "through obstore, which cannot run in such a child (it would hang)"
)
_FORK_FIX = (
    "or start such processes with multiprocessing_context='forkserver' or 'spawn', which keep "
    "obstore (the DataLoader does so by itself for these options)"
)


def check_options(protocol: str, options: Mapping[str, Any]) -> None:
    """Refuse, when a volume is built, options that the client serving it cannot honour.

    Every name is read into each client's spelling now (``_options.spell``), so a name
    no client takes, or one the serving client cannot honour, is an error here, not
    later in a worker. A name beyond only the fsspec fallback of an obstore volume is
    no error: the fallback is then off for this volume (``fallback_usable``).
    """
    _, options = split_ours(options)  # checks ours too
    kind = OBSTORE_PROTOCOLS.get(protocol)
    if kind is None:
        refuse_gcs_encryption(protocol, options)
        return  # fsspec alone serves it, with its own names
    spelling = spell(kind, options)
    if _env.backend() == "fsspec":
        refuse(spelling.beyond_fsspec, _CHOSEN)
    elif importlib.util.find_spec("obstore") is not None:  # else "not installed" at first use
        refuse(spelling.beyond_obstore, "which serves this volume")


# Encryption names GCS users bring, which gcsfs would take silently and never send:
# it has no customer-supplied keys, and a KMS key name only per file it opens itself.
_GCS_ENCRYPTION_NAMES = ("kms_key_name", "encryption_key", "customer_encryption_key",
                         "customer_supplied_key", "encryption_key_sha256")


def refuse_gcs_encryption(protocol: str, options: Mapping[str, Any]) -> None:
    """Refuse GCS encryption options that gcsfs would accept and never honour."""
    if protocol not in ("gs", "gcs"):
        return
    named = [n for n in _GCS_ENCRYPTION_NAMES if n in options]
    if named:
        raise ConfigurationError(
            f"storage_options {named} cannot be honoured on GCS: gcsfs sends no "
            "customer-supplied encryption keys, and takes a KMS key name only for a file "
            "it opens itself, not for the uploads a volume makes. Fix: give the bucket a "
            "default KMS key (objects written there are encrypted with it), or encrypt "
            "checkpoints client-side with encryption=Encryption(...)."
        )


def fallback_usable(protocol: str, options: Mapping[str, Any]) -> bool:
    """Whether a child forked after obstore I/O can reach this store through fsspec: its
    client is installed, and it honours every option."""
    kind = OBSTORE_PROTOCOLS.get(protocol)
    if not fsspec_client_installed(protocol):
        return False
    return kind is None or not fallback_refusal(kind, options)


def _after_fork(protocol: str, kind: str, options: Mapping[str, Any]) -> Backend:
    """The fsspec backend for a child forked after its parent used obstore."""
    global _warned_fork
    try:
        backend = FsspecBackend(
            protocol, fsspec_kwargs(kind, options, _FORKED, _FORK_FIX)
        )
    except BackendNotInstalledError as exc:
        raise ConfigurationError(
            f"This process was forked after its parent did I/O through obstore, which cannot "
            f"run in such a child (it would hang), and no fsspec client for '{protocol}://' "
            f"({fsspec_client(kind)}) is installed to fall back on. Fix: start worker "
            "processes with multiprocessing_context='forkserver' or 'spawn' (DataLoader does "
            "so by default), or install the fsspec clients (pip install "
            "'dcp_volumes[fsspec-clients]')."
        ) from exc
    if not _warned_fork:
        _warned_fork = True
        logger.log(
            logging.DEBUG if _fsspec_after_fork_chosen else logging.WARNING,
            "process %d was forked after its parent did I/O through obstore, which cannot "
            "run in a forked child: %s:// goes through fsspec here (slower). Start such "
            "processes with multiprocessing_context='forkserver' or 'spawn' to keep obstore.",
            os.getpid(),
            protocol,
        )
    return backend


def fsspec_client_installed(protocol: str) -> bool:
    """Whether fsspec's client for ``protocol`` is installed (what a child forked after
    obstore I/O falls back on), found without importing it (s3fs takes half a second)."""
    implementation = known_implementations.get(protocol)
    if implementation is None:
        return protocol in fsspec.registry  # registered at run time (imported already)
    module = implementation["class"].split(".", 1)[0]
    return importlib.util.find_spec(module) is not None


def choose_fsspec_after_fork() -> None:
    """Children this process forks from now on use fsspec where obstore cannot run, by
    the caller's choice: they log it at debug level, not as a warning."""
    global _fsspec_after_fork_chosen
    _fsspec_after_fork_chosen = True
