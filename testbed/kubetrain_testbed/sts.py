"""MinIO as an STS that trusts the testbed's API server as its OIDC provider.

On EKS a pod presents a projected ServiceAccount token to AWS STS
(AssumeRoleWithWebIdentity), which verifies it against the cluster's published OIDC
discovery document and JWKS, and returns temporary credentials of a role whose policy
limits them. Here the same exchange happens locally, so kubetrain's web identity mode is
tested for real:

- the API server publishes its ServiceAccount issuer discovery document and JWKS
  (/.well-known/openid-configuration, /openid/v1/jwks); `allow_anonymous_discovery` lets
  unauthenticated callers read them, as managed clusters do;
- MinIO's OpenID identity points at that discovery URL (trusting the testbed CA through
  its certs/CAs folder) once per role below: the token's audience is the provider's client
  id, and MinIO gives the role a fixed policy limited to one bucket prefix
  (`role_policy`; the role ARN is derived from the client id).

Two roles, so a test can show a role refused outside its prefix. Nothing here starts
anything: pure data, plus two idempotent calls made while the testbed starts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class StsRole:
    """One MinIO OpenID provider with a role policy: audience -> role -> one bucket prefix."""

    name: str
    """Suffix of MinIO's MINIO_IDENTITY_OPENID_*_<NAME> settings."""
    audience: str
    """The token audience (MinIO's client id for this provider)."""
    policy: str
    prefix: str
    """Key prefix in the testbed bucket (no leading or trailing '/') the role may use."""

    @property
    def role_arn(self) -> str:
        """MinIO's ARN of a role policy provider: a hash of the client id (MinIO's region is unset)."""
        digest = base64.urlsafe_b64encode(hashlib.sha1(self.audience.encode()).digest()).rstrip(b"=").decode()
        return f"arn:minio:iam:::role/{digest}"

    def policy_document(self, bucket: str) -> dict:
        """Least privilege on `<bucket>/<prefix>/`: list and use objects there, nothing else.

        ListBucketMultipartUploads has no prefix condition key (on AWS either): the trainer lists
        the bucket's in-progress uploads and keeps its own (storage.list_multipart_uploads)."""
        objects = f"arn:aws:s3:::{bucket}/{self.prefix}/*"
        return {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"],
             "Condition": {"StringLike": {"s3:prefix": [f"{self.prefix}/*"]}}},
            {"Effect": "Allow", "Action": ["s3:ListBucketMultipartUploads"], "Resource": [f"arn:aws:s3:::{bucket}"]},
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                           "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
             "Resource": [objects]},
        ]}


JOBS_ROLE = StsRole(name="JOBS", audience="kubetrain-testbed-sts", policy="kubetrain-sts-jobs", prefix="sts-jobs")
"""The role web identity jobs use: checkpoints under s3://<bucket>/sts-jobs/."""
OTHER_ROLE = StsRole(name="OTHER", audience="kubetrain-testbed-sts-other", policy="kubetrain-sts-other",
                     prefix="sts-other")
"""A role for another prefix: a job under sts-jobs/ that assumes it must be refused."""
ROLES = (JOBS_ROLE, OTHER_ROLE)

DISCOVERY_BINDING = "kubetrain-testbed-anonymous-oidc-discovery"


def discovery_url(api_port: int) -> str:
    return f"https://127.0.0.1:{api_port}/.well-known/openid-configuration"


def minio_env(api_port: int) -> dict[str, str]:
    """MinIO's OpenID settings: one provider per role, all at the API server's discovery URL."""
    env: dict[str, str] = {}
    for role in ROLES:
        env[f"MINIO_IDENTITY_OPENID_CONFIG_URL_{role.name}"] = discovery_url(api_port)
        env[f"MINIO_IDENTITY_OPENID_CLIENT_ID_{role.name}"] = role.audience
        env[f"MINIO_IDENTITY_OPENID_ROLE_POLICY_{role.name}"] = role.policy
    return env


def minio_certs_dir(run_dir: Path, ca_crt: Path) -> Path:
    """MinIO's --certs-dir with only CAs/ (so it trusts the API server) and no serving key (plain HTTP)."""
    certs = run_dir / "minio-certs"
    (certs / "CAs").mkdir(parents=True, exist_ok=True)
    (certs / "CAs" / "testbed-ca.crt").write_bytes(ca_crt.read_bytes())
    return certs


def discovery_binding() -> dict:
    """Anonymous read of the issuer discovery document and JWKS (the bootstrap ClusterRole
    system:service-account-issuer-discovery), as managed clusters publish them."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": DISCOVERY_BINDING},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "system:service-account-issuer-discovery"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:unauthenticated"}],
    }


ADMIN_READY_TIMEOUT_S = 60.0
"""How long `create_policies` waits for MinIO's admin API after MinIO reports itself live: it answers 503
until its IAM subsystem is up, a moment later (seen once in a full test run on a loaded machine)."""


def create_policies(*, endpoint: str, access_key: str, secret_key: str, region: str, bucket: str,
                    send: Callable[[str, str, bytes, dict[str, str]], int] | None = None,
                    timeout: float = ADMIN_READY_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> None:
    """Create (or replace) each role's policy through MinIO's admin API (a SigV4-signed PUT). A 503 (the
    admin API not ready yet) is retried for `timeout` seconds; any other refusal fails at once."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    creds = Credentials(access_key, secret_key)
    deadline = clock() + timeout
    for role in ROLES:
        body = json.dumps(role.policy_document(bucket)).encode()
        url = f"{endpoint}/minio/admin/v3/add-canned-policy?name={role.policy}"
        while True:
            req = AWSRequest(method="PUT", url=url, data=body)
            S3SigV4Auth(creds, "s3", region).add_auth(req)  # signed per try: the signature carries the time
            status = (send or _send)("PUT", url, body, dict(req.headers.items()))
            if status == 200:
                break
            if status != 503 or clock() >= deadline:
                waited = f" (still after {timeout:g} s)" if status == 503 else ""
                raise RuntimeError(f"MinIO refused policy {role.policy}: HTTP {status}{waited}")
            sleep(0.5)


def _send(method: str, url: str, body: bytes, headers: dict[str, str]) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
