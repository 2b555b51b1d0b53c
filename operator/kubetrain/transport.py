"""A lean HTTPS path for the operator's hot writes: pod, Service and Event creates and status patches
(the TrainingJob's, and Kueue's Workload's).

A launch of 200 four-node jobs is some 1,800 writes in a few seconds. Through the
generated client each costs about 0.6 ms of the operator's CPU (its argument
checks, a recursive walk of the body, urllib3's pool and response objects); the
same request on a kept-alive `http.client` connection costs about 0.3 ms
(benchmarks/README.md). Everything else, and any setup this path does not cover
(an HTTP proxy, a TLS server name other than the host), goes through the
generated client as before.

Same semantics as the client for the caller: the same auth headers (the
client's own `update_params_for_auth`, so a refreshed service account token or
exec credential is used), the same 30 s timeout, a non-2xx answer raised as the
client's `ApiException` (status, reason, body), a connection error as `OSError`.
One connection per API thread, kept alive. A kept connection the server closed
while idle is noticed before it is used; a request whose kept connection broke
with no answer at all is sent once more on a new one (`Transport._send`).
Timeouts are per socket operation (30 s each), where the client's is per request.
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
import urllib.parse
from typing import Any

import orjson
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from urllib3.util.wait import wait_for_read

TIMEOUT = 30.0
_JSON = "application/json"
ROUTES: dict[str, tuple[str, str]] = {
    # generated method -> (HTTP method, path from its positional arguments, the body last)
    "create_namespaced_pod": ("POST", "/api/v1/namespaces/{0}/pods"),
    "create_namespaced_service": ("POST", "/api/v1/namespaces/{0}/services"),
    "create_namespaced_event": ("POST", "/api/v1/namespaces/{0}/events"),
    "patch_namespaced_custom_object_status": ("PATCH", "/apis/{0}/{1}/namespaces/{2}/{3}/{4}/status"),
}
_BROKEN = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _stamp(path: str | None) -> tuple | None:
    """What says a file changed: its path, inode, size and mtime (None for no file; the path alone for one
    that cannot be read, which the context's build then reports)."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return (path,)
    return (path, st.st_ino, st.st_size, st.st_mtime_ns)


class _Unanswered(Exception):
    """A kept connection broke before any answer (see `Transport._send`)."""


def load_client_config(*, threads: int) -> client.ApiClient:
    """In-cluster credentials when running in a pod, the kubeconfig otherwise."""
    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = threads
    return client.ApiClient(configuration=cfg)


class Transport:
    """Requests on kept-alive connections, one per thread, to the API server of `api_client`."""

    def __init__(self, api_client: client.ApiClient, url: urllib.parse.SplitResult) -> None:
        self.api_client, self.tls = api_client, url.scheme == "https"
        self.host, self.port = url.hostname or "", url.port or (443 if self.tls else 80)
        self.prefix = url.path.rstrip("/")
        self._local = threading.local()
        self._context_lock = threading.Lock()
        self._context: tuple[tuple, ssl.SSLContext] | None = None
        if self.tls:
            self.context()  # a bad CA or key fails here, at start

    @classmethod
    def for_client(cls, api_client: client.ApiClient) -> Transport | None:
        """The transport for this client's configuration, or None where it would not do what the client does."""
        cfg = api_client.configuration
        url = urllib.parse.urlsplit(cfg.host or "")
        if cfg.proxy or getattr(cfg, "tls_server_name", None) or cfg.assert_hostname is not None \
                or url.scheme not in ("http", "https") or not url.hostname:
            return None
        return cls(api_client, url)

    def context(self) -> ssl.SSLContext:
        """The TLS context for a new connection: one, shared by the threads, built again when a file it was
        read from has changed (path, inode, size or mtime), so a rotated CA or client certificate (in-cluster,
        a projected volume, swapped by a symlink) is picked up without a restart, as urllib3 does for the
        client by reading the files for each connection. Building one costs about 1 ms of CPU (OpenSSL's
        context, the CA and the key parsed; 20 ms with the system's store), once per API thread before.
        Not noticed: a file rewritten in place with the same size within one mtime tick, and a change to
        the system's store (used when no CA is configured), which is read once."""
        cfg = self.api_client.configuration
        files = (cfg.ssl_ca_cert if cfg.verify_ssl else None, cfg.cert_file, cfg.key_file)
        key = (cfg.verify_ssl, tuple(_stamp(f) for f in files))
        with self._context_lock:
            if self._context is None or self._context[0] != key:
                self._context = (key, self._build_context())
            return self._context[1]

    def _build_context(self) -> ssl.SSLContext:
        cfg = self.api_client.configuration
        if cfg.verify_ssl:  # no CA configured: the system's store, as urllib3 loads it for the client
            context = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
        else:
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if cfg.cert_file:
            context.load_cert_chain(cfg.cert_file, cfg.key_file)
        return context

    def route(self, method_name: str, args: tuple, kwargs: dict[str, Any]) -> tuple[str, str, Any, str] | None:
        """(HTTP method, path, body, content type) of a generated client call, or None if it is not routed
        here (another method, or an argument this path does not carry, such as dry_run)."""
        route = ROUTES.get(method_name)
        if route is None or set(kwargs) - {"_content_type"} or not args:
            return None
        *parts, body = args
        path = route[1].format(*(urllib.parse.quote(str(p), safe="") for p in parts))
        return route[0], self.prefix + path, body, kwargs.get("_content_type") or _JSON

    def request(self, method: str, path: str, body: Any, content_type: str) -> bytes:
        """Send one request; the answer's body, or ApiException for a non-2xx status."""
        headers = {"Content-Type": content_type, "Accept": _JSON, "User-Agent": self.api_client.user_agent,
                   **self.api_client.default_headers}
        self.api_client.update_params_for_auth(headers, [], ["BearerToken"])
        payload = orjson.dumps(body)
        for last in (False, True):
            conn, reused = self._connection()
            try:
                resp = self._send(conn, method, path, payload, headers)
                break
            except _Unanswered as exc:
                conn.close()
                if last or not reused:
                    raise exc.__cause__ or exc from None
            except http.client.HTTPException as exc:  # a malformed answer: not an OSError, so said as one
                conn.close()
                raise ConnectionError(f"{type(exc).__name__}: {exc}") from None
            except BaseException:
                conn.close()
                raise
        if not 200 <= resp.status < 300:
            exc = ApiException(status=resp.status, reason=resp.reason)
            exc.body, exc.headers = resp.data, dict(resp.getheaders())
            raise exc
        return resp.data

    @staticmethod
    def _send(conn: http.client.HTTPConnection, method: str, path: str, payload: bytes,
              headers: dict[str, str]) -> http.client.HTTPResponse:
        """One exchange. `_Unanswered` when a kept connection broke with no answer at all: while sending, or
        closed or reset before the response (the server's idle close crossing our request). Only then is
        the request sent again, once, on a new connection: a create is safe to repeat (fixed names: a 409
        and the owner check), the status patch carries its resourceVersion (a 409: re-read), an Event may
        come twice. A connection that broke later, mid-answer, is not retried."""
        try:
            conn.request(method, path, body=payload, headers=headers)
        except _BROKEN as exc:
            raise _Unanswered() from exc
        try:
            resp = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError) as exc:  # a FIN, or an RST if unread
            raise _Unanswered() from exc
        resp.data = resp.read()  # type: ignore[attr-defined]  (read whole: the connection is free again)
        return resp

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            try:
                if not wait_for_read(conn.sock, timeout=0):  # nothing to read on an idle connection: open
                    return conn, True
            except (OSError, ValueError):
                pass
            conn.close()  # closed by the server (EOF) while idle, or unusable
        if self.tls:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=TIMEOUT, context=self.context())
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)
        self._local.conn = conn
        return conn, False
