"""The leader elector against an in-memory Lease API whose calls can be made to hang.

The fake stands for the API server only (the boundary); the elector's logic is
the real one. What is checked: every Lease call carries a request timeout, and
the renew deadline is kept by the clock, so a leader whose renewal hangs stops
leading while the call still hangs, and a renewal that comes back late does not
make it lead again.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from typing import Any

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.leader import LeaderElector, LeaseTiming

TIMING = LeaseTiming(lease_duration=4.0, renew_deadline=2.0, retry_period=0.2)
SAFETY = 60.0  # a safety net for a loaded machine, never a speed


class FakeLeases:
    """read/create/replace_namespaced_lease on one Lease kept in memory, with resourceVersions.
    While `hang` is set, every call blocks until `unblock` is set (an API server that accepted
    the connection and never answers)."""

    def __init__(self) -> None:
        self.spec: dict[str, Any] | None = None
        self.rv = 0
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.hang, self.hanging, self.unblock = threading.Event(), threading.Event(), threading.Event()
        self.renewals = 0

    def _enter(self, what: str, kwargs: dict[str, Any]) -> None:
        self.calls.append((what, kwargs))
        if self.hang.is_set():
            self.hanging.set()
            self.unblock.wait(SAFETY * 2)

    def _lease(self, name: str) -> client.V1Lease:
        assert self.spec is not None
        times = {k: dt.datetime.strptime(self.spec[k], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc)
                 for k in ("acquireTime", "renewTime") if self.spec.get(k)}
        return client.V1Lease(metadata=client.V1ObjectMeta(name=name, resource_version=str(self.rv)),
                              spec=client.V1LeaseSpec(
                                  holder_identity=self.spec.get("holderIdentity"),
                                  lease_duration_seconds=self.spec.get("leaseDurationSeconds"),
                                  lease_transitions=self.spec.get("leaseTransitions"),
                                  acquire_time=times.get("acquireTime"), renew_time=times.get("renewTime")))

    def read_namespaced_lease(self, name: str, namespace: str, **kwargs: Any) -> client.V1Lease:
        self._enter("read", kwargs)
        if self.spec is None:
            raise ApiException(status=404, reason="Not Found")
        return self._lease(name)

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any], **kwargs: Any) -> None:
        self._enter("create", kwargs)
        if self.spec is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        self.spec, self.rv = dict(body["spec"]), self.rv + 1

    def replace_namespaced_lease(self, name: str, namespace: str, body: dict[str, Any], **kwargs: Any) -> None:
        self._enter("replace", kwargs)
        if body["metadata"].get("resourceVersion") != str(self.rv):
            raise ApiException(status=409, reason="Conflict")
        self.spec, self.rv = dict(body["spec"]), self.rv + 1
        self.renewals += 1


def make_elector(fake: FakeLeases, on_lost: Any = None) -> LeaderElector:
    elector = LeaderElector(client.ApiClient(), namespace="ops", name="kubetrain", identity="me",
                            timing=TIMING, on_lost=on_lost)
    elector.api = fake  # type: ignore[assignment]
    return elector


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + SAFETY
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_every_lease_call_has_a_request_timeout() -> None:
    fake = FakeLeases()
    elector = make_elector(fake)
    assert elector.acquire()
    elector.start_renewing()
    wait_for(lambda: fake.renewals >= 2, "two renewals")
    elector.release()
    assert {what for what, _ in fake.calls} == {"read", "create", "replace"}
    for what, kwargs in fake.calls:
        timeout = kwargs.get("_request_timeout")
        assert timeout is not None and 0 < timeout <= TIMING.renew_deadline, (what, kwargs)
    assert fake.spec is not None and fake.spec["holderIdentity"] is None  # released


def test_the_renew_deadline_is_kept_by_the_clock_while_a_renewal_hangs() -> None:
    fake = FakeLeases()
    reasons: list[str] = []
    lost = threading.Event()
    elector = make_elector(fake, on_lost=lambda reason: (reasons.append(reason), lost.set()))
    assert elector.acquire()
    elector.start_renewing()
    try:
        wait_for(lambda: fake.renewals >= 1, "a first renewal")
        fake.hang.set()
        assert fake.hanging.wait(SAFETY), "the leader stopped calling the API"
        assert lost.wait(SAFETY), "the leader kept leading past its renew deadline while a renewal hung"
        assert not fake.unblock.is_set(), "the loss was declared only after the call returned"
        assert not elector.is_leader
        assert "could not renew" in reasons[0]
    finally:
        fake.hang.clear()
        fake.unblock.set()
    # The hung call now returns and the renewal would succeed: it must not make us lead again.
    assert elector._thread is not None
    elector._thread.join(SAFETY)
    assert not elector._thread.is_alive()
    assert not elector.is_leader and len(reasons) == 1
    elector.release()
    assert fake.spec is not None and fake.spec["holderIdentity"] == "me"  # a lost leader leaves the Lease alone


def test_a_fractional_lease_is_written_rounded_up_so_no_standby_takes_over_while_the_leader_still_leads() -> None:
    """The Lease holds whole seconds: 2.5 s written as 2 let a standby take over 2 s after the last renewal it
    saw, while the leader (renew deadline 2.4 s) still reconciled. Rounded up, the Lease outlasts the deadline."""
    fake = FakeLeases()
    elector = LeaderElector(client.ApiClient(), namespace="ops", name="kubetrain", identity="me",
                            timing=LeaseTiming(lease_duration=2.5, renew_deadline=2.4, retry_period=0.5))
    elector.api = fake  # type: ignore[assignment]
    assert elector.try_acquire_or_renew()
    assert fake.spec is not None and fake.spec["leaseDurationSeconds"] == 3 >= 2.4


# A standby that cannot read the Lease: said once, tried as often as ever. The 403 message is k8s.io/apiserver's
# forbiddenMessage for the chart's ServiceAccount without its leader-election Role.
SA = "system:serviceaccount:ops:kt-kubetrain"


def _lease_forbidden() -> ApiException:
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden", "message":
                           f'leases.coordination.k8s.io "kubetrain" is forbidden: User "{SA}" cannot get resource '
                           '"leases" in API group "coordination.k8s.io" in the namespace "ops"'})
    return exc


def _unreachable() -> Exception:  # urllib3 names the connection by its address: a new one on every try
    return urllib3.exceptions.MaxRetryError(None, "/apis/coordination.k8s.io/v1/namespaces/ops/leases/kubetrain",
                                            urllib3.exceptions.NewConnectionError(
                                                object(), f"{object()!r}: Failed to establish a new connection: "
                                                          "[Errno 111] Connection refused"))


class FailingLeases(FakeLeases):
    """The first `len(failures)` reads fail with what each function makes; then nobody holds the Lease."""

    def __init__(self, failures: list[Any]) -> None:
        super().__init__()
        self.failures = failures

    def read_namespaced_lease(self, name: str, namespace: str, **kwargs: Any) -> client.V1Lease:
        if self.failures:
            self.calls.append(("read", kwargs))
            raise self.failures.pop(0)()
        return super().read_namespaced_lease(name, namespace, **kwargs)


class Ticks(threading.Event):
    """`acquire`'s stop event: each wait for the next try passes at once on a fake clock."""

    def __init__(self) -> None:
        super().__init__()
        self.now, self.waits = 1000.0, []

    def __call__(self) -> float:
        return self.now

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        self.now += timeout or 0.0
        return False


