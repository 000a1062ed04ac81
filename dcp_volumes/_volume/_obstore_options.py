"""The ``storage_options`` users already pass (s3fs / adlfs names) as obstore store settings.

Users of fsspec-based tools pass ``key``/``secret``/``client_kwargs`` (s3fs) or
``account_name``/``account_key``/``connection_string`` (adlfs). Those are mapped
here to obstore's config keys, and obstore's own keys (``access_key_id``,
``endpoint``, ``client_options``, ``retry_config``, ...) pass through as they are.
A key that is neither is a ``ConfigurationError`` naming it: a credential or an
endpoint that was silently dropped would send the job to another store.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from dcp_volumes import _env
from dcp_volumes._exceptions import ConfigurationError, VolumeAccessError
from dcp_volumes._volume._retry import RetryPolicy
from dcp_volumes._volume._stall import StallGuard

logger = logging.getLogger("dcp_volumes._volume")

# s3fs / adlfs settings of their own client caches and event loops: they mean
# nothing to obstore's data path, and tools pass them routinely.
_CLIENT_CACHE_OPTIONS = frozenset(
    {
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "skip_instance_cache",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "asynchronous",
        "loop",
        "max_concurrency",
        "fixed_upload_size",
        "cache_regions",
        "version_aware",
        "blocksize",
    }
)
_CLIENT_OPTIONS = frozenset(
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
# obstore's own S3 / Azure config keys (its ``S3Config`` / ``AzureConfig``).
_S3_KEYS = frozenset(
    {
        "access_key_id",
        "secret_access_key",
        "session_token",
        "bucket",
        "checksum_algorithm",
        "conditional_put",
        "container_credentials_relative_uri",
        "container_credentials_full_uri",
        "container_authorization_token_file",
        "copy_if_not_exists",
        "default_region",
        "disable_tagging",
        "disable_bulk_delete",
        "endpoint",
        "imdsv1_fallback",
        "metadata_endpoint",
        "region",
        "request_payer",
        "role_arn",
        "role_session_name",
        "server_side_encryption",
        "skip_signature",
        "sse_bucket_key_enabled",
        "sse_kms_key_id",
        "sts_endpoint",
        "unsigned_payload",
        "virtual_hosted_style_request",
        "web_identity_token_file",
        "s3_express",
    }
)
_AZURE_KEYS = frozenset(
    {
        "account_name",
        "account_key",
        "client_id",
        "client_secret",
        "credential_type",
        "tenant_id",
        "authority_host",
        "sas_key",
        "token",
        "use_emulator",
        "use_fabric_endpoint",
        "encryption_key",
        "endpoint",
        "msi_endpoint",
        "object_id",
        "msi_resource_id",
        "federated_token_file",
        "use_azure_cli",
        "skip_signature",
        "container_name",
        "disable_tagging",
    }
)
# obstore's (object_store's) own request timeout when none is configured.
_CLIENT_DEFAULT_TIMEOUT_S = 30.0
# Options the store takes as keyword arguments of its own, not config keys.
_STORE_ARGUMENTS = frozenset({"client_options", "retry_config", "credential_provider"})
# s3fs's names (top level and in client_kwargs) and what obstore calls them.
_S3FS_RENAMES = {
    "key": "access_key_id",
    "aws_access_key_id": "access_key_id",
    "secret": "secret_access_key",
    "aws_secret_access_key": "secret_access_key",
    "token": "session_token",
    "aws_session_token": "session_token",
    "endpoint_url": "endpoint",
    "region_name": "region",
    "requester_pays": "request_payer",
}
# s3fs options handled here besides the renames (client_kwargs' own: verify, use_ssl).
_S3FS_OPTIONS = frozenset({"client_kwargs", "config_kwargs", "use_ssl", "anon", "profile"})
_S3FS_CLIENT_KWARGS = frozenset({*_S3FS_RENAMES, "verify", "use_ssl"})
_BOTOCORE_CONFIG = frozenset(
    {
        "s3",
        "connect_timeout",
        "read_timeout",
        "max_pool_connections",
        "retries",
        "request_checksum_calculation",
        "response_checksum_validation",
        "signature_version",
    }
)
_ADLFS_OPTIONS = frozenset(
    {"connection_string", "sas_token", "account_host", "credential", "anon"}
)
# Every top-level option name an S3 or an Azure volume takes, for "did you mean".
_S3_NAMES = frozenset(
    {*_S3FS_RENAMES, *_S3FS_OPTIONS, *_S3_KEYS, *_CLIENT_OPTIONS, *_CLIENT_CACHE_OPTIONS,
     *_STORE_ARGUMENTS}
)
_AZURE_NAMES = frozenset(
    {*_ADLFS_OPTIONS, *_AZURE_KEYS, *_CLIENT_OPTIONS, *_CLIENT_CACHE_OPTIONS, *_STORE_ARGUMENTS}
)


# A class of requests that share a store (``_stall.py``): ("read" | "upload" | "server",
# seconds).
RequestClass = tuple[str, float]


@dataclass
class StoreSettings:
    """Keyword arguments for one ``S3Store`` / ``AzureStore`` (the bucket comes later)."""

    config: dict[str, Any] = field(default_factory=dict)
    client_options: dict[str, Any] = field(default_factory=dict)
    retry_config: dict[str, Any] = field(default_factory=dict)
    credential_provider: Any = None
    # Where ``config["endpoint"]`` came from, for messages: "storage_options" or the
    # environment variable that gave it ("" when no endpoint is configured).
    endpoint_source: str = ""
    # The stall detector's deadlines (``_stall.py``); None where the user set the
    # client's read timeout, or the policy turned stall detection off.
    stall: StallGuard | None = None
    # Whether retry_config is the policy's (True) or the user's own.
    own_retry_config: bool = True

    def __repr__(self) -> str:
        # The config holds credentials: name its keys, never its values.
        return (
            f"StoreSettings(config keys={sorted(self.config)}, "
            f"client_options keys={sorted(self.client_options)}, "
            f"endpoint_source={self.endpoint_source!r})"
        )

    def kwargs(self, request: RequestClass | None = None) -> dict[str, Any]:
        """The keyword arguments of a store for one class of requests (``_stall.py``):
        ``("read", s)``: wait ``s`` for each next piece of an answer; ``("upload", s)``:
        ``s`` from the start to the answer; ``("server", inf)``: the request timeout
        alone; ``None``: the settings as they are."""
        client_options = dict(self.client_options)
        retry = dict(self.retry_config)
        if request is None or self.stall is None:
            pass
        elif request[0] == "server":
            client_options.pop("read_timeout", None)
        else:
            seconds = request[1]
            client_options["read_timeout"] = timedelta(seconds=seconds)
            # The client's own 30 s would cut a request the learnt deadline allows.
            client_options.setdefault(
                "timeout", timedelta(seconds=max(_CLIENT_DEFAULT_TIMEOUT_S, 2 * seconds))
            )
            if self.own_retry_config:
                # One try more inside the client (a 503 on one part does not restart the
                # file), then the volume's loop: its next try waits longer, if learnt.
                retry["max_retries"] = min(1, int(retry.get("max_retries", 1)))
        out: dict[str, Any] = {"config": self.config, "client_options": client_options}
        out["retry_config"] = retry
        if self.credential_provider is not None:
            out["credential_provider"] = self.credential_provider
        return out


def retry_config(policy: RetryPolicy) -> dict[str, Any]:
    """obstore's retry settings for ``policy``: it retries each request itself, GIL released."""
    return {
        "max_retries": policy.attempts - 1,
        "backoff": {
            "init_backoff": timedelta(seconds=max(policy.base_delay_s, 0.001)),
            "max_backoff": timedelta(seconds=max(policy.max_delay_s, 0.001)),
            "base": 2,
        },
        # A bound on one request's retries, so a dead endpoint fails in bounded time;
        # each try may take its whole timeout (a stalled request), else a stall would
        # use up the bound before its first retry.
        "retry_timeout": timedelta(
            seconds=max(1.0, policy.attempts * (policy.max_delay_s + request_timeout_s(policy)))
        ),
    }


