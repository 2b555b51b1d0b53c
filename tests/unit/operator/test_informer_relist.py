"""A relist replaces the informer's view: what vanished meanwhile comes out as DELETED."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.informer import JobInformer, PodInformer


def _pod(ns: str, name: str, job: str) -> dict:
    return {"metadata": {"namespace": ns, "name": name, "labels": {"kubetrain.io/job-name": job}}, "status": {}}


def test_relist_reports_vanished_pods_as_deleted_with_their_labels_and_sets_synced():
    events: list[tuple[str, str, str]] = []
    informer = PodInformer(client.ApiClient(), namespaces=("a", "b"), label_selector="x=y",
                           on_event=lambda kind, obj: events.append(
                               (kind, obj["metadata"]["name"], obj["metadata"]["labels"]["kubetrain.io/job-name"])))
    informer._replace("a", [_pod("a", "p0", "j"), _pod("a", "p1", "j")])
    assert not informer.synced.is_set()  # namespace b has not listed yet
    informer._replace("b", [_pod("b", "q0", "k")])
    assert informer.synced.is_set()
    events.clear()

    informer._deliver("DELETED", "a", _pod("a", "p0", "j"))
    informer._replace("a", [_pod("a", "p2", "j")])  # after a 410: p1 went away while we were not looking

    assert events == [("DELETED", "p0", "j"), ("DELETED", "p1", "j"), ("MODIFIED", "p2", "j")]
    informer._replace("b", [])
    assert events[-1] == ("DELETED", "q0", "k")


def test_a_training_job_that_vanished_between_lists_comes_out_deleted_with_its_uid_and_labels():
    """The reconciler releases a deleted Kueue job's Workload by the job's uid and queue label: a DELETED made up
    after a relist must carry both, as the watch's own DELETED does."""
    events: list[tuple[str, dict]] = []
    informer = JobInformer(client.ApiClient(), namespaces=("a",), on_event=lambda kind, obj: events.append((kind, obj)))
    job = {"metadata": {"namespace": "a", "name": "j", "uid": "u-1",
                        "labels": {"kueue.x-k8s.io/queue-name": "q"}}, "spec": {}}
    informer._replace("a", [job])
    assert informer.synced.is_set() and events == [("MODIFIED", job)]
    informer._replace("a", [])  # deleted while the watch was down
    kind, obj = events[-1]
    assert kind == "DELETED"
    assert obj["metadata"] == {"namespace": "a", "name": "j", "uid": "u-1",
                               "labels": {"kueue.x-k8s.io/queue-name": "q"}}


def test_a_training_job_deleted_and_re_created_between_lists_comes_out_deleted_then_new():
    """The old incarnation must be forgotten (and its Kueue Workload released) before the new one is seen."""
    events: list[tuple[str, str]] = []
    informer = JobInformer(client.ApiClient(), namespaces=("a",),
                           on_event=lambda kind, obj: events.append((kind, obj["metadata"]["uid"])))
    informer._replace("a", [{"metadata": {"namespace": "a", "name": "j", "uid": "u-1"}}])
    informer._replace("a", [{"metadata": {"namespace": "a", "name": "j", "uid": "u-2"}}])
    assert events == [("MODIFIED", "u-1"), ("DELETED", "u-1"), ("MODIFIED", "u-2")]


def test_a_handler_error_on_one_listed_object_does_not_lose_the_rest_of_the_list():
    seen: list[str] = []

    def on_event(kind: str, obj: dict) -> None:
        if obj["metadata"]["name"] == "bad":
            raise ValueError("a handler bug")
        seen.append(obj["metadata"]["name"])

    informer = JobInformer(client.ApiClient(), namespaces=("a",), on_event=on_event)
    informer._replace("a", [{"metadata": {"namespace": "a", "name": n, "uid": n}} for n in ("x", "bad", "y")])
    assert seen == ["x", "y"] and informer.synced.is_set()


def test_nothing_is_delivered_after_stop():
    """Events already queued by a reader must not reach a reconciler that is shutting down."""
    events: list[str] = []
    informer = JobInformer(client.ApiClient(), namespaces=("a",), on_event=lambda kind, obj: events.append(kind))
    informer._post("ADDED", "a", {"metadata": {"namespace": "a", "name": "j", "uid": "u"}})
    informer.stop()
    informer._drain()
    assert events == []


