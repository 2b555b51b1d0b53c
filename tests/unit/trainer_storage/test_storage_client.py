"""The S3 client `CheckpointStore` builds, as botocore really drives it: the requests it sends and how the
answers of real stores are classified. No network: a `before-send` hook answers every request."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.awsrequest import AWSResponse

from kubetrain_trainer.storage import CheckpointStore, StorageConfig
from kubetrain_trainer.storage_errors import StorageAccessError, StoragePermanentError, classify

REDIRECT = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code><Message>The bucket you '
            b'are attempting to access must be addressed using the specified endpoint.</Message></Error>')


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_kwargs: Any):
        yield self.body


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
    for name in ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION", "AWS_CONFIG_FILE"):
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
