"""The S3 client `CheckpointStore` builds, as botocore really drives it: the requests it sends and how the
answers of real stores are classified. No network: a `before-send` hook answers every request."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse

from kubetrain_trainer.storage import CheckpointStore, StorageConfig
from kubetrain_trainer.storage_errors import StorageAccessError, StoragePermanentError, StorageTemporaryError, classify

REDIRECT = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code><Message>The bucket you '
            b'are attempting to access must be addressed using the specified endpoint.</Message></Error>')


class _Raw(io.BytesIO):
    """An HTTP response body, as botocore reads one (urllib3's `stream` and `read`)."""

    def stream(self, **_kwargs: Any):
        yield self.getvalue()


def _answering(store: CheckpointStore, status: int, body: bytes, headers: dict[str, str]) -> list[Any]:
    """Answer every request of `store` with (status, body, headers); the requests sent, in order."""
    sent: list[Any] = []

    def answer(request: Any, **_kwargs: Any) -> AWSResponse:
        sent.append(request)
        return AWSResponse(request.url, status, headers, _Raw(body))

    store._client.meta.events.register_first("before-send.s3", answer)
    return sent


@pytest.fixture()
def keys(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x" * 40)
    for name in ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION", "AWS_CONFIG_FILE",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("call", ["check_access", "list_checkpoints", "put"])
def test_a_bucket_in_another_region_is_a_permanent_error_naming_the_region(keys, call):
    # A custom endpoint (or a store) that answers 301: botocore cannot follow it, and every retry gets the
    # same answer. Retried as temporary, the start waited out its whole restore timeout, then exited 84.
    store = CheckpointStore(StorageConfig(uri="s3://b/p", endpoint_url="https://s3.us-east-1.amazonaws.com"))
    _answering(store, 301, b"" if call == "check_access" else REDIRECT,
               {"x-amz-bucket-region": "eu-west-1", "Content-Type": "application/xml"})
    with pytest.raises(StoragePermanentError) as err:
        {"check_access": store.check_access, "list_checkpoints": store.list_checkpoints,
         "put": lambda: store.put_bytes(1, "x.json", b"{}")}[call]()
    assert not isinstance(err.value, StorageAccessError)
    assert "eu-west-1" in str(err.value) and "spec.checkpoint.region" in str(err.value)


def test_a_transfer_managers_wrapped_redirect_is_permanent():
    # boto3's upload_file raises S3UploadFailedError, whose text carries the inner error's code only.
    from boto3.exceptions import S3UploadFailedError

    exc = S3UploadFailedError("Failed to upload f to b/k: An error occurred (PermanentRedirect) when calling the "
                              "PutObject operation: The bucket you are attempting to access must be addressed ...")
    assert type(classify(exc, op="upload", where="s3://b/k")) is StoragePermanentError


ENDPOINT = "https://objects.example.internal"
PUT_OK = {"ETag": '"0"'}


def _env(**extra: str) -> dict[str, str]:
    return {"KUBETRAIN_CHECKPOINT_URI": "s3://b/p", **extra}


def _checksum_headers(request: Any) -> dict[str, str]:
    headers = {k.lower(): v.decode() if isinstance(v, bytes) else str(v) for k, v in request.headers.items()}
    return {k: v for k, v in headers.items() if k.startswith(("x-amz-checksum", "x-amz-trailer", "x-amz-sdk-checksum"))
            or (k == "content-encoding" and "aws-chunked" in v)}


def test_a_custom_endpoint_gets_no_checksum_headers_nor_aws_chunked_uploads(keys):
    # botocore >= 1.36 sends every PUT over https as aws-chunked with a CRC32 trailer, and asks for response
    # checksums: stores such as Ceph RGW, GCS's S3 interoperability or older MinIO refuse or mishandle that,
    # so every checkpoint upload (and the start's attempt claim) failed on them.
    store = CheckpointStore(StorageConfig.from_env(_env(AWS_ENDPOINT_URL=ENDPOINT)))
    sent = _answering(store, 200, b"", PUT_OK)
    store.put_bytes(1, "x.json", b"{}")
    store._get("p/checkpoint-1/x.json")
    assert [_checksum_headers(r) for r in sent] == [{}, {}]
    assert [r.headers.get("x-amz-checksum-mode") for r in sent] == [None, None]


def test_a_multipart_upload_to_a_custom_endpoint_names_no_checksum_algorithm(keys, tmp_path):
    cfg = StorageConfig.from_env(_env(AWS_ENDPOINT_URL=ENDPOINT), multipart_threshold=5 << 20,
                                 multipart_chunksize=5 << 20, max_concurrency=1)
    store = CheckpointStore(cfg)
    body = (b"<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key><UploadId>u1</UploadId>"
            b"</InitiateMultipartUploadResult>")
    sent = _answering(store, 200, body, PUT_OK)
    (tmp_path / "w.bin").write_bytes(b"\0" * (6 << 20))
    store.upload_file(1, tmp_path / "w.bin", "w.bin")
    assert len(sent) == 4  # create, two parts, complete
    assert [_checksum_headers(r) for r in sent] == [{}] * 4


def _pod(monkeypatch, **env: str) -> dict[str, str]:
    """`env` set in this process too, as in a pod: botocore reads the endpoint variables from there as well."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return _env(**env)


OTHER = "https://other.example.internal"


@pytest.mark.parametrize("env, host", [
    ({"AWS_ENDPOINT_URL_S3": ENDPOINT}, ENDPOINT),
    ({"AWS_ENDPOINT_URL_S3": OTHER, "AWS_ENDPOINT_URL": ENDPOINT}, ENDPOINT),  # the operator's stays the store
    ({"AWS_ENDPOINT_URL_S3": "", "AWS_ENDPOINT_URL": ENDPOINT}, ENDPOINT),
])
def test_the_s3_endpoint_variable_is_the_store_as_botocore_reads_it(keys, monkeypatch, env, host):
    # botocore takes its S3 endpoint from AWS_ENDPOINT_URL_S3 before AWS_ENDPOINT_URL. Read from AWS_ENDPOINT_URL
    # only, a pod with AWS_ENDPOINT_URL_S3 (envFrom, a user's own image) talked to that store as if it were AWS:
    # virtual-hosted addressing (a DNS name per bucket that the store does not have) and botocore's CRC32
    # checksums, which many S3-compatible stores refuse; with both set the trainer used the other store.
    cfg = StorageConfig.from_env(_pod(monkeypatch, **env))
    assert cfg.endpoint_url == host and cfg.request_checksum_calculation == "when_required"
    store = CheckpointStore(cfg)
    sent = _answering(store, 200, b"", PUT_OK)
    store.put_bytes(1, "x.json", b"{}")
    assert sent[0].url == f"{host}/b/p/checkpoint-1/x.json" and _checksum_headers(sent[0]) == {}


@pytest.mark.parametrize("ignore", ["true", "TRUE"])
def test_ignored_endpoint_variables_are_aws_itself(keys, monkeypatch, ignore):
    # AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true: botocore ignores AWS_ENDPOINT_URL_S3, and so does the trainer.
    cfg = StorageConfig.from_env(_pod(monkeypatch, AWS_ENDPOINT_URL_S3=ENDPOINT,
                                      AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=ignore))
    assert cfg.endpoint_url is None and cfg.request_checksum_calculation is None
    store = CheckpointStore(cfg)
    sent = _answering(store, 200, b"", PUT_OK)
    store.put_bytes(1, "x.json", b"{}")
    assert sent[0].url == "https://s3.amazonaws.com/b/p/checkpoint-1/x.json"  # ('b' is too short for a DNS name)


def test_a_custom_endpoint_gets_delete_objects_content_md5_as_before_botocore_1_36(keys):
    # DeleteObjects requires a checksum whatever the setting: botocore >= 1.36 sends CRC32 where it sent
    # Content-MD5, and stores that require Content-MD5 (older MinIO, Ceph RGW) answer MissingContentMD5, so
    # retention deleted each old checkpoint's manifest and left its files in the bucket for good.
    import base64
    import hashlib

    listing = (b"<ListBucketResult><Name>b</Name><KeyCount>1</KeyCount><IsTruncated>false</IsTruncated>"
               b"<Contents><Key>p/checkpoint-1/w.bin</Key><Size>1</Size></Contents></ListBucketResult>")
    store = CheckpointStore(StorageConfig.from_env(_env(AWS_ENDPOINT_URL=ENDPOINT)))
    sent = _answering(store, 200, listing, PUT_OK)
    store.delete_checkpoint(1)
    bulk = [r for r in sent if r.url.endswith("?delete")]
    assert len(bulk) == 1 and _checksum_headers(bulk[0]) == {}
    assert bulk[0].headers["Content-MD5"] == base64.b64encode(hashlib.md5(bulk[0].body).digest())


def test_aws_itself_keeps_botocores_delete_objects_checksum(keys):
    store = CheckpointStore(StorageConfig.from_env(_env()))
    sent = _answering(store, 200, b"<DeleteResult></DeleteResult>", PUT_OK)
    store._client.delete_objects(Bucket="b", Delete={"Objects": [{"Key": "k"}]})
    assert "Content-MD5" not in sent[0].headers and "x-amz-checksum-crc32" in _checksum_headers(sent[0])


def test_the_checksum_variables_in_spec_env_still_win(keys, monkeypatch):
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_supported")
    cfg = StorageConfig.from_env(_env(AWS_ENDPOINT_URL=ENDPOINT, AWS_REQUEST_CHECKSUM_CALCULATION="when_supported"))
    assert (cfg.request_checksum_calculation, cfg.response_checksum_validation) == (None, "when_required")
    store = CheckpointStore(cfg)
    sent = _answering(store, 200, b"", PUT_OK)
    store.put_bytes(1, "x.json", b"{}")
    assert _checksum_headers(sent[0]).get("x-amz-trailer") == "x-amz-checksum-crc32"


def test_aws_itself_keeps_botocores_default_checksums(keys):
    cfg = StorageConfig.from_env(_env())
    assert (cfg.request_checksum_calculation, cfg.response_checksum_validation) == (None, None)
    client = CheckpointStore(cfg)._client
    assert client.meta.config.request_checksum_calculation == "when_supported"


@pytest.mark.parametrize("endpoint", ["https://s3.us-east-1.amazonaws.com", "https://s3-fips.us-gov-west-1.amazonaws.com",
                                      "https://bucket.vpce-0a1b2c3d-e4f5g6h7.s3.us-east-1.vpce.amazonaws.com",
                                      "https://s3.cn-north-1.amazonaws.com.cn"])
def test_aws_behind_an_endpoint_url_keeps_botocores_default_checksums(keys, endpoint):
    # AWS itself through AWS_ENDPOINT_URL (a regional, FIPS or VPC interface endpoint): with 'when_required' a PUT
    # carried no checksum at all, and a bucket with Object Lock default retention refuses that ("Content-MD5 OR
    # x-amz-checksum- HTTP header is required"): every upload and the start's claim failed, exit 82.
    cfg = StorageConfig.from_env(_env(AWS_ENDPOINT_URL=endpoint))
    assert (cfg.request_checksum_calculation, cfg.response_checksum_validation) == (None, None)
    store = CheckpointStore(cfg)
    sent = _answering(store, 200, b"<DeleteResult></DeleteResult>", PUT_OK)
    store.put_bytes(1, "x.json", b"{}")
    store._client.delete_objects(Bucket="b", Delete={"Objects": [{"Key": "k"}]})
    assert [bool(_checksum_headers(r)) for r in sent] == [True, True] and "Content-MD5" not in sent[1].headers


def test_credentials_that_are_not_there_yet_at_start_are_retried_not_a_crash(keys, monkeypatch):
    # EKS Pod Identity: boto3 fetches the credentials from the node's agent as it builds the client; on a
    # node just scaled up the agent may not answer yet. Built in the constructor, the raw botocore error
    # crashed the launcher (exit 1, a traceback); now the first call raises a temporary error, retried.
    from botocore.exceptions import CredentialRetrievalError

    import kubetrain_trainer.storage as storage

    real, tries = storage._make_client, []

    def agent_up_on_second_try(config):
        tries.append(1)
        if len(tries) == 1:
            raise CredentialRetrievalError(provider="container-role", error_msg="Could not connect")
        return real(config)

    monkeypatch.setattr(storage, "_make_client", agent_up_on_second_try)
    store = CheckpointStore(StorageConfig(uri="s3://b/p", endpoint_url=ENDPOINT))
    with pytest.raises(StorageTemporaryError, match="container-role"):
        store.check_access()
    _answering(store, 200, b"", {})
    store.check_access()
    assert len(tries) == 2


def test_credentials_the_chain_finds_only_on_a_later_look_are_used(keys, monkeypatch, tmp_path):
    # The instance role (spec.checkpoint ambient): boto3 asks IMDS as it builds the client, and a throttled or
    # slow IMDS (many pods starting on a node) finds nothing, without an error. The client built then had no
    # credentials for good: every retry of the access window failed alike, then the pod exited 82 and the job
    # failed for good, however soon IMDS answered. Now a client is built only once credentials are found.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # nothing found: as IMDS not answering in time
    for name in ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    store = CheckpointStore(StorageConfig(uri="s3://b/p", endpoint_url=ENDPOINT))
    with pytest.raises(StorageAccessError, match="no S3 credentials"):
        store.check_access()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE")  # what the chain finds on its next look
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x" * 40)
    _answering(store, 200, b"", {})
    store.check_access()


def test_a_profile_that_is_not_there_is_a_permanent_error(keys, monkeypatch, tmp_path):
    (tmp_path / "config").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "training")
    store = CheckpointStore(StorageConfig(uri="s3://b/p", endpoint_url=ENDPOINT))
    with pytest.raises(StoragePermanentError, match="ProfileNotFound"):
        store.check_access()


def test_a_checksum_setting_botocore_refuses_is_a_permanent_error(keys, monkeypatch):
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "always")
    store = CheckpointStore(StorageConfig.from_env(_env(AWS_ENDPOINT_URL=ENDPOINT,
                                                        AWS_REQUEST_CHECKSUM_CALCULATION="always")))
    with pytest.raises(StoragePermanentError, match="InvalidChecksumConfigError"):
        store.check_access()


def _sse(request: Any) -> tuple[str | None, str | None]:
    h = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
    return h.get("x-amz-server-side-encryption"), h.get("x-amz-server-side-encryption-aws-kms-key-id")


def test_every_object_written_asks_for_the_server_side_encryption_set(keys, tmp_path):
    # A bucket policy that denies s3:PutObject without x-amz-server-side-encryption = aws:kms (a common
    # compliance rule) refused every upload: kubetrain had no way to ask for it.
    key = "arn:aws:kms:eu-west-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    cfg = StorageConfig.from_env(_env(KUBETRAIN_S3_SSE="aws:kms", KUBETRAIN_S3_SSE_KMS_KEY_ID=key),
                                 multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=1)
    store = CheckpointStore(cfg)
    body = (b"<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key><UploadId>u1</UploadId>"
            b"</InitiateMultipartUploadResult>")
    sent = _answering(store, 200, body, PUT_OK)
    (tmp_path / "small.json").write_bytes(b"{}")
    (tmp_path / "w.bin").write_bytes(b"\0" * (6 << 20))
    store.put_bytes(1, "manifest.json", b"{}")
    store.upload_file(1, tmp_path / "small.json", "small.json")
    store.upload_file(1, tmp_path / "w.bin", "w.bin")
    kms = ("aws:kms", key)
    # put, upload (one PUT), create multipart (the parts and the completion carry none: S3 refuses them there)
    assert [_sse(r) for r in sent] == [kms, kms, kms, (None, None), (None, None), (None, None)]


def test_no_encryption_header_unless_asked(keys):
    store = CheckpointStore(StorageConfig.from_env(_env()))
    sent = _answering(store, 200, b"", PUT_OK)
    store.put_bytes(1, "manifest.json", b"{}")
    assert _sse(sent[0]) == (None, None)


@pytest.mark.parametrize("env, message", [
    ({"KUBETRAIN_S3_SSE": "kms"}, "KUBETRAIN_S3_SSE: unknown value 'kms'"),
    ({"KUBETRAIN_S3_SSE": "AES256", "KUBETRAIN_S3_SSE_KMS_KEY_ID": "alias/ml"}, "needs KUBETRAIN_S3_SSE=aws:kms"),
])
def test_an_encryption_setting_s3_would_refuse_is_invalid_configuration(env, message):
    from kubetrain_trainer.launch_config import ConfigError, LaunchConfig

    with pytest.raises(ConfigError, match=message):
        LaunchConfig.from_env(env, [])


def test_a_certificate_the_pod_does_not_trust_is_an_access_error_naming_aws_ca_bundle():
    # A store with a private CA and no AWS_CA_BUNDLE: retried as a network error, the start waited out its
    # restore timeout and exited 84, over and over. Now it is retried within the start's access window, as a
    # refused access is (a certificate rotated ahead of its CA bundle's mount, a clock not yet synced, pass),
    # and then the job fails with exit 82 and this message.
    from botocore.exceptions import SSLError

    exc = SSLError(endpoint_url="https://minio.storage:9000/ckpt",
                   error="[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate")
    err = classify(exc, op="head_bucket", where="s3://ckpt/")
    assert type(err) is StorageAccessError and "AWS_CA_BUNDLE" in str(err)
    # A handshake cut short by the network stays temporary.
    assert type(classify(SSLError(endpoint_url="https://s", error="EOF occurred in violation of protocol"),
                         op="get", where="s3://b/k")) is StorageTemporaryError


@pytest.mark.parametrize("env, url", [
    ({"AWS_ENDPOINT_URL": ENDPOINT}, f"{ENDPOINT}/ckpt-bucket/p/checkpoint-1/x.json"),
    ({"AWS_ENDPOINT_URL": ENDPOINT, "KUBETRAIN_S3_ADDRESSING_STYLE": "virtual"},
     "https://ckpt-bucket.objects.example.internal/p/checkpoint-1/x.json"),
    ({"AWS_ENDPOINT_URL": ENDPOINT, "KUBETRAIN_S3_ADDRESSING_STYLE": "auto"},  # botocore's auto: path there
     f"{ENDPOINT}/ckpt-bucket/p/checkpoint-1/x.json"),
    ({}, "https://ckpt-bucket.s3.amazonaws.com/p/checkpoint-1/x.json"),
    ({"KUBETRAIN_S3_ADDRESSING_STYLE": "path"}, "https://s3.amazonaws.com/ckpt-bucket/p/checkpoint-1/x.json"),
])
def test_the_addressing_style_is_the_users_choice(keys, env, url):
    # Every custom endpoint got path-style requests: a store that serves buckets only by host name (and an
    # AWS access point or VPC endpoint given as the endpoint) refused every one of them.
    store = CheckpointStore(StorageConfig.from_env({**_env(**env), "KUBETRAIN_CHECKPOINT_URI": "s3://ckpt-bucket/p"}))
    sent = _answering(store, 200, b"", PUT_OK)
    store.put_bytes(1, "x.json", b"{}")
    assert sent[0].url == url


@pytest.mark.parametrize("style", ["Path", "host", "virtual-hosted"])
def test_an_addressing_style_botocore_does_not_know_is_invalid_configuration_naming_the_choices(style):
    from kubetrain_trainer.launch_config import ConfigError, LaunchConfig

    env = _env(KUBETRAIN_S3_ADDRESSING_STYLE=style)
    message = f"KUBETRAIN_S3_ADDRESSING_STYLE: unknown value '{style}'; allowed: auto, path, virtual"
    with pytest.raises(ConfigError, match=f"^{message}$"):
        LaunchConfig.from_env(env, [])
    with pytest.raises(ValueError, match=f"^{message}$"):
        StorageConfig.from_env(env)


@pytest.mark.parametrize("name", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
@pytest.mark.parametrize("endpoint, problem", [
    ("minio:9000", "it must start with http:// or https://"),
    ("minio.minio", "it must start with http:// or https://"),
    ("ftp://minio:9000", "it must start with http:// or https://"),
    ("http://minio:abc", "its port is not a number from 1 to 65535"),
    ("https://minio:99999", "its port is not a number from 1 to 65535"),
    ("http://minio_1:9000", "'minio_1' is not a host name"),
    ("http://:9000", "it names no host"),
    ("http://minio:9000 ", "it has white space"),
    ("http://minio:9000?region=x", "it must not have a query"),
])
def test_a_malformed_endpoint_is_invalid_configuration_naming_the_variable(name, endpoint, problem):
    # botocore refuses these only as it builds the client, with "Invalid endpoint: ..." or "Custom endpoint ... was
    # not a valid URI", which were classified as temporary: the start retried them until its restore timeout (10
    # minutes), exited 84, and the job restarted as often as its backoffLimit allowed, never naming the setting.
    from kubetrain_trainer.launch_config import ConfigError, LaunchConfig

    with pytest.raises(ConfigError, match=re.escape(f"{endpoint!r} is not an endpoint URL: {problem}")) as err:
        LaunchConfig.from_env(_env(**{name: endpoint}), [])
    assert str(err.value).startswith(name) and "e.g. http://minio.minio:9000" in str(err.value)
    assert ("spec.checkpoint.endpoint" in str(err.value)) is (name == "AWS_ENDPOINT_URL")


def test_an_endpoint_with_credentials_is_refused_without_showing_them():
    with pytest.raises(ValueError, match="AWS_ENDPOINT_URL_S3: .not shown.*must not contain credentials") as err:
        StorageConfig.from_env(_env(AWS_ENDPOINT_URL_S3="http://AKIAEXAMPLE:s3cret@minio:9000"))
    assert "s3cret" not in str(err.value) and "AKIAEXAMPLE" not in str(err.value)


@pytest.mark.parametrize("endpoint", ["http://minio.minio:9000", "https://s3.eu-west-1.amazonaws.com/",
                                      "http://127.0.0.1:9000", "http://[::1]:9000", "HTTPS://Store.Example:443/base"])
def test_endpoints_botocore_takes_are_taken(endpoint):
    assert StorageConfig.from_env(_env(AWS_ENDPOINT_URL=endpoint)).endpoint_url == endpoint


def test_an_endpoint_botocores_rules_cannot_resolve_is_permanent(keys):
    # What the checks above let through and botocore's endpoint rules still refuse is no network trouble either.
    from botocore.exceptions import EndpointResolutionError

    err = classify(EndpointResolutionError(msg="Custom endpoint `http://x` was not a valid URI"), op="get", where="s3://b/k")
    assert type(err) is StoragePermanentError


@pytest.mark.parametrize("region, hint", [
    ("us-east1", "'us-east1' is no AWS S3 region botocore knows (did you mean 'us-east-1'?)"),
    ("eu-wset-1", "(did you mean 'eu-west-1'?)"),
    ("eu-west-1", ""), ("us-gov-west-1", ""), ("cn-north-1", ""),
])
def test_a_region_aws_s3_does_not_have_is_named_at_start(region, hint):
    # A typo in spec.checkpoint.region (us-east1) showed only as "Could not connect to the endpoint URL:
    # https://b.s3.us-east1.amazonaws.com/", retried for the whole restore timeout, then exit 84 and restarts.
    from kubetrain_trainer.storage_config import region_hint

    got = region_hint(StorageConfig(uri="s3://b/p", region=region))
    assert (hint in got and "AWS_REGION (spec.checkpoint.region)" in got) if hint else got == ""
    assert region_hint(StorageConfig(uri="s3://b/p", region=region, endpoint_url=ENDPOINT)) == ""  # its own regions
