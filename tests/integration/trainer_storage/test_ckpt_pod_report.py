"""The launcher's best-effort pod annotation, against the testbed's real kube-apiserver.

The trainer image has no Kubernetes client: `annotate_pod` is a plain HTTPS
merge patch with the pod's ServiceAccount token. Here the token comes from a
real TokenRequest, the CA from the testbed, and RBAC decides.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import urlparse

import pytest

from kubetrain_trainer.launch import annotate_pod

pytestmark = pytest.mark.integration


def _sa_dir(tmp_path: Path, testbed, core, namespace: str) -> Path:
    token = core.create_namespaced_service_account_token(
        "default", namespace, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                               "spec": {"audiences": [], "expirationSeconds": 600}}).status.token
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(token)
    (sa / "namespace").write_text(namespace)
    shutil.copyfile(testbed.ca_file, sa / "ca.crt")
    return sa


def test_pod_annotation_with_the_service_account_token(testbed, kube_api, namespace, tmp_path, monkeypatch):
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    rbac = client.RbacAuthorizationV1Api(kube_api)
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "job-a1-n0"},
        "spec": {"containers": [{"name": "trainer", "image": "kubetrain-trainer:test"}]}})
    api = urlparse(testbed.api_server)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", api.hostname)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
    sa = _sa_dir(tmp_path, testbed, core, namespace)
    value = json.dumps({"step": 1200, "uri": "s3://b/p/checkpoint-1200", "time": "2026-01-01T00:00:00Z"})

    # Without RBAC the API server refuses: best effort means False, never an exception.
    assert annotate_pod(sa_dir=sa, namespace="", pod="job-a1-n0",
                        annotations={"kubetrain.io/last-checkpoint": value}) is False

    rbac.create_namespaced_role(namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "annotate-self"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "annotate-self"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "annotate-self"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]})
    import time

    deadline = time.monotonic() + 120  # the RBAC cache catches up within moments (generous: loaded CI)
    while not annotate_pod(sa_dir=sa, namespace="", pod="job-a1-n0",
                           annotations={"kubetrain.io/last-checkpoint": value, "kubetrain.io/checkpoint-sync": "x"}):
        assert time.monotonic() < deadline, "annotation never accepted"
        time.sleep(0.5)
    pod = core.read_namespaced_pod("job-a1-n0", namespace)
    assert pod.metadata.annotations["kubetrain.io/last-checkpoint"] == value
    assert annotate_pod(sa_dir=sa, namespace=namespace, pod="job-a1-n0",
                        annotations={"kubetrain.io/checkpoint-sync": None})  # None removes it
    pod = core.read_namespaced_pod("job-a1-n0", namespace)
    assert "kubetrain.io/checkpoint-sync" not in (pod.metadata.annotations or {})