def request_timeout_s(policy: RetryPolicy) -> float:
    """Seconds one request may take before obstore abandons and retries it."""
    return policy.timeout_s if policy.timeout_s is not None else _CLIENT_DEFAULT_TIMEOUT_S


def s3_settings(options: Mapping[str, Any], policy: RetryPolicy) -> StoreSettings:
    """``S3Store`` settings for s3fs-style (or obstore) ``options``."""
    out = _start(options, policy)
    opts = dict(options)
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    config_kwargs = dict(opts.pop("config_kwargs", None) or {})
    for source in (client_kwargs, opts):
        for name in list(source):
            if name in _S3FS_RENAMES:
                value = source.pop(name)
                if value is not None:
                    out.config[_S3FS_RENAMES[name]] = value
    if client_kwargs.pop("verify", True) is False:
        out.client_options["allow_invalid_certificates"] = True
    if client_kwargs.pop("use_ssl", True) is False or opts.pop("use_ssl", True) is False:
        out.client_options["allow_http"] = True
    if opts.pop("anon", False):
        out.config["skip_signature"] = True
    profile = opts.pop("profile", None)
    if profile is not None:
        out.credential_provider = _boto3_chain(profile)
    _config_kwargs(config_kwargs, out)
    _unmapped("client_kwargs", client_kwargs, "s3fs", _S3FS_CLIENT_KWARGS)
    _rest(opts, out, _S3_KEYS, "s3fs", _S3_NAMES)
    if out.config.get("endpoint"):
        out.endpoint_source = "storage_options"
    else:
        # The SDKs' variables, read here rather than left to obstore: the endpoint's
        # scheme decides plain http wherever it comes from, and the S3 variable wins
        # over the general one, as in the AWS SDKs.
        variable, endpoint = _env.aws_endpoint_source()
        if endpoint:
            out.config["endpoint"] = endpoint
            out.endpoint_source = variable
    _allow_plain_http(out)
    if not _is_plain_http(out.config.get("endpoint")):
        _unsigned_over_tls(out)
    if "endpoint" in out.config:
        # A custom endpoint (MinIO, Ceph, a proxy) addresses buckets by path, as
        # s3fs and botocore do for it; obstore would put the bucket in the host.
        out.config.setdefault("virtual_hosted_style_request", False)
    if "region" not in out.config and "default_region" not in out.config:
        out.config["region"] = "us-east-1"  # requests must be signed for some region
    _check_aws_credentials(out)
    _stall_detection(out, policy)
    return out


