"""Where a job's checkpoints live in S3 and how to reach it: the store's address and its transfer settings.

Plain data, read from the pod environment once (`StorageConfig.from_env`); `storage.py` (the only
module that talks to S3) acts on it and re-exports both names.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit

from kubetrain_trainer.contract import S3_ADDRESSING_STYLE, S3_ADDRESSING_STYLES, S3_SSE, S3_SSE_KMS_KEY_ID, TEST_UPLOAD_RATE
from kubetrain_trainer.storage_errors import StoragePermanentError


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str
    """Key prefix without leading or trailing slash ('' for the bucket root)."""

    @classmethod
    def parse(cls, uri: str) -> "S3Location":
        if not uri.startswith("s3://"):
            raise StoragePermanentError(f"checkpoint URI must start with s3://, got {uri!r}")
        rest = uri[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StoragePermanentError(f"checkpoint URI has no bucket: {uri!r}")
        return cls(bucket=bucket, prefix=prefix.strip("/"))

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)


@dataclass(frozen=True)
class StorageConfig:
    """How to reach S3. Read from the pod environment once (`from_env`)."""

    uri: str
    endpoint_url: str | None = None
    """The store's endpoint, given to the client explicitly; None: AWS S3 itself. `from_env`: AWS_ENDPOINT_URL (the
    operator's spec.checkpoint.endpoint), else AWS_ENDPOINT_URL_S3 unless AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true
    (`endpoint_variable`)."""
    region: str = "us-east-1"
    addressing_style: str | None = None
    """`KUBETRAIN_S3_ADDRESSING_STYLE`: `path`, `virtual` or `auto` (contract.S3_ADDRESSING_STYLES); None: `path` for
    a custom endpoint (most S3-compatible stores serve no host name per bucket), else `auto`."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    multipart_threshold: int = 64 << 20
    multipart_chunksize: int = 64 << 20
    max_concurrency: int = 4
    """Parts of one file in flight at once (multipart transfers)."""
    file_concurrency: int = 8
    """Files of one checkpoint downloaded (and verified) at once by `download_checkpoint`."""
    download_parts_in_flight: int = 16
    """Parts in flight on a restore, shared by the checkpoint's files large enough to be fetched in parts
    (`multipart_threshold`; at least `max_concurrency` each): one large file beside small ones gets them all.
    Each file is hashed as its bytes land (`landing.py`); keep `download_chunksize` a multiple of
    `hashing.DIGEST_PART` (8 MiB) so each ranged GET holds whole digest parts."""
    download_chunksize: int = 32 << 20
    upload_file_concurrency: int = 4
    """Files of one checkpoint uploaded at once by the commit protocol. Each starts only after a fence
    check and is cut within one part by it, so what a zombie writes after a newer claim is bounded by
    this many in-flight requests (commit.py); 1 uploads one file after another."""
    request_checksum_calculation: str | None = None
    response_checksum_validation: str | None = None
    """botocore's integrity checksums (`when_supported` or `when_required`); None: botocore's own setting
    (AWS_REQUEST_CHECKSUM_CALCULATION / AWS_RESPONSE_CHECKSUM_VALIDATION, else `when_supported`). `from_env`
    makes them `when_required` for a custom endpoint other than AWS's own (`s3_compatible`) unless those
    variables say otherwise: many S3-compatible stores refuse or mishandle botocore's default CRC32 headers and
    aws-chunked uploads, and the manifest's digests already check every file end to end."""
    server_side_encryption: str | None = None
    """`KUBETRAIN_S3_SSE` (AES256, aws:kms, aws:kms:dsse), asked for on every object written; None: the
    bucket's default encryption."""
    sse_kms_key_id: str | None = None
    """`KUBETRAIN_S3_SSE_KMS_KEY_ID`: the KMS key of aws:kms; None: the account's S3 key."""
    test_upload_bytes_per_second: int = 0
    """TEST HOOK (`KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND`; 0 = off): caps this pod's upload bandwidth, so a
    test on a fast loopback store can make a checkpoint's upload take as long as a real link would."""

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides: Any) -> "StorageConfig":
        raw = env.get(UPLOAD_RATE_ENV, "").strip() or "0"
        try:  # as the launcher's own check reads it (launch_config._int: "+5" is 5), so both agree
            rate = int(raw)
        except ValueError:
            rate = -1
        if rate < 0:
            raise ValueError(f"{UPLOAD_RATE_ENV} must be a whole number of bytes per second, not {raw!r}")
        style = env.get(S3_ADDRESSING_STYLE, "").strip() or None
        if style is not None and style not in S3_ADDRESSING_STYLES:
            raise ValueError(f"{S3_ADDRESSING_STYLE}: unknown value {style!r}; allowed: {', '.join(S3_ADDRESSING_STYLES)}")
        endpoint = endpoint_from_env(env)
        checksums = {name: "when_required" for name, variable in _CHECKSUM_ENV.items()
                     if s3_compatible(endpoint) and not env.get(variable, "").strip()}
        return cls(
            uri=env["KUBETRAIN_CHECKPOINT_URI"],
            endpoint_url=endpoint,
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            **{"test_upload_bytes_per_second": rate, "addressing_style": style,
               "server_side_encryption": env.get(S3_SSE, "").strip() or None,
               "sse_kms_key_id": env.get(S3_SSE_KMS_KEY_ID, "").strip() or None, **checksums, **overrides},
        )


ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
"""The variables the store's endpoint is read from, in order: the operator's (spec.checkpoint.endpoint) first."""
IGNORE_ENDPOINTS_ENV = "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"
"""`true` (any case): botocore ignores its configured endpoints; the trainer ignores AWS_ENDPOINT_URL_S3 then."""


