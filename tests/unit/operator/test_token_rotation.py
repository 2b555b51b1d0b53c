"""The kubelet rewrites a projected service account token (about hourly) and the old one expires: every client of
the operator must send the file's current token, never the one it read at start (401 Unauthorized an hour or so
after each start). The real in-cluster loader (`transport.load_client_config`) on a token file rewritten in a
temporary directory, its clock moved on; requests are caught where they would leave the process."""

from __future__ import annotations

import datetime
import types

import pytest
from kubernetes import client
from kubernetes.config import incluster_config

from kubetrain import transport
from kubetrain.transport import Transport


class _Clock:
    """`datetime` as the in-cluster loader sees it, `ahead` later than now."""

    ahead = datetime.timedelta()
    timedelta = datetime.timedelta

    class datetime(datetime.datetime):  # stands in for datetime.datetime
        @classmethod
        def now(cls, tz=None):  # type: ignore[override]
            return datetime.datetime.now(tz) + _Clock.ahead


@pytest.fixture
def in_cluster(tmp_path, monkeypatch):
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("token-1")
    ca.write_text("not read here")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setattr(incluster_config, "datetime", _Clock)
    monkeypatch.setattr(_Clock, "ahead", datetime.timedelta())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.delenv("KUBECONFIG", raising=False)

    def rotate(new: str) -> None:
        token.write_text(new)
        _Clock.ahead += datetime.timedelta(minutes=2)  # the loader reads the file again once a minute

    return rotate


def _authorization(headers: dict) -> str:
    return next(v for k, v in headers.items() if k.lower() == "authorization")


def test_the_lean_transport_sends_the_rewritten_token(in_cluster, monkeypatch):
    api_client = transport.load_client_config(threads=1)
    sent: list[str] = []

    def send(conn, method, path, payload, headers):
        sent.append(_authorization(headers))
        return types.SimpleNamespace(status=201, reason="Created", data=b"{}")

    t = Transport(api_client, transport.urllib.parse.urlsplit("http://127.0.0.1:1"))
    monkeypatch.setattr(Transport, "_send", staticmethod(send))
    route = t.route("create_namespaced_pod", ("ns", {"metadata": {"name": "p"}}), {})
    t.request(*route)
    in_cluster("token-2")
    t.request(*route)
    assert sent == ["bearer token-1", "bearer token-2"]


def test_the_generated_client_and_so_the_informers_send_the_rewritten_token(in_cluster, monkeypatch):
    api_client = transport.load_client_config(threads=1)
    sent: list[str] = []

    def request(method, url, **kwargs):
        sent.append(_authorization(kwargs["headers"]))
        return types.SimpleNamespace(status=200, reason="OK", data=b'{"items": []}', getheaders=lambda: {},
                                     release_conn=lambda: None)

    monkeypatch.setattr(api_client.rest_client, "request", request)
    core = client.CoreV1Api(api_client)
    core.list_namespaced_pod("ns", watch=True, _preload_content=False)  # as informer.py calls it
    in_cluster("token-2")
    core.list_namespaced_pod("ns", watch=True, _preload_content=False)
    assert sent == ["bearer token-1", "bearer token-2"]
