"""The chart's metrics: the operator's endpoint and progress settings reach the Deployment, a
metrics Service per component (the operator's, and the trainers' in every managed namespace),
optional ServiceMonitors (off by default; they render), and the values schema refuses bad
settings. Runs the real helm from the testbed's bin folder (skipped until it is built)."""

from __future__ import annotations

import pytest

from test_chart import CHART, by_kind, helm, needs_helm, render

pytestmark = needs_helm


def _env(docs: list[dict]) -> dict[str, str]:
    [deploy] = by_kind(docs, "Deployment")
    return {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_defaults_serve_operator_metrics_and_read_progress_every_30_seconds():
    docs = render()
    env = _env(docs)
    assert (env["KUBETRAIN_METRICS_PORT"], env["KUBETRAIN_PROGRESS_INTERVAL_SECONDS"],
            env["KUBETRAIN_PROGRESS_TIMEOUT_SECONDS"], env["KUBETRAIN_PROGRESS_CONCURRENCY"]) == ("9400", "30", "3", "16")
    [deploy] = by_kind(docs, "Deployment")
    ports = {p["name"]: p["containerPort"] for p in deploy["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == 9400
    assert by_kind(docs, "ServiceMonitor") == [], "ServiceMonitors are off by default"
    services = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in by_kind(docs, "Service")}
    operator = services[("kubetrain-system", "kt-kubetrain-metrics")]
    assert operator["spec"]["selector"]["app.kubernetes.io/component"] == "operator"
    assert operator["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics", "protocol": "TCP"}]
    trainer = services[("kubetrain-system", "kt-kubetrain-trainer-metrics")]
    assert trainer["spec"]["selector"] == {"app.kubernetes.io/managed-by": "kubetrain"}
    assert trainer["spec"]["ports"][0]["port"] == 9410 and trainer["spec"]["clusterIP"] == "None"


def test_a_trainer_service_per_managed_namespace_and_service_monitors_when_asked():
    docs = render('namespaces=["ml","research"]', 'metrics={"serviceMonitor":{"enabled":true,"labels":{"release":"prom"}}}')
    trainers = sorted(s["metadata"]["namespace"] for s in by_kind(docs, "Service")
                      if s["metadata"]["name"].endswith("-trainer-metrics"))
    assert trainers == ["ml", "research"]
    monitors = {m["metadata"]["name"]: m for m in by_kind(docs, "ServiceMonitor")}
    assert set(monitors) == {"kt-kubetrain-operator", "kt-kubetrain-trainer"}
    assert monitors["kt-kubetrain-trainer"]["spec"]["namespaceSelector"] == {"matchNames": ["ml", "research"]}
    assert all(m["metadata"]["labels"]["release"] == "prom" for m in monitors.values())
    assert all(m["spec"]["endpoints"][0]["port"] == "metrics" for m in monitors.values())


def test_metrics_and_progress_can_be_turned_off():
    docs = render('metrics={"port":0}', 'progress={"intervalSeconds":0}')
    env = _env(docs)
    assert (env["KUBETRAIN_METRICS_PORT"], env["KUBETRAIN_PROGRESS_INTERVAL_SECONDS"]) == ("0", "0")
    assert not [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-kubetrain-metrics")]


@pytest.mark.parametrize("value, named", [
    ('metrics={"port":-1}', "port"),
    ('metrics={"port":"9400"}', "port"),
    ('metrics={"serviceMonitor":{"interval":"often"}}', "interval"),
    ('metrics={"serviceMonitor":{"enabled":"yes"}}', "enabled"),
    ('metrics={"scrape":true}', "scrape"),
    ('progress={"intervalSeconds":0.5}', "intervalSeconds"),
    ('progress={"timeoutSeconds":0}', "timeoutSeconds"),
    ('progress={"concurrency":0}', "concurrency"),
])
def test_values_schema_refuses_bad_metrics_and_progress_settings(value, named):
    proc = helm("template", "kt", str(CHART), "--set-json", value, check=False)
    assert proc.returncode != 0, f"{value} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert named in proc.stderr, proc.stderr
