"""A job deleted while its reconcile is in flight leaves nothing behind: its reconcile's errors in a row, their
Repeats entries, its expectations and its body are forgotten with it, not kept for the operator's lifetime (one
set per deleted job, over weeks). The real `Reconciler`; `k8s.apply` stands in for the API server, and the job's
DELETED event arrives while it runs, as from the watch."""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Callable

import pytest
from kubernetes import client

from kubetrain import k8s
from kubetrain.errors import ConflictError, InvalidError, RejectedError, TemporaryError
from kubetrain.k8s import Api
from reconciler_harness import quiet_reconciler
from test_rbac_denials import BODY, KEY


def _said(said: Callable[[dict[str, Any]], Any]) -> None:
    said({**copy.deepcopy(BODY), "metadata": {**BODY["metadata"], "resourceVersion": "9"}})


@pytest.mark.parametrize("then", [
    lambda said: (_ for _ in ()).throw(RejectedError("QuotaExceeded", "create pod train-a1-n0: exceeded quota")),
    lambda said: (_ for _ in ()).throw(TemporaryError("create pod: HTTP 503 Service Unavailable")),
    lambda said: (_ for _ in ()).throw(InvalidError("patch workload: HTTP 404 Not Found", status=404)),
    _said,  # its status was written, and then its pods created
], ids=["quota", "temporary", "refused", "went through"])
def test_a_job_deleted_while_its_reconcile_ran_is_forgotten_whatever_the_reconcile_met(monkeypatch, then) -> None:
    """Before: the DELETED event forgot the job, and the reconcile then noted its refusal, its error or its writes
    (and, after a status write, stored its body again: a deleted job reconciled at every resync)."""
    delays: list[float] = []

    async def main() -> None:
        api = Api(client.ApiClient(), threads=1)
        rec = quiet_reconciler(api, delays)

        async def apply(_api: Any, _job: Any, _rv: str, _plan: Any, said: Any = None) -> None:
            if KEY in rec.jobs:  # once: a refused create's waiting plan is applied after it, the job already gone
                rec.job_event("DELETED", KEY, copy.deepcopy(BODY))
                then(said)

        monkeypatch.setattr(k8s, "apply", apply)
        monkeypatch.setattr(rec, "job_deleted", lambda *_: None)  # Kueue's release: none here
        rec.jobs[KEY] = copy.deepcopy(BODY)
        try:
            await rec.reconcile(KEY)
        finally:
            api.close()
        assert KEY not in rec.jobs
        assert rec.backoff.failures == {} and rec.backoff.rejections == {}
        assert KEY not in rec.backoff.repeats and KEY not in rec.backoff.refusals
        assert rec.expectations == {} and rec._jobs_parsed == {}

    asyncio.run(main())


def test_a_job_deleted_while_a_conflict_re_read_it_is_not_stored_again(monkeypatch) -> None:
    """Before: the status write met a newer job (409), the job's DELETED event came while the re-read was in flight,
    and the re-read's body (older than the deletion) was stored: a deleted job, reconciled at every resync."""
    delays: list[float] = []
    conflicts = [ConflictError("trainingjob ml/train changed since it was read", status=409)]

    async def main() -> None:
        api = Api(client.ApiClient(), threads=1)
        rec = quiet_reconciler(api, delays)

        async def apply(*_: Any, **__: Any) -> None:
            if conflicts:
                raise conflicts.pop()

        async def get_job(namespace: str, name: str) -> dict[str, Any]:
            rec.job_event("DELETED", KEY, copy.deepcopy(BODY))
            return {**copy.deepcopy(BODY), "metadata": {**BODY["metadata"], "resourceVersion": "8"}}

        monkeypatch.setattr(k8s, "apply", apply)
        monkeypatch.setattr(rec.api, "get_job", get_job)
        monkeypatch.setattr(rec, "job_deleted", lambda *_: None)
        rec.jobs[KEY] = copy.deepcopy(BODY)
        try:
            await rec.reconcile(KEY)
        finally:
            api.close()
        assert KEY not in rec.jobs and rec.expectations == {}

    asyncio.run(main())


def test_a_job_re_created_while_the_deleted_ones_reconcile_ran_starts_with_no_errors_in_a_row(monkeypatch) -> None:
    """Before: a job deleted and re-created under the same name (`kubectl delete` then `apply`) while its reconcile
    met a full quota inherited that refusal: the new job's first refusal waited longer (its second in a row) and
    was logged at DEBUG as a repeat of the deleted job's, never warned. The new job is kept, the old one's errors
    in a row are not."""
    delays: list[float] = []
    new = {**copy.deepcopy(BODY), "metadata": {**BODY["metadata"], "uid": "uid-new", "resourceVersion": "20"}}

    async def main() -> None:
        api = Api(client.ApiClient(), threads=1)
        rec = quiet_reconciler(api, delays)

        async def apply(_api: Any, _job: Any, _rv: str, _plan: Any, said: Any = None) -> None:
            if rec.jobs[KEY]["metadata"]["uid"] == "uid-now":  # once: the waiting plan is applied after it
                rec.job_event("DELETED", KEY, copy.deepcopy(BODY))
                rec.job_event("ADDED", KEY, copy.deepcopy(new))
                raise RejectedError("QuotaExceeded", "create pod train-a1-n0: exceeded quota")

        monkeypatch.setattr(k8s, "apply", apply)
        monkeypatch.setattr(rec, "job_deleted", lambda *_: None)
        monkeypatch.setattr(rec, "enqueue", lambda *_, **__: None)  # the new job's own reconcile: not this test's
        rec.jobs[KEY] = copy.deepcopy(BODY)
        try:
            await rec.reconcile(KEY)
        finally:
            api.close()
        assert rec.jobs[KEY]["metadata"]["uid"] == "uid-new"
        assert rec.backoff.failures == {} and rec.backoff.rejections == {} and KEY not in rec.backoff.refusals

    asyncio.run(main())
