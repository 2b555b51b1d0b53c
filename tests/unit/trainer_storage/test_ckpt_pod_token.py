"""Training pods get no API token by default (docs/contract.md): the launcher's live
report to its own pod is then skipped silently, without any request. A listening
socket stands where the API server would be and must see no connection."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from kubetrain_trainer.launch import annotate_pod


def test_no_mounted_token_means_no_request_and_no_noise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    api = socket.create_server(("127.0.0.1", 0))
    api.setblocking(False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.getsockname()[1]))
    sa_dir = tmp_path / "serviceaccount"   # what automountServiceAccountToken: false leaves: nothing
    caplog.set_level(logging.DEBUG)
    try:
        assert annotate_pod(sa_dir=sa_dir, namespace="ml", pod="job-a1-n0",
                            annotations={"kubetrain.io/last-checkpoint": "{}"}) is False
        with pytest.raises(BlockingIOError):
            api.accept()   # nobody connected
    finally:
        api.close()
    assert caplog.records == []


def test_a_mounted_token_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same setup with a token file does reach the address: the test above is not vacuous."""
    api = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.getsockname()[1]))
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    (sa_dir / "token").write_text("t")
    api.settimeout(30)
    try:
        assert annotate_pod(sa_dir=sa_dir, namespace="ml", pod="job-a1-n0",
                            annotations={"kubetrain.io/last-checkpoint": "{}"}, timeout_s=0.5) is False
        conn, _ = api.accept()   # it connected (and gave up on the TLS handshake)
        conn.close()
    finally:
        api.close()
