"""Which client calls the lean transport carries, and where it sends them (transport.py)."""

from __future__ import annotations

import inspect
import re

import pytest
from kubernetes import client

from kubetrain.transport import ROUTES, Transport


def _client(host: str, **settings) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = host
    for key, value in settings.items():
        setattr(cfg, key, value)
    return client.ApiClient(cfg)


def test_the_hot_writes_are_routed_to_the_paths_the_generated_client_uses():
    t = Transport.for_client(_client("https://127.0.0.1:6443", verify_ssl=False))
    assert t is not None and (t.host, t.port, t.prefix) == ("127.0.0.1", 6443, "")
    body = {"metadata": {"name": "p"}}
    assert t.route("create_namespaced_pod", ("ns", body), {}) == (
        "POST", "/api/v1/namespaces/ns/pods", body, "application/json")
    assert t.route("create_namespaced_service", ("ns", body), {})[1] == "/api/v1/namespaces/ns/services"
    assert t.route("create_namespaced_event", ("ns", body), {})[1] == "/api/v1/namespaces/ns/events"
    assert t.route("patch_namespaced_custom_object_status", ("kubetrain.io", "v1", "ns", "trainingjobs", "j", body),
                   {"_content_type": "application/merge-patch+json"}) == (
        "PATCH", "/apis/kubetrain.io/v1/namespaces/ns/trainingjobs/j/status", body, "application/merge-patch+json")



@pytest.mark.parametrize("method", sorted(ROUTES))
def test_each_route_is_the_generated_clients_own_method_and_path(method):
    """The paths are the generated client's (its source names them with parameter names, ours by position)."""
    api = client.CoreV1Api if hasattr(client.CoreV1Api, method) else client.CustomObjectsApi
    source = inspect.getsource(getattr(api, f"{method}_with_http_info"))
    verb, path = ROUTES[method]
    pattern = re.sub(r"[{]\d[}]", "[{][a-z_]+[}]", path)
    assert re.search(f"'{pattern}', '{verb}'", source), source[-1500:]


def test_calls_it_does_not_carry_go_to_the_generated_client():
    t = Transport.for_client(_client("https://api.example:443/k8s/clusters/c-1", verify_ssl=False))
    assert t.prefix == "/k8s/clusters/c-1"  # a path in the server URL (a proxying front end) is kept
    assert t.route("create_namespaced_pod", ("ns", {}), {})[1] == "/k8s/clusters/c-1/api/v1/namespaces/ns/pods"
    assert t.route("read_namespaced_pod", ("p", "ns"), {}) is None  # not a hot write
    assert t.route("create_namespaced_pod", ("ns", {}), {"dry_run": "All"}) is None  # an argument it does not carry


@pytest.mark.parametrize("settings", [{"proxy": "http://proxy:3128"}, {"tls_server_name": "kubernetes"},
                                      {"assert_hostname": "kubernetes"}], ids=["proxy", "tls-server-name",
                                                                                "assert-hostname"])
def test_a_connection_setup_it_does_not_cover_leaves_every_call_to_the_generated_client(settings):
    assert Transport.for_client(_client("https://127.0.0.1:6443", verify_ssl=False, **settings)) is None
