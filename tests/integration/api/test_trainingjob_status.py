"""What users see of a TrainingJob through kubectl on a real API server: the
status subresource (spec writes cannot touch status, status has its own
schema), the printer columns of `kubectl get tj`, and `kubectl explain`
teaching the API from the CRD's descriptions."""

from __future__ import annotations

import json
import re
import time

import pytest

pytestmark = pytest.mark.integration

JOB = {
    "apiVersion": "kubetrain.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "cols"},
    "spec": {
        "image": "kubetrain/trainer:0.1.0",
        "nodes": 4,
        "trainer": {"builtin": {"task": "regression"}},
        # Suspended: an operator that happens to run against the testbed leaves it alone.
        "runPolicy": {"suspend": True},
    },
    "status": {"phase": "Succeeded", "attempt": 99},
}

STATUS = {
    "phase": "Running", "message": "all 4 nodes running", "attempt": 3, "restarts": 2, "preemptions": 1,
    "failures": 1, "nodesReady": 3, "nodesTotal": 4, "startTime": "2026-01-01T00:00:00Z",
    "lastCheckpoint": {"step": 1200, "uri": "s3://b/p/ns/cols/checkpoint-1200", "time": "2026-01-01T01:00:00Z"},
    "progress": {"step": 1234, "maxSteps": 4000, "steps": "1234/4000", "loss": 2.5, "samplesPerSecond": 96.5,
                 "attempt": 3, "observedAt": "2026-01-01T01:00:30Z", "reachable": True},
    "conditions": [{"type": "Running", "status": "True", "reason": "AllNodesRunning", "message": "ok",
                    "lastTransitionTime": "2026-01-01T00:10:00Z"}],
    "observedGeneration": 1,
}


def test_status_subresource_and_printer_columns(trainingjob_crd, namespace, submit, kubectl):
    created = submit(JOB, dry_run=False, namespace=namespace)
    assert "status" not in created, "status must only be writable through the status subresource"

    kubectl("patch", "trainingjob", "cols", "-n", namespace, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": STATUS}))
    stored = json.loads(kubectl("get", "tj", "cols", "-n", namespace, "-o", "json"))
    assert stored["status"]["lastCheckpoint"]["step"] == 1200

    table = kubectl("get", "tj", "cols", "-n", namespace, "-o", "wide").splitlines()
    header = table[0].split()
    assert header[:13] == ["NAME", "PHASE", "READY", "NODES", "ATTEMPT", "RESTARTS", "PREEMPTIONS",
                           "STEP", "CHECKPOINT", "KUEUE", "AGE", "LOSS", "SAMPLES/S"], header
    # kubectl aligns the columns: read each cell under its header (an empty cell is "<none>" or blank).
    starts = [table[0].index(name) for name in header]
    cells = {name: table[1][start:end].strip() if end else table[1][start:].strip()
             for name, start, end in zip(header, starts, starts[1:] + [None])}
    assert [cells[c] for c in header[:9]] == ["cols", "Running", "3", "4", "3", "2", "1", "1234/4000", "1200"], cells
    assert cells["KUEUE"] in ("", "<none>"), cells  # a job without a queue label has no Kueue reason
    assert (cells["LOSS"], cells["SAMPLES/S"]) == ("2.5", "96.5"), cells  # -o wide: loss and throughput
    assert "all 4 nodes running" in table[1]


def test_status_has_its_own_schema(trainingjob_crd, namespace, submit, kubectl):
    from kubetrain_testbed import TestbedError

    submit(JOB, dry_run=False, namespace=namespace)
    with pytest.raises(TestbedError) as info:
        kubectl("patch", "trainingjob", "cols", "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": {"phase": "Exploded"}}))
    # 1.36 names the field status.phase; 1.30 (the chart's minimum, checked by hand on a 1.30 testbed) says phase.
    assert re.search(r"\b(status\.)?phase: Unsupported value", str(info.value)), str(info.value)


def test_kubectl_explain_teaches_the_api(trainingjob_crd, kubectl):
    from kubetrain_testbed import TestbedError

    # The OpenAPI document that explain reads is published a moment after the CRD is established.
    deadline = time.monotonic() + 180
    while True:
        try:
            out = kubectl("explain", "trainingjob.spec.runPolicy.backoffLimit")
            break
        except TestbedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    text = " ".join(out.split())  # explain wraps descriptions
    assert "Application failures" in text and "never count against it" in text, out
    text = " ".join(kubectl("explain", "tj.spec.checkpoint").split())
    assert "credentialsSecret" in text and "exactly one of credentialsSecret" in text and "webIdentity" in text, text
