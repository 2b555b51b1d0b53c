"""Checkpoints with web identity for real: a projected-style ServiceAccount token from the
testbed's API server, exchanged by boto3's default credential chain at MinIO's STS
(AssumeRoleWithWebIdentity; MinIO trusts the API server as its OIDC provider, see
testbed/kubetrain_testbed/sts.py), temporary credentials limited to one bucket prefix.

No static key reaches the trainer: the processes below get AWS_ROLE_ARN,
AWS_WEB_IDENTITY_TOKEN_FILE and the endpoint, exactly what the operator gives a webIdentity pod.

Expiry in the middle of an upload: MinIO's credentials live as long as the token they came
from (boto3 sends no DurationSeconds), and the API server issues no token shorter than 10
minutes. So that test mints its tokens itself with the API server's own ServiceAccount signing
key (same issuer, key id and claims, a 20 s lifetime), and rotates the token file the way the
kubelet does. MinIO, its STS, the JWKS check and botocore's refreshing credentials are real.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubetrain_testbed.components import SA_ISSUER
from kubetrain_testbed.sts import JOBS_ROLE, OTHER_ROLE
from kubetrain_trainer.storage import CheckpointStore, StorageConfig
from kubetrain_trainer.storage_errors import StorageAccessError, StoragePermanentError

pytestmark = [pytest.mark.integration]

ACCOUNT = "trainer"


@pytest.fixture
def service_account(kube_api, namespace) -> str:
    from kubernetes import client

    client.CoreV1Api(kube_api).create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=ACCOUNT)))
    return ACCOUNT


def _api_token(kubectl, namespace: str, audience: str) -> str:
    """A token from the API server's TokenRequest, as the kubelet gets one for a projected volume."""
    return kubectl("create", "token", ACCOUNT, "-n", namespace, "--audience", audience, "--duration", "600s").strip()