def stand_by(failures: list[Any]) -> tuple[FailingLeases, Ticks]:
    """A standby whose Lease reads fail with `failures`, one per try, until it takes the free Lease over."""
    fake, ticks = FailingLeases(failures), Ticks()
    elector = LeaderElector(client.ApiClient(), namespace="ops", name="kubetrain", identity="me", clock=ticks)
    elector.api = fake  # type: ignore[assignment]
    assert elector.acquire(ticks)
    return fake, ticks


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name.startswith("kubetrain")]


def test_a_standby_rbac_refuses_the_lease_says_it_once_with_the_fix_and_still_tries_every_retry_period(caplog):
    """Before: `cannot read or write Lease ops/kubetrain: read_namespaced_lease: HTTP 403 Forbidden` at WARNING
    every 2 s, forever, naming neither the permission nor the Role that grants it."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    fake, ticks = stand_by([_lease_forbidden] * 30)
    (error,) = messages(caplog, logging.ERROR)
    assert "forbids the operator to get leases in namespace ops (API group coordination.k8s.io" in error
    assert "leaderElection.enabled=true (its Role <release>-leader-election in ops)" in error
    assert f"kubectl auth can-i get leases.coordination.k8s.io -n ops --as={SA}" in error
    assert messages(caplog, logging.WARNING) == []
    assert any("allowed again" in m for m in messages(caplog, logging.INFO))
    # The election's cadence is untouched: a try every retry period, and the take-over at the first that works.
    assert ticks.waits == [LeaseTiming().retry_period] * 30
    assert [what for what, _ in fake.calls] == ["read"] * 31 + ["create"]


def test_a_standby_that_cannot_reach_the_api_warns_once_a_minute_with_a_count_and_says_when_it_can(caplog):
    """Before: a WARNING every 2 s for as long as the API server was away."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    fake, ticks = stand_by([_unreachable] * 61)  # two minutes of tries
    warnings = messages(caplog, logging.WARNING)
    assert len(warnings) == 3, warnings
    assert all("cannot read or write Lease ops/kubetrain: " in w and "Connection refused" in w for w in warnings)
    assert warnings[1].endswith("(30 more times in the last 60s)")
    assert "Lease ops/kubetrain can be read and written again (after 61 failures in a row)" in messages(
        caplog, logging.INFO)
    assert ticks.waits == [LeaseTiming().retry_period] * 61
    assert [what for what, _ in fake.calls] == ["read"] * 62 + ["create"]


