"""Pod writes first: on a big launch the bookkeeping writes (status, events, services) wait until the
pod creates have paused for `QUIET_SECONDS`, at most `LOW_PRIORITY_MAX_WAIT`, so the API server's time
goes to the pods a user waits for; what a job's own pods wait for (reads, its ConfigMap, Kueue's
Workload, a status written as the intent of deletes) goes out at once. The calls run for real in
`Api`'s thread pool; only the client functions are stand-ins (they record when they ran)."""

from __future__ import annotations

import asyncio
import copy
import inspect
import time
from types import SimpleNamespace

import pytest
from kubernetes import client

from kubetrain import k8s
from kubetrain.actions import DeletePod, PatchStatus, Plan
from kubetrain.api import Job
from kubetrain.k8s import Api
from kubetrain.status import Status

QUIET = 0.5
"""The quiet period in these tests: far longer than the gaps below, so a slow CI machine does not make one."""


@pytest.fixture(autouse=True)
def _long_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(k8s, "QUIET_SECONDS", QUIET)


class _Response:
    data = b"{}"

    def release_conn(self) -> None:
        pass


Log = list[tuple[str, float, float]]


def _recorder(log: Log, name: str, seconds: float):
    def call(*_: object, **__: object) -> _Response:
        start = time.monotonic()
        time.sleep(seconds)
        log.append((name, start, time.monotonic()))
        return _Response()
    call.__name__ = name
    return call


async def _burst(api: Api, log: Log, creates: int, seconds: float, gap: float, tag: str = "pod") -> None:
    """Pod creates one after another with short gaps between them, as a launch's reconciles make them."""
    for i in range(creates):
        await api.call("create pod", _recorder(log, f"{tag}{i}", seconds), "ns", {})
        await asyncio.sleep(gap)


def _during_burst(what: str, *, creates: int, seconds: float = 0.03, gap: float = 0.0, loops: int = 1,
                  **call_kwargs) -> tuple[Log, float]:
    """`loops` bursts of pod creates, and `what` asked once the first create is in flight: (log, when asked)."""
    log: Log = []

    async def main() -> float:
        api = Api(client.ApiClient(), threads=8)
        try:
            bursts = [asyncio.ensure_future(_burst(api, log, creates, seconds, gap, tag=f"pod{n}-"))
                      for n in range(loops)]
            await asyncio.sleep(0.01)
            asked = time.monotonic()
            await api.call(what, _recorder(log, "other", 0.0), "ns", {}, **call_kwargs)
            await asyncio.gather(*bursts)
            return asked
        finally:
            api.close()

    asked = asyncio.run(main())
    return log, asked


def _start(log: Log, name: str) -> float:
    return next(start for n, start, _ in log if n == name)


def _pods_end(log: Log) -> float:
    return max(end for name, _, end in log if name.startswith("pod"))


@pytest.mark.parametrize("what", sorted(k8s._DEFERRABLE))
def test_bookkeeping_waits_for_a_burst_of_pod_creates_with_short_gaps(what: str) -> None:
    log, _ = _during_burst(what, creates=6, gap=0.02)  # gaps far shorter than the quiet period
    start, pods_end = _start(log, "other"), _pods_end(log)
    assert start >= pods_end + QUIET * 0.9, f"{what} went out between two pod creates of a launch"
    assert start < pods_end + QUIET + 1.0, f"{what} waited for more than the pause it needs"


def test_status_goes_out_after_the_longest_wait_even_if_pods_never_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(k8s, "LOW_PRIORITY_MAX_WAIT", 0.2)
    log, asked = _during_burst("patch trainingjob/status", creates=30)  # ~0.9 s of creates, one after another
    start = _start(log, "other")
    assert asked + 0.2 * 0.9 <= start < _pods_end(log), "the status waited for the whole burst"


