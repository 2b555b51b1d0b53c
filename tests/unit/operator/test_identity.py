"""Checkpoint storage identity (kubetrain.identity): exactly one explicit mode per job, the
pod pieces each mode adds, and what status and events say about it (never a credential).

The CRD refuses the same specs at admission (tests/integration/api/test_trainingjob_validation.py);
the operator re-checks so a spec stored before a rule existed fails as InvalidSpec naming the field."""

from __future__ import annotations

import copy

import pytest

from kubetrain import builders
from kubetrain.api import Job
from kubetrain.spec import Spec, SpecError
from kubetrain.identity import TOKEN_DIR, TOKEN_FILE, TOKEN_VOLUME, describe
from kubetrain.observe import Observed
from kubetrain.plan import plan

from kubetrain_factories import at, job

ROLE = "arn:aws:iam::111122223333:role/ml-checkpoints"
WEB = {"roleArn": ROLE, "serviceAccountName": "trainer"}
SECRET = {"name": "s3-keys"}


def spec_with(checkpoint: dict | None = None, **extra) -> dict:
    ckpt = {"uri": "s3://bucket/jobs", "endpoint": "http://minio:9000", **(checkpoint or {})}
    return {"image": "i", "nodes": 2, "trainer": {"builtin": {"task": "regression"}}, "checkpoint": ckpt, **extra}


