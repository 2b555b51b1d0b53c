"""Kueue's admission put into the gang's pods: the flavors' node labels and tolerations, then the
admission checks' pod set updates, merged the way Kueue's own integrations do (`pkg/podset`).

Pure, like `kueue.py`: the caller reads the ResourceFlavors and sends the pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kubetrain.kueue import PODSET_NAME, KueueError, WorkloadView

@dataclass(frozen=True)
class PodSetInfo:
    """What an admission adds to every pod of the gang (Kueue's podset.PodSetInfo)."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


def pod_set_info(view: WorkloadView, flavors: Mapping[str, Mapping[str, Any]]) -> PodSetInfo:
    """The admitted flavors' node labels and tolerations, then each admission check's podSetUpdates.

    `flavors` maps a ResourceFlavor's name to its `spec` (nodeLabels, tolerations), read by the caller.
    Like Kueue (podset.FromAssignment, then PodSetInfo.Merge): flavors' labels are copied in order,
    an update's labels, annotations and node selector must not contradict what is there, and a
    toleration is added once. Raises KueueError for a topology assignment, a missing podSet
    assignment or flavor, or a conflict."""
    ours = [a for a in view.assignments if a.name == PODSET_NAME]
    if not ours:
        raise KueueError("status.admission.podSetAssignments", f"has no assignment for the podSet {PODSET_NAME!r}")
    assignment = ours[0]
    if assignment.topology:
        raise KueueError("status.admission.podSetAssignments.topologyAssignment",
                         "Kueue assigned a topology (topology-aware scheduling), which kubetrain does not support")
    node_selector: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    seen: set[str] = set()
    for flavor_name in assignment.flavors.values():
        if flavor_name in seen:
            continue
        seen.add(flavor_name)
        flavor = flavors.get(flavor_name)
        if flavor is None:
            raise KueueError("status.admission.podSetAssignments.flavors", f"ResourceFlavor {flavor_name!r} not found")
        node_selector.update({str(k): str(v) for k, v in (flavor.get("nodeLabels") or {}).items()})
        tolerations.extend(dict(t) for t in flavor.get("tolerations") or ())
    info = PodSetInfo(node_selector=node_selector, tolerations=tuple(tolerations))
    for update in view.pod_set_updates:
        if update.name != PODSET_NAME:
            continue
        info = _merge(info, PodSetInfo(node_selector=update.node_selector, tolerations=update.tolerations,
                                       labels=update.labels, annotations=update.annotations),
                      where="status.admissionChecks.podSetUpdates")
    return info


def merge_into_pod(pod: Mapping[str, Any], info: PodSetInfo) -> dict[str, Any]:
    """A copy of `pod` with the admission merged in (Kueue's podset.Merge): a key the pod already sets
    to another value is a conflict (KueueError naming it), never silently overwritten."""
    meta, spec = dict(pod.get("metadata") or {}), dict(pod.get("spec") or {})
    current = PodSetInfo(node_selector=dict(spec.get("nodeSelector") or {}),
                         tolerations=tuple(spec.get("tolerations") or ()),
                         labels=dict(meta.get("labels") or {}), annotations=dict(meta.get("annotations") or {}))
    merged = _merge(current, info, where="pod")
    for key, value in (("labels", merged.labels), ("annotations", merged.annotations)):
        if value:
            meta[key] = dict(value)
    if merged.node_selector:
        spec["nodeSelector"] = dict(merged.node_selector)
    if merged.tolerations:
        spec["tolerations"] = [dict(t) for t in merged.tolerations]
    return {**pod, "metadata": meta, "spec": spec}


def _merge(base: PodSetInfo, extra: PodSetInfo, *, where: str) -> PodSetInfo:
    for name, ours, theirs in (("annotations", base.annotations, extra.annotations),
                               ("labels", base.labels, extra.labels),
                               ("nodeSelector", base.node_selector, extra.node_selector)):
        for key, value in theirs.items():
            if key in ours and ours[key] != value:
                raise KueueError(f"{where}.{name}[{key}]",
                                 f"conflict: {ours[key]!r} is set and Kueue's admission asks for {value!r}")
    tolerations = list(base.tolerations)
    for tol in extra.tolerations:
        if not any(_same_toleration(t, tol) for t in tolerations):
            tolerations.append(tol)
    return PodSetInfo(node_selector={**base.node_selector, **extra.node_selector}, tolerations=tuple(tolerations),
                      labels={**base.labels, **extra.labels}, annotations={**base.annotations, **extra.annotations})


def _same_toleration(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Kueue's tolerations.Equal: the same key, operator (default Equal), value, effect and seconds."""
    def norm(t: Mapping[str, Any]) -> tuple:
        return (t.get("key") or "", t.get("operator") or "Equal", t.get("value") or "", t.get("effect") or "",
                t.get("tolerationSeconds"))
    return norm(a) == norm(b)
