"""The lean transport of the hot writes (transport.py) against the real API server: what the operator
relies on from the generated client (bodies, the error statuses `errors.classify` reads, auth, kept
connections) holds here too."""

from __future__ import annotations

import copy
import os
import shutil
import socket
import ssl
import threading
from pathlib import Path

import orjson
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.api import GROUP, PLURAL, VERSION
from kubetrain.errors import ConflictError, InvalidError, classify
from kubetrain.transport import Transport

pytestmark = pytest.mark.integration


def _pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "transport-test"}},
            "spec": {"containers": [{"name": "c", "image": "kubetrain/none"}],
                     "nodeSelector": {"kubetrain.io/no-such-node": "1"}}}


def _send(t: Transport, method: str, *args, **kwargs) -> dict:
    route = t.route(method, args, kwargs)
    assert route is not None
    return orjson.loads(t.request(*route))


def test_creates_answer_like_the_client_and_errors_carry_what_classify_reads(kube_api, namespace):
    t = Transport.for_client(kube_api)
    assert t is not None, "the testbed's kubeconfig (CA + client certificate) is covered"
    made = _send(t, "create_namespaced_pod", namespace, _pod("p0"))
    assert made["metadata"]["name"] == "p0" and made["metadata"]["uid"]
    assert client.CoreV1Api(kube_api).read_namespaced_pod("p0", namespace).metadata.uid == made["metadata"]["uid"]

    with pytest.raises(ApiException) as again:
        _send(t, "create_namespaced_pod", namespace, _pod("p0"))
    assert isinstance(classify(again.value, "create pod"), ConflictError)

    bad = _pod("p1")
    bad["spec"]["containers"][0]["name"] = "Not_A_Name"
    with pytest.raises(ApiException) as invalid:
        _send(t, "create_namespaced_pod", namespace, bad)
    error = classify(invalid.value, "create pod")
    assert isinstance(error, InvalidError) and "spec.containers[0].name" in error.api_message


def test_a_status_patch_with_an_old_resource_version_is_a_conflict(kube_api, namespace, trainingjob_crd):
    custom = client.CustomObjectsApi(kube_api)
    job = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": "j"},
        "spec": {"image": "kubetrain/none", "nodes": 1,
                 "trainer": {"builtin": {"task": "regression", "args": {"max_steps": 10}}}}})
    t = Transport.for_client(kube_api)
    rv = job["metadata"]["resourceVersion"]
    merge = {"_content_type": "application/merge-patch+json"}
    written = _send(t, "patch_namespaced_custom_object_status", GROUP, VERSION, namespace, PLURAL, "j",
                    {"metadata": {"resourceVersion": rv}, "status": {"message": "first"}}, **merge)
    assert written["status"]["message"] == "first"
    with pytest.raises(ApiException) as stale:
        _send(t, "patch_namespaced_custom_object_status", GROUP, VERSION, namespace, PLURAL, "j",
              {"metadata": {"resourceVersion": rv}, "status": {"message": "second"}}, **merge)
    assert isinstance(classify(stale.value, "patch status"), ConflictError)
    assert custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "j")["status"]["message"] == "first"


def test_a_kept_connection_is_reused_and_one_closed_underneath_is_replaced(kube_api, namespace, monkeypatch):
    t = Transport.for_client(kube_api)
    exchanges: list[str] = []
    send = Transport._send
    monkeypatch.setattr(Transport, "_send", staticmethod(
        lambda conn, method, path, *rest: (exchanges.append(path), send(conn, method, path, *rest))[1]))
    _send(t, "create_namespaced_pod", namespace, _pod("a"))
    first = t._local.conn
    _send(t, "create_namespaced_pod", namespace, _pod("b"))
    assert t._local.conn is first  # kept alive, not one connection per request
    first.sock.shutdown(socket.SHUT_RDWR)  # as if the server had closed it while idle
    _send(t, "create_namespaced_pod", namespace, _pod("c"))
    assert t._local.conn is not first
    assert len(exchanges) == 3  # the closed connection was noticed before use: no failed send, no retry
    names = {p.metadata.name for p in client.CoreV1Api(kube_api).list_namespaced_pod(namespace).items}
    assert names == {"a", "b", "c"}


def _in_a_new_thread(t: Transport, namespace: str, name: str) -> BaseException | None:
    """One create from a thread of its own: a new connection, so a TLS context is asked for."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            _send(t, "create_namespaced_pod", namespace, _pod(name))
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"the create of {name} did not return in 60 s"
    return failure[0] if failure else None


def test_the_threads_share_one_tls_context_until_a_file_it_was_read_from_is_swapped(
        kube_api, namespace, tmp_path):
    from kubetrain_testbed.pki import ensure_pki

    # The kubelet's atomic writer, as for the in-cluster CA: ca.crt -> ..data/ca.crt, ..data -> ..<timestamp>,
    # and a rotation writes a new ..<timestamp> folder and swaps the ..data link (ca.crt itself never changes).
    cfg = copy.deepcopy(kube_api.configuration)
    volume = tmp_path / "volume"
    served, other = volume / "..2026_12_05_a", volume / "..2026_12_05_b"
    served.mkdir(parents=True)
    other.mkdir()
    shutil.copy(cfg.ssl_ca_cert, served / "ca.crt")
    shutil.copy(ensure_pki(tmp_path / "other").ca_crt, other / "ca.crt")  # did not sign the API server's cert
    (volume / "..data").symlink_to(served.name)
    (volume / "ca.crt").symlink_to("..data/ca.crt")
    cfg.ssl_ca_cert = str(volume / "ca.crt")
    t = Transport.for_client(client.ApiClient(configuration=cfg))
    first = t.context()
    assert _in_a_new_thread(t, namespace, "one") is None
    assert _in_a_new_thread(t, namespace, "two") is None
    assert t.context() is first  # built once, not once per connection

    def swap(target: Path) -> None:
        staged = volume / "..data_tmp"
        staged.symlink_to(target.name)
        os.replace(staged, volume / "..data")

    swap(other)
    assert isinstance(_in_a_new_thread(t, namespace, "three"), ssl.SSLCertVerificationError)
    swap(served)
    assert _in_a_new_thread(t, namespace, "four") is None
    names = {p.metadata.name for p in client.CoreV1Api(kube_api).list_namespaced_pod(namespace).items}
    assert names == {"one", "two", "four"}
