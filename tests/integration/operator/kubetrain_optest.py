"""Helpers shared by the operator's integration tests (imported, unlike conftest)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

GROUP, VERSION, PLURAL = "kubetrain.io", "v1alpha1", "trainingjobs"

TIMEOUT = 120.0
"""Default safety net of the waits below: generous, since CI runs next to CPU hogs on every core (the
operator and the control plane share two loaded cores). Never the property a test checks."""


@dataclass
class Jobs:
    """Small client for TrainingJobs and their pods/events in one namespace."""

    api_client: Any
    namespace: str

    def __post_init__(self) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)

    def create(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
                "metadata": {"name": name, "namespace": self.namespace}, "spec": spec}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name, {"spec": spec})

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def wait(self, name: str, predicate: Callable[[dict[str, Any]], bool], *, timeout: float = TIMEOUT,
             what: str = "") -> dict[str, Any]:
        from kubetrain_testbed import wait_until

        return wait_until(lambda: self.status(name), predicate, timeout=timeout, interval=0.3,
                          what=what or f"status of {name}")

    def wait_phase(self, name: str, phase: str, *, timeout: float = TIMEOUT, **match: Any) -> dict[str, Any]:
        return self.wait(name, lambda s: s.get("phase") == phase and all(s.get(k) == v for k, v in match.items()),
                         timeout=timeout, what=f"{name} phase {phase} {match}")

    def pods(self, name: str | None = None, attempt: int | None = None) -> list[Any]:
        selector = [f"kubetrain.io/job-name={name}"] if name else ["app.kubernetes.io/managed-by=kubetrain"]
        if attempt is not None:
            selector.append(f"kubetrain.io/attempt={attempt}")
        return self.core.list_namespaced_pod(self.namespace, label_selector=",".join(selector)).items

    def wait_pods(self, name: str, count: int, *, attempt: int | None = None, running: bool = False,
                  timeout: float = TIMEOUT) -> list[Any]:
        from kubetrain_testbed import wait_until

        def ok(pods: list[Any]) -> bool:
            live = [p for p in pods if p.metadata.deletion_timestamp is None]
            return len(live) == count and (not running or all(p.status.phase == "Running" for p in live))

        return wait_until(lambda: self.pods(name, attempt), ok, timeout=timeout, interval=0.3,
                          what=f"{count} pod(s) of {name} attempt {attempt} {'running' if running else ''}")

    def history_until_deleted(self, name: str, resource_version: str, *,
                              timeout: float = TIMEOUT) -> list[tuple[str, dict[str, Any]]]:
        """Every (event type, status) of job `name` after `resource_version`, up to its DELETED event.

        A watch from a known resourceVersion misses nothing, however slowly this process polls: use it
        when a state may be short-lived (e.g. Succeeded right before a TTL deletes the job)."""
        from kubernetes import watch

        seen: list[tuple[str, dict[str, Any]]] = []
        w = watch.Watch()
        for ev in w.stream(self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                           field_selector=f"metadata.name={name}", resource_version=resource_version,
                           timeout_seconds=int(timeout)):
            seen.append((ev["type"], (ev["object"] or {}).get("status") or {}))
            if ev["type"] == "DELETED":
                w.stop()
                break
        return seen

    def finish_pod(self, pod: str, code: int, message: str | None = None) -> None:
        """Make a kwok pod exit with `code` (testbed/README.md)."""
        from kubetrain_testbed import EXIT_CODE_ANNOTATION, EXIT_MESSAGE_ANNOTATION

        ann = {EXIT_CODE_ANNOTATION: str(code)}
        if message is not None:
            ann[EXIT_MESSAGE_ANNOTATION] = message
        self.core.patch_namespaced_pod(pod, self.namespace, {"metadata": {"annotations": ann}})

    def event_messages(self, name: str, reason: str) -> list[str]:
        events = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name},reason={reason}").items
        return [e.message for e in events]

    def event_reasons(self, name: str) -> list[str]:
        events = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name},involvedObject.kind=TrainingJob").items
        return [e.reason for e in sorted(events, key=lambda e: (e.first_timestamp or e.event_time, e.metadata.name))]


@dataclass
class PodTimeline:
    """The pod watch stream of a namespace, in the order the API server delivered it."""

    entries: list[tuple[str, str, int]] = field(default_factory=list)
    """(ADDED|DELETED, pod name, attempt)."""

    def check_no_overlap(self, job: str | None = None) -> None:
        """Every pod of attempt N is DELETED before the first pod of attempt N+1 is ADDED
        (among all the namespace's pods, or the pods of `job`)."""
        alive: dict[str, int] = {}
        for kind, name, attempt in self.entries:
            if job is not None and not name.startswith(f"{job}-a"):
                continue
            if kind == "ADDED":
                older = {n: a for n, a in alive.items() if a < attempt}
                assert not older, f"{name} (attempt {attempt}) created while {older} still existed"
                alive[name] = attempt
            else:
                alive.pop(name, None)

    def attempts_created(self) -> list[int]:
        return sorted({a for kind, _, a in self.entries if kind == "ADDED"})

    def wait_attempts(self, expected: list[int], *, timeout: float = TIMEOUT) -> None:
        """Wait until the stream shows exactly the attempts `expected` were created.

        The stream is read by a background thread: right after the API answered, it may not have
        delivered the latest events yet. (A prefix of the stream is still consistent, so
        check_no_overlap needs no wait.)"""
        from kubetrain_testbed import wait_until

        wait_until(self.attempts_created, lambda got: got == expected, timeout=timeout,
                   what=f"attempts {expected} created in the pod watch stream")

    def added(self, prefix: str = "") -> list[str]:
        return [name for kind, name, _ in self.entries if kind == "ADDED" and name.startswith(prefix)]

    def wait_added(self, count: int, prefix: str = "", *, timeout: float = TIMEOUT) -> list[str]:
        """Wait until at least `count` ADDED events (of pods named `prefix`...) were delivered; returns them all."""
        from kubetrain_testbed import wait_until

        return wait_until(lambda: self.added(prefix), lambda names: len(names) >= count, timeout=timeout,
                          what=f"{count} pod(s) {prefix}* ADDED in the pod watch stream")


def spec(nodes: int = 2, **extra: Any) -> dict[str, Any]:
    """A small TrainingJob spec for kwok nodes."""
    base: dict[str, Any] = {"image": "kubetrain/trainer:test", "nodes": nodes,
                            "trainer": {"builtin": {"task": "regression", "args": {"max_steps": 10}}},
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def kwok_exit(code: int, delay: str = "1s", message: str | None = None) -> dict[str, str]:
    """podTemplate annotations that make every pod exit with `code` after `delay`."""
    from kubetrain_testbed import EXIT_CODE_ANNOTATION, EXIT_DELAY_ANNOTATION, EXIT_MESSAGE_ANNOTATION

    ann = {EXIT_CODE_ANNOTATION: str(code), EXIT_DELAY_ANNOTATION: delay}
    if message is not None:
        ann[EXIT_MESSAGE_ANNOTATION] = message
    return ann


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:3000]
