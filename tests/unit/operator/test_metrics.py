"""The operator's Prometheus metrics: counted from applied plans, read from the operator's state at
scrape time, served over HTTP, and parsed back with prometheus-client's own parser."""

from __future__ import annotations

import json
import socket
import urllib.request
from dataclasses import replace

import pytest

from prometheus_client.parser import text_string_to_metric_families

from kubetrain import metrics
from kubetrain.observe import Observed
from kubetrain.plan import plan
from kubetrain_factories import at, gang, job, started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_preemption_and_the_restart_it_causes_are_counted_with_their_reasons() -> None:
    before = (_value("kubetrain_job_preemptions_total", reason="EvictionByEvictionAPI"),
              _value("kubetrain_job_restarts_total", reason="Preempted"))
    tj = job(status=started(nodesReady=2))
    evicted = plan(tj, Observed(pods=(gang()[0], replace(gang()[1], disruption="EvictionByEvictionAPI"))), at(5))
    metrics.count_plan(tj.status, evicted)
    # The next reconcile starts attempt 2 (the old pods are gone): that is the restart.
    restarting = job(status=evicted.status.for_storage())
    started2 = plan(restarting, Observed(pods=()), at(6))
    assert started2.status.attempt == 2 and started2.status.restarts == 1
    metrics.count_plan(restarting.status, started2)
    metrics.count_plan(restarting.status, replace(started2, actions=()))  # a plan without a status write counts nothing
    after = (_value("kubetrain_job_preemptions_total", reason="EvictionByEvictionAPI"),
             _value("kubetrain_job_restarts_total", reason="Preempted"))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


def test_label_values_stay_bounded() -> None:
    assert metrics.bounded("PreemptionByScheduler") == "PreemptionByScheduler"
    assert metrics.bounded("pod/x: anything a client wrote") == "Other"
    assert metrics.bounded("") == "Other"


def test_state_is_read_at_scrape_time_and_served_over_http() -> None:
    jobs = [{"status": {"phase": "Running"}}, {"status": {"phase": "Running"}}, {"status": {}},
            {"status": {"phase": "Failed"}}]
    writes = {"create pod": 8, "patch trainingjob/status": 3}
    metrics.watch(jobs=lambda: list(jobs), queue_depth=lambda: 5, writes=lambda: dict(writes))
    metrics.LEADER.set(1)
    port = _free_port()
    server = metrics.serve(port, "127.0.0.1")
    try:
        writes["create pod"] += 4
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
    got = _samples(text)
    assert got[("kubetrain_jobs", (("phase", "Running"),))] == 2
    assert got[("kubetrain_jobs", (("phase", "New"),))] == 1
    assert got[("kubetrain_jobs", (("phase", "Succeeded"),))] == 0
    assert got[("kubetrain_reconcile_queue_depth", ())] == 5
    assert got[("kubetrain_api_writes_total", (("kind", "pod"), ("verb", "create")))] == 12
    assert got[("kubetrain_api_writes_total", (("kind", "trainingjob/status"), ("verb", "patch")))] == 3
    assert got[("kubetrain_leader", ())] == 1
    names = {name for name, _ in got}
    assert "kubetrain_reconcile_duration_seconds_bucket" in names
    assert all(n.startswith("kubetrain_") for n in names)


def test_a_taken_port_is_not_fatal() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert metrics.serve(s.getsockname()[1], "127.0.0.1") is None
    assert metrics.serve(0) is None


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="this machine has no dual-stack IPv6")
def test_without_an_address_it_answers_on_ipv4_and_ipv6() -> None:
    # An IPv6-only cluster scrapes the pod's IPv6 address, an IPv4 one its IPv4 address: one default for both.
    port = _free_port()
    server = metrics.serve(port)
    try:
        for host in ("127.0.0.1", "[::1]"):
            assert urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).status == 200, host
    finally:
        server.shutdown()


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="this machine has no dual-stack IPv6")
def test_a_standby_replicas_liveness_endpoint_binds_the_charts_ipv6_address() -> None:
    # The chart's healthBindAddress "[::]" (IPv6-only clusters) reaches the standby's own health server too.
    from types import SimpleNamespace

    from kubetrain.cli import _standby_health

    port = _free_port()
    elector = SimpleNamespace(lease_ref="ns/lease", holder="other")
    with _standby_health(f"http://[::]:{port}/healthz", elector):
        answer = urllib.request.urlopen(f"http://[::1]:{port}/healthz", timeout=10)
        assert answer.status == 200 and json.loads(answer.read())["leader"] is False
