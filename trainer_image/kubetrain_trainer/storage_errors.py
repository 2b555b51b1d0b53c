"""What a storage failure means: temporary, permanent or refused access, with a message safe to log.

`classify` turns boto/botocore/OS exceptions into two types, so callers know
what to do next: `StorageTemporaryError` (network, throttling, 5xx: retry after
a delay) and `StoragePermanentError` (no bucket, bad credentials, bad URI: stop
and report). `StorageAccessError`, a permanent error, marks refused access and
missing buckets (HTTP 401/403/404): at a job's start these are retried for a
bounded window (`retry.should_retry`), because real clusters produce them
transiently (a Secret or IAM policy still propagating, clock skew, a bucket
another controller creates a few seconds after the job). Messages carry the
operation, bucket/key and the S3 error code only; they never carry credentials
(values of the AWS_* secrets are redacted even if a library puts them in a
message).
"""

from __future__ import annotations

import os

_ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "NoSuchBucket",
        "ExpiredToken",
        "InvalidToken",
        "RequestTimeTooSkewed",
        "AllAccessDisabled",
        "AccountProblem",
        # STS AssumeRoleWithWebIdentity, called by boto3's credential chain (web identity mode):
        # a token the identity provider or the role's trust policy does not accept.
        "InvalidIdentityToken",
        "IDPRejectedClaim",
        "ExpiredTokenException",
    }
)
"""Refused access or a missing bucket: `StorageAccessError` (see `retry.should_retry`)."""

_PERMANENT_CODES = _ACCESS_CODES | frozenset(
    {
        "InvalidBucketName",
        "InvalidArgument",
        "InvalidRequest",
        "MethodNotAllowed",
        # The bucket is in another region than the client signs for, and botocore could not follow
        # (a custom endpoint, or a store that names no region): every retry gets the same answer.
        "PermanentRedirect",
    }
)


PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, AttributeError, NameError, AssertionError, NotImplementedError,
)
"""A bug in the caller's code (or a hook it passed), never the store's state: raised as it is, with its
traceback, instead of being classified and retried as a storage failure."""


class StorageError(Exception):
    """Base of storage failures. The message is safe to log."""


class TransferStopped(Exception):
    """Raised by a transfer's own progress callback to stop it (the process is on its way out): not a
    storage failure, never retried or classified as one."""


class StorageTemporaryError(StorageError):
    """Network trouble, throttling or a server error: retry after a delay."""


class StoragePermanentError(StorageError):
    """Will not get better by retrying (missing bucket, bad credentials, bad URI)."""


class StorageAccessError(StoragePermanentError):
    """Access refused or the bucket missing (HTTP 401/403/404, or no credentials at all).

    Permanent for one call; at a job's start it is retried within a bounded
    window (`retry.should_retry`), since a Secret, an IAM policy or a bucket may
    still be on its way.
    """


class ChecksumError(StorageError):
    """Downloaded bytes do not match the manifest: that checkpoint is not usable."""


class DigestMismatchError(ChecksumError):
    """A file's bytes in storage differ from its manifest entry (not merely gone: the folder is still there)."""


def classify(exc: BaseException, *, op: str, where: str) -> StorageError:
    """Map a boto/botocore/OS exception to a temporary or permanent StorageError with a safe message."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConfigNotFound,
        ConnectionError as BotoConnectionError,
        EndpointResolutionError,
        HTTPClientError,
        InvalidChecksumConfigError,
        InvalidConfigError,
        InvalidEndpointConfigurationError,
        InvalidRegionError,
        NoCredentialsError,
        NoRegionError,
        ParamValidationError,
        PartialCredentialsError,
        ProfileNotFound,
        SSLError,
    )

    code = error_code(exc)
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return StorageAccessError(f"{op} {where}: no S3 credentials found by the default AWS credential chain "
                                  "(spec.checkpoint: credentialsSecret, webIdentity or ambient)")
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        message = _redact(str(exc.response.get("Error", {}).get("Message", "")))
        text = f"{op} {where}: {code or status} {message}".strip()
        if code == "PermanentRedirect" or status == 301:
            region = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
            return StoragePermanentError(f"{text} (the bucket is in another region{f', {region}' if region else ''}"
                                         ": set spec.checkpoint.region, and the endpoint, to the bucket's)")
        if code in _ACCESS_CODES or (code not in _PERMANENT_CODES and status in (401, 403, 404)):
            return StorageAccessError(text)
        if code in _PERMANENT_CODES or status in (400, 405):
            return StoragePermanentError(text)
        return StorageTemporaryError(text)
    if isinstance(exc, (ParamValidationError, NoRegionError,  # the request can never be valid as configured
                        ProfileNotFound, ConfigNotFound, InvalidConfigError, InvalidChecksumConfigError,
                        InvalidEndpointConfigurationError, InvalidRegionError,  # nor the client (AWS_* settings)
                        EndpointResolutionError)):  # botocore's rules make no URL of the endpoint, region and bucket
        return StoragePermanentError(f"{op} {where}: {type(exc).__name__}: {_redact(str(exc))}")
    if isinstance(exc, SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(exc):  # retried within the access window
        # (a certificate rotated ahead of its CA bundle's mount, a node clock not yet synced), then exit 82
        return StorageAccessError(f"{op} {where}: {type(exc).__name__}: {_redact(str(exc))} (a store with a "
                                     "private CA: mount its certificate and point AWS_CA_BUNDLE at it in spec.env)")
    if isinstance(exc, (BotoConnectionError, HTTPClientError, OSError)):
        return StorageTemporaryError(f"{op} {where}: {type(exc).__name__}: {_redact(str(exc))}")
    if isinstance(exc, BotoCoreError):
        return StorageTemporaryError(f"{op} {where}: {type(exc).__name__}: {_redact(str(exc))}")
    # boto3's transfer manager wraps errors (S3UploadFailedError and friends);
    # their text includes the inner ClientError's code.
    text = _redact(str(exc))
    if any(c in text for c in _ACCESS_CODES):
        return StorageAccessError(f"{op} {where}: {type(exc).__name__}: {text}")
    if any(c in text for c in _PERMANENT_CODES):
        return StoragePermanentError(f"{op} {where}: {type(exc).__name__}: {text}")
    return StorageTemporaryError(f"{op} {where}: {type(exc).__name__}: {text}")


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError ('' for anything else)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _redact(text: str) -> str:
    """`text` with this process's AWS keys masked.

    The one read of the environment outside workerenv.py and launch_config.py, on purpose: the keys
    are read only to be removed, at the moment a message is built, in whichever process (launcher or
    worker) built it; passing secrets around as values would spread exactly what this hides.
    """
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN"):
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text
