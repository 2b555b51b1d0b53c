"""The chart's RBAC, applied to the real API server, lets the operator's
ServiceAccount do exactly what the operator's code calls, where it calls it,
and nothing else: asked through SubjectAccessReviews, i.e. by the real RBAC
authorizer. What the code calls is derived from the code (tests/kubetrain_rbac.py),
never listed by hand here. Every verb on every resource the code touches, plus
resources it must never touch (Secrets, exec, RBAC, workloads), is asked in the
managed namespace, in namespaces it does not manage (kube-system among them)
and cluster-wide: allowed exactly where the code calls it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import yaml

import kubetrain_rbac

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
NEVER = [("", "secrets"), ("", "pods/exec"), ("", "pods/eviction"), ("", "serviceaccounts/token"),
         ("", "namespaces"), ("apps", "deployments"), ("batch", "jobs"),
         ("rbac.authorization.k8s.io", "roles"), ("rbac.authorization.k8s.io", "rolebindings"),
         ("apiextensions.k8s.io", "customresourcedefinitions"), ("events.k8s.io", "events")]
"""Resources the operator's code never touches; asked with every verb, they must all be denied."""


@pytest.fixture
def installed_rbac(testbed, namespace, kubectl):
    """The chart's ServiceAccount and RBAC (not the Deployment: no operator image here), released in
    `namespace` and managing it alone. Yields (user, Lease name)."""
    helm = Path(testbed.bin_dir) / "helm"
    if not helm.exists():
        pytest.fail(f"helm is missing from {testbed.bin_dir}; testbed/build.sh builds it", pytrace=False)
    release = f"rbac{namespace[-6:]}"
    out = subprocess.run(
        [str(helm), "template", release, str(ROOT / "charts" / "kubetrain"), "--namespace", namespace],
        capture_output=True, text=True, timeout=180, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d and d["kind"] != "Deployment"]
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    sa = next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    yield f"system:serviceaccount:{namespace}:{sa}", sa  # the Lease is named after the release's full name
    for d in docs:
        if "namespace" not in d["metadata"]:
            kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found")


def allowed(kube_api, user: str, namespace: str | None, group: str, resource: str, verb: str,
            name: str | None = None) -> bool:
    from kubernetes import client

    res, _, sub = resource.partition("/")
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=user, groups=["system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}",
                           "system:authenticated"],
        resource_attributes=client.V1ResourceAttributes(
            namespace=namespace, group=group, resource=res, subresource=sub or None, verb=verb, name=name)))
    return client.AuthorizationV1Api(kube_api).create_subject_access_review(review).status.allowed


def test_operator_serviceaccount_can_do_what_its_code_calls_and_nothing_else(kube_api, namespace, installed_rbac):
    user, lease = installed_rbac
    use = kubetrain_rbac.used()
    here: dict = {}  # the release namespace is also the managed one here
    for scope in (kubetrain_rbac.WATCHED, kubetrain_rbac.OWN):
        for key, verbs in use[scope].items():
            here.setdefault(key, set()).update(verbs)
    cluster = use[kubetrain_rbac.CLUSTER]

    needed = [(namespace, g, r, v, lease if g == "coordination.k8s.io" and v != "create" else None)
              for (g, r), verbs in here.items() for v in sorted(verbs)]
    needed += [(None, g, r, v, None) for (g, r), verbs in cluster.items() for v in sorted(verbs)]
    # The authorizer learns new bindings through its informers: allow it a moment.
    deadline = time.monotonic() + 120
    while True:
        missing = [n for n in needed if not allowed(kube_api, user, *n)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert missing == [], "called by the code, denied by the chart's RBAC"

    resources = sorted(set(here) | set(cluster) | set(NEVER))
    excess = [(namespace, g, r, v) for g, r in resources for v in VERBS
              if v not in here.get((g, r), ()) and v not in cluster.get((g, r), ())
              and allowed(kube_api, user, namespace, g, r, v)]
    # Namespaced rights stop at the managed namespace; cluster-wide, only the cluster-scoped reads.
    for other in ("default", "kube-system"):
        excess += [(other, g, r, v) for g, r in resources for v in VERBS
                   if v not in cluster.get((g, r), ()) and allowed(kube_api, user, other, g, r, v)]
    excess += [(None, g, r, v) for g, r in resources for v in VERBS
               if v not in cluster.get((g, r), ()) and allowed(kube_api, user, None, g, r, v)]
    # The Lease rights are for the release's own Lease only (create cannot be limited by name).
    excess += [(namespace, "coordination.k8s.io", "leases", v, "someone-elses-lease") for v in ("get", "update")
               if allowed(kube_api, user, namespace, "coordination.k8s.io", "leases", v, "someone-elses-lease")]
    assert excess == [], "granted by the chart's RBAC, never called by the code"
