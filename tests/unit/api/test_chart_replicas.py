"""The chart's several operator replicas (leader election) survive a node drain: they prefer
different nodes, and a PodDisruptionBudget lets a drain evict one at a time. One replica gets
neither (a budget would block every drain of its node). Runs the real helm from the testbed's
bin folder (skipped until it is built)."""

from __future__ import annotations

import json

import pytest

from test_chart import CHART, by_kind, helm, needs_helm, render

pytestmark = needs_helm

OPERATOR = {"app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/instance": "kt",
            "app.kubernetes.io/component": "operator"}


def _pod(docs: list[dict]) -> dict:
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["selector"]["matchLabels"] == OPERATOR
    return dep["spec"]["template"]["spec"]


def test_two_replicas_spread_over_nodes_and_a_drain_evicts_one_at_a_time():
    docs = render("replicaCount=2")
    (term,) = _pod(docs)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname",
                                       "labelSelector": {"matchLabels": OPERATOR}}
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["metadata"]["namespace"] == "kubetrain-system"
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": OPERATOR}}


def test_one_replica_gets_no_budget_that_would_block_drains():
    docs = render()
    assert "affinity" not in _pod(docs)
    assert by_kind(docs, "PodDisruptionBudget") == []


def test_the_users_affinity_wins_and_the_budget_can_be_left_out():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}}
    docs = render("replicaCount=3", f"affinity={json.dumps(affinity)}", 'podDisruptionBudget={"enabled":false}')
    assert _pod(docs)["affinity"] == affinity
    assert by_kind(docs, "PodDisruptionBudget") == []


@pytest.mark.parametrize("value", ['podDisruptionBudget={"enabled":"yes"}', 'podDisruptionBudget={"minAvailable":1}'])
def test_values_schema_rejects_bad_budget_values(value):
    proc = helm("template", "kt", str(CHART), "--set-json", value, check=False)
    assert proc.returncode != 0 and "podDisruptionBudget" in proc.stderr, proc.stderr