def _stall_detection(out: StoreSettings, policy: RetryPolicy) -> None:
    """Reads wait ``policy.stall_s`` for each next piece of an answer (``_stall.py``);
    a ``read_timeout`` of the user's own wins, and turns the learnt deadlines off."""
    if policy.stall_s is None or "read_timeout" in out.client_options:
        return
    out.client_options["read_timeout"] = timedelta(seconds=policy.stall_s)
    out.stall = StallGuard(stall_s=policy.stall_s, min_rate=policy.min_rate)


def _is_plain_http(endpoint: object) -> bool:
    return isinstance(endpoint, str) and urlsplit(endpoint.strip()).scheme.lower() == "http"


def _allow_plain_http(out: StoreSettings) -> None:
    """An ``http://`` endpoint is a request for plain http: obstore's client refuses to
    build any request to one unless ``allow_http`` is set (the user's setting wins)."""
    if _is_plain_http(out.config.get("endpoint")):
        out.client_options.setdefault("allow_http", True)


def _unsigned_over_tls(out: StoreSettings) -> None:
    """Over TLS, send bodies unsigned (``UNSIGNED-PAYLOAD``), as botocore does for S3.

    TLS already protects the body in transit; signing it costs a SHA-256 pass
    over every byte before the first one is sent (CPU on the training host,
    and every page of the staged file mapped at once; benchmarks/HISTORY.md).
    The user's ``unsigned_payload`` (or ``AWS_UNSIGNED_PAYLOAD``) wins.
    """
    if "unsigned_payload" not in out.config and not _env.aws_unsigned_payload_set():
        out.config["unsigned_payload"] = True


