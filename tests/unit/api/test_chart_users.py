"""The chart's side of the cluster's users (not the operator's rights): TrainingJobs join
Kubernetes' default user roles by ClusterRole aggregation, so a namespace editor can create
them and a viewer read them, without writing the operator's status. Runs the real helm from
the testbed's bin folder (skipped until it is built)."""

from __future__ import annotations

import pytest

from test_chart import CHART, by_kind, helm, needs_helm, render

pytestmark = needs_helm

AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def _rules_for(docs: list[dict], role: str) -> dict[str, set[str]]:
    """{resource: verbs} of TrainingJobs in the ClusterRoles aggregated into the default `role`."""
    out: dict[str, set[str]] = {}
    for cr in by_kind(docs, "ClusterRole"):
        if cr["metadata"].get("labels", {}).get(AGGREGATE + role) != "true":
            continue
        for rule in cr["rules"]:
            assert rule["apiGroups"] == ["kubetrain.io"], rule
            for resource in rule["resources"]:
                out.setdefault(resource, set()).update(rule["verbs"])
    return out


WRITE = {"create", "delete", "deletecollection", "patch", "update"}
READ = {"get", "list", "watch"}


@pytest.mark.parametrize("sets", [(), ('namespaces=["ml","research"]',), ("clusterWide=true",)])
def test_namespace_editors_may_create_trainingjobs_and_viewers_read_them(sets):
    docs = render(*sets)
    for role in ("admin", "edit"):
        assert _rules_for(docs, role) == {"trainingjobs": WRITE | READ, "trainingjobs/status": {"get"}}, role
    assert _rules_for(docs, "view") == {"trainingjobs": READ, "trainingjobs/status": READ}
    # For the users' own RoleBindings: the chart binds none of them to anyone.
    aggregated = {cr["metadata"]["name"] for cr in by_kind(docs, "ClusterRole")
                  if any(k.startswith(AGGREGATE) for k in cr["metadata"].get("labels", {}))}
    assert aggregated == {"kt-kubetrain-edit", "kt-kubetrain-view"}
    bound = {b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding")}
    assert not aggregated & bound


def test_aggregation_can_be_left_to_the_platform_team():
    docs = render("aggregateToDefaultRoles=false")
    assert not [cr for cr in by_kind(docs, "ClusterRole")
                if any(k.startswith(AGGREGATE) for k in cr["metadata"].get("labels", {}))]
    proc = helm("template", "kt", str(CHART), "--set-json", 'aggregateToDefaultRoles="yes"', check=False)
    assert proc.returncode != 0 and "aggregateToDefaultRoles" in proc.stderr, proc.stderr
