"""storage_options users already pass (s3fs / adlfs names) become obstore settings, or a clear
error naming the option; nothing is silently dropped."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes._volume import RetryPolicy, Volume
from dcp_volumes._volume._obstore_options import azure_settings, s3_settings

POLICY = RetryPolicy(attempts=3, base_delay_s=0.5, max_delay_s=4.0)


def test_s3fs_names_map_to_obstore_keys() -> None:
    out = s3_settings(
        {
            "key": "AKIAEXAMPLE",
            "secret": "s3cr3t-value",
            "token": "session",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
            "config_kwargs": {"s3": {"addressing_style": "virtual"}, "connect_timeout": 5},
            "requester_pays": True,
            "use_listings_cache": False,  # s3fs's own cache: ignored
        },
        POLICY,
    )
    assert out.config["access_key_id"] == "AKIAEXAMPLE"
    assert out.config["secret_access_key"] == "s3cr3t-value"
    assert out.config["session_token"] == "session"
    assert out.config["endpoint"] == "http://127.0.0.1:9000"
    assert out.config["region"] == "eu-west-1"
    assert out.config["virtual_hosted_style_request"] is True
    assert out.config["request_payer"] is True
    assert out.client_options["allow_http"] is True  # an http:// endpoint
    assert out.client_options["connect_timeout"] == timedelta(seconds=5)
    assert "use_listings_cache" not in out.config


def test_retry_policy_becomes_obstores_retry_config() -> None:
    out = s3_settings({"key": "k", "secret": "secret-1"}, POLICY)
    assert out.retry_config["max_retries"] == 2
    assert out.retry_config["backoff"]["init_backoff"] == timedelta(seconds=0.5)
    assert out.retry_config["backoff"]["max_backoff"] == timedelta(seconds=4.0)
    assert out.config["region"] == "us-east-1"  # signed for some region
    assert "virtual_hosted_style_request" not in out.config  # AWS itself: its default


def test_obstore_keys_pass_through_and_a_custom_endpoint_uses_path_style() -> None:
    out = s3_settings(
        {"access_key_id": "k", "secret_access_key": "secret-2", "endpoint": "https://minio:9000",
         "client_options": {"timeout": "30s"}, "skip_signature": False},
        POLICY,
    )
    assert out.config["endpoint"] == "https://minio:9000"
    assert out.config["virtual_hosted_style_request"] is False
    # The user's timeout, and the stall detector's read timeout (RetryPolicy.stall_s).
    assert out.client_options == {"timeout": "30s", "read_timeout": timedelta(seconds=3)}
    assert "allow_http" not in out.client_options


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"key": "k", "secret": "secret-3", "s3_additional_kwargs": {"ACL": "private"}},
         r"s3_additional_kwargs\['ACL'\]"),
        ({"key": "k", "secret": "secret-3", "client_kwargs": {"api_version": "2006-03-01"}},
         "'api_version'"),
        ({"key": "k", "secret": "secret-3", "config_kwargs": {"proxies": {}}}, "'proxies'"),
    ],
)
def test_an_s3fs_option_obstore_cannot_take_is_an_error_naming_it(
    options: dict, named: str
) -> None:
    with pytest.raises(ConfigurationError, match=named) as err:
        s3_settings(options, POLICY)
    assert "secret-3" not in str(err.value)
    assert "DCP_VOLUMES_BACKEND=fsspec" in str(err.value)  # s3fs takes it


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"key": "k", "secret": "secret-3", "acl": "private"}, "'acl'"),
        ({"key": "k", "secret": "secret-3", "client_kwargs": {"verify_ssl": 1}}, "'verify_ssl'"),
    ],
)
def test_an_option_no_client_takes_is_an_error_naming_it(options: dict, named: str) -> None:
    # s3fs would hand it to botocore, which raises a TypeError in every worker.
    with pytest.raises(ConfigurationError, match=named) as err:
        s3_settings(options, POLICY)
    assert "secret-3" not in str(err.value)
    assert "DCP_VOLUMES_BACKEND" not in str(err.value)  # another client does not take it


@pytest.mark.parametrize(
    ("options", "typo", "meant"),
    [
        ({"endpont_url": "http://127.0.0.1:9000"}, "endpont_url", "endpoint_url"),
        ({"regoin_name": "eu-west-1"}, "regoin_name", "region_name"),
        ({"client_kwargs": {"endpont_url": "http://127.0.0.1:9000"}}, "endpont_url",
         "endpoint_url"),
        ({"client_kwargs": {"regoin_name": "eu-west-1"}}, "regoin_name", "region_name"),
        ({"sercet": "secret-3"}, "sercet", "secret"),
    ],
)
def test_a_misspelt_option_is_refused_with_the_name_it_most_likely_means(
    options: dict, typo: str, meant: str
) -> None:
    with pytest.raises(ConfigurationError) as err:
        s3_settings({"key": "k", "secret": "secret-3", **options}, POLICY)
    message = str(err.value)
    assert f"'{typo}'" in message
    assert f"did you mean '{meant}'?" in message
    assert "Fix:" in message
    assert "DCP_VOLUMES_BACKEND" not in message  # another client does not fix a typo
    assert "secret-3" not in message


def test_an_azure_typo_is_refused_with_the_name_it_most_likely_means() -> None:
    with pytest.raises(ConfigurationError, match="did you mean 'account_name'") as err:
        azure_settings({"acount_name": "acct", "account_key": "a2V5LXNlY3JldA=="}, POLICY)
    assert "a2V5LXNlY3JldA==" not in str(err.value)


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"])
def test_an_http_endpoint_from_the_environment_allows_plain_http(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "http://127.0.0.1:9000")
    out = s3_settings({"key": "k", "secret": "secret-6"}, POLICY)
    assert out.config["endpoint"] == "http://127.0.0.1:9000"
    assert out.client_options["allow_http"] is True
    assert out.config["virtual_hosted_style_request"] is False  # a custom endpoint: path style
    assert out.endpoint_source == variable
    # The user's own settings win: an endpoint in the options, or allow_http itself.
    mine = s3_settings({"key": "k", "secret": "secret-6", "endpoint_url": "https://minio:9000"},
                       POLICY)
    assert mine.config["endpoint"] == "https://minio:9000"
    assert "allow_http" not in mine.client_options
    off = s3_settings({"key": "k", "secret": "secret-6",
                       "client_options": {"allow_http": False}}, POLICY)
    assert off.client_options["allow_http"] is False


def test_an_https_endpoint_from_the_environment_stays_on_tls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "HTTPS://minio.internal:9000")
    out = s3_settings({"key": "k", "secret": "secret-6"}, POLICY)
    assert "allow_http" not in out.client_options


def test_the_settings_repr_names_no_secret() -> None:
    out = s3_settings({"key": "AKIDEXAMPLE", "secret": "secret-value-7"}, POLICY)
    assert "secret-value-7" not in repr(out)
    assert "secret_access_key" in repr(out)


def test_adlfs_names_and_connection_strings_map() -> None:
    out = azure_settings(
        {"connection_string": "DefaultEndpointsProtocol=http;AccountName=acct;"
                              "AccountKey=a2V5;BlobEndpoint=http://127.0.0.1:10000/acct;"},
        POLICY,
    )
    assert out.config == {"account_name": "acct", "account_key": "a2V5",
                          "endpoint": "http://127.0.0.1:10000/acct"}
    assert out.client_options["allow_http"] is True
    out = azure_settings({"account_name": "acct", "sas_token": "sv=1&sig=x", "anon": False},
                         POLICY)
    assert out.config == {"account_name": "acct", "sas_key": "sv=1&sig=x"}
    with pytest.raises(ConfigurationError, match="credential_provider"):
        azure_settings({"account_name": "acct", "credential": object()}, POLICY)


def test_abfs_urls_name_the_account() -> None:
    vol = Volume("abfss://data@myacct.dfs.core.windows.net/run1/step-1")
    assert vol.root == "data/run1/step-1"
    assert vol.storage_options["account_name"] == "myacct"
    assert vol.url == "abfss://data/run1/step-1"


def test_the_policys_timeout_is_the_request_timeout_and_the_users_own_wins() -> None:
    policy = RetryPolicy(attempts=3, base_delay_s=0.1, max_delay_s=1.0, timeout_s=2.5)
    out = s3_settings({"key": "k", "secret": "secret-3"}, policy)
    assert out.client_options["timeout"] == timedelta(seconds=2.5)
    # Every try may use its whole timeout (a stall) and still be retried.
    assert out.retry_config["retry_timeout"] == timedelta(seconds=3 * (1.0 + 2.5))
    mine = s3_settings({"key": "k", "secret": "secret-3", "timeout": "9s"}, policy)
    assert mine.client_options["timeout"] == "9s"
    botocore = s3_settings({"key": "k", "secret": "secret-3",
                            "config_kwargs": {"read_timeout": 7}}, policy)
    assert botocore.client_options["timeout"] == timedelta(seconds=7)
    with pytest.raises(ConfigurationError, match="timeout_s"):
        RetryPolicy(timeout_s=0)


@pytest.mark.parametrize(
    ("options", "unsigned"),
    [
        ({}, True),  # AWS itself: https
        ({"endpoint_url": "https://minio.internal:9000"}, True),
        ({"endpoint_url": "http://127.0.0.1:9000"}, None),  # no TLS: the body stays signed
        ({"unsigned_payload": False}, False),  # the user's choice wins
        ({"endpoint_url": "http://127.0.0.1:9000", "unsigned_payload": True}, True),
    ],
)
def test_bodies_go_unsigned_only_over_tls_unless_the_user_chooses(
    options: dict, unsigned: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_UNSIGNED_PAYLOAD", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    out = s3_settings({"key": "k", "secret": "secret-3", **options}, POLICY)
    assert out.config.get("unsigned_payload") == unsigned


def test_an_http_endpoint_from_the_environment_keeps_bodies_signed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AWS_UNSIGNED_PAYLOAD", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    out = s3_settings({"key": "k", "secret": "secret-5"}, POLICY)
    assert "unsigned_payload" not in out.config


def test_aws_unsigned_payload_in_the_environment_decides_signing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_UNSIGNED_PAYLOAD", "false")
    out = s3_settings({"key": "k", "secret": "secret-4"}, POLICY)
    assert "unsigned_payload" not in out.config  # obstore reads the variable itself


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
def test_what_a_ranged_read_costs_is_our_option_and_a_capability(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCP_VOLUMES_BACKEND", backend)
    base = {"key": "k", "secret": "secret-4", "endpoint_url": "http://127.0.0.1:9"}
    plain = Volume("s3://bucket/run", storage_options=base)
    assert not plain.capabilities.ranged_reads_cost_whole_object
    moto_like = Volume(
        "s3://bucket/run", storage_options={**base, "ranged_reads_cost_whole_object": True}
    )
    # Taken by the volume, not handed to the client (obstore would refuse an unknown key).
    assert moto_like.capabilities.ranged_reads_cost_whole_object
    with pytest.raises(ConfigurationError, match=r"ranged_reads_cost_whole_object.*True or False"):
        _ = Volume("s3://bucket/run",
                   storage_options={**base, "ranged_reads_cost_whole_object": "yes"}).capabilities


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
def test_whether_listings_lag_is_our_option_and_a_capability(
    backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # S3 lists every write that returned; a server known to lag says so through the
    # option (the commit then checks its uploads in a listing); a mount may be NFS.
    monkeypatch.setenv("DCP_VOLUMES_BACKEND", backend)
    base = {"key": "k", "secret": "secret-4", "endpoint_url": "http://127.0.0.1:9"}
    assert not Volume("s3://bucket/run", storage_options=base).capabilities.listing_lags
    lagging = Volume("s3://bucket/run", storage_options={**base, "listing_lags": True})
    assert lagging.capabilities.listing_lags  # taken by the volume, not handed to the client
    assert Volume(tmp_path).capabilities.listing_lags
    with pytest.raises(ConfigurationError, match=r"listing_lags.*True or False"):
        _ = Volume("s3://bucket/run",
                   storage_options={**base, "listing_lags": "yes"}).capabilities
