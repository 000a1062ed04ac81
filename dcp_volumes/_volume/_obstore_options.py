"""The ``storage_options`` of an S3 or Azure volume as obstore store settings.

``_options.spell`` reads the names (s3fs's, adlfs's and obstore's own) into
obstore's spelling, alongside the fsspec client's; this module completes them
with what the volume adds: the retry policy's settings, the endpoint and
credentials the environment gives, plain http for an ``http://`` endpoint,
unsigned bodies over TLS, and the stall detector's deadlines.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from dcp_volumes import _env
from dcp_volumes._exceptions import ConfigurationError, VolumeAccessError
from dcp_volumes._volume._options import ObstoreArgs, Spelling, refuse, spell
from dcp_volumes._volume._retry import RetryPolicy
from dcp_volumes._volume._stall import StallGuard

logger = logging.getLogger("dcp_volumes._volume")

# obstore's (object_store's) own request timeout when none is configured.
_CLIENT_DEFAULT_TIMEOUT_S = 30.0

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
    spelling = _obstore_spelling("s3", options)
    out = _start(spelling.obstore, policy)
    if spelling.obstore.profile is not None:
        out.credential_provider = _boto3_chain(spelling.obstore.profile)
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
    out = _start(_obstore_spelling("azure", options).obstore, policy)
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


def _obstore_spelling(kind: str, options: Mapping[str, Any]) -> Spelling:
    """``options`` in obstore's spelling; an error naming any that obstore cannot take."""
    spelling = spell(kind, options)
    refuse(spelling.beyond_obstore, "which serves this volume")
    return spelling


def _start(args: ObstoreArgs, policy: RetryPolicy) -> StoreSettings:
    out = StoreSettings(retry_config=retry_config(policy))
    if policy.timeout_s is not None:
        out.client_options["timeout"] = timedelta(seconds=policy.timeout_s)
    # The user's own client options win.
    out.client_options.update(args.client_options)
    out.config.update(args.config)
    if args.retry_config:
        out.retry_config = dict(args.retry_config)
        out.own_retry_config = False
    out.credential_provider = args.credential_provider
    return out


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
