"""What `helm install` prints (NOTES.txt) names the operator image the release runs, as the Deployment
names it: the tag or digest the user set, not the chart's appVersion. Runs the real helm from the
testbed's bin folder (skipped until it is built)."""

from __future__ import annotations

import pytest

from test_chart import by_kind, needs_helm, render, render_notes

pytestmark = needs_helm

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize("image, shown", [
    ('{"repository":"registry.example.com/kubetrain/operator","tag":"0.2.0-rc1"}',
     "registry.example.com/kubetrain/operator:0.2.0-rc1"),
    (f'{{"repository":"reg.local/op","tag":"9","digest":"{DIGEST}"}}', f"reg.local/op@{DIGEST}"),
    ('{"repository":"kubetrain/operator"}', "kubetrain/operator:0.1.0"),
], ids=["tag", "digest", "appVersion when no tag"])
def test_notes_name_the_operator_image_the_deployment_runs(tmp_path, image, shown):
    (dep,) = by_kind(render(f"image={image}"), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == shown
    notes = render_notes(tmp_path, f"image={image}")
    assert f"running the operator image\n# {shown} " in notes, notes


def test_notes_warn_when_the_image_is_the_charts_placeholder(tmp_path):
    """The chart ships no image: left at kubetrain/operator, the operator pod pulls nothing (or a stranger's
    Docker Hub image); NOTES says so, and what to set."""
    notes = render_notes(tmp_path)
    assert "WARNING: image.repository is the chart's placeholder kubetrain/operator" in notes
    assert "--set image.repository=<registry>/kubetrain/operator" in notes
    (tmp_path / "set").mkdir()
    assert "WARNING" not in render_notes(tmp_path / "set", 'image={"repository":"registry.example.com/kubetrain/operator"}')