class Rounds(Ticks):
    """`_renew_loop`'s stop event on a fake clock: `rounds` renewals, then stop."""

    def __init__(self, ticks: Ticks, rounds: int) -> None:
        super().__init__()
        self.ticks, self.rounds = ticks, rounds

    def wait(self, timeout: float | None = None) -> bool:
        self.ticks.wait(timeout)
        return len(self.ticks.waits) > self.rounds


def renew_through(failures: list[Any]) -> tuple[FailingLeases, Ticks]:
    """A leader whose renewals' reads fail with `failures`, one per round, then one renewal that goes through;
    renewed on the calling thread (no watchdog: the renew deadline is not what is tested here)."""
    fake, ticks = FailingLeases([]), Ticks()
    elector = LeaderElector(client.ApiClient(), namespace="ops", name="kubetrain", identity="me", clock=ticks)
    elector.api = fake  # type: ignore[assignment]
    assert elector.acquire(ticks)
    fake.failures, fake.calls, ticks.waits = list(failures), [], []
    elector._stop = Rounds(ticks, len(failures) + 1)
    elector._renew_loop()
    assert elector.is_leader
    return fake, ticks


def test_a_leader_that_cannot_renew_warns_once_and_says_when_it_renews_again(caplog):
    """Before: `cannot renew Lease ops/kubetrain (will retry): ...` at WARNING at every try, every retry period."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    fake, ticks = renew_through([_unreachable] * 4)
    warnings = messages(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("cannot renew Lease ops/kubetrain: ") and "Connection refused" in warnings[0]
    assert warnings[0].endswith("; trying again every 2s (leadership is lost 10s after the last renewal)")
    assert len([m for m in messages(caplog, logging.DEBUG) if m.startswith("cannot renew")]) == 3
    assert "Lease ops/kubetrain renewed again (after 4 failures in a row)" in messages(caplog, logging.INFO)
    # The renewals' cadence is untouched: a try every retry period.
    assert ticks.waits == [LeaseTiming().retry_period] * 6
    assert [what for what, _ in fake.calls] == ["read"] * 5 + ["replace"]


def test_a_leader_whose_renewal_rbac_refuses_says_it_once_at_error_not_a_warning_per_try(caplog):
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    renew_through([_lease_forbidden] * 4)
    (error,) = messages(caplog, logging.ERROR)
    assert "forbids the operator to get leases in namespace ops" in error
    assert messages(caplog, logging.WARNING) == []
    assert any("allowed again" in m for m in messages(caplog, logging.INFO))
