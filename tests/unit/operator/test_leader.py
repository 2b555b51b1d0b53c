"""The leader elector against an in-memory Lease API whose calls can be made to hang.

The fake stands for the API server only (the boundary); the elector's logic is
the real one. What is checked: every Lease call carries a request timeout, and
the renew deadline is kept by the clock, so a leader whose renewal hangs stops
leading while the call still hangs, and a renewal that comes back late does not
make it lead again.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

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
