"""The Kubernetes API's answers as types: every `ApiException` is classified here, once.

`k8s.Api._call` turns each client error into one of these, so no caller ever
inspects an HTTP status. Two families, the kopf way:
- `TemporaryError`: no definite answer (network trouble, 5xx, 429 or any other
  status): retry after `delay`. `RejectedError` is a refusal of a pod create
  that can pass (a full ResourceQuota, RBAC not yet granted, an admission
  webhook the API server cannot call): wait with backoff, showing why.
- `RefusedError`: a definite answer about this request: `ConflictError` (409:
  changed since read, or already exists), `NotFoundError` (404), `InvalidError`
  (400, 422: the object is wrong), `ForbiddenError` (403). What it means
  depends on the request, and the caller decides (a conflict on a create is
  success, on a status write a reason to re-read and plan again).
`PermanentError` is the caller's verdict that a job cannot run (the API server
rejected an object built from its spec). A 403 that RBAC gave names what is
missing (`ForbiddenError.denial`); on a write the operator must make it becomes a
`DeniedError`: retried with backoff, since a Role can be fixed while we wait.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kubernetes.client.rest import ApiException


class ApiError(RuntimeError):
    """An error from a call to the Kubernetes API."""

    def __init__(self, message: str, *, status: int | None = None, http_reason: str = "",
                 api_message: str = "") -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status, when the API server answered."""
        self.http_reason = http_reason
        """The HTTP reason phrase (Conflict, Not Found...)."""
        self.api_message = api_message
        """The `message` of the API server's Status object (or the reason phrase), at most 600 characters."""


class TemporaryError(ApiError):
    """The API could not be reached or refused for now: retry after a delay."""

    def __init__(self, message: str, delay: float = 2.0, *, status: int | None = None, http_reason: str = "",
                 api_message: str = "") -> None:
        super().__init__(message, status=status, http_reason=http_reason, api_message=api_message)
        self.delay = delay


class RejectedError(TemporaryError):
    """The API server refused to create a pod for a reason that can pass (a ResourceQuota that
    is full, RBAC not yet granted): wait with backoff, and show the reason on the job."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class WorkloadRejectedError(RejectedError):
    """The same for a write of the job's Kueue Workload: the job shows why while the operator waits with
    backoff, in the terms of its queue (`plan_kueue.rejected_plan`)."""

    def __init__(self, reason: str, message: str, *, create: bool) -> None:
        super().__init__(reason, message)
        self.create = create
        """The Workload's create was refused (the job has none yet), else a patch of it."""


class RefusedError(ApiError):
    """A definite answer about this request; the subclass says which."""


class ConflictError(RefusedError):
    """409: the object changed since it was read (re-read and plan again), or already exists."""


class NotFoundError(RefusedError):
    """404: the object (or its namespace) does not exist."""


class InvalidError(RefusedError):
    """400 or 422: the API server refused the object itself (schema, validation)."""


class ForbiddenError(RefusedError):
    """403: RBAC, a ResourceQuota, PodSecurity, a LimitRange or an admission webhook said no."""

    def __init__(self, message: str, *, status: int | None = None, http_reason: str = "",
                 api_message: str = "") -> None:
        super().__init__(message, status=status, http_reason=http_reason, api_message=api_message)
        self.denial: Denial | None = Denial.parse(api_message)
        """What RBAC refused, when it was RBAC (None for a quota, PodSecurity, a webhook...); for `owner_finalizers`,
        which names no permission, the API client's ledger sets it (`permissions.py`)."""

    @property
    def owner_finalizers(self) -> bool:
        """The garbage collector's admission (OwnerReferencesPermissionEnforcement) refused an owner reference with
        blockOwnerDeletion: RBAC does not let the caller update the owner's finalizers. Its message names neither
        the user nor the owner's resource."""
        return OWNER_FINALIZERS in self.api_message

    @property
    def webhook_denied(self) -> bool:
        """An admission webhook judged the object and said no (the API server's `admission webhook "<name>" denied
        the request: ...`): not RBAC, not a quota; the same object is refused again."""
        return self.denial is None and "denied the request" in self.api_message


OWNER_FINALIZERS = "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on"


@dataclass(frozen=True)
class Denial:
    """The permission RBAC refused, as the API server names it in a 403's message."""

    user: str
    verb: str
    resource: str
    """With its subresource: `trainingjobs/status`."""
    group: str
    """"" for the core API (pods, events)."""
    namespace: str
    """"" for a cluster-scoped request."""

    @classmethod
    def parse(cls, api_message: str) -> Denial | None:
        # k8s.io/apiserver's forbiddenMessage: `User "u" cannot <verb> resource "<res>[/<sub>]" in API group "<g>"
        # in the namespace "<ns>"` (or `at the cluster scope`), possibly followed by the authorizer's reason.
        found = _RBAC.search(api_message)
        if found is None:
            return None
        user, verb, resource, group, namespace = found.groups()
        return cls(user=user, verb=verb, resource=resource, group=group, namespace=namespace or "")


_RBAC = re.compile(r'User "([^"]*)" cannot (\S+) resource "([^"]+)" in API group "([^"]*)"'
                   r'(?: in the namespace "([^"]*)"| at the cluster scope)')