class _Response:
    """What the client returns with _preload_content=False: `.data` for a list, lines for a watch."""

    def __init__(self, *, data: bytes = b"", lines: tuple[bytes, ...] = ()) -> None:
        self.data, self._lines = data, lines

    def __iter__(self):
        return iter(self._lines)

    def release_conn(self) -> None:
        pass


def test_a_410_in_the_watch_stream_relists_and_reports_the_pods_that_vanished(caplog):
    def listing(rv: str, *names: str) -> _Response:
        return _Response(data=json.dumps({"metadata": {"resourceVersion": rv},
                                          "items": [_pod("a", n, "j") for n in names]}).encode())

    expired = json.dumps({"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}).encode()
    caplog.set_level(logging.INFO, logger="kubetrain")
    events: list[tuple[str, str]] = []
    calls: list[dict] = []

    async def main() -> None:
        informer = PodInformer(client.ApiClient(), namespaces=("a",), label_selector="x=y",
                               on_event=lambda kind, obj: events.append((kind, obj["metadata"]["name"])))
        responses = [listing("10", "p0", "p1"), _Response(lines=(expired + b"\n",)), listing("20", "p1"),
                     _Response()]

        def fake_call(scope, **kwargs):
            if not responses:  # the scripted responses are spent: empty watches until stopped
                informer._stop.wait(0.05)
                return _Response()
            calls.append(kwargs)
            return responses.pop(0)

        informer._call = fake_call
        informer.start()
        deadline = time.monotonic() + 10
        try:
            while len(events) < 4:
                assert time.monotonic() < deadline, events
                await asyncio.sleep(0.01)
        finally:
            informer.stop()

    asyncio.run(main())
    assert events == [("MODIFIED", "p0"), ("MODIFIED", "p1"), ("DELETED", "p0"), ("MODIFIED", "p1")]
    assert calls[1]["resource_version"] == "10" and calls[1]["watch"] is True
    assert "watch" not in calls[2]  # a list again, not a watch from the expired version
    assert calls[3]["resource_version"] == "20"
    relists = [r for r in caplog.records if "410" in r.getMessage()]
    assert len(relists) == 1 and relists[0].levelname == "INFO" and "(a)" in relists[0].getMessage()


def test_while_a_namespace_s_watch_is_down_its_store_is_not_current_and_it_is_again_once_watching():
    """A pod created while the pod watch was down (API server errors, a dropped connection) never reached the
    store; once the reconciler's expectation of it expired (60 s) it read as deleted by someone else and the gang
    was restarted. `watching(namespace)` is clear while that namespace's watch is down, and set again once it
    has listed again, with what happened meanwhile; other namespaces go on."""
    def listing(ns: str, *more: str) -> _Response:
        return _Response(data=json.dumps({"metadata": {"resourceVersion": str(10 + len(more))},
                                          "items": [_pod(ns, n, "j") for n in (f"{ns}0", *more)]}).encode())

    seen: list[tuple[str, bool]] = []

    async def main() -> None:
        informer = PodInformer(client.ApiClient(), namespaces=("a", "b"), label_selector="x=y",
                               on_event=lambda kind, obj: seen.append((obj["metadata"]["name"],
                                                                       informer.watching("a").is_set())))
        fail, back = asyncio.Event(), asyncio.Event()
        scripts: dict[str, list] = {
            "a": [listing("a"), fail, ApiException(status=500, reason="Internal Server Error"), back,
                  listing("a", "a1")],  # a1 was created while the watch was down
            "b": [listing("b")]}
        loop = asyncio.get_running_loop()

        def fake_call(scope, **kwargs):
            script = scripts[scope]
            if not script:
                informer._stop.wait(0.05)
                return _Response()
            step = script.pop(0)
            if isinstance(step, asyncio.Event):  # the next answer waits for the test
                asyncio.run_coroutine_threadsafe(step.wait(), loop).result()
                step = script.pop(0)
            if isinstance(step, Exception):
                raise step
            return step

        informer._call = fake_call
        informer._pause = lambda backoff: backoff  # no wait between tries
        informer.start()
        try:
            await asyncio.wait_for(informer.synced.wait(), 5)
            assert informer.watching("a").is_set() and informer.watching("b").is_set()
            fail.set()
            deadline = time.monotonic() + 5
            while informer.watching("a").is_set():  # a's watch failed: its store is stale
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert informer.watching("b").is_set() and informer.synced.is_set()
            back.set()
            await asyncio.wait_for(informer.watching("a").wait(), 5)  # listed again
            assert ("a1", False) in seen  # in the store before a's jobs may be planned again
        finally:
            informer.stop()

    asyncio.run(main())
    assert sorted(seen) == [("a0", False), ("a0", False), ("a1", False), ("b0", True)]


def test_a_job_is_not_reconciled_while_the_pod_watch_of_its_namespace_is_down():
    from kubetrain.config import Settings
    from kubetrain.reconciler import Reconciler

    async def main() -> list[tuple[str, str]]:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type]  (no API call: reconcile stubbed)
        runs: list[tuple[str, str]] = []

        async def reconcile(key: tuple[str, str]) -> None:
            runs.append(key)

        rec.reconcile = reconcile  # type: ignore[method-assign]
        watching = {"a": asyncio.Event(), "b": asyncio.Event()}
        watching["b"].set()
        rec.pods_synced.set()
        rec.pods_watching = watching.__getitem__
        rec.enqueue(("a", "j"))
        rec.enqueue(("b", "k"))
        await asyncio.sleep(0.05)
        assert runs == [("b", "k")]
        watching["a"].set()
        await asyncio.sleep(0.05)
        return runs

    assert asyncio.run(main()) == [("b", "k"), ("a", "j")]


def test_a_watch_that_ends_at_once_with_nothing_in_it_backs_off():
    """A server or proxy that closes every watch at once (200, no events) met a loop of watch requests as fast as
    they could be sent (some 800,000 a second against this stand-in); each one now backs off as an error does."""
    listing = _Response(data=json.dumps({"metadata": {"resourceVersion": "10"}, "items": []}).encode())
    watches: list[str] = []
    pauses: list[float] = []

    async def main() -> None:
        informer = PodInformer(client.ApiClient(), namespaces=("a",), label_selector="x=y",
                               on_event=lambda kind, obj: None)

        def fake_call(scope, **kwargs):
            if "watch" not in kwargs:
                return listing
            watches.append(kwargs["resource_version"])
            return _Response()

        def pause(backoff: float) -> float:
            pauses.append(backoff)
            if len(pauses) >= 4:
                informer.stop()
            return min(30.0, backoff * 2)

        informer._call, informer._pause = fake_call, pause
        informer.start()
        deadline = time.monotonic() + 5
        while len(pauses) < 4:
            assert time.monotonic() < deadline, len(watches)
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert pauses == [1.0, 2.0, 4.0, 8.0] and watches == ["10"] * 4


class _Recorded(asyncio.Event):
    """An informer's `watching` event that notes, each time it is set, the pods its handler has seen by then."""

    def __init__(self, store: set[str]) -> None:
        super().__init__()
        self.store, self.sets = store, []

    def set(self) -> None:
        self.sets.append(frozenset(self.store))
        super().set()


def test_a_namespace_is_current_again_only_once_what_happened_while_its_watch_was_down_is_in():
    """A pod created while the watch was down (a1) reached the store only after the watch was back; the namespace
    read as current as soon as the new watch answered, before a1 came through it, so its jobs were planned from
    the stale store first (a1's expectation expired: read as deleted by someone else, the gang restarted)."""
    store: set[str] = set()
    release = threading.Event()
    added = json.dumps({"type": "ADDED", "object": {"metadata": {**_pod("a", "a1", "j")["metadata"],
                                                                 "resourceVersion": "11"}}}).encode()

    class _Stream(_Response):  # what happened meanwhile comes a moment after the answer's headers
        def __init__(self, stop: threading.Event, *lines: bytes) -> None:
            super().__init__(lines=lines)
            self.stop = stop

        def __iter__(self):
            release.wait(5)
            yield from self._lines
            self.stop.wait(5)

    async def main() -> list[frozenset[str]]:
        informer = PodInformer(client.ApiClient(), namespaces=("a",), label_selector="x=y",
                               on_event=lambda kind, obj: (store.discard if kind == "DELETED" else store.add)(
                                   obj["metadata"]["name"]))
        watching = informer._watching["a"] = _Recorded(store)
        watches: list[str] = []
        pods = ["a0"]

        def fake_call(scope, **kwargs):
            if "watch" not in kwargs:
                return _Response(data=json.dumps({"metadata": {"resourceVersion": str(9 + len(pods))},
                                                  "items": [_pod("a", n, "j") for n in pods]}).encode())
            watches.append(kwargs["resource_version"])
            if len(watches) == 1:
                pods.append("a1")  # created while the watch is down
                raise ApiException(status=500, reason="Internal Server Error")
            return _Stream(informer._stop, *((added + b"\n",) if kwargs["resource_version"] == "10" else ()))

        informer._call = fake_call
        informer._pause = lambda backoff: backoff
        informer.start()
        try:
            deadline = time.monotonic() + 5
            while len(watching.sets) < 2:
                assert time.monotonic() < deadline, watching.sets
                await asyncio.sleep(0.01)
        finally:
            release.set()
            informer.stop()
        return watching.sets

    sets = asyncio.run(main())
    assert sets[0] == {"a0"}
    assert sets[1] == {"a0", "a1"}, "current again before the pod created meanwhile was in the store"


def test_a_watch_that_fails_right_after_a_relist_leaves_the_namespace_not_current():
    """After a 410 and its relist, a watch that could not be opened again (the API server going away) left the
    namespace marked current while no event reached it."""
    expired = json.dumps({"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}).encode()
    paused, hold = threading.Event(), threading.Event()

    async def main() -> bool:
        informer = PodInformer(client.ApiClient(), namespaces=("a",), label_selector="x=y",
                               on_event=lambda kind, obj: None)
        watches: list[str] = []

        def fake_call(scope, **kwargs):
            if "watch" not in kwargs:
                return _Response(data=json.dumps({"metadata": {"resourceVersion": "10"}, "items": []}).encode())
            watches.append(kwargs["resource_version"])
            if len(watches) == 1:
                return _Response(lines=(expired + b"\n",))
            if len(watches) == 2:
                raise ConnectionRefusedError("connection refused")
            informer._stop.wait(5)
            return _Response()

        def pause(backoff: float) -> float:
            paused.set()
            hold.wait(5)
            return backoff

        informer._call, informer._pause = fake_call, pause
        informer.start()
        try:
            await asyncio.wait_for(informer.synced.wait(), 5)
            deadline = time.monotonic() + 5
            while not paused.is_set():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # what the reader posted before its pause is handled
            return informer.watching("a").is_set()
        finally:
            informer.stop()
            hold.set()

    assert asyncio.run(main()) is False


def test_a_watch_down_for_minutes_is_logged_at_error_once_per_outage(monkeypatch, caplog):
    """A namespace whose watch never comes back (the operator's RoleBinding there removed: 403 forever) holds its
    jobs unreconciled; a WARNING every 30 s was all the log said. After DOWN_ERROR_SECONDS: one ERROR per outage."""
    import kubetrain.informer as informer_module

    clock = [1000.0]
    monkeypatch.setattr(informer_module.time, "monotonic", lambda: clock[0])
    informer = PodInformer(client.ApiClient(), namespaces=("a",), label_selector="x=y", on_event=lambda k, o: None)
    informer._post = lambda *args: None
    with caplog.at_level(logging.ERROR, logger=informer_module.log.name):
        informer._broken("a")
        clock[0] += informer_module.DOWN_ERROR_SECONDS - 1
        informer._broken("a")
        assert not caplog.records
        clock[0] += 2
        informer._broken("a")
        informer._broken("a")
        assert len(caplog.records) == 1 and "has been down for" in caplog.text and "(a)" in caplog.text
        informer._down.discard("a")  # listed again (as `_list` does) and watching (as `_watch` does once it
        informer._watch_up("a")  # delivers), then a new outage counts afresh
        informer._broken("a")
        clock[0] += informer_module.DOWN_ERROR_SECONDS
        informer._broken("a")
        assert len(caplog.records) == 2


class _QuietThenBroken:
    """A watch that stays open `seconds` (on the test's clock) with nothing in it, then breaks."""

    def __init__(self, clock: list[float], seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def __iter__(self):
        self.clock[0] += self.seconds
        raise ConnectionResetError("connection reset by peer")
        yield  # a generator

    def release_conn(self) -> None:
        pass


@pytest.mark.parametrize("recovered", ["delivers an event", "stays open, quiet"])
def test_a_namespace_that_lists_but_whose_watch_never_comes_up_is_logged_at_error(monkeypatch, caplog, recovered):
    """RBAC that grants list but not watch there (or a proxy refusing watches): each relist worked, so each one
    restarted the count, and the namespace stayed unreconciled for good without the ERROR. The outage ends when
    a watch is up (it delivers, or stays open), not when a list works; the next outage is counted afresh."""
    import kubetrain.informer as informer_module

    clock = [1000.0]
    monkeypatch.setattr(informer_module.time, "monotonic", lambda: clock[0])
    informer = PodInformer(client.ApiClient(), namespaces=("a",), label_selector="x=y", on_event=lambda k, o: None)
    informer._post = lambda *args: None
    event = json.dumps({"type": "ADDED", "object": _pod("a", "p", "j")}).encode()
    watches = [0]

    def fake_call(scope, **kwargs):
        if "watch" not in kwargs:
            return _Response(data=json.dumps({"metadata": {"resourceVersion": "10"}, "items": []}).encode())
        watches[0] += 1
        if watches[0] == 12:  # fixed after some 5.5 minutes: the watch is up a while, then breaks
            if recovered == "delivers an event":
                return _Response(lines=(event + b"\n", b"{not json"))
            return _QuietThenBroken(clock, 40.0)
        raise ApiException(status=403, reason="Forbidden")  # at once, as RBAC refuses

    def pause(backoff: float) -> float:
        clock[0] += 30.0
        if watches[0] >= 25:
            informer._stop.set()
        return backoff

    informer._call, informer._pause = fake_call, pause
    with caplog.at_level(logging.ERROR, logger=informer_module.log.name):
        informer._run("a")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, [r.getMessage() for r in errors]  # one per outage: before the fix, none
    assert all("has been down for" in r.getMessage() for r in errors)


@pytest.mark.parametrize("refusal", [(403, "Forbidden"), (504, "Gateway Timeout"), (429, "Too Many Requests")],
                         ids=["RBAC, slow to answer", "a proxy timing the watch out", "APF, after queueing"])
def test_a_watch_refused_slowly_is_never_up_and_its_outage_is_logged_at_error(monkeypatch, caplog, refusal):
    """A watch request that is answered with an error status never opened, however long the answer took: a proxy
    that holds watches until its own timeout and then answers 504, an API server that queues the request (APF)
    and then answers 429, or RBAC's 403 on a loaded API server. Counting the wait as a quiet watch that was up
    restarted the outage on every try, and the namespace stayed unreconciled behind WARNINGs only."""
    import kubetrain.informer as informer_module

    clock = [1000.0]
    monkeypatch.setattr(informer_module.time, "monotonic", lambda: clock[0])
    informer = PodInformer(client.ApiClient(), namespaces=("a",), label_selector="x=y", on_event=lambda k, o: None)
    informer._post = lambda *args: None
    watches = [0]

    def fake_call(scope, **kwargs):
        if "watch" not in kwargs:
            return _Response(data=json.dumps({"metadata": {"resourceVersion": "10"}, "items": []}).encode())
        watches[0] += 1
        clock[0] += 15.0  # the answer takes a while
        raise ApiException(status=refusal[0], reason=refusal[1])

    def pause(backoff: float) -> float:
        clock[0] += 30.0
        if watches[0] >= 15:  # 15 tries, 45 s apart: past DOWN_ERROR_SECONDS
            informer._stop.set()
        return backoff

    informer._call, informer._pause = fake_call, pause
    with caplog.at_level(logging.ERROR, logger=informer_module.log.name):
        informer._run("a")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "has been down for" in errors[0], errors


def test_a_workload_watch_down_for_minutes_says_what_it_holds_up(monkeypatch, caplog):
    """Before: 'Workload watch (a) has been down for 300s: jobs there are not reconciled until it is back', though
    queued jobs are reconciled without it (at the resync, slower); what waits is a deleted job's Workload."""
    import kubetrain.informer as informer_module
    from kubetrain.informer import WorkloadInformer

    clock = [1000.0]
    monkeypatch.setattr(informer_module.time, "monotonic", lambda: clock[0])
    informer = WorkloadInformer(client.ApiClient(), namespaces=("a",), on_event=lambda k, o: None)
    informer._post = lambda *args: None
    with caplog.at_level(logging.ERROR, logger=informer_module.log.name):
        informer._broken("a")
        clock[0] += informer_module.DOWN_ERROR_SECONDS + 1
        informer._broken("a")
    (error,) = [r.getMessage() for r in caplog.records]
    assert error.startswith("Workload watch (a) has been down for 301s: Kueue's decisions reach the queued jobs")
    assert "not reconciled" not in error and "stays Terminating" in error
