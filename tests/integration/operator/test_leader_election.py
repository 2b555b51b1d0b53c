"""Leader election against the real API server: one Lease, one leader.

The elector is driven directly first (handover on release, takeover after a dead
leader's lease expires, a leader that loses its Lease is told), then two real
operator processes share a Lease: the standby answers its liveness probe,
creates nothing while the leader lives, and takes the job over when the leader
is SIGKILLed, with no duplicate pods; a leader whose connection to the API
server hangs stops before the standby takes over."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
import urllib.parse
import urllib.request

import pytest
from kubernetes import client

from kubetrain.leader import LeaderElector, LeaseTiming
from kubetrain_optest import spec
from kubetrain_testbed import free_port, wait_until

pytestmark = pytest.mark.integration

# Short enough for quick tests, long enough that a leader on a loaded machine (CPU hogs on every
# core, a slow API server) still renews well within a lease duration: the tests check who holds the
# Lease and when it changes hands relative to these timings, so a missed renewal would be a false failure.
FAST = LeaseTiming(lease_duration=8.0, renew_deadline=6.0, retry_period=0.5)


def elector(kube_api, namespace: str, lease: str, identity: str, **kw) -> LeaderElector:
    return LeaderElector(kube_api, namespace=namespace, name=lease, identity=identity, timing=FAST, **kw)


def read_lease(kube_api, namespace: str, name: str):
    return client.CoordinationV1Api(kube_api).read_namespaced_lease(name, namespace).spec


def test_clean_release_hands_the_lease_over_at_once(kube_api, namespace) -> None:
    a, b = (elector(kube_api, namespace, "ops", who) for who in ("a", "b"))
    assert a.acquire() and a.is_leader
    a.start_renewing()
    assert not b.try_acquire_or_renew() and b.holder == "a"
    got = threading.Event()
    threading.Thread(target=lambda: b.acquire() and got.set(), daemon=True).start()
    time.sleep(FAST.lease_duration + 1)   # a renews, so b must keep standing by past a lease duration
    assert not got.is_set() and read_lease(kube_api, namespace, "ops").holder_identity == "a"
    released = time.monotonic()
    a.release()
    assert got.wait(FAST.lease_duration), "b did not take over after a released the Lease"
    assert time.monotonic() - released < FAST.lease_duration, "b waited for expiry instead of taking the release"
    lease = read_lease(kube_api, namespace, "ops")
    assert lease.holder_identity == "b" and lease.lease_transitions == 1
    b.release()


def test_a_dead_leader_is_replaced_once_its_lease_expires(kube_api, namespace) -> None:
    a, b = (elector(kube_api, namespace, "ops", who) for who in ("a", "b"))
    assert a.acquire()          # and then never renews: a crashed leader
    start = time.monotonic()
    assert b.acquire()
    waited = time.monotonic() - start
    # At least a lease duration (b counts from its own first look at the Lease); not much more than one
    # retry period and a few API calls beyond it (ample margin for a loaded machine).
    assert FAST.lease_duration - 0.5 <= waited <= FAST.lease_duration + 6, waited
    assert read_lease(kube_api, namespace, "ops").holder_identity == "b"
    b.release()


def test_two_candidates_racing_for_a_free_lease_get_one_leader(kube_api, namespace) -> None:
    candidates = [elector(kube_api, namespace, "race", f"c{i}") for i in range(4)]
    results: list[bool] = [False] * len(candidates)
    barrier = threading.Barrier(len(candidates))

    def go(i: int) -> None:
        barrier.wait()
        results[i] = candidates[i].try_acquire_or_renew()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(candidates))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a candidate's API calls did not finish"
    assert results.count(True) == 1, results
    winner = candidates[results.index(True)].identity
    assert read_lease(kube_api, namespace, "race").holder_identity == winner


def test_a_leader_whose_lease_is_taken_is_told(kube_api, namespace) -> None:
    reasons: list[str] = []
    lost = threading.Event()
    a = elector(kube_api, namespace, "ops", "a", on_lost=lambda r: (reasons.append(r), lost.set()))
    assert a.acquire()
    a.start_renewing()
    coord = client.CoordinationV1Api(kube_api)

    def take_over() -> bool:
        # a renews concurrently: a read-modify-write may meet its renewal (409) and is then tried again
        lease = coord.read_namespaced_lease("ops", namespace)
        lease.spec.holder_identity = "intruder"
        coord.replace_namespaced_lease("ops", namespace, lease)
        return True

    wait_until(take_over, timeout=60, what="the intruder's write of the Lease")
    assert lost.wait(60), "the leader did not notice that its Lease was taken"
    assert not a.is_leader and "intruder" in reasons[0]
    a.release()   # not the holder any more: must leave the intruder's Lease alone
    assert read_lease(kube_api, namespace, "ops").holder_identity == "intruder"


@pytest.mark.slow
def test_standby_operator_takes_over_when_the_leader_dies(make_operator, namespace, kube_api, jobs,
                                                         pod_timeline) -> None:
    lease = f"kubetrain-{secrets.token_hex(3)}"
    # Lease timings with room for a loaded machine: the leader must never miss a lease duration of
    # renewals while it lives (the standby would take over early and the test would fail falsely).
    election = {"KUBETRAIN_LEADER_ELECTION": "true", "KUBETRAIN_LEADER_ELECTION_NAMESPACE": namespace,
                "KUBETRAIN_LEADER_ELECTION_ID": lease, "KUBETRAIN_LEASE_DURATION_SECONDS": "8",
                "KUBETRAIN_RENEW_DEADLINE_SECONDS": "6", "KUBETRAIN_RETRY_PERIOD_SECONDS": "0.5"}
    ops = {who: make_operator(who, {**election, "KUBETRAIN_LEADER_ELECTION_IDENTITY": f"op-{who}"},
                              [f"--liveness=http://127.0.0.1:{free_port()}/healthz"]) for who in ("a", "b")}
    try:
        ops["a"].start()
        wait_until(lambda: _holder(kube_api, namespace, lease), lambda h: h == "op-a", timeout=120,
                   what="op-a holds the Lease")
        ops["b"].start()
        # The endpoint answers before the standby's first read of the Lease (holder still None then).
        health = wait_until(lambda: _get_json(ops["b"].args[0].split("=", 1)[1]),
                            lambda h: h is not None and h.get("holder") is not None,
                            timeout=120, what="the standby's liveness endpoint, after its first look at the Lease")
        assert health == {"leader": False, "lease": f"Lease {namespace}/{lease}", "holder": "op-a"}

        jobs.create("first", spec(nodes=2))
        jobs.wait_phase("first", "Running", nodesReady=2, timeout=120)
        ops["a"].kill()
        killed = time.monotonic()
        wait_until(lambda: _holder(kube_api, namespace, lease), lambda h: h == "op-b", timeout=120,
                   what="op-b takes the Lease over")
        took_over = time.monotonic() - killed
        # the new leader reconciles: a job created now runs, and a preempted pod of the old one restarts its gang
        jobs.create("second", spec(nodes=2))
        jobs.wait_phase("second", "Running", nodesReady=2, timeout=120)
        jobs.core.delete_namespaced_pod("first-a1-n1", namespace)
        status = jobs.wait_phase("first", "Running", attempt=2, timeout=120)
        assert status["preemptions"] == 1 and status["restarts"] == 1
        added = pod_timeline.wait_added(6)
        assert sorted(added) == ["first-a1-n0", "first-a1-n1", "first-a2-n0", "first-a2-n1",
                                 "second-a1-n0", "second-a1-n1"], "each pod created once, by one leader"
        pod_timeline.check_no_overlap("first")
        print(f"standby took over {took_over:.1f}s after the leader was killed (lease 8 s)")
    finally:
        for who, op in ops.items():
            print(f"--- operator {who} log tail ---\n{op.log_tail(20)}")


def _holder(kube_api, namespace: str, name: str) -> str | None:
    try:
        return read_lease(kube_api, namespace, name).holder_identity
    except client.ApiException:
        return None


def _get_json(url: str):
    try:
        return json.loads(urllib.request.urlopen(url, timeout=10).read())
    except OSError:
        return None


class StallingProxy:
    """A loopback TCP proxy in front of the API server that can stall: once stalled it keeps every
    connection open and accepts new ones, but passes no byte in either direction (a half-open path,
    an API server that accepts and never answers). TLS goes through untouched."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.stalled = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.server.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                continue
            self.sockets += [conn, upstream]
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self.stalled.is_set() and not self.closed.is_set():
                    time.sleep(0.05)   # hold the bytes: nothing passes while stalled
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed.set()
        for s in [self.server, *self.sockets]:
            s.close()


