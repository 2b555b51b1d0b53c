"""The chart's RBAC, applied to the real API server, lets the operator's
ServiceAccount do exactly what the operator needs in a watched namespace, and
nothing beyond it (no Secrets, no pod patching, no other namespaces).
Asked through SubjectAccessReviews, i.e. by the real RBAC authorizer."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]

# (group, resource, verbs) the operator uses in a namespace it watches.
NAMESPACED = [
    ("kubetrain.io", "trainingjobs", ["get", "list", "watch", "patch", "update", "delete"]),
    ("kubetrain.io", "trainingjobs/status", ["get", "patch", "update"]),
    ("", "pods", ["get", "list", "watch", "create", "delete"]),
    ("", "services", ["get", "list", "watch", "create", "delete"]),
    ("", "configmaps", ["get", "list", "watch", "create", "delete", "patch"]),
    ("", "events", ["create", "patch"]),
    ("events.k8s.io", "events", ["create", "patch"]),
]
CLUSTER = [
    ("", "nodes", ["get", "list", "watch"]),
    ("", "namespaces", ["list", "watch"]),
    ("apiextensions.k8s.io", "customresourcedefinitions", ["get", "list", "watch"]),
]
DENIED_IN_NAMESPACE = [
    ("", "secrets", "get"), ("", "secrets", "list"), ("", "pods", "patch"), ("", "pods/exec", "create"),
    ("kubetrain.io", "trainingjobs", "create"), ("", "services", "patch"), ("", "nodes", "patch"),
    ("apps", "deployments", "create"), ("rbac.authorization.k8s.io", "roles", "create"),
]


@pytest.fixture
def installed_rbac(testbed, namespace, kubectl):
    """The chart's ServiceAccount and RBAC (not the Deployment: no operator image here), watching `namespace`."""
    helm = Path(testbed.bin_dir) / "helm"
    if not helm.exists():
        pytest.fail(f"helm is missing from {testbed.bin_dir}; testbed/build.sh builds it", pytrace=False)
    release = f"rbac{namespace[-6:]}"
    out = subprocess.run(
        [str(helm), "template", release, str(ROOT / "charts" / "kubetrain"), "--namespace", namespace,
         "--set-json", f'namespaces=["{namespace}"]'],
        capture_output=True, text=True, timeout=180, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d and d["kind"] != "Deployment"]
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    sa = next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    yield f"system:serviceaccount:{namespace}:{sa}"
    for d in docs:
        if "namespace" not in d["metadata"]:
            kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found")


def allowed(kube_api, user: str, namespace: str | None, group: str, resource: str, verb: str) -> bool:
    from kubernetes import client

    res, _, sub = resource.partition("/")
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=user, groups=["system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}",
                           "system:authenticated"],
        resource_attributes=client.V1ResourceAttributes(
            namespace=namespace, group=group, resource=res, subresource=sub or None, verb=verb)))
    return client.AuthorizationV1Api(kube_api).create_subject_access_review(review).status.allowed


def test_operator_serviceaccount_can_do_what_it_needs_and_no_more(kube_api, namespace, installed_rbac):
    user = installed_rbac
    needed = [(namespace, g, r, v) for g, r, verbs in NAMESPACED for v in verbs]
    needed += [(None, g, r, v) for g, r, verbs in CLUSTER for v in verbs]
    # The authorizer learns new bindings through its informers: allow it a moment.
    deadline = time.monotonic() + 120
    while True:
        missing = [n for n in needed if not allowed(kube_api, user, *n)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert missing == []

    excess = [(namespace, g, r, v) for g, r, v in DENIED_IN_NAMESPACE if allowed(kube_api, user, namespace, g, r, v)]
    # Namespaced rights stop at the watched namespace.
    excess += [("default", g, r, v) for g, r, verbs in NAMESPACED for v in verbs
               if allowed(kube_api, user, "default", g, r, v)]
    assert excess == []
