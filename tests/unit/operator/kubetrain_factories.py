"""Small factories for planner tests: stored-form jobs and pods, as the API returns them."""

from __future__ import annotations

import datetime as dt
from typing import Any

from kubetrain.api import Job
from kubetrain.observe import NodeView, Observed, PodView

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def iso(seconds: float) -> str:
    return at(seconds).strftime("%Y-%m-%dT%H:%M:%SZ")


def job(*, name: str = "tj", nodes: int = 2, status: dict[str, Any] | None = None,
        run_policy: dict[str, Any] | None = None, spec: dict[str, Any] | None = None,
        deleting: bool = False, generation: int = 1) -> Job:
    body_spec = {"image": "img:1", "nodes": nodes, "trainer": {"builtin": {"task": "regression"}},
                 "runPolicy": {"backoffSeconds": 10, **(run_policy or {})}}
    body_spec.update(spec or {})
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": "uid-1", "generation": generation}
    if deleting:
        meta["deletionTimestamp"] = iso(0)
    return Job.from_storage({"metadata": meta, "spec": body_spec, "status": status or {}})


def started(attempt: int = 1, *, phase: str = "Running", nodes: int = 2, **extra: Any) -> dict[str, Any]:
    """The status of a job whose attempt `attempt` has been created."""
    return {"phase": phase, "attempt": attempt, "nodesTotal": nodes, "startTime": iso(0),
            "observedGeneration": 1, **extra}


def pod_body(*, name: str = "tj", attempt: int = 1, rank: int = 0, phase: str = "Running",
             exit_code: int | None = None, message: str = "", waiting: str | None = None,
             disruption: str | None = None, deleting: bool | str = False, node: str | None = "kwok-0",
             ready: bool | None = None, ready_since: str | None = None, reason: str = "",
             annotations: dict[str, str] | None = None, status_message: str = "",
             waiting_message: str = "details", scheduled: str | None = None,
             unschedulable: str | None = None, exit_reason: str | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if exit_code is not None:
        state["terminated"] = {"exitCode": exit_code, "message": message}
        if exit_reason is not None:
            state["terminated"]["reason"] = exit_reason
    elif waiting:
        state["waiting"] = {"reason": waiting, "message": waiting_message}
    elif phase == "Running":
        state["running"] = {}
    conds = [{"type": "Ready", "status": "True" if (ready if ready is not None else phase == "Running") else "False",
              "lastTransitionTime": ready_since or iso(0)}]
    if disruption:
        conds.append({"type": "DisruptionTarget", "status": "True", "reason": disruption})
    if scheduled:
        conds.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled})
    if unschedulable:  # what kube-scheduler writes on a pod it cannot place
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable})
        node = None
    meta: dict[str, Any] = {"name": f"{name}-a{attempt}-n{rank}", "labels": {
        "kubetrain.io/job-name": name, "kubetrain.io/attempt": str(attempt), "kubetrain.io/node-rank": str(rank)}}
    if deleting:
        meta["deletionTimestamp"] = deleting if isinstance(deleting, str) else iso(0)
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "reason": reason, "message": status_message, "conditions": conds,
                       "containerStatuses": [{"name": "trainer", "state": state}]}}


def pod(**kw: Any) -> PodView:
    view = PodView.from_storage(pod_body(**kw))
    assert view is not None
    return view


def gang(n: int = 2, attempt: int = 1, **kw: Any) -> tuple[PodView, ...]:
    return tuple(pod(attempt=attempt, rank=r, **kw) for r in range(n))


def observed(*pods: PodView, nodes: dict[str, NodeView] | None = None) -> Observed:
    return Observed(pods=tuple(pods), nodes=nodes or {})