def _proxied_kubeconfig(testbed, port: int, path) -> str:
    import yaml

    config = yaml.safe_load(open(testbed.kubeconfig).read())
    api = urllib.parse.urlparse(testbed.api_server)
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"https://{api.hostname}:{port}"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_a_leader_whose_connection_hangs_stops_before_the_standby_starts(make_operator, namespace, kube_api, jobs,
                                                                        testbed, tmp_path) -> None:
    """The old leader reaches the API server through a proxy that then stalls: its renewal hangs
    (no error, no answer). It must stop acting (the operator exits) before the standby takes the
    Lease over; without a clock-kept renew deadline it would hang, still leading, forever."""
    api = urllib.parse.urlparse(testbed.api_server)
    proxy = StallingProxy(api.hostname, api.port)
    lease = f"kubetrain-{secrets.token_hex(3)}"
    election = {"KUBETRAIN_LEADER_ELECTION": "true", "KUBETRAIN_LEADER_ELECTION_NAMESPACE": namespace,
                "KUBETRAIN_LEADER_ELECTION_ID": lease, "KUBETRAIN_LEASE_DURATION_SECONDS": "8",
                "KUBETRAIN_RENEW_DEADLINE_SECONDS": "4", "KUBETRAIN_RETRY_PERIOD_SECONDS": "0.5"}
    old = make_operator("old", {**election, "KUBETRAIN_LEADER_ELECTION_IDENTITY": "op-old",
                                "KUBECONFIG": _proxied_kubeconfig(testbed, proxy.port, tmp_path / "proxied.kubeconfig")})
    new = make_operator("new", {**election, "KUBETRAIN_LEADER_ELECTION_IDENTITY": "op-new"})
    try:
        old.start()
        wait_until(lambda: _holder(kube_api, namespace, lease), lambda h: h == "op-old", timeout=120,
                   what="op-old holds the Lease (through the proxy)")
        new.start()
        wait_until(lambda: "standing by" in new.log_tail(200), timeout=120, what="op-new standing by")
        jobs.create("first", spec(nodes=1))
        jobs.wait_phase("first", "Running", nodesReady=1, timeout=120)  # the old leader acts through the proxy
        assert old.proc is not None and old.proc.poll() is None, f"op-old died early:\n{old.log_tail()}"

        exited: list[float] = []
        threading.Thread(target=lambda: (old.proc.wait(), exited.append(time.time())), daemon=True).start()
        proxy.stalled.set()
        wait_until(lambda: _holder(kube_api, namespace, lease), lambda h: h == "op-new", timeout=120,
                   what="op-new takes the Lease over")
        taken = read_lease(kube_api, namespace, lease).acquire_time.timestamp()  # op-new's clock, before it acts
        assert exited, "op-old still runs, stalled, after op-new took the Lease over"
        assert exited[0] < taken, f"op-old exited {exited[0] - taken:.2f}s after op-new took the Lease"
        assert "could not renew" in old.log_tail(200), old.log_tail()
        # the new leader acts: a job created now runs
        jobs.create("second", spec(nodes=1))
        jobs.wait_phase("second", "Running", nodesReady=1, timeout=120)
    finally:
        proxy.close()
        for who, op in (("old", old), ("new", new)):
            print(f"--- operator {who} log tail ---\n{op.log_tail(20)}")
