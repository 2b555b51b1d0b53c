"""When the lean transport sends a hot write again (transport.py `_send`): only when a kept-alive connection
broke with no answer at all, once, on a new connection; never after a fresh connection failed, and a
malformed answer is a connection error (a TemporaryError to the reconciler), not an unknown exception.
Against a local HTTP server that answers, drops or garbles each request as told."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from kubernetes import client

from kubetrain.transport import Transport


class Server:
    """Plain HTTP/1.1 on 127.0.0.1: per request, the next of `actions` ('ok', 'drop', 'reset' or 'garbage')."""

    def __init__(self, actions: list[str]) -> None:
        self.actions, self.requests, self.heads = list(actions), 0, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                self.requests += 1
                self.heads.append(head.decode())
                action = self.actions.pop(0)
                if action == "drop":
                    return
                if action == "reset":  # closed with the request unread: the kernel sends an RST, not a FIN
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                if action == "garbage":
                    conn.sendall(b"NOT HTTP\r\n\r\n")
                    return
                body = b'{"metadata": {"name": "p"}}'
                conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)

    def close(self) -> None:
        self.sock.close()


def _create(t: Transport) -> bytes:
    return t.request(*t.route("create_namespaced_pod", ("ns", {"metadata": {"name": "p"}}), {}))


@pytest.fixture
def serve():
    servers: list[Server] = []

    def make(actions: list[str], **settings) -> tuple[Server, Transport]:
        servers.append(Server(actions))
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{servers[-1].port}"
        for key, value in settings.items():
            setattr(cfg, key, value)
        return servers[-1], Transport.for_client(client.ApiClient(cfg))

    yield make
    for s in servers:
        s.close()


def test_a_kept_connection_dropped_without_an_answer_is_retried_once_on_a_new_one(serve):
    server, t = serve(["ok", "drop", "ok"])
    assert b'"p"' in _create(t)
    assert b'"p"' in _create(t)  # the kept connection dropped the request: sent again, answered
    assert server.requests == 3


def test_a_kept_connection_reset_without_an_answer_is_retried_too(serve):
    server, t = serve(["ok", "reset", "ok"])
    _create(t)
    assert b'"p"' in _create(t)
    assert server.requests == 3


def test_a_new_connection_that_drops_the_request_is_not_retried(serve):
    server, t = serve(["drop", "ok"])
    with pytest.raises(ConnectionError):
        _create(t)
    assert server.requests == 1


def test_a_second_drop_after_the_retry_is_an_error_not_a_third_try(serve):
    server, t = serve(["ok", "drop", "drop", "ok"])
    _create(t)
    with pytest.raises(ConnectionError):
        _create(t)
    assert server.requests == 3
    assert b'"p"' in _create(t)  # the next request gets a fresh, working connection


def test_a_malformed_answer_is_a_connection_error(serve):
    server, t = serve(["garbage", "ok"])
    with pytest.raises(ConnectionError):
        _create(t)
    assert b'"p"' in _create(t)


def test_each_request_carries_the_clients_bearer_token_as_refreshed_by_its_hook(serve):
    """The client's own auth: a service account token (or an exec credential) re-read by the refresh hook."""
    tokens = iter(["first", "second"])

    def refresh(cfg) -> None:
        cfg.api_key["authorization"] = f"Bearer {next(tokens)}"

    server, t = serve(["ok", "ok"], api_key={"authorization": "Bearer stale"}, refresh_api_key_hook=refresh)
    _create(t)
    _create(t)
    auth = [next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                 if line.lower().startswith("authorization:")) for head in server.heads]
    assert auth == ["Bearer first", "Bearer second"]