def _check_aws_credentials(out: StoreSettings) -> None:
    """Refuse early where the only place left to find credentials is switched off.

    With no credentials given, the AWS chain ends at the instance-metadata
    service; botocore's ``AWS_EC2_METADATA_DISABLED=true`` says not to ask it,
    which obstore does not read, so it is honoured here.
    """
    given = (
        out.config.get("access_key_id")
        or out.config.get("skip_signature")
        or out.credential_provider is not None
        or _env.aws_credentials_in_environment()
    )
    if not given and _boto3_installed():
        # The full AWS chain as users know it from the SDKs (AWS_PROFILE, the shared
        # credentials and config files, SSO, then instance metadata); obstore's own
        # chain reads only environment variables and metadata.
        out.credential_provider = _boto3_chain(None)
        return
    if not given and _env.aws_metadata_disabled():
        raise VolumeAccessError(
            "No AWS credentials: none in storage_options (key/secret, anon=True, profile) or "
            "the environment (AWS_ACCESS_KEY_ID, a web identity or container credentials), "
            "and AWS_EC2_METADATA_DISABLED=true rules out instance metadata. Fix: pass "
            "credentials, or anon=True for a public bucket."
        )


def azure_settings(options: Mapping[str, Any], policy: RetryPolicy) -> StoreSettings:
    """``AzureStore`` settings for adlfs-style (or obstore) ``options``."""
    out = _start(options, policy)
    opts = dict(options)
    connection_string = opts.pop("connection_string", None)
    if connection_string:
        _connection_string(str(connection_string), out)
    renames = {"sas_token": "sas_key", "account_host": "endpoint", "credential": None}
    for name, target in renames.items():
        if name in opts:
            value = opts.pop(name)
            if target is None:
                raise ConfigurationError(
                    f"storage_options['{name}'] (an azure-identity credential object) cannot be "
                    "used with obstore. Fix: pass client_id/client_secret/tenant_id, "
                    "account_key or sas_token, or a credential_provider "
                    "(obstore.auth.azure.AzureCredentialProvider)."
                )
            if value is not None:
                if target == "endpoint" and "://" not in str(value):
                    value = f"https://{value}"
                out.config[target] = value
    if opts.pop("anon", False):
        out.config["skip_signature"] = True
    _rest(opts, out, _AZURE_KEYS, "adlfs", _AZURE_NAMES)
    if out.config.get("endpoint"):
        out.endpoint_source = "storage_options"
    _allow_plain_http(out)
    _stall_detection(out, policy)
    return out


def azure_account_from_url(netloc: str) -> tuple[str, str | None]:
    """(container, account) of an ``abfs://container@account.dfs.core.windows.net`` netloc."""
    container, at, host = netloc.partition("@")
    if not at:
        return netloc, None
    return container, host.split(".", 1)[0] or None


def _start(options: Mapping[str, Any], policy: RetryPolicy) -> StoreSettings:
    if not isinstance(options, Mapping):
        raise ConfigurationError(
            f"storage_options must be a mapping (a dict), not {type(options).__name__}."
        )
    out = StoreSettings(retry_config=retry_config(policy))
    if policy.timeout_s is not None:
        out.client_options["timeout"] = timedelta(seconds=policy.timeout_s)
    # The user's own client options (here and as top-level keys, see _rest) win.
    out.client_options.update(dict(options.get("client_options") or {}))
    if options.get("retry_config"):
        out.retry_config = dict(options["retry_config"])
        out.own_retry_config = False
    out.credential_provider = options.get("credential_provider")
    return out


def _rest(
    opts: dict[str, Any],
    out: StoreSettings,
    keys: frozenset[str],
    peer: str,
    known: Collection[str],
) -> None:
    """obstore's own keys pass through; s3fs/adlfs cache settings are ignored; anything else
    is an error naming it (``known``: the names it may be a misspelling of)."""
    for name, value in opts.items():
        if name in _STORE_ARGUMENTS:
            continue
        if name in _CLIENT_CACHE_OPTIONS:
            logger.debug("storage option %r configures %s's own cache: not used", name, peer)
            continue
        if name in _CLIENT_OPTIONS:
            out.client_options[name] = value
        elif name in keys:
            out.config[name] = value
        else:
            _unmapped("storage_options", {name: value}, peer, known)


