"""Missing RBAC permissions, reported once each: one ERROR that names the permission and the fix.

A permission RBAC refuses (a stale ClusterRole after an upgrade, a Role or
RoleBinding made by hand, a namespace added to the operator but not to the
chart's `namespaces`) stays refused until someone fixes the Role, and every
reconcile that needs it meets it again: the callers retry with backoff, and
this ledger keeps the log readable. The first refusal of each call in each
namespace is logged at ERROR, with the verb, the resource, the namespace, the
ServiceAccount and what to do; its repeats at DEBUG. The first answer to that
call in that namespace afterwards that RBAC let through (a success, or a 404 or
409, which come after RBAC's check) is logged at INFO and clears the entry, so
a permission lost again later is reported again. `watching` does the same
around a blocking call (the leader elector's Lease calls).

A create whose owner reference (blockOwnerDeletion) the garbage collector's
admission refuses is RBAC's answer for the owner: `update` on
`trainingjobs/finalizers` (its message names neither, so it is filled in here).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Awaitable, Iterator, TypeVar

from kubetrain.api import GROUP, PLURAL
from kubetrain.errors import Denial, ForbiddenError, InvalidError, RefusedError

T = TypeVar("T")

log = logging.getLogger("kubetrain.permissions")


class Permissions:
    """The calls RBAC refuses now, by (call, namespace)."""

    def __init__(self) -> None:
        self.denied: dict[tuple[str, str], Denial] = {}

    async def watch(self, what: str, namespace: str, call: Awaitable[T]) -> T:
        """Await one API call (`what` in `namespace`), noting whether RBAC refused or allowed it."""
        with self.watching(what, namespace):
            return await call

    @contextlib.contextmanager
    def watching(self, what: str, namespace: str) -> Iterator[None]:
        """Around one blocking API call (the leader elector's) whose client errors come as `errors.py`'s types."""
        try:
            yield
        except ForbiddenError as exc:
            if exc.denial is None and exc.owner_finalizers:  # ours are all TrainingJob owners, in the call's namespace
                exc.denial = Denial(user="", verb="update", resource=f"{PLURAL}/finalizers", group=GROUP,
                                    namespace=namespace)
            if (denial := exc.denial) is not None:
                self.refused(what, denial)
            raise
        except RefusedError as exc:  # 404, 409, 422 come after RBAC's check: the call was allowed (a Lease not made yet)
            self.allowed(what, namespace, admitted=not isinstance(exc, InvalidError))
            raise
        self.allowed(what, namespace)

    def refused(self, what: str, denial: Denial) -> None:
        key = (what, denial.namespace)
        if self.denied.get(key) == denial:  # another permission of the same call (its owner's finalizers) is news
            log.debug("%s in %s still refused by RBAC", what, denial.namespace or "the cluster")
            return
        self.denied[key] = denial
        log.error("%s; retrying with backoff, and logging this once until it works", describe(denial))

    def allowed(self, what: str, namespace: str, *, admitted: bool = True) -> None:
        """A call that succeeded: if RBAC refused it in that namespace before, it works again. Not `admitted` (a
        400 or 422: the object's own validation, before the admission that checks its owner's finalizers), it
        says nothing about those."""
        denial = self.denied.get((what, namespace)) if self.denied else None
        if denial is None or (not admitted and denial.resource.endswith("/finalizers")):
            return
        del self.denied[(what, namespace)]
        log.info("%s in %s is allowed again (RBAC fixed): carrying on", what, namespace or "the cluster")


def describe(denial: Denial) -> str:
    """What is missing, who lacks it, and how to fix it."""
    resource, _, sub = denial.resource.partition("/")
    qualified = f"{resource}.{denial.group}" if denial.group else resource
    where = f"in namespace {denial.namespace}" if denial.namespace else "cluster-wide"
    user = denial.user or "system:serviceaccount:<its namespace>:<its ServiceAccount>"  # unnamed by the refusal
    check = (f"kubectl auth can-i {denial.verb} {qualified}{f' --subresource={sub}' if sub else ''}"
             f"{f' -n {denial.namespace}' if denial.namespace else ''} --as={user}")
    scope = f", with {denial.namespace} among its `namespaces` (or clusterWide=true)" if denial.namespace else ""
    why = (" (the API server's OwnerReferencesPermissionEnforcement admission asks for it: the operator's pods, "
           "Service, ConfigMap and Workload name their TrainingJob as owner with blockOwnerDeletion)"
           if sub == "finalizers" else "")
    if denial.group == "coordination.k8s.io":  # leader election's Lease: the chart's own Role, not the jobs' one
        scope = f", with leaderElection.enabled=true (its Role <release>-leader-election in {denial.namespace})"
    return (f"RBAC forbids the operator to {denial.verb} {denial.resource} {where}{why} (API group "
            f"{denial.group or 'core'}, user {denial.user or 'its ServiceAccount'}): no role bound to it grants that "
            f"(RBAC left from an older release, or made by hand). Re-apply the chart's RBAC: `helm upgrade <release> <chart> -f <your "
            f"values>` (not --reuse-values: it keeps an older chart's defaults){scope}; check with `{check}`")
