"""``storage_options``: every name a volume accepts, in each client's own spelling.

One set of options must mean the same on every client and in every process. S3
and Azure volumes go through obstore, and through s3fs / adlfs where obstore
cannot run (a process forked after its parent's obstore I/O: DataLoader workers
on a rank with one CPU) or by choice (``DCP_VOLUMES_BACKEND=fsspec``). Users
write s3fs's and adlfs's names (``key``, ``client_kwargs``, ``sas_token``) or
obstore's (``access_key_id``, ``region``, ``endpoint``), often mixed. So each
accepted name is read here, once, into both spellings at the same time
(``spell``): obstore's settings (``Spelling.obstore``, which
``_obstore_options`` completes with the policy and the environment) and the
fsspec client's keyword arguments (``Spelling.fsspec``). Nothing else in the
package knows an option name.

For each client a name is one of three things:

- honoured: written in that client's spelling (two spellings of one setting
  with different values are refused: which one would each client take?);
- not that client's concern: it tunes the other client (its caches, pools,
  retries, how it makes a put create-only) and changes nothing a request
  means; left out, with a debug line;
- beyond that client: it would change where requests go, who signs them or
  what the store keeps, and the client has no way to do it. Recorded as a
  ``Beyond`` with the reason and the fix.

A name that no client takes is refused at once, naming it (never its value:
it may be a secret) and the name it most likely misspells. ``Volume`` calls
``spell`` when it is built (``_select.check_options``): a name beyond the
client that serves the volume is refused there; one beyond only the fsspec
fallback turns the fallback off for that volume (the DataLoader then starts
its workers from a fork server, which keeps obstore), and a child that was
forked anyway gets that ``Beyond`` as its error, not a ``TypeError`` from the
client.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import logging
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from dcp_volumes import _env
from dcp_volumes._exceptions import ConfigurationError

logger = logging.getLogger("dcp_volumes._volume")

# -- ours ---------------------------------------------------------------------------------------

# Options of ours, not a client's: what the server does with a ranged read
# (``Capabilities.ranged_reads_cost_whole_object``), and whether its listings may lag
# its writes (``Capabilities.listing_lags``). Taken by the volume, given to no client.
WHOLE_OBJECT_RANGES = "ranged_reads_cost_whole_object"
LISTING_LAGS = "listing_lags"
OUR_OPTIONS = {
    WHOLE_OBJECT_RANGES: "True: the server reads the whole object for each ranged read, "
    "as moto's does",
    LISTING_LAGS: "True: the store's listings may leave out objects written just before, "
    "as some S3-compatible servers and caching gateways do",
}


def split_ours(options: Mapping[str, Any]) -> tuple[dict[str, bool], dict[str, Any]]:
    """(our options, checked; the client's options) of ``options``."""
    if not isinstance(options, Mapping):
        raise ConfigurationError(
            f"storage_options must be a mapping (a dict), not {type(options).__name__}."
        )
    ours: dict[str, bool] = {}
    rest = dict(options)
    for name, meaning in OUR_OPTIONS.items():
        if name not in rest:
            continue
        value = rest.pop(name)
        if not isinstance(value, bool):
            raise ConfigurationError(
                f"storage_options['{name}']={value!r} must be True or False ({meaning})."
            )
        ours[name] = value
    return ours, rest


# -- the names ----------------------------------------------------------------------------------

# The clients (fsspec's implementation of each protocol obstore also serves).
S3FS = "s3fs"
ADLFS = "adlfs"
OBSTORE = "obstore"

# Settings of how a client keeps its own caches and event loop: s3fs's and adlfs's
# (tools pass them routinely); they mean nothing to obstore's data path.
_S3FS_TUNING = frozenset(
    {
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "max_concurrency",
        "fixed_upload_size",
        "cache_regions",
        "version_aware",
        "local_expiry_check",
    }
)
_ADLFS_TUNING = frozenset(
    {
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "blocksize",
        "default_fill_cache",
        "default_cache_type",
        "max_concurrency",
        "version_aware",
        "assume_container_exists",
    }
)
# What the volume decides for every fsspec client: one client per process (a forked
# child never shares its parent's), used synchronously. Dropped wherever given.
_VOLUME_DECIDES = frozenset({"skip_instance_cache", "asynchronous", "loop"})
# Another client's cache settings, passed to a volume of the other store kind
# (``blocksize`` to S3): meaningless to both of its clients, as before.
_ANY_TUNING = _S3FS_TUNING | _ADLFS_TUNING

# obstore's client options (its ``ClientConfig``), top level or in ``client_options``.
CLIENT_OPTIONS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "default_headers",
        "http1_only",
        "http2_keep_alive_interval",
        "http2_keep_alive_timeout",
        "http2_keep_alive_while_idle",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_url",
        "proxy_ca_certificate",
        "proxy_excludes",
        "root_certificate",
        "randomize_addresses",
        "read_timeout",
        "timeout",
        "user_agent",
    }
)
_DURATIONS = frozenset({"connect_timeout", "read_timeout", "timeout", "pool_idle_timeout",
                        "http2_keep_alive_timeout"})
# How obstore's connections are kept: each fsspec client manages its own.
_TRANSPORT_TUNING = frozenset(
    {
        "http1_only",
        "http2_keep_alive_interval",
        "http2_keep_alive_timeout",
        "http2_keep_alive_while_idle",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "randomize_addresses",
    }
)
# Options the obstore store takes as keyword arguments of its own, not config keys.
STORE_ARGUMENTS = frozenset({"client_options", "retry_config", "credential_provider"})

