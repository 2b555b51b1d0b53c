"""The test node agent's only door to the API server: its Node and Lease, the pod watch, lookups, status writes.

Everything the agent says to Kubernetes goes through `NodeApi`, the way a
kubelet talks to the API server: it registers the Node, keeps it Ready (node
status and a Lease in kube-node-lease), lists and watches the pods bound to
it, reads the Secrets and ConfigMaps they reference, requests their
ServiceAccount tokens, writes their status and finalizes them. What to say,
and when, is decided elsewhere (`agent_machine.py`, `agent_status.py`).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from .agent_pod import ContainerConfigError, decode_secret
from .agent_status import node_object, node_status

log = logging.getLogger("kubetrain.agent")


def now_str(*, micro: bool = False) -> str:
    """Now in UTC as the API stores it: RFC 3339 seconds (Time), or with microseconds (MicroTime: Leases)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


class NodeApi:
    """One node's API client: a second connection serves the heartbeat, so a slow watch never delays it."""

    def __init__(self, *, kubeconfig: str, node_name: str, lease_seconds: int = 40) -> None:
        from kubernetes import client, config

        self.client = client
        self.api = config.new_client_from_config(config_file=kubeconfig)
        self.hb_api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.node_name = node_name
        self.lease_seconds = lease_seconds
        self.version = "v0.0.0"
        self.started_at = now_str()

    def pod_env(self) -> dict[str, str]:
        """What a kubelet injects for the `kubernetes` Service, pointing at the real API server."""
        url = urlsplit(self.api.configuration.host)
        return {"KUBERNETES_SERVICE_HOST": url.hostname or "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(url.port or 443)}

    # ------------------------------------------------------------------ node
    def register(self, *, labels: dict[str, str], taints: list[dict], capacity: dict[str, str]) -> None:
        client = self.client
        try:
            self.version = client.VersionApi(self.api).get_code().git_version
        except Exception:  # noqa: BLE001 - cosmetic only
            pass
        body = node_object(name=self.node_name, labels=labels, taints=taints)
        try:
            self.core.create_node(body)
            log.info("registered node %s", self.node_name)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_node(self.node_name, {"metadata": {"labels": body["metadata"]["labels"]}, "spec": body["spec"]})
            log.info("node %s already exists: labels and taints refreshed", self.node_name)
        self._post_node_status(self.core, capacity)
        self._renew_lease(client.CoordinationV1Api(self.api))

    def _post_node_status(self, core, capacity: dict[str, str]) -> None:
        status = node_status(capacity=capacity, now=now_str(), since=self.started_at, version=self.version)
        core.patch_node_status(self.node_name, {"status": status})

    def _renew_lease(self, coord) -> None:
        try:
            coord.patch_namespaced_lease(self.node_name, "kube-node-lease", {"spec": {"renewTime": now_str(micro=True), "holderIdentity": self.node_name}})
        except self.client.ApiException as exc:
            if exc.status != 404:
                raise
            node = self.core.read_node(self.node_name)
            coord.create_namespaced_lease("kube-node-lease", {
                "metadata": {"name": self.node_name, "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node.metadata.uid}]},
                "spec": {"holderIdentity": self.node_name, "leaseDurationSeconds": self.lease_seconds, "renewTime": now_str(micro=True)},
            })

    def heartbeat_loop(self, stop: threading.Event, *, every: float, capacity: dict[str, str]) -> None:
        """Renew the Lease every ``every`` seconds and post the node status every 10 s, until ``stop``."""
        core = self.client.CoreV1Api(self.hb_api)
        coord = self.client.CoordinationV1Api(self.hb_api)
        last_status = 0.0
        while not stop.wait(every):
            try:
                self._renew_lease(coord)
                if time.monotonic() - last_status > 10:
                    self._post_node_status(core, capacity)
                    last_status = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - a heartbeat must survive API hiccups
                log.warning("heartbeat failed: %s", exc)

    def delete_node(self) -> None:
        try:
            self.core.delete_node(self.node_name)
            self.client.CoordinationV1Api(self.api).delete_namespaced_lease(self.node_name, "kube-node-lease")
        except Exception as exc:  # noqa: BLE001
            log.warning("deleting node %s: %s", self.node_name, exc)

    # ------------------------------------------------------------------ watch
    def watch_loop(self, stop: threading.Event, put: Callable[[tuple[str, object]], None]) -> None:
        """List then watch the pods bound to this node until ``stop``: ("SYNC", items) after each listing,
        then (ADDED|MODIFIED|DELETED, pod); relists after any failure."""
        from kubernetes import watch

        selector = f"spec.nodeName={self.node_name}"
        while not stop.is_set():
            try:
                resp = self.core.list_pod_for_all_namespaces(field_selector=selector, _preload_content=False)
                body = json.loads(resp.data)
                put(("SYNC", body["items"]))
                w = watch.Watch()
                for ev in w.stream(self.core.list_pod_for_all_namespaces, field_selector=selector,
                                   resource_version=body["metadata"]["resourceVersion"], timeout_seconds=30):
                    if stop.is_set():
                        w.stop()
                        break
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        put((ev["type"], ev["raw_object"]))
            except Exception as exc:  # noqa: BLE001 - relist after any watch failure
                if not stop.is_set():
                    log.warning("pod watch failed, relisting: %s", exc)
                    stop.wait(1.0)

    # ------------------------------------------------------------------ lookups
    def secret(self, ns: str, name: str) -> dict[str, str] | None:
        try:
            return decode_secret(self.core.read_namespaced_secret(name, ns).data)
        except self.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def configmap(self, ns: str, name: str) -> dict[str, str] | None:
        try:
            return dict(self.core.read_namespaced_config_map(name, ns).data or {})
        except self.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def token(self, pod: dict, audience: str, seconds: int) -> bytes:
        """A token of a projected serviceAccountToken source, bound to the pod, as a kubelet requests it."""
        return self._request_token(pod, [audience] if audience else [], seconds,
                                   what=f" (audience {audience!r})").encode()

    def _request_token(self, pod: dict, audiences: list[str], seconds: int, *, what: str = "") -> str:
        c = self.client
        meta, sa = pod["metadata"], pod["spec"].get("serviceAccountName") or "default"
        try:
            tr = self.core.create_namespaced_service_account_token(sa, meta["namespace"], c.AuthenticationV1TokenRequest(
                spec=c.V1TokenRequestSpec(audiences=audiences, expiration_seconds=seconds,
                                          bound_object_ref=c.V1BoundObjectReference(
                                              api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]))))
        except c.ApiException as exc:
            raise ContainerConfigError(f"TokenRequest for ServiceAccount {meta['namespace']}/{sa}{what} "
                                       f"failed: {exc.status} {exc.reason}") from None
        return tr.status.token

    def credentials(self, pod: dict, *, seconds: int) -> tuple[bytes | None, dict[str, bytes]]:
        """A kubeconfig and token files for the pod's ServiceAccount (TokenRequest bound to the pod)."""
        spec, meta = pod["spec"], pod["metadata"]
        if spec.get("automountServiceAccountToken") is False:
            return None, {"token": b""}
        sa = spec.get("serviceAccountName") or "default"
        token = self._request_token(pod, [], seconds)
        cfg = self.api.configuration
        ca = Path(cfg.ssl_ca_cert).read_bytes() if cfg.ssl_ca_cert else b""
        user = f"system:serviceaccount:{meta['namespace']}:{sa}"
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "in-pod",
            "clusters": [{"name": "testbed", "cluster": {"server": cfg.host, "certificate-authority-data": base64.b64encode(ca).decode()}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "in-pod", "context": {"cluster": "testbed", "user": user, "namespace": meta["namespace"]}}],
        }
        return json.dumps(kubeconfig).encode(), {"token": token.encode()}

    # ------------------------------------------------------------------ pods
    def patch_status(self, pod: dict, status: dict) -> bool:
        """Write the pod's status; False when the API refused it for now (the caller retries)."""
        m = pod["metadata"]
        try:
            self.core.patch_namespaced_pod_status(m["name"], m["namespace"], {"metadata": {"uid": m["uid"]}, "status": status},
                                                  _content_type="application/strategic-merge-patch+json")
            return True
        except self.client.ApiException as exc:
            if exc.status in (404, 409):
                return True  # gone or replaced: nothing left to report on
            log.warning("status of pod %s/%s not written (%s), will retry", m["namespace"], m["name"], exc.status)
            return False

    def finalize(self, pod: dict) -> None:
        """Delete the pod object with grace 0, if it is still the same pod (uid precondition)."""
        c, m = self.client, pod["metadata"]
        try:
            self.core.delete_namespaced_pod(m["name"], m["namespace"], body=c.V1DeleteOptions(
                grace_period_seconds=0, preconditions=c.V1Preconditions(uid=m["uid"])))
            log.info("pod %s/%s finalized", m["namespace"], m["name"])
        except c.ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("finalizing pod %s/%s failed: %s", m["namespace"], m["name"], exc.status)
