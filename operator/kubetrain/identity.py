"""Who the training pods are towards checkpoint storage: one of three explicit modes.

Platform teams on managed clusters forbid long-lived S3 keys in Secrets; pods get short-lived
credentials instead. Silently falling back to whatever the node offers would be a security
surprise, so a job names its identity (spec.checkpoint, exactly one of):

- `credentialsSecret`: access keys from a Secret, by secretKeyRef (never inline);
- `webIdentity`: a role assumed with a projected ServiceAccount token (what the EKS IRSA webhook
  injects, done by the operator so it works with or without the webhook, and on any
  S3-compatible store with an OIDC-based STS): the token volume with the job's audience and
  expiry, AWS_ROLE_ARN, AWS_WEB_IDENTITY_TOKEN_FILE and the named ServiceAccount. The token is
  separate from automountServiceAccountToken and grants no Kubernetes API rights by itself: the
  API server accepts only tokens for its own audiences;
- `ambient`: the pod's default AWS credential chain (EKS Pod Identity, a node's instance role).

The trainer needs nothing per mode: boto3's default chain picks up what the pod has, and
refreshes temporary credentials itself. Everything here is pure: parsing, a description for
status and events (never a credential), and the env/volume pieces the pod builder adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Union

IdentityMode = Literal["credentialsSecret", "webIdentity", "ambient"]
MODES: tuple[IdentityMode, ...] = ("credentialsSecret", "webIdentity", "ambient")

TOKEN_VOLUME = "kubetrain-aws-web-identity"
TOKEN_DIR = "/etc/kubetrain/aws-web-identity"
"""Under /etc/kubetrain, which user mounts may not use: nothing can shadow the token."""
TOKEN_FILE = f"{TOKEN_DIR}/token"
DEFAULT_AUDIENCE = "sts.amazonaws.com"
DEFAULT_TOKEN_SECONDS = 3600
MIN_TOKEN_SECONDS = 600
"""The API server refuses a projected token that lives shorter (10 minutes)."""
MAX_TOKEN_SECONDS = 86400


class IdentityError(ValueError):
    """The identity part of spec.checkpoint is unusable; `field_path` is relative to `spec.`."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"spec.{field_path}: {message}")
        self.field_path = field_path
        self.message = message


@dataclass(frozen=True)
class SecretKeys:
    """Access keys from a Secret in the job's namespace."""

    name: str
    access_key_id_key: str = "accessKeyId"
    secret_access_key_key: str = "secretAccessKey"
    mode: IdentityMode = "credentialsSecret"


@dataclass(frozen=True)
class WebIdentity:
    """A role assumed through STS AssumeRoleWithWebIdentity with a projected ServiceAccount token."""

    role_arn: str
    service_account: str
    audience: str = DEFAULT_AUDIENCE
    token_expiration_seconds: int = DEFAULT_TOKEN_SECONDS
    """The kubelet rotates the token at 80% of this; boto3 re-reads the file on every refresh."""
    mode: IdentityMode = "webIdentity"


@dataclass(frozen=True)
class Ambient:
    """The pod's default AWS credential chain, chosen explicitly (Pod Identity, instance roles)."""

    mode: IdentityMode = "ambient"


StorageIdentity = Union[SecretKeys, WebIdentity, Ambient]


def parse_identity(checkpoint: Mapping[str, Any]) -> StorageIdentity:
    """The one identity a stored spec.checkpoint names; IdentityError names the field otherwise."""
    present = [m for m in MODES if checkpoint.get(m) is not None]
    if len(present) != 1:
        got = f"got {', '.join(present)}" if present else "got none"
        raise IdentityError("checkpoint", "must set exactly one identity: credentialsSecret, webIdentity or "
                                          f"ambient ({got})")
    mode, raw = present[0], checkpoint[present[0]]
    if not isinstance(raw, Mapping):
        raise IdentityError(f"checkpoint.{mode}", "must be an object")
    if mode == "credentialsSecret":
        if not raw.get("name"):
            raise IdentityError("checkpoint.credentialsSecret.name", "is required")
        return SecretKeys(name=str(raw["name"]), access_key_id_key=raw.get("accessKeyIdKey") or "accessKeyId",
                          secret_access_key_key=raw.get("secretAccessKeyKey") or "secretAccessKey")
    if mode == "ambient":
        return Ambient()
    role = raw.get("roleArn")
    if not role or not isinstance(role, str) or not role.startswith("arn:") or ":role/" not in role:
        raise IdentityError("checkpoint.webIdentity.roleArn", "is required: the ARN of the role to assume, "
                                                              f"arn:<partition>:iam::<account>:role/<name>, got {role!r}")
    account = raw.get("serviceAccountName")
    if not account:
        raise IdentityError("checkpoint.webIdentity.serviceAccountName",
                            "is required: the ServiceAccount the role trusts (its token is what the pods present)")
    seconds = raw.get("tokenExpirationSeconds", DEFAULT_TOKEN_SECONDS)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not MIN_TOKEN_SECONDS <= seconds <= MAX_TOKEN_SECONDS:
        raise IdentityError("checkpoint.webIdentity.tokenExpirationSeconds",
                            f"must be a whole number from {MIN_TOKEN_SECONDS} to {MAX_TOKEN_SECONDS}, got {seconds!r}")
    return WebIdentity(role_arn=role, service_account=str(account),
                       audience=str(raw.get("audience") or DEFAULT_AUDIENCE), token_expiration_seconds=seconds)


def describe(identity: StorageIdentity) -> str:
    """For status and events: which mode, and the non-secret names that locate it."""
    if isinstance(identity, SecretKeys):
        return f"credentialsSecret (Secret {identity.name})"
    if isinstance(identity, WebIdentity):
        return (f"webIdentity (role {identity.role_arn}, ServiceAccount {identity.service_account}, "
                f"audience {identity.audience})")
    return "ambient (the pod's default AWS credential chain)"


def get_identity_env(identity: StorageIdentity, *, session_name: str) -> list[dict[str, Any]]:
    """The AWS_* variables of the mode (docs/contract.md); values of keys only by secretKeyRef."""
    if isinstance(identity, SecretKeys):
        return [
            {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {
                "name": identity.name, "key": identity.access_key_id_key}}},
            {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {
                "name": identity.name, "key": identity.secret_access_key_key}}},
        ]
    if isinstance(identity, WebIdentity):
        return [
            {"name": "AWS_ROLE_ARN", "value": identity.role_arn},
            {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": TOKEN_FILE},
            # Shows up in the store's audit log (CloudTrail) as the session that wrote a checkpoint.
            {"name": "AWS_ROLE_SESSION_NAME", "value": session_name[:64]},
        ]
    return []


def get_identity_volume(identity: StorageIdentity) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, mount) of the projected ServiceAccount token for webIdentity, else None."""
    if not isinstance(identity, WebIdentity):
        return None
    volume = {"name": TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": {
        "audience": identity.audience, "expirationSeconds": identity.token_expiration_seconds,
        "path": "token"}}]}}
    return volume, {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}