# One S3 setting, every spelling of it (s3fs's, botocore's, obstore's): the obstore
# config key and where s3fs takes it (a path into its keyword arguments).
_S3_SAME: dict[str, tuple[str, tuple[str, ...]]] = {
    **dict.fromkeys(("key", "aws_access_key_id", "username", "access_key_id"),
                    ("access_key_id", ("key",))),
    **dict.fromkeys(("secret", "aws_secret_access_key", "password", "secret_access_key"),
                    ("secret_access_key", ("secret",))),
    **dict.fromkeys(("token", "aws_session_token", "session_token"),
                    ("session_token", ("token",))),
    **dict.fromkeys(("endpoint_url", "endpoint"), ("endpoint", ("endpoint_url",))),
    **dict.fromkeys(("region_name", "region"), ("region", ("client_kwargs", "region_name"))),
}
# s3fs's (and botocore's) spellings among those, for messages and the docs.
S3FS_RENAMES = {
    name: target for name, (target, _) in _S3_SAME.items() if name != target
} | {"requester_pays": "request_payer", "anon": "skip_signature"}
def _true(value: Any) -> bool:
    """A flag as obstore reads it: booleans, or the strings "true"/"1"/"yes"/"on"."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)


# Where s3fs takes each obstore S3 config key that is not one of the above, as
# (path, value for s3fs).
_S3_TO_S3FS: dict[str, tuple[tuple[str, ...], Any]] = {
    "virtual_hosted_style_request": (("config_kwargs", "s3", "addressing_style"),
                                     lambda v: "virtual" if _true(v) else "path"),
    "unsigned_payload": (("config_kwargs", "s3", "payload_signing_enabled"),
                         lambda v: not _true(v)),
    "checksum_algorithm": (("s3_additional_kwargs", "ChecksumAlgorithm"),
                           lambda v: str(v).upper()),
    "server_side_encryption": (("s3_additional_kwargs", "ServerSideEncryption"), str),
    "sse_kms_key_id": (("s3_additional_kwargs", "SSEKMSKeyId"), str),
    "sse_bucket_key_enabled": (("s3_additional_kwargs", "BucketKeyEnabled"), _true),
    # SSE-C's key: obstore takes it base64, botocore (under s3fs) the key's bytes.
    "sse_customer_key_base64": (("s3_additional_kwargs", "SSECustomerKey"),
                                lambda v: base64.b64decode(v)),
    "request_payer": (("requester_pays",), lambda v: _true(v) or str(v).lower() == "requester"),
    "skip_signature": (("anon",), _true),
    "default_region": (("client_kwargs", "region_name"), str),
}
# The server-side encryption settings (read by ``_Reader.s3_sse``), and their
# algorithms: S3's names, and obstore's for SSE-C (s3fs: SSECustomerAlgorithm="AES256").
_S3_SSE = frozenset({"server_side_encryption", "sse_kms_key_id", "sse_bucket_key_enabled",
                     "sse_customer_key_base64"})
SSE_ALGORITHMS = ("AES256", "aws:kms", "aws:kms:dsse", "sse-c")
# s3fs's request arguments (``s3_additional_kwargs``) for them, as obstore's names.
_S3FS_SSE_ARGUMENTS = {
    "ServerSideEncryption": "server_side_encryption",
    "SSEKMSKeyId": "sse_kms_key_id",
    "BucketKeyEnabled": "sse_bucket_key_enabled",
    "SSECustomerKey": "sse_customer_key_base64",
    "SSECustomerAlgorithm": "server_side_encryption",
}
# How obstore makes a put create-only, or tags objects: s3fs does neither its way.
_S3_OBSTORE_MECHANICS = frozenset({"conditional_put", "copy_if_not_exists", "disable_tagging"})
# Where the AWS credential chain finds credentials: botocore (under s3fs) reads these
# from the environment or ~/.aws/config only, never from its options.
_S3_CHAIN_VARIABLES = {
    "role_arn": "AWS_ROLE_ARN",
    "role_session_name": "AWS_ROLE_SESSION_NAME",
    "web_identity_token_file": "AWS_WEB_IDENTITY_TOKEN_FILE",
    "container_credentials_relative_uri": "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "container_credentials_full_uri": "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "container_authorization_token_file": "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "sts_endpoint": "",
    "metadata_endpoint": "",
    "imdsv1_fallback": "",
}
_S3_BEYOND_S3FS = {
    "bucket": "the URL names the bucket",
    "disable_bulk_delete": "s3fs deletes several objects with one DeleteObjects request",
    "s3_express": "s3fs has no S3 Express One Zone sessions",
}
# obstore's own S3 config keys (its ``S3Config``).
S3_KEYS = frozenset(
    {target for target, _ in _S3_SAME.values()}
    | set(_S3_TO_S3FS)
    | _S3_OBSTORE_MECHANICS
    | set(_S3_CHAIN_VARIABLES)
    | set(_S3_BEYOND_S3FS)
)
# botocore create_client keywords s3fs passes through client_kwargs, beyond those above.
_S3FS_CLIENT_KWARGS_OWN = frozenset({"api_version", "aws_account_id"})
# botocore ``Config`` settings that obstore does its own way (pools, retries, checksums).
_BOTOCORE_OWN_WAY = frozenset(
    {
        "max_pool_connections",
        "retries",
        "request_checksum_calculation",
        "response_checksum_validation",
        "signature_version",
        "tcp_keepalive",
    }
)
# s3fs options obstore has no equivalent for (s3fs takes them; obstore is refused them).
_S3FS_BEYOND_OBSTORE = frozenset({"s3_additional_kwargs", "session"})

# Azure: one setting, every spelling (adlfs's, obstore's) -> (obstore key, adlfs name).
_AZURE_SAME: dict[str, tuple[str, str]] = {
    "account_name": ("account_name", "account_name"),
    "account_key": ("account_key", "account_key"),
    **dict.fromkeys(("sas_token", "sas_key"), ("sas_key", "sas_token")),
    "client_id": ("client_id", "client_id"),
    "client_secret": ("client_secret", "client_secret"),
    "tenant_id": ("tenant_id", "tenant_id"),
}
ADLFS_RENAMES = {"sas_token": "sas_key", "account_host": "endpoint", "anon": "skip_signature"}
_AZURE_BEYOND_ADLFS = {
    "token": "adlfs takes a bearer token only inside an azure-identity credential object",
    "use_emulator": "adlfs reaches Azurite only through a connection string",
    "use_fabric_endpoint": "adlfs has no Fabric endpoints",
    "msi_endpoint": "adlfs's credential chain (azure-identity) reads it from the environment",
    "object_id": "adlfs's credential chain (azure-identity) reads it from the environment",
    "msi_resource_id": "adlfs's credential chain (azure-identity) reads it from the environment",
    "federated_token_file": "adlfs's credential chain reads AZURE_FEDERATED_TOKEN_FILE",
    "use_azure_cli": "adlfs has no switch for the Azure CLI's credentials",
    "authority_host": "adlfs's credential chain reads AZURE_AUTHORITY_HOST",
    "credential_type": "adlfs picks its credential from the options given",
    "encryption_key": "adlfs sends no customer-provided encryption key",
    "container_name": "the URL names the container",
}
# obstore's own Azure config keys (its ``AzureConfig``).
AZURE_KEYS = frozenset(
    {target for target, _ in _AZURE_SAME.values()}
    | set(_AZURE_BEYOND_ADLFS)
    | {"endpoint", "skip_signature", "disable_tagging"}
)
# adlfs options obstore has no equivalent for.
_ADLFS_BEYOND_OBSTORE = frozenset({"location_mode", "request_session"})
# adlfs's own timeouts (seconds), and obstore's client option of each.
_ADLFS_TIMEOUTS = {"timeout": "timeout", "read_timeout": "read_timeout",
                   "connection_timeout": "connect_timeout", "connect_timeout": "connect_timeout"}

# Every top-level name an S3 or an Azure volume takes, for "did you mean".
S3_NAMES = frozenset(
    {*_S3_SAME, *S3FS_RENAMES, "client_kwargs", "config_kwargs", "use_ssl", "profile",
     *_S3FS_BEYOND_OBSTORE, *S3_KEYS, *CLIENT_OPTIONS, *_ANY_TUNING, *_VOLUME_DECIDES,
     *STORE_ARGUMENTS, *OUR_OPTIONS}
)
AZURE_NAMES = frozenset(
    {*_AZURE_SAME, *ADLFS_RENAMES, "connection_string", "credential", *_ADLFS_BEYOND_OBSTORE,
     *_ADLFS_TIMEOUTS, *AZURE_KEYS, *CLIENT_OPTIONS, *_ANY_TUNING, *_VOLUME_DECIDES,
     *STORE_ARGUMENTS, *OUR_OPTIONS}
)


# -- the result ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Beyond:
    """A name one client cannot honour: which, why, and how to fix it."""

    name: str  # as the user wrote it, e.g. "credential_provider", "client_kwargs['api_version']"
    client: str
    why: str
    fix: str


@dataclass
class ObstoreArgs:
    """The user's settings in obstore's spelling (``_obstore_options`` adds the policy's)."""

    config: dict[str, Any] = field(default_factory=dict)
    client_options: dict[str, Any] = field(default_factory=dict)
    retry_config: dict[str, Any] | None = None
    credential_provider: Any = None
    profile: str | None = None  # read through boto3's chain (``_obstore_options``)

    def __repr__(self) -> str:
        # The config holds credentials: name its keys, never its values.
        return (
            f"ObstoreArgs(config keys={sorted(self.config)}, "
            f"client_options keys={sorted(self.client_options)})"
        )


@dataclass
class Spelling:
    """One set of storage_options in each client's spelling."""

    kind: str  # "s3" or "azure"
    obstore: ObstoreArgs
    fsspec: dict[str, Any]
    beyond_obstore: list[Beyond]
    beyond_fsspec: list[Beyond]

    def __repr__(self) -> str:
        # Both spellings hold credentials: name keys, never values.
        return (
            f"Spelling({self.kind}: obstore config keys={sorted(self.obstore.config)}, "
            f"fsspec keys={sorted(self.fsspec)}, beyond obstore="
            f"{[b.name for b in self.beyond_obstore]}, beyond fsspec="
            f"{[b.name for b in self.beyond_fsspec]})"
        )


def fsspec_client(kind: str) -> str:
    """The fsspec client of an obstore store kind."""
    return S3FS if kind == "s3" else ADLFS


# -- reading options ----------------------------------------------------------------------------


def spell(kind: str, options: Mapping[str, Any]) -> Spelling:
    """``options`` (without ours) in obstore's and in the fsspec client's spelling.

    Raises:
        ConfigurationError: a name no client takes (naming it, never its value), two
            spellings of one setting with different values, or a value of the wrong kind.
    """
    if not isinstance(options, Mapping):
        raise ConfigurationError(
            f"storage_options must be a mapping (a dict), not {type(options).__name__}."
        )
    reader = _Reader(kind)
    if kind == "s3":
        reader.s3(options)
    else:
        reader.azure(options)
    return Spelling(
        kind=kind,
        obstore=reader.obstore_args(),
        fsspec=reader.fsspec_kwargs(),
        beyond_obstore=reader.beyond_obstore,
        beyond_fsspec=reader.beyond_fsspec,
    )


class _Sink:
    """One client's settings being written: a name's second spelling with another value
    is an error; ``weak`` settings (derived from a looser equivalent) give way."""

    def __init__(self, client: str) -> None:
        self.client = client
        self.values: dict[tuple[str, ...], Any] = {}
        self._sources: dict[tuple[str, ...], str] = {}
        self._weak: set[tuple[str, ...]] = set()

    def set(self, path: tuple[str, ...], value: Any, source: str, *, weak: bool = False) -> None:
        if path in self.values:
            if weak:
                return
            if path not in self._weak and self.values[path] != value:
                raise ConfigurationError(
                    f"storage_options give one setting twice, as {_quoted(self._sources[path])} "
                    f"and {_quoted(source)}, with different values: {self.client} would take "
                    "one of them. Fix: give it once."
                )
        self.values[path] = value
        self._sources[path] = source
        if weak:
            self._weak.add(path)
        else:
            self._weak.discard(path)

    def nested(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, value in self.values.items():
            node = out
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        return out


class _Reader:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.peer = fsspec_client(kind)
        self.config = _Sink(OBSTORE)
        self.client_options = _Sink(OBSTORE)
        self.fs = _Sink(self.peer)
        self.retry_config: dict[str, Any] | None = None
        self.credential_provider: Any = None
        self.profile: str | None = None
        self.beyond_obstore: list[Beyond] = []
        self.beyond_fsspec: list[Beyond] = []

    # -- results --------------------------------------------------------------------------

    def obstore_args(self) -> ObstoreArgs:
        return ObstoreArgs(
            config={path[0]: v for path, v in self.config.values.items()},
            client_options={path[0]: v for path, v in self.client_options.values.items()},
            retry_config=self.retry_config,
            credential_provider=self.credential_provider,
            profile=self.profile,
        )

    def fsspec_kwargs(self) -> dict[str, Any]:
        return self.fs.nested()

    # -- helpers --------------------------------------------------------------------------

    def not_for(self, client: str, name: str, why: str) -> None:
        logger.debug("storage option %r is not %s's concern (%s): not given to it",
                     name, client, why)

    def beyond(self, client: str, name: str, why: str, fix: str) -> None:
        item = Beyond(name=name, client=client, why=why, fix=fix)
        (self.beyond_obstore if client == OBSTORE else self.beyond_fsspec).append(item)

    def unknown(self, where: str, names: Collection[str], known: Collection[str],
                peer: str) -> None:
        if names:
            raise ConfigurationError(unknown_message(where, names, known, peer))

    def client_option(self, name: str, value: Any, source: str) -> None:
        """obstore's client option ``name``, and the fsspec client's equivalent."""
        if value is None:
            return
        self.client_options.set((name,), _obstore_duration(name, value), source)
        if name in _TRANSPORT_TUNING:
            self.not_for(self.peer, source, "it tunes obstore's connections")
        elif name == "allow_http":
            self.not_for(self.peer, source, f"{self.peer} follows the endpoint's scheme")
        elif name == "user_agent" and self.kind == "s3":
            self.fs.set(("config_kwargs", "user_agent"), value, source)
        elif name == "user_agent":
            self.not_for(self.peer, source, "it only names the client")
        elif name in ("connect_timeout", "read_timeout", "timeout"):
            self.timeout(name, value, source)
        elif self.kind == "s3" and name == "allow_invalid_certificates":
            if _true(value):
                self.fs.set(("client_kwargs", "verify"), False, source)
        elif self.kind == "s3" and name == "root_certificate" and isinstance(value, str):
            self.fs.set(("client_kwargs", "verify"), value, source)
        elif self.kind == "s3" and name == "proxy_url":
            self.fs.set(("config_kwargs", "proxies"), {"http": value, "https": value}, source)
        elif self.kind == "s3" and name == "proxy_ca_certificate":
            self.fs.set(("config_kwargs", "proxies_config", "proxy_ca_bundle"), value, source)
        else:
            self.beyond(
                self.peer, source, f"{self.peer} has no option for obstore's {name!r}",
                "remove it, or keep this volume on obstore (workers started with "
                "multiprocessing_context='forkserver' or 'spawn')",
            )

    def timeout(self, name: str, value: Any, source: str) -> None:
        seconds = seconds_of(value, source)
        if self.kind == "azure":
            adlfs = {"timeout": "timeout", "read_timeout": "read_timeout",
                     "connect_timeout": "connection_timeout"}[name]
            self.fs.set((adlfs,), max(1, round(seconds)), source)
        elif name == "timeout":
            # A bound on a whole request; botocore bounds each read of the answer, which a
            # request within the bound never exceeds.
            self.fs.set(("config_kwargs", "read_timeout"), seconds, source, weak=True)
        else:
            self.fs.set(("config_kwargs", name), seconds, source)

    def store_arguments(self, name: str, value: Any) -> None:
        if name == "client_options":
            if not isinstance(value, Mapping):
                raise ConfigurationError(
                    "storage_options['client_options'] must be a mapping (obstore's "
                    f"ClientConfig), not {type(value).__name__}."
                )
            unknown = [n for n in value if n not in CLIENT_OPTIONS]
            self.unknown("client_options", unknown, CLIENT_OPTIONS, OBSTORE)
            for option, v in value.items():
                self.client_option(option, v, f"client_options[{option!r}]")
        elif name == "retry_config":
            if value:
                self.retry_config = dict(value)
            self.not_for(self.peer, name, "the volume retries every request itself")
        elif value is not None:  # credential_provider
            self.credential_provider = value
            self.beyond(
                self.peer, name,
                f"an obstore credential provider is an object {self.peer}'s credential "
                "chain cannot call",
                "give the credentials themselves (key/secret/token, or a profile; "
                "account_key, sas_token or client_id/client_secret/tenant_id for Azure) or "
                "leave them to the environment, which both clients read",
            )

    # -- S3 -------------------------------------------------------------------------------

    def s3(self, options: Mapping[str, Any]) -> None:
        unknown = []
        for name, value in options.items():
            if name in OUR_OPTIONS:
                continue
            if not self.s3_name(name, value, name):
                unknown.append(name)
        self.unknown("storage_options", unknown, S3_NAMES, S3FS)
        self.s3_check_sse()

    def s3_sse(self, name: str, value: Any, source: str) -> None:
        """One server-side encryption setting, in obstore's and s3fs's spelling; every
        request of both clients then carries its headers (SSE-C's key on reads too)."""
        sse = ("s3_additional_kwargs",)
        if name == "server_side_encryption":
            algorithm = str(value)
            known = {a.lower(): a for a in SSE_ALGORITHMS}
            if algorithm.lower() not in known:
                raise ConfigurationError(
                    f"storage_options {_quoted(source)}={algorithm!r} is no server-side "
                    f"encryption: use one of {list(SSE_ALGORITHMS)} (SSE-S3, SSE-KMS, "
                    "DSSE-KMS, SSE-C with a customer key)."
                )
            algorithm = known[algorithm.lower()]
            self.config.set((name,), algorithm, source)
            if algorithm == "sse-c":
                self.fs.set((*sse, "SSECustomerAlgorithm"), "AES256", source)
            else:
                self.fs.set((*sse, "ServerSideEncryption"), algorithm, source)
        elif name == "sse_customer_key_base64":
            key = _customer_key(value, source)
            self.config.set((name,), base64.b64encode(key).decode(), source)
            self.fs.set((*sse, "SSECustomerKey"), key, source)
            # The key alone means SSE-C (obstore wants it said; botocore its algorithm).
            self.config.set(("server_side_encryption",), "sse-c", source, weak=True)
            self.fs.set((*sse, "SSECustomerAlgorithm"), "AES256", source, weak=True)
        elif name == "sse_kms_key_id":
            self.config.set((name,), str(value), source)
            self.fs.set((*sse, "SSEKMSKeyId"), str(value), source)
            # A KMS key alone means SSE-KMS, as the AWS CLI reads it.
            self.config.set(("server_side_encryption",), "aws:kms", source, weak=True)
            self.fs.set((*sse, "ServerSideEncryption"), "aws:kms", source, weak=True)
        else:  # sse_bucket_key_enabled
            self.config.set((name,), _true(value), source)
            self.fs.set((*sse, "BucketKeyEnabled"), _true(value), source)

    def s3_additional_kwargs(self, extra: Mapping[str, Any]) -> None:
        """s3fs's request arguments: the encryption ones are read as obstore's settings;
        the rest are s3fs's alone."""
        for name, value in extra.items():
            source = f"s3_additional_kwargs[{name!r}]"
            if value is None:
                continue
            if name == "SSECustomerAlgorithm":
                if str(value).upper() != "AES256":
                    raise ConfigurationError(
                        f"storage_options {_quoted(source)}={value!r}: S3's customer-provided "
                        "keys (SSE-C) use 'AES256', the only algorithm S3 offers for them."
                    )
                self.s3_sse("server_side_encryption", "sse-c", source)
            elif name == "SSECustomerKey":
                # botocore takes the key's bytes (text is encoded as UTF-8), and sends it
                # base64 with its MD5, as obstore does with its base64 setting.
                raw = value.encode() if isinstance(value, str) else value
                if not isinstance(raw, (bytes, bytearray, memoryview)):
                    raise ConfigurationError(
                        f"storage_options {_quoted(source)} must be the 32-byte key (bytes), "
                        f"not {type(value).__name__}."
                    )
                self.s3_sse("sse_customer_key_base64", base64.b64encode(bytes(raw)).decode(),
                            source)
            elif name in _S3FS_SSE_ARGUMENTS:
                self.s3_sse(_S3FS_SSE_ARGUMENTS[name], value, source)
            elif name == "SSECustomerKeyMD5":
                self.fs.set(("s3_additional_kwargs", name), value, source)
                self.not_for(OBSTORE, source, "obstore sends the customer key's MD5 itself")
            else:
                self.fs.set(("s3_additional_kwargs", name), value, source)
                self.beyond(OBSTORE, source, "an s3fs request argument with no obstore "
                            "setting", "remove it")

    def s3_check_sse(self) -> None:
        """Refuse server-side encryption settings that contradict each other."""
        config = {path[0]: v for path, v in self.config.values.items()}
        algorithm = config.get("server_side_encryption")
        if algorithm == "sse-c" and "sse_customer_key_base64" not in config:
            raise ConfigurationError(
                "storage_options ask for SSE-C (server_side_encryption='sse-c' or "
                "SSECustomerAlgorithm) without the customer key. Fix: pass "
                "sse_customer_key_base64=<the 32-byte key, base64> (s3fs: "
                "s3_additional_kwargs={'SSECustomerKey': key_bytes})."
            )
        if "sse_customer_key_base64" in config and algorithm != "sse-c":
            raise ConfigurationError(
                f"storage_options give an SSE-C customer key and server_side_encryption="
                f"{algorithm!r}: an object is encrypted one way. Fix: drop one of them."
            )
        if "sse_kms_key_id" in config and algorithm not in ("aws:kms", "aws:kms:dsse"):
            raise ConfigurationError(
                f"storage_options give sse_kms_key_id with server_side_encryption="
                f"{algorithm!r}: a KMS key goes with 'aws:kms' or 'aws:kms:dsse'."
            )

    def s3_name(self, name: str, value: Any, source: str) -> bool:
        """Read one top-level S3 option; False for a name no client takes."""
        if name not in S3_NAMES:
            return False
        if name in _VOLUME_DECIDES:
            self.not_for(S3FS, source, "the volume makes one synchronous client per process")
        elif value is None:
            pass  # s3fs's and obstore's "not set"
        elif name in _S3_SAME:
            target, path = _S3_SAME[name]
            self.config.set((target,), value, source)
            self.fs.set(path, value, source)
        elif name in _S3_SSE:
            self.s3_sse(name, value, source)
        elif name == "s3_additional_kwargs":
            self.s3_additional_kwargs(_mapping(value, name))
        elif name in ("requester_pays", "anon"):
            if _true(value):
                target = S3FS_RENAMES[name]
                self.config.set((target,), True, source)
                self.fs.set(_S3_TO_S3FS[target][0], True, source)
        elif name in _S3_TO_S3FS:
            self.config.set((name,), value, source)
            path, convert = _S3_TO_S3FS[name]
            self.fs.set(path, convert(value), source, weak=name == "default_region")
        elif name in _S3_OBSTORE_MECHANICS:
            self.config.set((name,), value, source)
            self.not_for(S3FS, source, "it is how obstore makes puts create-only or tags")
        elif name in _S3_CHAIN_VARIABLES:
            self.config.set((name,), value, source)
            variable = _S3_CHAIN_VARIABLES[name]
            self.beyond(
                S3FS, source, "botocore under s3fs reads the AWS credential chain's settings "
                "from the environment and ~/.aws/config, never from options",
                f"set {variable} in the environment instead, which both clients read"
                if variable else "set it in ~/.aws/config (or the AWS_* environment) instead",
            )
        elif name in _S3_BEYOND_S3FS:
            self.config.set((name,), value, source)
            self.beyond(S3FS, source, _S3_BEYOND_S3FS[name], "remove it")
        elif name == "profile":
            self.profile = str(value)
            self.fs.set(("profile",), value, source)
        elif name == "use_ssl":
            if value is False:
                self.client_options.set(("allow_http",), True, source, weak=True)
            self.fs.set(("use_ssl",), value, source)
        elif name == "client_kwargs":
            self.s3_client_kwargs(_mapping(value, name))
        elif name == "config_kwargs":
            self.s3_config_kwargs(_mapping(value, name))
        else:
            return self.shared_name(name, value, source, client=S3FS, kind="S3",
                                    beyond=_S3FS_BEYOND_OBSTORE, tuning=_S3FS_TUNING)
        return True

    def shared_name(self, name: str, value: Any, source: str, *, client: str, kind: str,
                    beyond: Collection[str], tuning: Collection[str]) -> bool:
        """The names every kind of store takes alike: its fsspec client's own options and
        caches, obstore's client options, the store's arguments; False for none of them."""
        if name in beyond:
            self.fs.set((name,), value, source)
            self.beyond(OBSTORE, source, f"it is an {client} option with no obstore setting",
                        "")
        elif name in tuning:
            self.fs.set((name,), value, source)
            self.not_for(OBSTORE, source, f"it configures {client}'s own cache")
        elif name in _ANY_TUNING:
            other = ADLFS if client == S3FS else S3FS
            self.not_for(f"any {kind} client", source, f"it configures {other}'s own cache")
        elif name in CLIENT_OPTIONS:
            self.client_option(name, value, source)
        elif name in STORE_ARGUMENTS:
            self.store_arguments(name, value)
        else:
            return False
        return True

    def s3_client_kwargs(self, client_kwargs: Mapping[str, Any]) -> None:
        unknown = []
        for name, value in client_kwargs.items():
            source = f"client_kwargs[{name!r}]"
            if value is None:
                continue
            if name in _S3_SAME or name == "requester_pays":
                self.s3_name(name, value, source)
            elif name == "verify":
                if value is False:
                    self.client_options.set(("allow_invalid_certificates",), True, source)
                elif isinstance(value, str):
                    self.client_options.set(("root_certificate",), value, source)
                self.fs.set(("client_kwargs", "verify"), value, source)
            elif name == "use_ssl":
                self.s3_name(name, value, source)
            elif name in _S3FS_CLIENT_KWARGS_OWN:
                self.fs.set(("client_kwargs", name), value, source)
                self.beyond(OBSTORE, source, f"it is an {S3FS} option with no obstore setting",
                            "")
            else:
                unknown.append(name)
        self.unknown("client_kwargs", unknown,
                     {*_S3_SAME, "requester_pays", "verify", "use_ssl"}, S3FS)

    def s3_config_kwargs(self, config_kwargs: Mapping[str, Any]) -> None:
        """botocore ``Config`` settings: s3fs takes them all; obstore those it has."""
        unknown = []
        for name, value in config_kwargs.items():
            source = f"config_kwargs[{name!r}]"
            if name == "s3":
                self.s3_botocore_s3(_mapping(value, source))
            elif name in ("connect_timeout", "read_timeout"):
                seconds = seconds_of(value, source)
                # botocore's read timeout bounds each read of an answer; obstore's
                # ``timeout`` a whole request, its nearest equivalent.
                target = "connect_timeout" if name == "connect_timeout" else "timeout"
                self.client_options.set((target,), timedelta(seconds=seconds), source,
                                        weak=True)
                self.fs.set(("config_kwargs", name), value, source)
            elif name in _BOTOCORE_OWN_WAY:
                self.fs.set(("config_kwargs", name), value, source)
                self.not_for(OBSTORE, source, "obstore has its own pools, retries and checks")
            elif name == "user_agent":
                self.fs.set(("config_kwargs", name), value, source)
                self.client_options.set(("user_agent",), value, source)
            elif name == "proxies" and len(set(_mapping(value, source).values())) == 1:
                # One proxy for every scheme: obstore's proxy_url.
                self.fs.set(("config_kwargs", name), value, source)
                self.client_options.set(("proxy_url",), next(iter(value.values())), source)
            elif name in ("proxies", "proxies_config") or _botocore_option(name):
                self.fs.set(("config_kwargs", name), value, source)
                self.beyond(OBSTORE, source, "a botocore setting with no obstore equivalent",
                            "")
            else:
                unknown.append(name)
        self.unknown("config_kwargs", unknown, {"s3", "connect_timeout", "read_timeout",
                                                *_BOTOCORE_OWN_WAY}, "botocore")

    def s3_botocore_s3(self, s3: Mapping[str, Any]) -> None:
        for name, value in s3.items():
            source = f"config_kwargs['s3'][{name!r}]"
            self.fs.set(("config_kwargs", "s3", name), value, source)
            if name == "addressing_style":
                self.config.set(("virtual_hosted_style_request",), value == "virtual", source)
            elif name == "payload_signing_enabled":
                self.config.set(("unsigned_payload",), not _true(value), source)
            elif _close_name(name, ("addressing_style", "payload_signing_enabled")):
                raise ConfigurationError(unknown_message(
                    "config_kwargs['s3']", [name], ("addressing_style", "payload_signing_enabled"),
                    "botocore"))
            else:
                self.beyond(OBSTORE, source, "a botocore setting with no obstore equivalent",
                            "")

    # -- Azure ----------------------------------------------------------------------------

    def azure(self, options: Mapping[str, Any]) -> None:
        unknown = []
        connection_string = options.get("connection_string")
        if connection_string:
            self.fs.set(("connection_string",), connection_string, "connection_string")
            for target, value in parse_connection_string(str(connection_string)).items():
                sink = self.client_options if target == "allow_http" else self.config
                sink.set((target,), value, "connection_string", weak=True)
        for name, value in options.items():
            if name in OUR_OPTIONS or name == "connection_string":
                continue
            if name not in AZURE_NAMES:
                unknown.append(name)
            elif name in _VOLUME_DECIDES:
                self.not_for(ADLFS, name, "the volume makes one synchronous client per process")
            elif value is None:
                pass
            elif name in _AZURE_SAME:
                target, adlfs = _AZURE_SAME[name]
                self.config.set((target,), value, name)
                self.fs.set((adlfs,), value, name)
            elif name in ("anon", "skip_signature"):
                if _true(value):
                    self.config.set(("skip_signature",), True, name)
                    self.fs.set(("anon",), True, name)
            elif name == "account_host":
                host = str(value)
                self.config.set(("endpoint",), host if "://" in host else f"https://{host}",
                                name)
                self.fs.set(("account_host",), value, name)
            elif name == "endpoint":
                self.config.set(("endpoint",), value, name)
            elif name == "credential":
                self.fs.set(("credential",), value, name)
                self.beyond(
                    OBSTORE, name, "an azure-identity credential object",
                    "pass client_id/client_secret/tenant_id, account_key or sas_token, or a "
                    "credential_provider (obstore.auth.azure.AzureCredentialProvider)",
                )
            elif name in _AZURE_BEYOND_ADLFS:
                self.config.set((name,), value, name)
                self.beyond(ADLFS, name, _AZURE_BEYOND_ADLFS[name], "remove it")
            elif name == "disable_tagging":
                self.config.set((name,), value, name)
                self.not_for(ADLFS, name, "adlfs tags nothing")
            elif name in _ADLFS_TIMEOUTS:
                self.client_option(_ADLFS_TIMEOUTS[name], value, name)
            elif not self.shared_name(name, value, name, client=ADLFS, kind="Azure",
                                      beyond=_ADLFS_BEYOND_OBSTORE, tuning=_ADLFS_TUNING):
                unknown.append(name)
        self.unknown("storage_options", unknown, AZURE_NAMES, ADLFS)
        self.azure_endpoint_for_adlfs()

    def azure_endpoint_for_adlfs(self) -> None:
        """adlfs takes a custom endpoint as a host (always https) or in a connection string."""
        given = self.config.values.get(("endpoint",))
        if not given or ("connection_string",) in self.fs.values or (
            ("account_host",) in self.fs.values
        ):
            return
        endpoint = str(given).rstrip("/")
        parts = urlsplit(endpoint)
        if parts.scheme.lower() == "https":
            self.fs.set(("account_host",), parts.netloc + parts.path, "endpoint")
            return
        account = self.config.values.get(("account_name",))
        key = self.config.values.get(("account_key",))
        sas = self.config.values.get(("sas_key",))
        if account and (key or sas):
            secret = f"AccountKey={key}" if key else f"SharedAccessSignature={sas}"
            self.fs.set(
                ("connection_string",),
                f"DefaultEndpointsProtocol={parts.scheme};AccountName={account};{secret};"
                f"BlobEndpoint={endpoint};",
                "endpoint",
            )
            return
        self.beyond(
            ADLFS, "endpoint", "adlfs reaches a plain http:// endpoint only through a "
            "connection string, which needs account_name and account_key or sas_token",
            "give account_name with account_key or sas_token, or a connection_string",
        )


def _customer_key(value: Any, source: str) -> bytes:
    """The 32-byte SSE-C key given base64 in ``value`` (the message never shows it)."""
    try:
        key = base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigurationError(
            f"storage_options {_quoted(source)} is not base64 text: give the 32-byte "
            "customer key base64-encoded."
        ) from None
    if len(key) != 32:
        raise ConfigurationError(
            f"storage_options {_quoted(source)} holds {len(key)} bytes; an SSE-C customer "
            "key is 32 bytes (AES-256)."
        )
    return key


def server_side_encryption(kind: str, options: Mapping[str, Any]) -> str | None:
    """How a volume with these (valid) options asks the store to encrypt: an S3
    algorithm (``"sse-c"``, ``"aws:kms"``...), ``"customer-key"`` for Azure's, or None."""
    try:
        spelling = spell(kind, split_ours(options)[1])
    except ConfigurationError:
        return None
    if kind == "azure":
        return "customer-key" if spelling.obstore.config.get("encryption_key") else None
    algorithm = spelling.obstore.config.get("server_side_encryption")
    return str(algorithm) if algorithm else None


def parse_connection_string(text: str) -> dict[str, Any]:
    """Azure's ``Key=Value;...`` connection string as obstore settings."""
    parts: dict[str, str] = {}
    for item in text.split(";"):
        name, eq, value = item.partition("=")
        if eq:
            parts[name.strip().lower()] = value.strip()
    out: dict[str, Any] = {}
    for name, target in (("accountname", "account_name"), ("accountkey", "account_key"),
                         ("sharedaccesssignature", "sas_key")):
        if name in parts:
            out[target] = parts[name]
    if "blobendpoint" in parts:
        endpoint = parts["blobendpoint"].rstrip("/")
        out["endpoint"] = endpoint
        if urlsplit(endpoint).scheme == "http":
            out["allow_http"] = True
    return out


def refuse(beyond: list[Beyond], how_served: str, more_fix: str = "") -> None:
    """Raise for the names in ``beyond`` (one client's), where that client serves the
    volume (``how_served``: how it came to; ``more_fix``: another way out)."""
    if not beyond:
        return
    first = beyond[0]
    names = ", ".join(repr(b.name) for b in beyond)
    whys = "; ".join(f"{b.name}: {b.why}" for b in beyond)
    fixes = [b.fix for b in beyond if b.fix]
    if first.client == OBSTORE:
        fix = (
            "; ".join(dict.fromkeys(fixes)) + ", or " if fixes else "remove it, use obstore's "
            "name for it (see the obstore store docs), or "
        )
        raise ConfigurationError(
            f"storage_options {names} cannot be passed to the object-store client (obstore): "
            f"{whys}. Fix: {fix}set DCP_VOLUMES_BACKEND=fsspec to use the fsspec client, "
            "which takes it."
        )
    fix = "; ".join([*dict.fromkeys(fixes), *([more_fix] if more_fix else [])])
    raise ConfigurationError(
        f"storage_options {names} cannot be honoured by {first.client} ({whys}), {how_served}. "
        f"Fix: {fix}."
    )


def fallback_refusal(kind: str, options: Mapping[str, Any]) -> list[Beyond]:
    """The names the fsspec client of ``kind`` cannot honour (empty: it can take over)."""
    return spell(kind, split_ours(options)[1]).beyond_fsspec


def fsspec_kwargs(
    kind: str, options: Mapping[str, Any], how_served: str, more_fix: str = ""
) -> dict[str, Any]:
    """``options`` (without ours) as the keyword arguments of ``kind``'s fsspec client,
    or an error naming what it cannot honour (see ``refuse``)."""
    spelling = spell(kind, options)
    refuse(spelling.beyond_fsspec, how_served, more_fix)
    kwargs = spelling.fsspec
    if kind == "s3" and "endpoint_url" not in kwargs:
        # obstore's own variable (AWS_ENDPOINT), which botocore does not read: the
        # same store for both clients.
        variable, endpoint = _env.aws_endpoint_source()
        if variable == "AWS_ENDPOINT":
            kwargs["endpoint_url"] = endpoint
    return kwargs


def other_fsspec_kwargs(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a protocol fsspec alone serves (GCS, any other): its own names,
    less what the volume decides for every client."""
    return {k: v for k, v in options.items() if k not in _VOLUME_DECIDES}


def endpoint_of(options: Mapping[str, Any]) -> str:
    """The endpoint (S3) or account (Azure) the options name, whichever spelling gave it."""
    client = options.get("client_kwargs") or {}
    if not isinstance(client, Mapping):
        client = {}
    found = (
        options.get("endpoint_url") or client.get("endpoint_url") or options.get("endpoint")
        or options.get("account_name")
    )
    return str(found or "")


# -- messages and values ------------------------------------------------------------------------


def unknown_message(where: str, names: Collection[str], known: Collection[str],
                    peer: str) -> str:
    """The refusal of option names no client takes (never their values: they may be secrets).

    A name close to a known one is most likely a misspelling, and the fix is the right
    spelling.
    """
    ordered = sorted(names)
    listed = ", ".join(repr(n) for n in ordered)
    guesses = {name: guess for name in ordered if (guess := _close_name(name, known))}
    meant = ", ".join(f"{guess!r}" if len(ordered) == 1 else f"{guess!r} for {name!r}"
                      for name, guess in guesses.items())
    if len(guesses) == len(ordered):
        return (
            f"{where} {listed}: no such {peer} option or obstore setting; did you mean "
            f"{meant}? Fix: correct the name (a misspelt option would otherwise leave a "
            "credential or an endpoint unset)."
        )
    hint = f" (did you mean {meant}?)" if guesses else ""
    return (
        f"{where} {listed}: neither a setting of {peer} nor of obstore{hint}, so no "
        f"client of this volume takes it ({peer} would fail on it in every worker). Fix: "
        "remove it, or use one of the names docs/volumes.md lists for what you mean."
    )


def _close_name(name: str, known: Collection[str]) -> str | None:
    """The known option name ``name`` most likely misspells, if one is close enough."""
    found = difflib.get_close_matches(name.lower(), list(known), n=1, cutoff=0.8)
    return found[0] if found else None


def _quoted(source: str) -> str:
    """A top-level name in quotes; a nested one (``client_kwargs['x']``) as it is."""
    return source if "[" in source else repr(source)


def _subscript(source: str) -> str:
    """``['name']`` for a top-level name, `` client_kwargs['x']`` for a nested one."""
    return f" {source}" if "[" in source else f"[{source!r}]"


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"storage_options {where} must be a mapping (a dict), not {type(value).__name__}."
        )
    return value


_DURATION = re.compile(r"(?:\s*\d+(?:\.\d*)?\s*[a-z]*)+\s*")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?)\s*([a-z]*)")
_UNIT_SECONDS = {
    "": 1.0, "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "ms": 1e-3, "msec": 1e-3, "millis": 1e-3, "us": 1e-6, "ns": 1e-9,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0, "d": 86400.0, "day": 86400.0,
    "days": 86400.0,
}


def seconds_of(value: Any, source: str) -> float:
    """A duration as obstore takes it (a ``timedelta``, ``"10s"``, ``"1m 30s"``, ``"500ms"``)
    or as the fsspec clients do (a number of seconds), in seconds."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and _DURATION.fullmatch(value.lower()):
        parts = _DURATION_PART.findall(value.lower())
        if all(unit in _UNIT_SECONDS for _, unit in parts):
            return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    raise ConfigurationError(
        f"storage_options{_subscript(source)}={value!r} is not a duration. Fix: give "
        "seconds (10), "
        "a datetime.timedelta, or a string such as '10s', '500ms' or '1m 30s'."
    )


def _obstore_duration(name: str, value: Any) -> Any:
    """A duration for obstore, which takes strings and timedeltas: numbers of seconds (the
    fsspec clients' form) become timedeltas; anything else goes as it was given."""
    if name in _DURATIONS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value)
    return value


def _botocore_option(name: str) -> bool:
    """Whether botocore's ``Config`` takes ``name`` (only asked for a name not known here)."""
    try:
        from botocore.config import Config
    except ImportError:
        return False
    return name in Config.OPTION_DEFAULTS
