"""`kubetrain` command line: `kubetrain operator run` runs the controller in-process.

Settings come from the environment (see `config.py`) and may be overridden by
flags; they are validated before anything connects to the cluster, and a bad
value exits with status 2 and a message naming the setting.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.server
import json
import logging
import os
import signal
import socket
import sys
import threading
import urllib.parse
import uuid
from typing import Any, Iterator, Sequence

from kubetrain.config import ConfigError, Settings
from kubetrain.redact import RedactFilter


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubetrain", description="Kubernetes-native training operator")
    sub = parser.add_subparsers(dest="command", required=True)
    op = sub.add_parser("operator", help="the TrainingJob controller")
    op_sub = op.add_subparsers(dest="action", required=True)
    run = op_sub.add_parser("run", help="run the controller in the foreground (kopf, standalone)")
    run.add_argument("--namespace", action="append", default=None,
                     help="watch this namespace (repeatable); overrides KUBETRAIN_NAMESPACES")
    run.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    run.add_argument("--log-level", default=None, help="overrides KUBETRAIN_LOG_LEVEL")
    run.add_argument("--leader-elect", action="store_true",
                     help="stand by until this replica holds the Lease (KUBETRAIN_LEADER_ELECTION=true)")
    run.add_argument("--liveness", default=None, metavar="URL",
                     help="serve kopf's health endpoint, e.g. http://0.0.0.0:8080/healthz")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = dict(os.environ)
    if args.namespace:
        env["KUBETRAIN_NAMESPACES"] = ",".join(args.namespace)
    if args.all_namespaces:
        env["KUBETRAIN_NAMESPACES"] = ""
    if args.log_level:
        env["KUBETRAIN_LOG_LEVEL"] = args.log_level
    if args.leader_elect:
        env["KUBETRAIN_LEADER_ELECTION"] = "true"
    try:
        settings = Settings.from_env(env)
    except ConfigError as exc:
        print(f"kubetrain: {exc}", file=sys.stderr)
        return 2
    return run_operator(settings, liveness=args.liveness)


def configure_logging(level: str) -> None:
    """kopf's log handler at `level`, every line it writes redacted (redact.py) as status and events are."""
    import kopf

    kopf.configure(debug=level == "DEBUG", verbose=level == "DEBUG", quiet=level in ("WARNING", "ERROR"))
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:  # kopf's, set up just above
        if not any(isinstance(f, RedactFilter) for f in handler.filters):
            handler.addFilter(RedactFilter())
    logging.getLogger("kubetrain").setLevel(level)
    if level != "DEBUG":  # "Handler 'pod_event' succeeded." on every watch event
        logging.getLogger("kopf.objects").setLevel("WARNING")


def run_operator(settings: Settings, *, liveness: str | None = None) -> int:
    configure_logging(settings.log_level)
    # Given explicitly: kopf would otherwise ask getpass for the user name, which fails in a container
    # whose uid has no passwd entry (a pod's runAsUser rarely has one).
    identity = settings.leader_election_identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    from kubetrain import metrics

    metrics.serve(settings.metrics_port)  # standbys too: kubetrain_leader says which replica leads
    metrics.LEADER.set(0)
    if not settings.leader_election:
        return _run_kopf(settings, liveness=liveness, identity=identity)
    from kubetrain import transport
    from kubetrain.leader import LeaderElector, LeaseTiming


    def lost(reason: str) -> None:
        # Exit at once, the way client-go's controllers do: the next leader starts from the cluster's
        # state (the operator is level-triggered), and no write of ours may land after the Lease expires.
        print(f"kubetrain: lost leadership ({reason}); exiting so that only one operator reconciles",
              file=sys.stderr, flush=True)
        os._exit(1)

    elector = LeaderElector(
        transport.load_client_config(threads=2), namespace=settings.leader_election_namespace,
        name=settings.leader_election_id, identity=identity, on_lost=lost,
        timing=LeaseTiming(lease_duration=settings.lease_duration_seconds,
                           renew_deadline=settings.renew_deadline_seconds,
                           retry_period=settings.retry_period_seconds))
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a standby stops at once
    with _standby_health(liveness, elector):
        leading = elector.acquire(stop)
    signal.signal(signal.SIGTERM, previous)
    if not leading:
        return 0
    elector.start_renewing()
    try:
        return _run_kopf(settings, liveness=liveness, identity=identity)
    finally:
        elector.release()


class _Server6(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


@contextlib.contextmanager
def _standby_health(liveness: str | None, elector: Any) -> Iterator[None]:
    """While a replica stands by, its liveness endpoint answers (kopf serves it once leading)."""
    if not liveness:
        yield
        return
    url = urllib.parse.urlsplit(liveness)
    path = url.path or "/"

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"leader": False, "lease": elector.lease_ref, "holder": elector.holder}).encode()
            self.send_response(200 if self.path.split("?")[0] == path else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    host = url.hostname or "0.0.0.0"
    server_class = _Server6 if ":" in host else http.server.ThreadingHTTPServer  # "[::]": an IPv6-only cluster
    try:
        server = server_class((host, url.port or 80), Health)
    except OSError as exc:
        # Not fatal: in a pod the port is ours, but where replicas share a network (processes on one
        # host, as on the test node agent) the leader holds it, and kopf binds it once this one leads.
        logging.getLogger("kubetrain.leader").warning("standby liveness endpoint %s not served: %s", liveness, exc)
        yield
        return
    thread = threading.Thread(target=server.serve_forever, name="kubetrain-standby-health", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _run_kopf(settings: Settings, *, liveness: str | None, identity: str) -> int:
    import kopf

    import kubetrain.handlers  # noqa: F401  (registers the handlers)

    # What the imports made lives as long as the process: out of the garbage collector's sight, so that each
    # full collection (4 in a 200-job launch, 43 ms each) no longer scans some 85,000 objects of it.
    gc.collect()
    gc.freeze()
    kopf.run(
        standalone=True,
        clusterwide=settings.clusterwide,
        namespaces=settings.namespaces,
        liveness_endpoint=liveness,
        identity=identity,
        memo=kopf.Memo(settings=settings),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
