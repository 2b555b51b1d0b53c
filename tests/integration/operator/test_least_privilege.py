"""The operator runs jobs with nothing but the chart's RBAC: its kubeconfig holds a
real TokenRequest token of the chart's ServiceAccount, so the real authorizer
decides every call. A gang starts, is preempted and restarts (pod create, list,
watch, delete; Service; events; status), a ZeRO-3 job with an inline DeepSpeed
config (its ConfigMap) succeeds and is removed after ttlSecondsAfterFinished, all
behind a Lease, and no call of the operator or of kopf is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import kubetrain_rbac
from kubetrain_optest import kwok_exit, spec
from kubetrain_testbed import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def chart_identity(testbed, namespace, kubectl, kube_api, tmp_path):
    """The chart's RBAC for a release in `namespace` managing it alone; yields (kubeconfig, Lease name)."""
    from kubernetes import client

    helm = Path(testbed.bin_dir) / "helm"
    if not helm.exists():
        pytest.fail(f"helm is missing from {testbed.bin_dir}; testbed/build.sh builds it", pytrace=False)
    docs = [d for d in kubetrain_rbac.helm_template(str(helm), f"lp{namespace[-6:]}", namespace)
            if d["kind"] != "Deployment"]
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    sa = next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    token = client.CoreV1Api(kube_api).create_namespaced_service_account_token(sa, namespace, {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": [], "expirationSeconds": 3600}}).status.token
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "testbed", "cluster": {"server": testbed.api_server,
                                                     "certificate-authority": testbed.ca_file}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "testbed", "user": "sa", "namespace": namespace}}]}))
    yield str(kubeconfig), sa  # the chart names the Lease after the release's full name, as the SA
    for d in docs:
        if "namespace" not in d["metadata"]:
            kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found")


def test_the_operator_runs_jobs_with_only_the_charts_rights(make_operator, chart_identity, namespace, jobs) -> None:
    kubeconfig, lease = chart_identity
    op = make_operator("sa", {"KUBECONFIG": kubeconfig, "KUBETRAIN_LEADER_ELECTION": "true",
                              "KUBETRAIN_LEADER_ELECTION_NAMESPACE": namespace,
                              "KUBETRAIN_LEADER_ELECTION_ID": lease})
    op.start()
    try:
        jobs.create("gang", spec(nodes=2))
        jobs.wait_phase("gang", "Running", nodesReady=2, timeout=180)
        jobs.core.delete_namespaced_pod("gang-a1-n1", namespace)   # a preemption: the operator deletes n0
        jobs.wait_phase("gang", "Running", attempt=2, nodesReady=2, timeout=180)

        jobs.create("zero", spec(nodes=1, strategy={"type": "zero3", "deepspeed": {"config": {"train_batch_size": 2}}},
                                 podTemplate={"annotations": kwok_exit(0, "2s")},
                                 runPolicy={"ttlSecondsAfterFinished": 1}))
        wait_until(lambda: [c.metadata.name for c in jobs.core.list_namespaced_config_map(namespace).items],
                   lambda names: "zero-deepspeed" in names, timeout=180, what="the DeepSpeed ConfigMap")
        wait_until(lambda: [j["metadata"]["name"] for j in jobs.custom.list_namespaced_custom_object(
            "kubetrain.io", "v1alpha1", namespace, "trainingjobs")["items"]],
            lambda names: "zero" not in names, timeout=180, what="the finished job removed after its TTL")
        wait_until(lambda: jobs.event_reasons("gang"), lambda reasons: "Preempted" in reasons, timeout=180,
                   what="the operator's Preempted event")
    finally:
        log = op.log_tail(100000)
        print(f"--- operator log tail ---\n{op.log_tail(40)}")
    refused = [line for line in log.splitlines()
               if any(mark in line for mark in ("HTTP 403", "Forbidden", "forbidden", "Not enough permissions"))]
    assert refused == [], "\n".join(refused)