def _unmapped(where: str, rest: Mapping[str, Any], peer: str, known: Collection[str]) -> None:
    """Refuse the option names in ``rest`` (never their values: they may be secrets).

    A name close to one in ``known`` is most likely a misspelling, and the fix is
    the right spelling, not another client.
    """
    if not rest:
        return
    names = sorted(rest)
    listed = ", ".join(repr(n) for n in names)
    guesses = {name: guess for name in names if (guess := _close_name(name, known))}
    meant = ", ".join(f"{guess!r}" if len(names) == 1 else f"{guess!r} for {name!r}"
                      for name, guess in guesses.items())
    if len(guesses) == len(names):
        raise ConfigurationError(
            f"{where} {listed}: no such {peer} option or obstore setting; did you mean "
            f"{meant}? Fix: correct the name (a misspelt option would otherwise leave a "
            "credential or an endpoint unset)."
        )
    hint = f" (did you mean {meant}?)" if guesses else ""
    raise ConfigurationError(
        f"{where} {listed} cannot be passed to the object-store client (obstore): it is "
        f"neither a {peer} option this library maps nor one of obstore's own settings{hint}. "
        "Fix: remove it, use obstore's name for it (see the obstore store docs), or "
        "set DCP_VOLUMES_BACKEND=fsspec to use the fsspec client, which takes it."
    )


def _close_name(name: str, known: Collection[str]) -> str | None:
    """The known option name ``name`` most likely misspells, if one is close enough."""
    found = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.8)
    return found[0] if found else None


def _config_kwargs(config_kwargs: dict[str, Any], out: StoreSettings) -> None:
    """botocore ``Config`` settings that have an obstore equivalent."""
    s3 = dict(config_kwargs.pop("s3", None) or {})
    style = s3.pop("addressing_style", None)
    if style is not None:
        out.config["virtual_hosted_style_request"] = style == "virtual"
    _unmapped("config_kwargs['s3']", s3, "botocore", ("addressing_style",))
    for name, target in (("connect_timeout", "connect_timeout"), ("read_timeout", "timeout")):
        if name in config_kwargs:
            out.client_options[target] = timedelta(seconds=float(config_kwargs.pop(name)))
    # Connection pools, botocore's own retries and checksums: obstore has its own.
    for name in _BOTOCORE_CONFIG:
        config_kwargs.pop(name, None)
    _unmapped("config_kwargs", config_kwargs, "botocore", _BOTOCORE_CONFIG)


def _connection_string(text: str, out: StoreSettings) -> None:
    """Azure's ``Key=Value;...`` connection string as config keys."""
    parts: dict[str, str] = {}
    for item in text.split(";"):
        name, eq, value = item.partition("=")
        if eq:
            parts[name.strip().lower()] = value.strip()
    if "accountname" in parts:
        out.config["account_name"] = parts["accountname"]
    if "accountkey" in parts:
        out.config["account_key"] = parts["accountkey"]
    if "sharedaccesssignature" in parts:
        out.config["sas_key"] = parts["sharedaccesssignature"]
    if "blobendpoint" in parts:
        endpoint = parts["blobendpoint"].rstrip("/")
        out.config["endpoint"] = endpoint
        if urlsplit(endpoint).scheme == "http":
            out.client_options["allow_http"] = True


def _boto3_installed() -> bool:
    try:
        import boto3  # noqa: F401
    except ImportError:
        return False
    return True


def _boto3_chain(profile: str | None) -> Any:
    """obstore credentials from boto3's chain (for ``profile``, or the default one)."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError as exc:
        raise ConfigurationError(
            f"storage_options['profile']={profile!r} needs boto3 to read the AWS profile. "
            "Fix: pip install 'dcp_volumes[fsspec-clients]' (or boto3), or pass key/secret."
        ) from exc
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=profile))
    except ValueError as exc:  # what the provider raises when the chain found nothing
        where = f"the AWS profile {profile!r}" if profile else "the AWS credential chain"
        raise VolumeAccessError(
            f"No AWS credentials: none in storage_options (key/secret, anon=True) and "
            f"{where} (environment, ~/.aws files, SSO, instance metadata) found none. "
            "Fix: pass credentials, configure the profile, or anon=True for a public bucket."
        ) from exc
