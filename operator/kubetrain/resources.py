"""Container resources in a TrainingJob's spec, as the pod API reads them: quantities ("500m", "16Gi", "1e3")
as exact numbers, and `spec.resources` checked the way the API server would check the pods built from it
(names, whole extended resources, requests within limits); likewise the user and group IDs of
`spec.podTemplate.securityContext`. Pure; raises `ResourceError` naming the field, which `spec.py` turns
into its `SpecError`.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any



class ResourceError(ValueError):
    """A resource value the pod API would refuse; `field_path` is under `spec.`."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(message)
        self.field_path, self.message = field_path, message

QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]{1,3})?$")
_SUFFIX = {"": 1, "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "k": 10**3,
           "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           **{s: 2 ** (10 * (i + 1)) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}}


def quantity(value: Any, path: str) -> Fraction:
    """A resource quantity (4, "500m", "16Gi", "1e3") as an exact number; negative is an error."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = Fraction(value)
    else:
        m = _QUANTITY.match(value) if isinstance(value, str) else None
        if m is None:
            raise ResourceError(path, f"must be a non-negative quantity such as 4, 500m or 16Gi, got {value!r}")
        suffix = m.group(2) or ""
        scale = Fraction(10) ** int(suffix[1:]) if suffix[:1] in ("e", "E") else _SUFFIX[suffix]
        number = Fraction(m.group(1)) * scale
    if number < 0:
        raise ResourceError(path, f"must be a non-negative quantity such as 4, 500m or 16Gi, got {value!r}")
    return number


def quantity_value(value: Any) -> Fraction | Any:
    """A quantity as an exact number, so that "4", 4 and "4000m" (or "16Gi" and "16384Mi") compare equal;
    a value that is not a quantity comes back as it is."""
    try:
        return quantity(value, "")
    except (ResourceError, TypeError, ValueError, KeyError):
        return value


def _is_extended(name: str) -> bool:
    """A resource outside the kubernetes.io domain (e.g. nvidia.com/gpu): integer, never overcommitted."""
    return "/" in name and "kubernetes.io/" not in name


_BYTES = ("memory", "ephemeral-storage")
"""Resources counted in bytes (hugepages too, by prefix): a milli-byte or less than a byte is a typo
(memory: 100m); a fraction such as 1.2Gi is fine (the kubelet rounds it up)."""
_SUB_UNIT = re.compile(r"[0-9.](m|u|n)$")


def parse_resources(raw: Any) -> dict[str, Any]:
    raw = dict(raw or {})
    parsed: dict[str, dict[str, Fraction]] = {}
    for which in ("requests", "limits"):
        parsed[which] = {}
        for name, value in dict(raw.get(which) or {}).items():
            path = f"resources.{which}.{name}"
            if "/" in name:
                if not QUALIFIED_NAME.match(name) or name.startswith("requests."):
                    raise ResourceError(path, "is not a container resource: use cpu, memory, ephemeral-storage, "
                                          "hugepages-<size> or an extended resource <domain>/<name>")
            elif name not in ("cpu", "memory", "ephemeral-storage") and not name.startswith("hugepages-"):
                raise ResourceError(path, "is not a container resource: use cpu, memory, ephemeral-storage, "
                                      "hugepages-<size> or an extended resource <domain>/<name>")
            number = parsed[which][name] = quantity(value, path)
            if _is_extended(name) and number.denominator != 1:
                raise ResourceError(path, f"must be a whole number: an extended resource cannot be split, got {value!r}")
            if (name in _BYTES or name.startswith("hugepages-")) and (0 < number < 1 or _SUB_UNIT.search(str(value))):
                raise ResourceError(path, f"must be a size in bytes such as 512Mi or 16Gi, got {value!r}"
                                      + (": m is a thousandth, not mega (use M or Mi)" if str(value).endswith("m")
                                         else ": less than one byte"))
            if name.startswith("hugepages-"):
                _check_huge_pages(name, number, value, path)
    requests, limits = parsed["requests"], parsed["limits"]
    for name, number in requests.items():
        if (_is_extended(name) or name.startswith("hugepages-")) and limits.get(name) != number:
            raise ResourceError(f"resources.requests.{name}", "must be set in limits too, and equal to the limit "
                                                         "(extended resources and hugepages cannot be overcommitted)")
        if name in limits and number > limits[name]:
            raise ResourceError(f"resources.requests.{name}", f"must not exceed resources.limits.{name}")
    # Not checked: the pod API's "HugePages require cpu or memory". It judges the pod after admission, where a
    # namespace's LimitRange may have given the container a default cpu or memory, so such a job can run.
    return raw


def _check_huge_pages(name: str, number: Fraction, value: Any, path: str) -> None:
    """hugepages-<page size> (a positive whole number of bytes: 2Mi, 1Gi, 2048Ki) and a whole number of pages,
    as the pod API checks them (it rounds the value up to a byte first)."""
    size = name.removeprefix("hugepages-")
    try:
        page = quantity(size, path)
    except ResourceError:
        page = Fraction(0)
    if page <= 0 or page.denominator != 1:
        raise ResourceError(path, "is not a container resource: use hugepages-<page size> such as hugepages-2Mi "
                                  "or hugepages-1Gi")
    if math.ceil(number) % page:
        raise ResourceError(path, f"must be a whole number of {size} pages (a multiple of {page} bytes), got {value!r}")


POD_SECURITY_IDS = ("runAsUser", "runAsGroup", "fsGroup")
"""The pod securityContext's ID fields a job may set (spec.podTemplate.securityContext), with
supplementalGroups and fsGroupChangePolicy; runAsNonRoot and seccompProfile are kubetrain's."""
FS_GROUP_CHANGE_POLICIES = ("OnRootMismatch", "Always")
MAX_ID = 2**31 - 1
"""The largest user or group ID the pod API takes."""


def parse_pod_security_context(raw: Any) -> dict[str, Any]:
    """spec.podTemplate.securityContext as the pod gets it: runAsUser 1 to 2^31-1 (0 is root, which the pods
    never run as), group IDs 0 to 2^31-1 (group 0 is no privilege: OpenShift-style images make their files
    group-0 writable for an arbitrary UID, and PodSecurity restricted allows it), and only the fields the CRD
    declares (the API server prunes any other)."""
    p = "podTemplate.securityContext"
    if not isinstance(raw, dict):
        raise ResourceError(p, f"must be an object, got {raw!r}")
    out: dict[str, Any] = {}
    for key in POD_SECURITY_IDS:
        if raw.get(key) is not None:
            out[key] = _id(raw[key], f"{p}.{key}", group=key != "runAsUser")
    if raw.get("supplementalGroups") is not None:
        groups = raw["supplementalGroups"]
        if not isinstance(groups, list):
            raise ResourceError(f"{p}.supplementalGroups", f"must be a list of group IDs, got {groups!r}")
        out["supplementalGroups"] = [_id(g, f"{p}.supplementalGroups[{i}]", group=True) for i, g in enumerate(groups)]
    policy = raw.get("fsGroupChangePolicy")
    if policy is not None:
        if policy not in FS_GROUP_CHANGE_POLICIES:
            raise ResourceError(f"{p}.fsGroupChangePolicy", f"must be OnRootMismatch or Always, got {policy!r}")
        out["fsGroupChangePolicy"] = policy
    return out


def _id(value: Any, path: str, *, group: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
        raise ResourceError(path, f"must be an integer from {0 if group else 1} to {MAX_ID}, got {value!r}")
    if value == 0 and not group:
        raise ResourceError(path, "must not be 0: that is root, and kubetrain's pods run as non-root "
                                  "(runAsNonRoot); use 1 or more")
    return value