def _web_identity_env(testbed, token_file: Path, role_arn: str, uri: str) -> dict[str, str]:
    """The pod's environment for webIdentity: no keys, a role and a token file (docs/contract.md)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBETRAIN_"))}
    env.update(AWS_ROLE_ARN=role_arn, AWS_WEB_IDENTITY_TOKEN_FILE=str(token_file), AWS_ROLE_SESSION_NAME="test-a1-n0",
               AWS_ENDPOINT_URL=testbed.s3_endpoint, AWS_REGION=testbed.region, KUBETRAIN_CHECKPOINT_URI=uri,
               HOME=str(token_file.parent))  # no ~/.aws of this machine's user
    return env


def _launch(env: dict[str, str], tmp: Path, attempt: int, max_steps: int, **extra: str) -> tuple[int, str]:
    args = {"max_steps": max_steps, "save_steps": 10, "use_cpu": True, "per_device_train_batch_size": 8,
            "logging_steps": 10}
    env = {**env, **extra, "NNODES": "1", "NODE_RANK": "0", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29700 + attempt), "OMP_NUM_THREADS": "1", "KUBETRAIN_ATTEMPT": str(attempt),
           "KUBETRAIN_JOB_INCARNATION": "1", "KUBETRAIN_STRATEGY": "ddp", "KUBETRAIN_BUILTIN_TASK": "regression",
           "KUBETRAIN_TRAINER_ARGS": json.dumps(args),
           "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp / f"pod-a{attempt}" / "ckpt"),
           "KUBETRAIN_TERMINATION_LOG": str(tmp / f"termination-log-a{attempt}"),
           "KUBETRAIN_TERMINATION_GRACE_SECONDS": "60"}
    log = tmp / f"attempt{attempt}.log"
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "kubetrain_trainer.launch"], env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=600).returncode
    return code, log.read_text(errors="replace")


def _admin_keys(s3, bucket: str, prefix: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def test_trainer_checkpoints_and_restores_with_only_a_web_identity_token(
        testbed, kubectl, namespace, service_account, s3, tmp_path):
    token = tmp_path / "token"
    token.write_text(_api_token(kubectl, namespace, JOBS_ROLE.audience))
    prefix = f"{JOBS_ROLE.prefix}/{namespace}/job/"
    env = _web_identity_env(testbed, token, JOBS_ROLE.role_arn, f"s3://{testbed.bucket}/{prefix.rstrip('/')}")
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(env)

    code, log = _launch(env, tmp_path, 1, max_steps=20)
    assert code == 0, log[-4000:]
    keys = _admin_keys(s3, testbed.bucket, prefix)
    assert f"{prefix}checkpoint-20/manifest.json" in keys and f"{prefix}final/manifest.json" in keys, sorted(keys)

    # A new pod (fresh local disk) of the same job restores checkpoint-20 through the same identity.
    code, log = _launch(env, tmp_path, 2, max_steps=30)
    assert code == 0, log[-4000:]
    manifest = json.loads(s3.get_object(Bucket=testbed.bucket, Key=f"{prefix}checkpoint-30/manifest.json")["Body"].read())
    assert (manifest["step"], manifest["attempt"]) == (30, 2)
    assert "restor" in log and "checkpoint-20" in log, log[-4000:]


def test_a_role_is_refused_outside_its_prefix(testbed, kubectl, namespace, service_account, monkeypatch, tmp_path):
    """The STS credentials of the jobs role may write sts-jobs/ only: MinIO refuses the rest."""
    token = tmp_path / "token"
    token.write_text(_api_token(kubectl, namespace, JOBS_ROLE.audience))
    for name, value in _web_identity_env(testbed, token, JOBS_ROLE.role_arn, "").items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    own = CheckpointStore(StorageConfig(uri=f"s3://{testbed.bucket}/{JOBS_ROLE.prefix}/{namespace}/job",
                                        endpoint_url=testbed.s3_endpoint))
    own.put_bytes(1, "probe.json", b"{}")  # its own prefix: allowed
    assert [c.step for c in own.list_checkpoints()] == [1]
    for other in (f"{OTHER_ROLE.prefix}/{namespace}/job", f"tests/{namespace}/job"):
        store = CheckpointStore(StorageConfig(uri=f"s3://{testbed.bucket}/{other}", endpoint_url=testbed.s3_endpoint))
        with pytest.raises(StorageAccessError, match="AccessDenied"):
            store.put_bytes(1, "probe.json", b"{}")
        with pytest.raises(StorageAccessError, match="AccessDenied"):
            store.list_checkpoints()


def test_a_job_whose_role_covers_another_prefix_fails_as_invalid_configuration_naming_access_denied(
        testbed, kubectl, namespace, service_account, tmp_path):
    token = tmp_path / "token"
    token.write_text(_api_token(kubectl, namespace, OTHER_ROLE.audience))
    uri = f"s3://{testbed.bucket}/{JOBS_ROLE.prefix}/{namespace}/wrong-role"
    env = _web_identity_env(testbed, token, OTHER_ROLE.role_arn, uri)
    code, log = _launch(env, tmp_path, 1, max_steps=10, KUBETRAIN_S3_AUTH_RETRY_SECONDS="2")
    assert code == 82, log[-4000:]
    assert "AccessDenied" in log and uri in log, log[-4000:]
    # What the operator reads (docs/contract.md, "Reporting a failure"): reason, MinIO's code, the location.
    record = (tmp_path / "termination-log-a1").read_text()
    assert json.loads(record) == {"kind": "kubetrain.io/failure", "reason": "StorageAccessDenied",
                                  "code": "AccessDenied", "where": uri}, record


def test_a_token_for_another_audience_is_refused_by_the_sts(testbed, kubectl, namespace, service_account,
                                                            monkeypatch, tmp_path):
    token = tmp_path / "token"
    token.write_text(_api_token(kubectl, namespace, "sts.amazonaws.com"))  # not what MinIO's jobs role trusts
    for name, value in _web_identity_env(testbed, token, JOBS_ROLE.role_arn, "").items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    store = CheckpointStore(StorageConfig(uri=f"s3://{testbed.bucket}/{JOBS_ROLE.prefix}/{namespace}/job",
                                          endpoint_url=testbed.s3_endpoint))
    # MinIO answers InvalidParameterValue (the token's aud is not the role's client id), AWS
    # InvalidIdentityToken: permanent either way, never a silent fallback to other credentials.
    with pytest.raises(StoragePermanentError, match="InvalidParameterValue|InvalidIdentityToken"):
        store.put_bytes(1, "probe.json", b"{}")


# ------------------------------------------------------------ expiry mid-upload

def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _mint(testbed, *, kid: str, namespace: str, audience: str, ttl: int) -> tuple[str, int]:
    """A ServiceAccount token as the API server would sign it, but living `ttl` seconds."""
    now = int(time.time())
    header = {"alg": "RS256", "kid": kid, "typ": "JWT"}
    claims = {"iss": SA_ISSUER, "sub": f"system:serviceaccount:{namespace}:{ACCOUNT}", "aud": [audience],
              "iat": now, "nbf": now, "exp": now + ttl}
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    key = Path(testbed.ca_file).parent / "sa.key"
    signature = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(key)], input=signing_input.encode(),
                               capture_output=True, check=True).stdout
    return f"{signing_input}.{_b64(signature)}", now + ttl


def test_credentials_expire_in_the_middle_of_an_upload_and_the_upload_goes_on(
        testbed, kubectl, namespace, service_account, s3, monkeypatch, tmp_path):
    import botocore.session
    from botocore.exceptions import ClientError

    real = _api_token(kubectl, namespace, JOBS_ROLE.audience)
    kid = json.loads(base64.urlsafe_b64decode(real.split(".")[0] + "=="))["kid"]
    token = tmp_path / "token"
    first, first_exp = _mint(testbed, kid=kid, namespace=namespace, audience=JOBS_ROLE.audience, ttl=20)
    token.write_text(first)
    for name, value in _web_identity_env(testbed, token, JOBS_ROLE.role_arn, "").items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    uri = f"s3://{testbed.bucket}/{JOBS_ROLE.prefix}/{namespace}/long"
    part = 5 << 20
    store = CheckpointStore(StorageConfig(uri=uri, endpoint_url=testbed.s3_endpoint, multipart_threshold=part,
                                          multipart_chunksize=part, max_concurrency=1))
    client = store._client  # instrumented only: which key signed each request, and a pause after part 1
    signed: list[str] = []  # the access key id of every request, in order
    used_for_part_1 = []

    def record(request, **_):
        auth = request.headers.get("Authorization")
        if auth:
            auth = auth.decode() if isinstance(auth, bytes) else auth
            signed.append(auth.split("Credential=")[1].split("/")[0])

    def after_part(http_response, parsed, model, **_):
        if used_for_part_1:
            return
        used_for_part_1.append(client._request_signer._credentials.get_frozen_credentials())
        # The kubelet rotates the token file before the old token expires; then part 2 waits
        # until the credentials from the first token are past their expiry.
        token.write_text(_mint(testbed, kid=kid, namespace=namespace, audience=JOBS_ROLE.audience, ttl=600)[0])
        while time.time() < first_exp + 2:
            time.sleep(0.5)

    client.meta.events.register("before-send.s3", record)
    client.meta.events.register("after-call.s3.UploadPart", after_part)
    data = os.urandom(3 * part)
    (tmp_path / "model.safetensors").write_bytes(data)
    store.upload_file(100, tmp_path / "model.safetensors", "model.safetensors")

    got = s3.get_object(Bucket=testbed.bucket, Key=f"{JOBS_ROLE.prefix}/{namespace}/long/checkpoint-100/model.safetensors")
    assert got["Body"].read() == data, "the upload finished whole"
    keys = signed
    assert len(set(keys)) >= 2, signed  # parts after the pause were signed with refreshed credentials
    old = used_for_part_1[0]
    assert keys[-1] != old.access_key, "the completing request used the credentials of the first token"
    # The first token's credentials are really expired: MinIO refuses them now.
    stale = botocore.session.get_session().create_client(
        "s3", endpoint_url=testbed.s3_endpoint, region_name=testbed.region, aws_access_key_id=old.access_key,
        aws_secret_access_key=old.secret_key, aws_session_token=old.token)
    with pytest.raises(ClientError) as refused:
        stale.list_objects_v2(Bucket=testbed.bucket, Prefix=f"{JOBS_ROLE.prefix}/{namespace}/")
    print(f"\n[sts] stale credentials refused with {refused.value.response['Error']['Code']}; "
          f"{len(set(keys))} distinct keys signed {len(keys)} requests")
