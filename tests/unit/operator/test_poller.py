"""The progress poller reads rank 0's /progress over real HTTP (a local aiohttp server stands in
for the launcher: the boundary is faked, the poller is not), with short timeouts and a schedule
of at most one read per job per interval; the operator's settings for it are validated."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from kubetrain.config import ConfigError, Settings
from kubetrain.observe import PodView
from kubetrain.poller import ProgressPoller, Target, select_targets
from test_progress import record


def _view(**kw) -> PodView:
    base = dict(name="tj-a1-n0", attempt=1, rank=0, phase="Running", pod_ip="10.0.0.7", metrics_port=9410)
    return PodView(**{**base, **kw})


def _body(phase: str = "Running", attempt: int = 1) -> dict:
    return {"metadata": {"name": "tj", "namespace": "ns", "uid": "u"}, "status": {"phase": phase, "attempt": attempt}}


@pytest.mark.parametrize("body, pods, expected", [
    (_body(), [("u", _view())], [("http://10.0.0.7:9410/progress", None)]),
    (_body(), [("u", _view(pod_ip="fd00::7"))], [("http://[fd00::7]:9410/progress", None)]),
    (_body(phase="Pending"), [("u", _view())], []),
    (_body(), [("u", _view(rank=1, name="tj-a1-n1"))], []),
    (_body(), [("other-uid", _view())], []),
    (_body(attempt=2), [("u", _view())], []),
    (_body(), [("u", _view(phase="Pending"))], []),
    (_body(), [("u", _view(metrics_port=None))], [("", "NoMetricsPort")]),
    (_body(), [("u", _view(pod_ip=None))], [("", "NoPodIP")]),
])
def test_only_a_running_jobs_current_rank_0_is_read(body, pods, expected) -> None:
    targets = select_targets([(("ns", "tj"), body)], lambda key: pods)
    assert [(t.url, t.problem[0] if t.problem else None) for t in targets] == expected


def test_the_test_only_url_template_replaces_the_pod_address() -> None:
    [t] = select_targets([(("ns", "tj"), _body())], lambda key: [("u", _view(pod_ip=None))],
                         template="http://127.0.0.1:1234/{namespace}/{pod}")
    assert t.url == "http://127.0.0.1:1234/ns/tj-a1-n0" and t.problem is None


async def _serve(handler) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("answer, reason", [
    (lambda: web.json_response(record()), ""),
    (lambda: web.Response(status=404), "HTTPError"),
    (lambda: web.json_response(record(loss="low")), "InvalidRecord"),
    (lambda: web.Response(text="x" * 70000), "InvalidRecord"),
])
def test_a_read_gives_a_report_or_says_why_not(answer, reason) -> None:
    async def main():
        async def handler(request):
            return answer()
        runner, port = await _serve(handler)
        poller = ProgressPoller(targets=list, deliver=lambda *_: None, interval=30, timeout=2, concurrency=4)
        await poller.open()
        try:
            return await poller.read(Target(("ns", "tj"), 1, "tj-a1-n0", url=f"http://127.0.0.1:{port}/progress"))
        finally:
            await poller.close()
            await runner.cleanup()
    obs = _run(main())
    assert obs.reason == reason, obs.message
    assert (obs.report is not None) == (reason == "")


def test_a_pod_that_does_not_answer_times_out_without_blocking_the_loop() -> None:
    async def main():
        release = asyncio.Event()

        async def silent(request):
            await asyncio.wait_for(release.wait(), 30)
            return web.Response()
        runner, port = await _serve(silent)
        poller = ProgressPoller(targets=list, deliver=lambda *_: None, interval=30, timeout=0.3, concurrency=4)
        await poller.open()
        ticks = 0

        async def heartbeat():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        beat = asyncio.get_running_loop().create_task(heartbeat())
        try:
            return await poller.read(Target(("ns", "tj"), 1, "p", url=f"http://127.0.0.1:{port}/progress")), ticks
        finally:
            beat.cancel()
            release.set()
            await poller.close()
            await runner.cleanup()
    obs, ticks = _run(main())
    assert obs.reason == "Timeout" and "0.3s" in obs.message
    assert ticks > 3, "the event loop kept running while the read waited"


def test_nothing_listening_is_connection_failed() -> None:
    async def main():
        poller = ProgressPoller(targets=list, deliver=lambda *_: None, interval=30, timeout=2, concurrency=4)
        await poller.open()
        try:
            return await poller.read(Target(("ns", "tj"), 1, "p", url="http://127.0.0.1:9/progress"))
        finally:
            await poller.close()
    assert _run(main()).reason == "ConnectionFailed"


def test_each_job_is_read_at_most_once_per_interval_at_its_own_offset() -> None:
    """Drive the schedule with a synthetic clock over 10 intervals: 50 jobs, reads counted by the server."""
    jobs = [(("ns", f"j{i}"), {**_body(), "metadata": {"name": f"j{i}", "namespace": "ns", "uid": "u"}})
            for i in range(50)]

    async def main():
        reads: dict[str, list[float]] = {}
        clock = [0.0]

        async def handler(request):
            reads.setdefault(request.match_info["tail"], []).append(clock[0])
            return web.json_response(record())
        runner, port = await _serve(handler)
        template = f"http://127.0.0.1:{port}/{{job}}"
        delivered = []
        poller = ProgressPoller(
            targets=lambda: select_targets(jobs, lambda key: [("u", _view(name=f"{key[1]}-a1-n0"))], template=template),
            deliver=lambda key, obs: delivered.append((key, obs)), interval=10, timeout=2, concurrency=8)
        await poller.open()
        try:
            while clock[0] < 100:
                poller.poll_due(clock[0])
                # The synthetic clock moves on only once the reads it started have landed: how long a read
                # takes in real time (a loaded CI machine) must not shift what the server notes.
                while poller._tasks:
                    await asyncio.sleep(0.005)
                clock[0] += 0.5
            while poller._tasks:
                await asyncio.sleep(0.02)
        finally:
            await poller.close()
            await runner.cleanup()
        return reads, delivered
    reads, delivered = _run(main())
    assert len(reads) == 50 and len(delivered) == sum(map(len, reads.values()))
    for times in reads.values():
        # 100 s of the synthetic clock (9 reads for a job whose offset is near the interval's end),
        # exactly one interval apart
        assert len(times) in (9, 10) and all(b - a == 10 for a, b in zip(times, times[1:])), times
    firsts = sorted(t[0] for t in reads.values())
    assert firsts[0] < 3 and firsts[-1] > 7, "first reads spread over the interval, not one burst"
    assert all(obs.report is not None for _, obs in delivered)


@pytest.mark.parametrize("env, setting", [
    ({"KUBETRAIN_PROGRESS_INTERVAL_SECONDS": "0.5"}, "KUBETRAIN_PROGRESS_INTERVAL_SECONDS"),
    ({"KUBETRAIN_PROGRESS_INTERVAL_SECONDS": "4000"}, "KUBETRAIN_PROGRESS_INTERVAL_SECONDS"),
    ({"KUBETRAIN_PROGRESS_INTERVAL_SECONDS": "10", "KUBETRAIN_PROGRESS_TIMEOUT_SECONDS": "6"},
     "KUBETRAIN_PROGRESS_TIMEOUT_SECONDS"),
    ({"KUBETRAIN_PROGRESS_CONCURRENCY": "0"}, "KUBETRAIN_PROGRESS_CONCURRENCY"),
    ({"KUBETRAIN_METRICS_PORT": "70000"}, "KUBETRAIN_METRICS_PORT"),
    ({"KUBETRAIN_METRICS_PORT": "9400.9"}, "KUBETRAIN_METRICS_PORT"),
    ({"KUBETRAIN_PROGRESS_CONCURRENCY": "2.5"}, "KUBETRAIN_PROGRESS_CONCURRENCY"),
    ({"KUBETRAIN_MAX_CONCURRENT_RECONCILES": "10.5"}, "KUBETRAIN_MAX_CONCURRENT_RECONCILES"),
    ({"KUBETRAIN_API_THREADS": "4.01"}, "KUBETRAIN_API_THREADS"),
    ({"KUBETRAIN_TEST_PROGRESS_URL": "127.0.0.1:80/{pod}"}, "KUBETRAIN_TEST_PROGRESS_URL"),
])
def test_bad_settings_name_the_setting(env, setting) -> None:
    with pytest.raises(ConfigError) as err:
        Settings.from_env(env)
    assert err.value.setting == setting


def test_settings_defaults() -> None:
    s = Settings.from_env({})
    assert (s.metrics_port, s.progress_interval_seconds, s.progress_timeout_seconds, s.progress_concurrency,
            s.test_progress_url) == (0, 30.0, 3.0, 16, "")
    assert Settings.from_env({"KUBETRAIN_PROGRESS_INTERVAL_SECONDS": "0"}).progress_interval_seconds == 0
    assert Settings.from_env({"KUBETRAIN_METRICS_PORT": "9400.0", "KUBETRAIN_API_THREADS": "8"}).metrics_port == 9400
    assert json.dumps(record())  # the shared record factory stays JSON
