"""The Kueue integration's calls to the Kubernetes API (issue 14): reads of Kueue's objects and the writes of a job's
Workload.

`k8s.Api` carries them (its thread pool, its write counter, the permissions ledger) and `k8s.apply` sends a
plan's `CreateWorkload` and `PatchWorkload` here; what each answer means for a Workload is decided here, once
(AlreadyExists on the create is success, NotFound on a patch is nothing left to do, a conflict makes the caller
plan again). The bodies themselves come from the pure `kueue.py`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from kubetrain import kueue
from kubetrain.actions import CreateWorkload, PatchWorkload
from kubetrain.api import Job
from kubetrain.errors import (
    ConflictError, ForbiddenError, InvalidError, NotFoundError, PermanentError, RefusedError, RejectedError,
    TemporaryError, WorkloadRejectedError, classify_unavailable, retry_later,
)

GROUP, VERSION, WORKLOADS = kueue.GROUP, kueue.VERSION, kueue.PLURAL
RESOURCE_FLAVORS, WORKLOAD_PRIORITY_CLASSES = "resourceflavors", "workloadpriorityclasses"
MERGE_PATCH = "application/merge-patch+json"


class Caller(Protocol):
    """What these calls need of `k8s.Api`."""

    custom: Any
    scheduling: Any

    async def call(self, what: str, fn: Callable[..., Any], *args: Any, write: bool = True,
                   defer: bool | None = None, namespace: str = "", **kwargs: Any) -> Any: ...


# ------------------------------------------------------------- reads

async def get_workload(api: Caller, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
    """(Kueue's Workload API is served, the Workload or None)."""
    try:
        return True, await api.call("get workload", api.custom.get_namespaced_custom_object, GROUP,
                                    VERSION, namespace, WORKLOADS, name, write=False, namespace=namespace)
    except NotFoundError as exc:
        return not _not_served(exc), None
    except RefusedError as exc:
        raise retry_later(exc, f"get workload {namespace}/{name}: HTTP {exc.status}") from None


async def workloads_served(api: Caller, namespace: str) -> bool:
    """Whether Kueue's Workload API is served: a list of at most one Workload in `namespace` ("": cluster-wide)."""
    try:
        if namespace:
            await api.call("list workloads", api.custom.list_namespaced_custom_object, GROUP, VERSION, namespace,
                           WORKLOADS, limit=1, write=False, namespace=namespace)
        else:
            await api.call("list workloads", api.custom.list_cluster_custom_object, GROUP, VERSION, WORKLOADS,
                           limit=1, write=False)
    except RefusedError as exc:
        if isinstance(exc, NotFoundError) and _not_served(exc):
            return False
        raise retry_later(exc, f"list workloads: HTTP {exc.status} {exc.api_message}") from None
    return True


def _not_served(exc: NotFoundError) -> bool:
    """A missing object names itself; a missing resource type ("the server could not find the requested
    resource") means Kueue's CRDs are not installed."""
    return "could not find the requested resource" in exc.api_message


async def priority_value(api: Caller, ref: kueue.PriorityRef) -> tuple[int | None, str]:
    """(The value of a PriorityClass or WorkloadPriorityClass, why it could not be read)."""
    try:
        if ref.kind == kueue.WORKLOAD_PRIORITY_KIND:
            body = await api.call("get workloadpriorityclass", api.custom.get_cluster_custom_object,
                                  GROUP, VERSION, WORKLOAD_PRIORITY_CLASSES, ref.name, write=False)
        else:
            body = await api.call("get priorityclass", api.scheduling.read_priority_class, ref.name,
                                  write=False)
    except NotFoundError:
        return None, f"{ref.kind} {ref.name!r} does not exist"
    except RefusedError as exc:
        raise retry_later(exc, f"get {ref.kind} {ref.name}: HTTP {exc.status}") from None
    value = (body or {}).get("value")
    return (value, "") if isinstance(value, int) else (None, f"{ref.kind} {ref.name!r} has no value")


async def flavor_spec(api: Caller, name: str) -> dict[str, Any] | None:
    """A ResourceFlavor's spec (nodeLabels, tolerations); None when it does not exist."""
    try:
        body = await api.call("get resourceflavor", api.custom.get_cluster_custom_object, GROUP,
                              VERSION, RESOURCE_FLAVORS, name, write=False)
    except NotFoundError:
        return None
    except RefusedError as exc:
        raise retry_later(exc, f"get resourceflavor {name}: HTTP {exc.status}") from None
    return dict((body or {}).get("spec") or {})


# ------------------------------------------------------------- writes

async def create_workload(api: Caller, job: Job, action: CreateWorkload) -> None:
    try:
        body = kueue.build_workload(job, labels=job.labels, priority=action.priority)
    except kueue.KueueError as exc:
        raise PermanentError("InvalidQueueName", str(exc)) from None
    try:
        await api.call("create workload", api.custom.create_namespaced_custom_object, GROUP, VERSION,
                       job.namespace, WORKLOADS, body, namespace=job.namespace)
    except ConflictError:
        return  # AlreadyExists: one Workload per job, by name
    except InvalidError as exc:
        raise PermanentError("InvalidWorkload", f"create workload {body['metadata']['name']}: {exc.api_message}") \
            from None
    except ForbiddenError as exc:
        if exc.webhook_denied:  # Kueue's validation or a policy engine: the job's Workload is refused as it is
            raise PermanentError("WorkloadRejected", f"create workload {body['metadata']['name']}: "
                                                     f"{exc.api_message}") from None
        raise retry_later(exc, f"create workload: HTTP {exc.status} {exc.api_message}") from None
    except RefusedError as exc:
        raise retry_later(exc, f"create workload: HTTP {exc.status} {exc.api_message}") from None
    except TemporaryError as exc:
        raise _unavailable(exc, f"create workload {body['metadata']['name']}: {exc.api_message}", create=True) \
            from None


async def patch_workload(api: Caller, namespace: str, action: PatchWorkload) -> None:
    """One merge patch of a Workload, guarded by its resourceVersion: a ConflictError (Kueue wrote
    meanwhile) makes the caller plan again from a fresh read; NotFound is nothing left to do."""
    meta: dict[str, Any] = {"resourceVersion": action.resource_version} if action.resource_version else {}
    try:
        if action.status is not None:
            await api.call("patch workload/status", api.custom.patch_namespaced_custom_object_status, GROUP,
                           VERSION, namespace, WORKLOADS, action.name,
                           {"metadata": meta, "status": dict(action.status)}, _content_type=MERGE_PATCH, namespace=namespace)
            return
        body: dict[str, Any] = {"metadata": meta}
        if action.spec is not None:
            body["spec"] = dict(action.spec)
        if action.annotations is not None:
            meta["annotations"] = dict(action.annotations)
        if action.remove_finalizer:
            current = await api.call("get workload", api.custom.get_namespaced_custom_object, GROUP,
                                     VERSION, namespace, WORKLOADS, action.name, write=False, namespace=namespace)
            meta["resourceVersion"] = current["metadata"]["resourceVersion"]
            meta["finalizers"] = [f for f in current["metadata"].get("finalizers") or () if f != kueue.FINALIZER]
        await api.call("patch workload", api.custom.patch_namespaced_custom_object, GROUP, VERSION,
                       namespace, WORKLOADS, action.name, body, _content_type=MERGE_PATCH, namespace=namespace)
    except NotFoundError:
        return
    except ConflictError:
        raise
    except RefusedError as exc:
        raise retry_later(exc, f"patch workload {action.name}: HTTP {exc.status} {exc.api_message}") from None
    except TemporaryError as exc:
        raise _unavailable(exc, f"patch workload {action.name}: {exc.api_message}", create=False) from None


def _unavailable(exc: TemporaryError, message: str, *, create: bool) -> TemporaryError:
    """Kueue's admission webhook (or another on Workloads) that the API server cannot call: the job is told
    (`WorkloadRejectedError`), as for a pod; any other error is retried quietly as it is."""
    rejected = classify_unavailable(exc, message)
    if isinstance(rejected, RejectedError):
        return WorkloadRejectedError(rejected.reason, str(rejected), create=create)
    return exc