def test_status_goes_out_after_the_longest_wait_while_pod_writes_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs' creates overlap, so some pod write is always in flight: the wait ends by its deadline."""
    monkeypatch.setattr(k8s, "LOW_PRIORITY_MAX_WAIT", 0.2)
    log, asked = _during_burst("patch trainingjob/status", creates=15, seconds=0.05, loops=2)
    start = _start(log, "other")
    assert asked + 0.2 * 0.9 <= start < _pods_end(log)


@pytest.mark.parametrize("what,kwargs", [
    ("get trainingjob", {"write": False}), ("create configmap", {}), ("create workload", {}),
    ("patch workload", {}), ("delete pod", {}), ("patch trainingjob/status", {"defer": False}),
])
def test_what_a_job_s_pods_wait_for_is_not_held_back_by_other_jobs_pod_creates(what: str, kwargs: dict) -> None:
    """Reads, the DeepSpeed ConfigMap the pods mount, Kueue's Workload (admission comes first), pod
    deletes, and a status written with `defer=False` go out during another job's burst."""
    log, asked = _during_burst(what, creates=10, **kwargs)
    start = _start(log, "other")
    assert start - asked < 0.25, f"{what} waited {start - asked:.2f}s for other jobs' pod creates"
    assert start < _pods_end(log)


def test_status_goes_out_at_once_when_no_pod_is_being_written() -> None:
    log: Log = []

    async def main() -> float:
        api = Api(client.ApiClient(), threads=2)
        try:
            asked = time.monotonic()
            await api.call("patch trainingjob/status", _recorder(log, "status", 0.0), "ns", {})
            return asked
        finally:
            api.close()

    asked = asyncio.run(main())
    assert log[0][1] - asked < QUIET / 2


def test_the_priority_names_are_the_names_the_calls_use() -> None:
    """A renamed call would silently change its priority: every name in the two sets is one `k8s` passes."""
    calls = "\n".join(line for line in inspect.getsource(k8s).splitlines()
                      if not line.startswith(("_URGENT =", "_DEFERRABLE =")))
    for name in k8s._URGENT | k8s._DEFERRABLE:
        assert f'"{name}"' in calls, f"no call in k8s.py is named {name!r}"


# ------------------------------------------------------------------ a whole plan through k8s.apply

JOB_BODY = {
    "metadata": {"name": "gpt-small", "namespace": "ml", "uid": "0b1c2d3e-aaaa-bbbb-cccc-000000000001",
                 "generation": 1, "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7"},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}}},
}


def _apply_during_burst(plan: Plan) -> tuple[Log, float]:
    """Another job's pod creates run while `plan` is applied for this job (client calls recorded)."""
    log: Log = []
    job = Job.from_storage(copy.deepcopy(JOB_BODY))

    async def main() -> float:
        api = Api(client.ApiClient(), threads=8)
        api.custom = SimpleNamespace(patch_namespaced_custom_object_status=_recorder(log, "status", 0.0))
        api.core = SimpleNamespace(delete_namespaced_pod=_recorder(log, "delete", 0.0))
        try:
            burst = asyncio.ensure_future(_burst(api, log, 10, 0.03, 0.0))
            await asyncio.sleep(0.01)
            asked = time.monotonic()
            await k8s.apply(api, job, "7", plan)
            await burst
            return asked
        finally:
            api.close()

    asked = asyncio.run(main())
    return log, asked


def test_a_status_written_as_the_intent_of_deletes_does_not_wait_and_neither_do_they() -> None:
    plan = Plan(actions=(PatchStatus(Status(phase="Restarting", attempt=1)), DeletePod(name="gpt-small-a1-n0")))
    log, asked = _apply_during_burst(plan)
    assert _start(log, "status") - asked < 0.25
    assert _start(log, "delete") < _pods_end(log), "the restart's deletes waited for another job's launch"


def test_a_status_with_nothing_after_it_is_bookkeeping() -> None:
    log, _ = _apply_during_burst(Plan(actions=(PatchStatus(Status(phase="Running", attempt=1)),)))
    assert _start(log, "status") >= _pods_end(log) + QUIET * 0.9
