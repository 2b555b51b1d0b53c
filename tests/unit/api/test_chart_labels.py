"""User labels of the chart (podLabels, metrics.serviceMonitor.labels) never take over the labels the chart
and the operator select by: a duplicate key reaches the API server as the last one written, so the
Deployment's selector no longer matches its pods, the Services and the PodDisruptionBudget select nothing,
or the operator takes its own pod for a training pod. `helm install` refuses them, naming the value and
the key. Runs the real helm from the testbed's bin folder (skipped until it is built)."""

from __future__ import annotations

import json

import pytest

from test_chart import CHART, by_kind, helm, needs_helm, render

pytestmark = needs_helm

MONITOR = '{"service":{"enabled":true},"serviceMonitor":{"enabled":true,"labels":%s}}'


@pytest.mark.parametrize("key", ["app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                                 "app.kubernetes.io/managed-by", "kubetrain.io/job-name"])
def test_pod_labels_that_the_chart_or_the_operator_select_by_are_refused(key):
    proc = helm("template", "kt", str(CHART), "--set-json", f"podLabels={json.dumps({key: 'mine'})}", check=False)
    assert proc.returncode != 0, f"podLabels {key} was accepted"
    assert f'podLabels["{key}"]: {key} is a label kubetrain sets itself' in proc.stderr, proc.stderr


@pytest.mark.parametrize("key", ["app.kubernetes.io/instance", "helm.sh/chart"])
def test_service_monitor_labels_that_the_chart_sets_are_refused(key):
    proc = helm("template", "kt", str(CHART), "--set-json", "metrics=" + MONITOR % json.dumps({key: "mine"}),
                check=False)
    assert proc.returncode != 0, f"metrics.serviceMonitor.labels {key} was accepted"
    assert f'metrics.serviceMonitor.labels["{key}"]: {key} is a label kubetrain sets itself' in proc.stderr


def test_other_labels_are_added_and_the_selector_still_matches_the_pods():
    docs = render('podLabels={"team":"ml","app.kubernetes.io/part-of":"platform"}',
                  "metrics=" + MONITOR % '{"release":"prometheus"}')
    (dep,) = by_kind(docs, "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "ml" and labels["app.kubernetes.io/part-of"] == "platform"
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert all(m["metadata"]["labels"]["release"] == "prometheus" for m in by_kind(docs, "ServiceMonitor"))
