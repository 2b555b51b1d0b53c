"""Fixtures of the Kueue tests (issue 14), a pytest plugin (tests/conftest.py loads it, so the
integration tests on kwok and the real-node e2e test share one Kueue): Kueue on the testbed, a ResourceFlavor, PriorityClasses
`low` and `high`, and per test a ClusterQueue with a small cpu/pods quota (preemption within the
queue: LowerPriority) plus a LocalQueue in the test's namespace.

  kueue           session: Kueue runs on the testbed (started here unless it already ran; stopped at the
                  end if started here, unless KUBETRAIN_TESTBED_KEEP=1). Its settings:
                  KUBETRAIN_TESTBED_KUEUE_PODS_READY_TIMEOUT (default 30s), testbed/README.md.
  kueue_flavor    session: the ResourceFlavor's name (no node labels: every fake node qualifies)
  priority_classes  session: {"low": 100, "high": 1000}, PriorityClasses created if absent
  kueue_queue     test: KueueQueue(cluster_queue, local_queue, namespace) with cpu 3, memory 24Gi, pods 3;
                  `make_kueue_queue(cpu=..., pods=..., namespace=...)` for another quota or namespace
                  (default: the test's fresh `namespace`). Workloads left in the
                  namespace are deleted (finalizers removed) afterwards, so no quota leaks between tests.
  trainingjob_crd session: crds/trainingjob.yaml applied (a Workload's owner must exist, or the
                  garbage collector deletes the Workload)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
FLAVOR = "kubetrain-test-flavor"
PRIORITIES = {"low": 100, "high": 1000}


@dataclass(frozen=True)
class KueueQueue:
    cluster_queue: str
    local_queue: str
    namespace: str


@pytest.fixture(scope="session")
def kueue(testbed, testbed_config):
    from kubetrain_testbed import TestbedError, ensure_kueue, remove_kueue

    try:
        started = ensure_kueue(testbed_config)
    except TestbedError as exc:
        pytest.fail(f"Kueue could not start: {exc}", pytrace=False)
    yield testbed_config.kueue_settings
    if started and os.environ.get("KUBETRAIN_TESTBED_KEEP") != "1":
        remove_kueue(testbed_config)


@pytest.fixture(scope="session")
def trainingjob_crd(kubectl) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "trainingjob.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.kubetrain.io", "--timeout=120s", timeout=180)


@pytest.fixture(scope="session")
def kueue_api(kueue, kube_api):
    from kubernetes import client

    return client.CustomObjectsApi(kube_api)


@pytest.fixture(scope="session")
def kueue_flavor(kueue_api) -> str:
    from kubernetes import client

    body = {"apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "ResourceFlavor",
            "metadata": {"name": FLAVOR}, "spec": {}}
    try:
        kueue_api.create_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "resourceflavors", body)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    return FLAVOR


@pytest.fixture(scope="session")
def priority_classes(kube_api) -> dict[str, int]:
    from kubernetes import client

    sched = client.SchedulingV1Api(kube_api)
    created = []
    for name, value in PRIORITIES.items():
        try:
            sched.create_priority_class(client.V1PriorityClass(metadata=client.V1ObjectMeta(name=name), value=value))
            created.append(name)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            have = sched.read_priority_class(name).value
            assert have == value, f"PriorityClass {name} exists with value {have}, the Kueue tests need {value}"
    yield dict(PRIORITIES)
    for name in created:
        sched.delete_priority_class(name)


@pytest.fixture
def make_kueue_queue(request, kueue_api, kueue_flavor, priority_classes):
    """make_kueue_queue(cpu="3", memory="24Gi", pods=3, namespace=None) -> KueueQueue for that namespace
    (default: the test's fresh `namespace`)."""
    from kubernetes import client

    made: list[str] = []
    namespaces: set[str] = set()

    def make(*, cpu: str = "3", memory: str = "24Gi", pods: int = 3, namespace: str | None = None) -> KueueQueue:
        namespace = namespace or request.getfixturevalue("namespace")
        namespaces.add(namespace)
        cq = f"cq-{namespace}"[:63] if not made else f"cq{len(made)}-{namespace}"[:63]
        kueue_api.create_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "ClusterQueue", "metadata": {"name": cq},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [{"coveredResources": ["cpu", "memory", "pods"], "flavors": [{
                    "name": kueue_flavor, "resources": [{"name": "cpu", "nominalQuota": cpu},
                                                        {"name": "memory", "nominalQuota": memory},
                                                        {"name": "pods", "nominalQuota": pods}]}]}],
            }})
        made.append(cq)
        lq = "lq" if len(made) == 1 else f"lq{len(made) - 1}"
        kueue_api.create_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, "localqueues", {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "LocalQueue",
            "metadata": {"name": lq, "namespace": namespace}, "spec": {"clusterQueue": cq}})
        return KueueQueue(cluster_queue=cq, local_queue=lq, namespace=namespace)

    yield make
    # Workloads hold their finalizer until their job's controller releases them: release what is left.
    for namespace in namespaces:
        for wl in kueue_api.list_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads")["items"]:
            name = wl["metadata"]["name"]
            try:
                kueue_api.patch_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name,
                                                         {"metadata": {"finalizers": None}})
                kueue_api.delete_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
    for cq in made:
        try:
            kueue_api.delete_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", cq)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def kueue_queue(make_kueue_queue) -> KueueQueue:
    return make_kueue_queue()
