"""The launcher's failure record: when checkpoint storage refuses a pod at start, it exits 82 and its
termination message names the reason, the store's error code and the checkpoint location, and
nothing else (docs/contract.md, "Reporting a failure").

The launcher runs in this process against a local HTTP server that answers every S3 request as a
store refusing it would (boto3 and botocore are real; only the store is a stand-in: MinIO's refusal
is tests/integration/trainer_storage/test_ckpt_web_identity_minio.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from botocore.exceptions import NoCredentialsError

from kubetrain_trainer import contract, launch
from kubetrain_trainer.failure import FailureRecord, error_code, storage_failure
from kubetrain_trainer.storage import CheckpointStore, StorageConfig
from kubetrain_trainer.storage_errors import StorageAccessError, StorageTemporaryError

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzEXAMPLEKEY"


class _Refusing(BaseHTTPRequestHandler):
    status, code = 403, "AccessDenied"

    def _answer(self) -> None:
        body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{self.code}</Code>"
                f"<Message>refused, as configured: secret={SECRET}</Message></Error>").encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def refusing_store():
    servers = []

    def start(status: int, code: str) -> str:
        handler = type("Handler", (_Refusing,), {"status": status, "code": code})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _run_launcher(monkeypatch, tmp_path: Path, endpoint: str, uri: str) -> tuple[int, str]:
    for name in [n for n in os.environ if n.startswith(("AWS_", "KUBETRAIN_"))]:
        monkeypatch.delenv(name)
    env = {"NNODES": "1", "NODE_RANK": "0", "KUBETRAIN_ATTEMPT": "1", "KUBETRAIN_JOB_INCARNATION": "1700000000",
           "KUBETRAIN_CHECKPOINT_URI": uri, "AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1",
           "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET,
           "KUBETRAIN_S3_AUTH_RETRY_SECONDS": "0.5", "KUBETRAIN_RESTORE_TIMEOUT_SECONDS": "5",
           "KUBETRAIN_METRICS_PORT": "0", "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
           "KUBETRAIN_TERMINATION_LOG": str(tmp_path / "termination-log"), "HOME": str(tmp_path)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = launch.main(["--", "false"])  # never started: storage refuses the restore first
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    log = tmp_path / "termination-log"
    return code, log.read_text() if log.exists() else ""


@pytest.mark.parametrize("status, code, reason", [
    (403, "AccessDenied", contract.FAILURE_STORAGE_ACCESS_DENIED),
    (404, "NoSuchBucket", contract.FAILURE_STORAGE_ACCESS_DENIED),
    (400, "InvalidBucketName", contract.FAILURE_STORAGE_REQUEST_INVALID),
])
def test_storage_refusing_the_pod_at_start_exits_82_with_the_failure_record(
        monkeypatch, tmp_path, refusing_store, status, code, reason):
    uri = "s3://ckpt/sts-other/ml/wrong-role"
    exit_code, message = _run_launcher(monkeypatch, tmp_path, refusing_store(status, code), uri)
    assert exit_code == contract.EXIT_INVALID_CONFIG
    assert message.endswith("\n") and message.count("\n") == 1, message
    assert json.loads(message) == {"kind": contract.FAILURE_KIND, "reason": reason, "code": code, "where": uri}
    assert SECRET not in message and "AKIA" not in message and "refused, as configured" not in message


def _store_raising(exc: Exception) -> CheckpointStore:
    class Client:
        def get_paginator(self, _name):
            raise exc

    return CheckpointStore(StorageConfig(uri="s3://ckpt/jobs/ml/j"), client=Client())


@pytest.mark.parametrize("bug", [TypeError("unsupported operand"), AttributeError("'NoneType' has no 'read'")])
def test_a_bug_is_raised_as_it_is_not_retried_as_a_storage_failure(bug):
    # The uploader logs an unexpected error with its traceback; a classified one would read as S3 trouble.
    with pytest.raises(type(bug)) as raised:
        _store_raising(bug).list_checkpoints()
    assert raised.value is bug


def test_an_os_error_is_a_temporary_storage_failure():
    with pytest.raises(StorageTemporaryError, match="ConnectionResetError"):
        _store_raising(ConnectionResetError("reset by peer")).list_checkpoints()


def test_missing_credentials_are_named_as_such():
    with pytest.raises(StorageAccessError) as refused:
        _store_raising(NoCredentialsError()).list_checkpoints()
    record = storage_failure(refused.value, reason=contract.FAILURE_STORAGE_ACCESS_DENIED, where="s3://ckpt/jobs/ml/j")
    assert (record.code, record.where) == ("NoCredentials", "s3://ckpt/jobs/ml/j")


def test_an_error_without_a_code_gives_a_record_without_one():
    assert error_code(StorageAccessError("list s3://b/k: refused")) is None
    record = storage_failure(StorageAccessError("x"), reason=contract.FAILURE_STORAGE_ACCESS_DENIED, where=None)
    assert json.loads(record.to_json()) == {"kind": contract.FAILURE_KIND, "reason": "StorageAccessDenied"}


def test_only_the_contract_s_reasons_and_codes_are_written():
    with pytest.raises(ValueError, match="reason"):
        FailureRecord(reason="SomethingElse")
    with pytest.raises(ValueError, match="code"):
        FailureRecord(reason=contract.FAILURE_STORAGE_ACCESS_DENIED, code="Access Denied")


def test_a_location_too_long_for_the_termination_message_is_left_out():
    where = "s3://ckpt/" + "p" * contract.TERMINATION_MESSAGE_LIMIT
    text = FailureRecord(reason=contract.FAILURE_STORAGE_ACCESS_DENIED, code="AccessDenied", where=where).to_json()
    assert len(text) < contract.TERMINATION_MESSAGE_LIMIT and json.loads(text)["code"] == "AccessDenied"
    assert "where" not in json.loads(text)


def test_a_certificate_the_pod_does_not_trust_is_named_in_the_record():
    """An untrusted certificate exits 82 as StorageAccessDenied with no code: the job's status read 'checkpoint
    storage refused access (StorageAccessDenied)', sending the user to IAM policies, not to AWS_CA_BUNDLE."""
    from botocore.exceptions import SSLError

    untrusted = SSLError(endpoint_url="https://minio.storage:9000/ckpt",
                         error="[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate")
    with pytest.raises(StorageAccessError) as refused:
        _store_raising(untrusted).list_checkpoints()
    record = storage_failure(refused.value, reason=contract.FAILURE_STORAGE_ACCESS_DENIED, where="s3://ckpt/jobs/ml/j")
    assert record.code == "CertificateVerifyFailed"
    # A handshake cut short by the network is no certificate problem (and not exit 82 anyway).
    assert error_code(SSLError(endpoint_url="https://s", error="EOF occurred in violation of protocol")) is None