class DeniedError(TemporaryError):
    """RBAC refused a write the operator must make (its status, a pod): retried with backoff, since the Role may
    be fixed meanwhile; the API client reported the missing permission once (`permissions.py`)."""

    def __init__(self, message: str, denial: Denial) -> None:
        super().__init__(message, status=403, http_reason="Forbidden")
        self.denial = denial


def retry_later(exc: RefusedError, message: str) -> TemporaryError:
    """A refusal of a write that is tried again: a `DeniedError` when RBAC refused it, else a `TemporaryError`."""
    denial = exc.denial if isinstance(exc, ForbiddenError) else None
    return DeniedError(message, denial) if denial is not None else TemporaryError(message)


class PermanentError(RuntimeError):
    """The API server rejected an object built from the spec: retrying cannot help."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_REFUSALS: dict[int, type[RefusedError]] = {
    409: ConflictError, 404: NotFoundError, 400: InvalidError, 422: InvalidError, 403: ForbiddenError,
}


def classify(exc: ApiException, what: str) -> ApiError:
    """The typed error of a client's ApiException (`what`: the call, for the message)."""
    status, reason, api_message = exc.status, str(exc.reason), _api_message(exc)
    message = f"{what}: HTTP {status} {reason}"
    refused = _REFUSALS.get(status) if isinstance(status, int) else None
    if refused is not None:
        return refused(message, status=status, http_reason=reason, api_message=api_message)
    delay = max(5.0 if status == 429 else 2.0, _retry_after(exc))
    return TemporaryError(message, delay=delay, status=status, http_reason=reason, api_message=api_message)


RETRY_AFTER_LIMIT = 300.0
"""The longest Retry-After (seconds) a temporary error waits for."""


def _retry_after(exc: ApiException) -> float:
    """The seconds of the answer's Retry-After header (429, 503), 0 when none or not a number of seconds."""
    value = next((v for k, v in (exc.headers or {}).items() if str(k).lower() == "retry-after"), None)
    try:
        return min(RETRY_AFTER_LIMIT, max(0.0, float(value)))
    except (TypeError, ValueError):  # none, or an HTTP date (the API server sends seconds)
        return 0.0


def classify_forbidden(api_message: str, message: str) -> RejectedError | PermanentError:
    """A 403 on a create: a full ResourceQuota, a new one whose usage is not counted yet, a ServiceAccount
    not made yet (a new namespace's `default`, one applied with the job) or missing RBAC (the call's own, or the
    owner's finalizers that the garbage collector's admission asks for) can pass (wait);
    PodSecurity, a LimitRange or an admission webhook judge the object itself (the job cannot run)."""
    if "exceeded quota" in api_message:
        return RejectedError("QuotaExceeded", message)
    if "status unknown for quota" in api_message:  # the quota controller has not counted a new quota's usage
        return RejectedError("QuotaPending", message)
    if "error looking up service account" in api_message:
        return RejectedError("ServiceAccountMissing", _service_account_missing(api_message, message))
    if "cannot create resource" in api_message:
        return RejectedError("Forbidden", message)
    if OWNER_FINALIZERS in api_message:  # RBAC's answer too, for the owner (reported once: permissions.py)
        return RejectedError("Forbidden", "the operator may not update trainingjobs/finalizers, which owner references "
                                          f"with blockOwnerDeletion need: its RBAC is older than its chart ({message})")
    if "violates PodSecurity" in api_message:
        return PermanentError("PodSecurity", message)
    return PermanentError("PodRejected", message)


_SA_NOT_FOUND = re.compile(r'error looking up service account ([^/\s]+)/([^:\s]+): serviceaccount "[^"]*" not found')


def _service_account_missing(api_message: str, message: str) -> str:
    """The ServiceAccount admission's refusal with the fix first (a condition's message is cut at 400 characters),
    the API server's words (which name the pod) after it."""
    found = _SA_NOT_FOUND.search(api_message)
    if found is None:  # another error of the lookup (an API server in trouble): as it came
        return message
    namespace, name = found.groups()
    if name == "default":
        fix = ("the namespace's own, made by kube-controller-manager moments after the namespace: if it stays "
               "missing, its serviceaccount controller is not running")
    else:
        fix = (f"create it (kubectl create serviceaccount {name} -n {namespace}) or set spec.podTemplate."
               "serviceAccountName (spec.checkpoint.webIdentity.serviceAccountName with webIdentity) to one that exists")
    return f"ServiceAccount {name} not found in namespace {namespace}: {fix}; the pods are created once it does " \
           f"(API server: {api_message})"


def classify_unavailable(error: TemporaryError, message: str) -> TemporaryError:
    """A create the API server could not decide on: an admission webhook it could not call (a policy engine that
    is down or slow, with failurePolicy Fail: HTTP 500 "failed calling webhook") stays so until someone fixes it,
    so it is shown on the job while it waits (`RejectedError`); any other error is retried quietly as it is."""
    if "failed calling webhook" in error.api_message:
        return RejectedError("AdmissionWebhookUnavailable", message)
    return error


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message") or exc.reason)[:600]
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)
