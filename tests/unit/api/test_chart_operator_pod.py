"""The operator's pod as the chart renders it: what it may write is bounded. Runs the real helm from the
testbed's bin folder (skipped until it is built)."""

from __future__ import annotations

from test_chart import by_kind, needs_helm, render

pytestmark = needs_helm


def test_the_operators_tmp_is_limited():
    """The operator's only writable path, /tmp, is an emptyDir on the node's disk: bounded, like the trainers'."""
    (dep,) = by_kind(render(), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (mount,) = pod["containers"][0]["volumeMounts"]
    assert mount["mountPath"] == "/tmp"
    assert [v["emptyDir"] for v in pod["volumes"] if v["name"] == mount["name"]] == [{"sizeLimit": "64Mi"}]
