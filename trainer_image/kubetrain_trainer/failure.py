"""Why a pod exited 82, told to the operator: the failure record of the termination message.

The operator never copies a pod's output into status (a log can hold credentials), so a job whose
checkpoint storage refused it used to show only "exit 82, read the log". That failure is the one
a user fixes outside the pod (a role's policy, a bucket name), so the launcher names it in a small
record that the operator validates field by field (docs/contract.md, "Reporting a failure"): a
reason from a fixed set, the store's error code and the job's checkpoint location. Never the
store's message text: that stays in the log.

The record replaces the last-checkpoint record in the termination message, and may: it is only
written when storage refused the pod at start, before this pod committed (or restored) anything.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kubetrain_trainer.contract import FAILURE_CODE_PATTERN, FAILURE_KIND, FAILURE_REASONS, TERMINATION_MESSAGE_LIMIT

_CODE = re.compile(FAILURE_CODE_PATTERN)
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError"})


@dataclass(frozen=True)
class FailureRecord:
    """`{"kind": "kubetrain.io/failure", "reason", "code", "where"}`; code and where may be absent."""

    reason: str
    """One of contract.FAILURE_REASONS."""
    code: str | None = None
    """The store's error code (AccessDenied, InvalidIdentityToken, NoSuchBucket...) when it gave one."""
    where: str | None = None
    """The job's checkpoint location (KUBETRAIN_CHECKPOINT_URI): an s3:// URI, never a credential."""

    def __post_init__(self) -> None:
        if self.reason not in FAILURE_REASONS:
            raise ValueError(f"failure reason {self.reason!r} is not one of {FAILURE_REASONS}")
        if self.code is not None and not _CODE.match(self.code):
            raise ValueError(f"failure code {self.code!r} does not match {FAILURE_CODE_PATTERN}")

    def to_json(self) -> str:
        """One line, within the kubelet's limit (a location too long to fit is left out)."""
        body = {"kind": FAILURE_KIND, "reason": self.reason}
        if self.code:
            body["code"] = self.code
        if self.where:
            body["where"] = self.where
        text = json.dumps(body, sort_keys=True)
        if len(text.encode()) + 1 > TERMINATION_MESSAGE_LIMIT:
            return FailureRecord(self.reason, self.code).to_json()
        return text


def storage_failure(error: BaseException, *, reason: str, where: str | None) -> FailureRecord:
    """The record of a storage error (`storage_errors.StorageError`) that exits the pod with 82."""
    uri = where if where and where.startswith("s3://") and where.isprintable() and " " not in where else None
    return FailureRecord(reason=reason, code=error_code(error), where=uri)


def error_code(error: BaseException) -> str | None:
    """The S3 or STS error code behind `error`: storage's errors carry only a safe message, and
    keep the botocore error they were raised from as their context. A numeric code (a HEAD
    request's 403 has no body) becomes HTTP<status>; missing credentials NoCredentials; a TLS certificate
    the pod does not trust CertificateVerifyFailed."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = str((response.get("Error") or {}).get("Code") or "")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if _CODE.match(code):
                return code
            if code.isdigit() or isinstance(status, int):
                return f"HTTP{code if code.isdigit() else status}"
        if type(current).__name__ in _NO_CREDENTIALS:
            return "NoCredentials"
        if type(current).__name__ == "SSLError" and "CERTIFICATE_VERIFY_FAILED" in str(current):
            return "CertificateVerifyFailed"  # the store's TLS certificate, not its access policy (AWS_CA_BUNDLE)
        current = current.__cause__ or current.__context__
    return None
