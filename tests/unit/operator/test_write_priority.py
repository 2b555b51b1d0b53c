"""Pod writes first: on a big launch the bookkeeping writes (status, events, services) wait until the
pod creates have paused for `QUIET_SECONDS`, at most `LOW_PRIORITY_MAX_WAIT`, so the API server's time
goes to the pods a user waits for. The calls run for real in `Api`'s thread pool; only the client
function is a stand-in (it records when it ran)."""

from __future__ import annotations

import asyncio
import time

import pytest
from kubernetes import client

from kubetrain import k8s
from kubetrain.k8s import Api


class _Response:
    data = b"{}"

    def release_conn(self) -> None:
        pass


def _recorder(log: list[tuple[str, float, float]], name: str, seconds: float):
    def call(*_: object, **__: object) -> _Response:
        start = time.monotonic()
        time.sleep(seconds)
        log.append((name, start, time.monotonic()))
        return _Response()
    call.__name__ = name
    return call


async def _burst(api: Api, log: list, creates: int, seconds: float, gap: float) -> None:
    """Pod creates one after another with short gaps between them, as a launch's reconciles make them."""
    for i in range(creates):
        await api.call("create pod", _recorder(log, f"pod{i}", seconds), "ns", {})
        await asyncio.sleep(gap)


def _run(creates: int, seconds: float, gap: float) -> list[tuple[str, float, float]]:
    log: list[tuple[str, float, float]] = []

    async def main() -> None:
        api = Api(client.ApiClient(), threads=4)
        try:
            burst = asyncio.ensure_future(_burst(api, log, creates, seconds, gap))
            await asyncio.sleep(0.01)  # the first create is in flight
            await api.call("patch trainingjob/status", _recorder(log, "status", 0.0), "ns", {})
            await burst
        finally:
            api.close()

    asyncio.run(main())
    return log


@pytest.fixture(autouse=True)
def _long_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quiet period far longer than the gaps below, so a slow CI machine does not make one."""
    monkeypatch.setattr(k8s, "QUIET_SECONDS", 0.5)


def test_status_waits_for_a_burst_of_pod_creates_with_short_gaps() -> None:
    log = _run(creates=6, seconds=0.03, gap=0.02)  # gaps shorter than QUIET_SECONDS
    pods_end = max(end for name, _, end in log if name.startswith("pod"))
    status_start = next(start for name, start, _ in log if name == "status")
    assert status_start >= pods_end + k8s.QUIET_SECONDS * 0.9, \
        "a status patch went out between two pod creates of a launch"


def test_status_goes_out_after_the_longest_wait_even_if_pods_never_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(k8s, "LOW_PRIORITY_MAX_WAIT", 0.2)
    log = _run(creates=30, seconds=0.03, gap=0.0)  # about 0.9 s of pod creates without a pause
    pods = [(start, end) for name, start, end in log if name.startswith("pod")]
    status_start = next(start for name, start, _ in log if name == "status")
    assert status_start < max(end for _, end in pods), "the status waited for the whole burst"
    assert status_start >= min(start for start, _ in pods) + 0.15


def test_status_goes_out_at_once_when_no_pod_is_being_written() -> None:
    log: list[tuple[str, float, float]] = []

    async def main() -> float:
        api = Api(client.ApiClient(), threads=2)
        try:
            asked = time.monotonic()
            await api.call("patch trainingjob/status", _recorder(log, "status", 0.0), "ns", {})
            return asked
        finally:
            api.close()

    asked = asyncio.run(main())
    assert log[0][1] - asked < k8s.QUIET_SECONDS / 2


@pytest.mark.parametrize("what", ["get trainingjob", "create configmap", "create workload"])
def test_what_a_job_s_pods_wait_for_is_not_held_back_by_other_jobs_pod_creates(what: str) -> None:
    """A read, the DeepSpeed ConfigMap (mounted by the pods) and Kueue's Workload (admission comes first)
    go out during a launch's burst: holding them would hold that job's own pod creates."""
    log: list[tuple[str, float, float]] = []

    async def main() -> float:
        api = Api(client.ApiClient(), threads=4)
        try:
            burst = asyncio.ensure_future(_burst(api, log, 10, 0.03, 0.0))
            await asyncio.sleep(0.01)
            asked = time.monotonic()
            await api.call(what, _recorder(log, "other", 0.0), "ns", {}, write=not what.startswith("get"))
            await burst
            return asked
        finally:
            api.close()

    asked = asyncio.run(main())
    other_start = next(start for name, start, _ in log if name == "other")
    assert other_start - asked < 0.25, f"{what} waited {other_start - asked:.2f}s for other jobs' pod creates"
    assert other_start < max(end for name, _, end in log if name.startswith("pod"))