def endpoint_variable(env: Mapping[str, str]) -> str | None:
    """The variable the store's endpoint comes from in `env`, None for AWS S3 itself. AWS_ENDPOINT_URL first: the
    operator sets it from spec.checkpoint.endpoint and the client gets it explicitly, so an AWS_ENDPOINT_URL_S3 a
    job brings for its own data (a job stored before the CRD refused it in spec.env, or through envFrom) never moves
    its checkpoints, as before it was read. Else AWS_ENDPOINT_URL_S3 (botocore's variable: a pod that sets only it
    talks to that store, and is treated as one), unless `IGNORE_ENDPOINTS_ENV` is true, as botocore reads it."""
    operators, s3 = ENDPOINT_ENV
    if env.get(operators):
        return operators
    if env.get(IGNORE_ENDPOINTS_ENV, "").lower() == "true":  # as botocore's ensure_boolean reads it
        return None
    return s3 if env.get(s3) else None


def endpoint_from_env(env: Mapping[str, str]) -> str | None:
    """The S3 endpoint URL botocore would use from `env` (`endpoint_variable`), None for AWS S3 itself. ValueError
    naming the variable for a URL botocore would refuse (`_endpoint_problem`): it refuses it only as the client is
    built, which was classified as a temporary failure and retried until the restore timeout, then as often as
    the job's backoffLimit allowed."""
    name = endpoint_variable(env)
    if name is None:
        return None
    url = env[name]
    problem = _endpoint_problem(url)
    if problem:
        shown = "(not shown: it has an '@')" if "@" in url else repr(url)
        spec = " (spec.checkpoint.endpoint)" if name == "AWS_ENDPOINT_URL" else ""
        raise ValueError(f"{name}{spec}: {shown} is not an endpoint URL: {problem}; expected http(s)://host[:port]"
                         "[/path], e.g. http://minio.minio:9000")
    return url


_HOST = re.compile(r"^((?!-)[a-z\d-]{1,63}(?<!-)\.)*(?!-)[a-z\d-]{1,63}(?<!-)\.?$", re.IGNORECASE)
"""A host name as botocore accepts one in an endpoint (`botocore.utils.is_valid_endpoint_url`): no '_'."""


def _endpoint_problem(url: str) -> str:
    """What is wrong with `url` as an S3 endpoint ('' when nothing)."""
    if url != url.strip() or any(c.isspace() for c in url):
        return "it has white space"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # an unclosed '[', a port that is no number or out of range
        return "its port is not a number from 1 to 65535, or an IPv6 address's ']' is missing"
    if parts.scheme not in ("http", "https") or url[:len(parts.scheme) + 3].lower() != f"{parts.scheme}://":
        return "it must start with http:// or https://"
    if "@" in parts.netloc:
        return "it must not contain credentials or '@'"
    if port == 0:
        return "its port is not a number from 1 to 65535"
    host = parts.hostname or ""
    if not host:
        return "it names no host"
    if not (parts.netloc.startswith("[") or (len(host) <= 255 and _HOST.match(host))):
        return f"{host!r} is not a host name (letters, digits, '-' and '.')"
    if parts.query or parts.fragment:
        return "it must not have a query ('?') or a fragment ('#')"
    return ""


_CHECKSUM_ENV = {"request_checksum_calculation": "AWS_REQUEST_CHECKSUM_CALCULATION",
                 "response_checksum_validation": "AWS_RESPONSE_CHECKSUM_VALIDATION"}
"""botocore's own variables for `StorageConfig`'s checksum settings: set in spec.env, they win."""


def region_hint(config: StorageConfig) -> str:
    """A warning for a region AWS S3 may not have ('' for none): AWS S3 itself (no custom endpoint, whose regions are
    its own) and a region no partition of this botocore has an S3 endpoint in. A typo (us-east1) otherwise showed
    only as 'Could not connect to the endpoint URL', retried until the restore timeout. Not an error: a region newer
    than this botocore still works."""
    if config.endpoint_url is not None:
        return ""
    import botocore.session

    session = botocore.session.get_session()
    known = sorted({r for p in session.get_available_partitions()
                    for r in session.get_available_regions("s3", partition_name=p)})
    if config.region in known:
        return ""
    close = difflib.get_close_matches(config.region, known, n=1)
    return (f"AWS_REGION (spec.checkpoint.region) {config.region!r} is no AWS S3 region botocore knows"
            f"{f' (did you mean {close[0]!r}?)' if close else ''}: if S3 stays unreachable, correct it")


def s3_compatible(endpoint_url: str | None) -> bool:
    """Whether `endpoint_url` is another store than AWS S3, which keeps botocore's defaults also behind an endpoint
    URL (regional, FIPS, a VPC interface endpoint): a bucket with Object Lock retention refuses a PUT without one."""
    host = (urlsplit(endpoint_url).hostname or "") if endpoint_url else ""
    return bool(endpoint_url) and not host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


def content_md5_instead_of_crc32(params: dict[str, Any], **_kwargs: Any) -> None:
    """botocore's `before-call.s3.DeleteObjects` hook for a custom endpoint: the request's Content-MD5, as botocore
    sent it before 1.36, in place of the CRC32 it sends since whatever the checksum setting (DeleteObjects requires
    one); stores that require Content-MD5 (older MinIO, Ceph RGW) answer the CRC32 alone with MissingContentMD5."""
    body = params.get("body")
    if isinstance(body, bytes) and "Content-MD5" not in params["headers"]:
        params["headers"]["Content-MD5"] = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
        params.get("context", {}).get("checksum", {}).pop("request_algorithm", None)  # botocore then adds no CRC32
        params.get("context", {}).get("checksum", {}).pop("request_algorithm_header", None)


UPLOAD_RATE_ENV = TEST_UPLOAD_RATE