def body(checkpoint: dict, **extra) -> dict:
    return {"metadata": {"name": "gpt", "namespace": "ml", "uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": spec_with(checkpoint, **extra)}


# (id, spec.checkpoint identity part, extra spec, field named, words of the message)
REFUSED = [
    ("no-mode", {}, {}, "spec.checkpoint", "exactly one identity: credentialsSecret, webIdentity or ambient (got none)"),
    ("secret-and-web", {"credentialsSecret": SECRET, "webIdentity": WEB}, {}, "spec.checkpoint",
     "got credentialsSecret, webIdentity"),
    ("web-and-ambient", {"webIdentity": WEB, "ambient": {}}, {}, "spec.checkpoint", "got webIdentity, ambient"),
    ("all-three", {"credentialsSecret": SECRET, "webIdentity": WEB, "ambient": {}}, {}, "spec.checkpoint",
     "exactly one identity"),
    ("web-without-role", {"webIdentity": {"serviceAccountName": "trainer"}}, {}, "spec.checkpoint.webIdentity.roleArn",
     "is required"),
    ("web-role-not-an-arn", {"webIdentity": {**WEB, "roleArn": "ml-checkpoints"}}, {},
     "spec.checkpoint.webIdentity.roleArn", "arn:<partition>:iam::<account>:role/<name>"),
    ("web-without-service-account", {"webIdentity": {"roleArn": ROLE}}, {},
     "spec.checkpoint.webIdentity.serviceAccountName", "is required"),
    ("web-token-too-short", {"webIdentity": {**WEB, "tokenExpirationSeconds": 599}}, {},
     "spec.checkpoint.webIdentity.tokenExpirationSeconds", "from 600 to 86400"),
    ("web-token-not-a-number", {"webIdentity": {**WEB, "tokenExpirationSeconds": True}}, {},
     "spec.checkpoint.webIdentity.tokenExpirationSeconds", "whole number"),
    ("secret-without-name", {"credentialsSecret": {}}, {}, "spec.checkpoint.credentialsSecret.name", "is required"),
    ("web-and-another-pod-service-account", {"webIdentity": WEB}, {"podTemplate": {"serviceAccountName": "other"}},
     "spec.podTemplate.serviceAccountName", "must equal spec.checkpoint.webIdentity.serviceAccountName (trainer)"),
]


@pytest.mark.parametrize("identity, extra, field, words", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_missing_ambiguous_or_incomplete_identity_is_refused_naming_the_field(identity, extra, field, words):
    with pytest.raises(SpecError) as err:
        Spec.from_storage(spec_with(identity, **extra))
    assert str(err.value).startswith(field + ":"), err.value
    assert words in str(err.value)


@pytest.mark.parametrize("identity, extra, mode", [
    ({"credentialsSecret": SECRET}, {}, "credentialsSecret"),
    ({"webIdentity": WEB}, {}, "webIdentity"),
    ({"webIdentity": WEB}, {"podTemplate": {"serviceAccountName": "trainer"}}, "webIdentity"),
    ({"webIdentity": {**WEB, "roleArn": "arn:minio:iam:::role/Xy_z-1"}}, {}, "webIdentity"),
    ({"ambient": {}}, {"podTemplate": {"serviceAccountName": "pod-identity"}}, "ambient"),
], ids=["secret", "web", "web-same-pod-account", "web-minio-role", "ambient"])
def test_each_mode_alone_is_accepted(identity, extra, mode):
    spec = Spec.from_storage(spec_with(identity, **extra))
    assert spec.checkpoint is not None and spec.checkpoint.identity.mode == mode


def _pod(checkpoint: dict, rank: int = 1, **extra) -> dict:
    return builders.get_pod(job=Job.from_storage(body(checkpoint, **extra)), attempt=2, rank=rank)


def _env(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


CREDENTIAL_VARS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}


def test_web_identity_pod_gets_a_projected_token_the_role_and_the_named_service_account():
    pod = _pod({"webIdentity": {**WEB, "audience": "minio-sts", "tokenExpirationSeconds": 900}})
    env = _env(pod)
    assert not CREDENTIAL_VARS & set(env), "web identity pods get no keys, only a token to exchange"
    assert env["AWS_ROLE_ARN"] == {"name": "AWS_ROLE_ARN", "value": ROLE}
    assert env["AWS_WEB_IDENTITY_TOKEN_FILE"] == {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": TOKEN_FILE}
    assert env["AWS_ROLE_SESSION_NAME"]["value"] == "gpt-a2-n1"
    assert env["AWS_REGION"]["value"] == "us-east-1" and env["AWS_ENDPOINT_URL"]["value"] == "http://minio:9000"
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "trainer"
    assert spec["automountServiceAccountToken"] is False, "the storage token is no API token"
    volume = next(v for v in spec["volumes"] if v["name"] == TOKEN_VOLUME)
    assert volume["projected"]["sources"] == [{"serviceAccountToken": {
        "audience": "minio-sts", "expirationSeconds": 900, "path": "token"}}]
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == TOKEN_VOLUME)
    assert mount == {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}
    assert TOKEN_FILE == f"{mount['mountPath']}/{volume['projected']['sources'][0]['serviceAccountToken']['path']}"


def test_web_identity_defaults_are_the_eks_webhooks_audience_and_an_hour():
    volume = next(v for v in _pod({"webIdentity": WEB})["spec"]["volumes"] if v["name"] == TOKEN_VOLUME)
    assert volume["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "sts.amazonaws.com"
    assert volume["projected"]["sources"][0]["serviceAccountToken"]["expirationSeconds"] == 3600


def test_ambient_pod_gets_no_credentials_no_token_and_the_templates_service_account():
    pod = _pod({"ambient": {}}, podTemplate={"serviceAccountName": "pod-identity"})
    env = _env(pod)
    assert not {n for n in env if n.startswith("AWS_")} - {"AWS_REGION", "AWS_ENDPOINT_URL"}, sorted(env)
    assert pod["spec"]["serviceAccountName"] == "pod-identity"
    assert all(v["name"] != TOKEN_VOLUME for v in pod["spec"].get("volumes", []))


def test_secret_pod_keeps_its_keys_by_reference_and_no_token():
    pod = _pod({"credentialsSecret": SECRET})
    env = _env(pod)
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "s3-keys", "key": "accessKeyId"}
    assert "AWS_ROLE_ARN" not in env and "serviceAccountName" not in pod["spec"]
    assert all(v["name"] != TOKEN_VOLUME for v in pod["spec"].get("volumes", []))


def test_token_mount_is_where_no_user_mount_may_go():
    from kubetrain.spec import RESERVED_MOUNT_TREES

    assert any(TOKEN_DIR.startswith(tree + "/") for tree in RESERVED_MOUNT_TREES)
    assert TOKEN_VOLUME.startswith("kubetrain-")  # the CRD reserves the prefix for kubetrain's volumes


@pytest.mark.parametrize("identity, says", [
    ({"credentialsSecret": SECRET}, "credentialsSecret (Secret s3-keys)"),
    ({"webIdentity": WEB}, f"webIdentity (role {ROLE}, ServiceAccount trainer, audience sts.amazonaws.com)"),
    ({"ambient": {}}, "ambient (the pod's default AWS credential chain)"),
])
def test_status_and_events_say_which_mode_a_job_uses(identity, says):
    tj = job(nodes=2, spec={"checkpoint": {"uri": "s3://b/p", **copy.deepcopy(identity)}})
    assert describe(tj.spec.checkpoint.identity) == says
    result = plan(tj, Observed(), at(0))
    created = result.status.condition("Created")
    assert created.message.endswith(f"; checkpoint identity: {says}"), created.message
    assert [e.message for e in result.events if e.reason == "Created"][0].endswith(says)


def test_a_job_without_storage_mentions_no_identity():
    result = plan(job(nodes=1), Observed(), at(0))
    assert "identity" not in result.status.condition("Created").message
