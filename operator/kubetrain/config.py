"""Operator settings, read from the environment and validated once at start-up.

A bad value stops the operator before it touches the cluster, with a message
that names the setting (`ConfigError`). Nothing else reads the environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal, Mapping

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
_NAMESPACE_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_BOOLEANS = {"": False, "false": False, "0": False, "no": False, "off": False,
             "true": True, "1": True, "yes": True, "on": True}


class ConfigError(ValueError):
    """A setting that cannot work: the operator refuses to start."""

    def __init__(self, setting: str, value: str, problem: str) -> None:
        super().__init__(f"invalid setting {setting}={value!r}: {problem}")
        self.setting = setting


@dataclass(frozen=True)
class Settings:
    """Everything configurable about the operator process."""

    namespaces: tuple[str, ...] = ()
    """KUBETRAIN_NAMESPACES: comma-separated namespaces to watch; empty or `*` = cluster-wide."""
    log_level: LogLevel = "INFO"
    """KUBETRAIN_LOG_LEVEL: DEBUG, INFO, WARNING or ERROR."""
    default_image: str | None = None
    """KUBETRAIN_DEFAULT_IMAGE: image for jobs that do not set spec.image."""
    max_concurrent_reconciles: int = 1024
    """KUBETRAIN_MAX_CONCURRENT_RECONCILES: jobs reconciled at the same time (1..8192). A reconcile
    mostly waits for API calls, which KUBETRAIN_API_THREADS bounds; a low cap here queues jobs
    behind others' status writes (with 128, the last of 200 jobs applied at once waited 4.5 s)."""
    api_threads: int = 32
    """KUBETRAIN_API_THREADS: threads (and HTTP connections) for API calls (1..256); pod writes may use
    all of them, every other call a quarter."""
    resync_seconds: float = 60.0
    """KUBETRAIN_RESYNC_SECONDS: every job is re-planned at least this often (1..3600)."""
    leader_election: bool = False
    """KUBETRAIN_LEADER_ELECTION: true to run as one of several replicas; only the holder of the Lease
    reconciles, the others stand by (true/false)."""
    leader_election_namespace: str = "default"
    """KUBETRAIN_LEADER_ELECTION_NAMESPACE: namespace of the Lease (the chart: the operator's own)."""
    leader_election_id: str = "kubetrain-operator"
    """KUBETRAIN_LEADER_ELECTION_ID: name of the Lease; replicas with the same name exclude each other."""
    leader_election_identity: str = ""
    """KUBETRAIN_LEADER_ELECTION_IDENTITY: this replica's name in the Lease (the chart: the pod name);
    empty: host name plus a random suffix."""
    lease_duration_seconds: float = 15.0
    """KUBETRAIN_LEASE_DURATION_SECONDS: how long a Lease nobody renews stays taken (2..300)."""
    renew_deadline_seconds: float = 10.0
    """KUBETRAIN_RENEW_DEADLINE_SECONDS: the leader exits if it cannot renew for this long
    (1..299, below the lease duration)."""
    retry_period_seconds: float = 2.0
    """KUBETRAIN_RETRY_PERIOD_SECONDS: time between tries to acquire or renew (0.1..60, below the
    renew deadline)."""
    metrics_port: int = 0
    """KUBETRAIN_METRICS_PORT: port of the Prometheus endpoint (/metrics), served by every replica,
    standbys included (0 = off; the chart: 9400)."""
    progress_interval_seconds: float = 30.0
    """KUBETRAIN_PROGRESS_INTERVAL_SECONDS: how often node rank 0's /progress is read per running
    job, and so the most often its progress is written to status (0 = never; else 1..3600)."""
    progress_timeout_seconds: float = 3.0
    """KUBETRAIN_PROGRESS_TIMEOUT_SECONDS: limit of one read of /progress (0.1..60, at most half the
    interval): a pod that does not answer is reported unreachable, never waited for."""
    progress_concurrency: int = 16
    """KUBETRAIN_PROGRESS_CONCURRENCY: reads of /progress in flight at once (1..256)."""
    test_progress_url: str = ""
    """KUBETRAIN_TEST_PROGRESS_URL: TESTS ONLY. A URL template ({namespace}, {job}, {pod}, {ip},
    {port}) read instead of the pod's own address: the benchmark's kwok pods have fake IPs and
    no trainer, so it serves their progress itself. Never set it in production."""

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        raw_ns = env.get("KUBETRAIN_NAMESPACES", "").strip()
        namespaces: tuple[str, ...] = ()
        if raw_ns and raw_ns != "*":
            namespaces = tuple(n.strip() for n in raw_ns.split(",") if n.strip())
            for ns in namespaces:
                if not _NAMESPACE_RE.match(ns) or len(ns) > 63:
                    raise ConfigError("KUBETRAIN_NAMESPACES", raw_ns, f"{ns!r} is not a namespace name")
        level = env.get("KUBETRAIN_LOG_LEVEL", "INFO").strip().upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError("KUBETRAIN_LOG_LEVEL", env["KUBETRAIN_LOG_LEVEL"],
                              "must be one of DEBUG, INFO, WARNING, ERROR")
        image = env.get("KUBETRAIN_DEFAULT_IMAGE", "").strip() or None
        if image is not None and any(c.isspace() for c in image):
            raise ConfigError("KUBETRAIN_DEFAULT_IMAGE", image, "an image reference has no whitespace")
        raw_le = env.get("KUBETRAIN_LEADER_ELECTION", "").strip().lower()
        if raw_le not in _BOOLEANS:
            raise ConfigError("KUBETRAIN_LEADER_ELECTION", env["KUBETRAIN_LEADER_ELECTION"],
                              "must be true or false (also 1/0, yes/no, on/off)")
        le_namespace = env.get("KUBETRAIN_LEADER_ELECTION_NAMESPACE", "").strip() or "default"
        if not _NAMESPACE_RE.match(le_namespace) or len(le_namespace) > 63:
            raise ConfigError("KUBETRAIN_LEADER_ELECTION_NAMESPACE", le_namespace, "is not a namespace name")
        le_id = env.get("KUBETRAIN_LEADER_ELECTION_ID", "").strip() or "kubetrain-operator"
        if not _SUBDOMAIN_RE.match(le_id) or len(le_id) > 253:
            raise ConfigError("KUBETRAIN_LEADER_ELECTION_ID", le_id,
                              "a Lease name is lower-case letters, digits, '-' and '.' (a DNS subdomain)")
        identity = env.get("KUBETRAIN_LEADER_ELECTION_IDENTITY", "").strip()
        if len(identity) > 128 or any(c.isspace() for c in identity):
            raise ConfigError("KUBETRAIN_LEADER_ELECTION_IDENTITY", identity,
                              "at most 128 characters, no whitespace")
        lease = _number(env, "KUBETRAIN_LEASE_DURATION_SECONDS", 15.0, 2, 300)
        renew = _number(env, "KUBETRAIN_RENEW_DEADLINE_SECONDS", 10.0, 1, 299)
        retry = _number(env, "KUBETRAIN_RETRY_PERIOD_SECONDS", 2.0, 0.1, 60)
        if renew >= lease:
            raise ConfigError("KUBETRAIN_RENEW_DEADLINE_SECONDS", str(renew),
                              f"must be below KUBETRAIN_LEASE_DURATION_SECONDS ({lease:g})")
        if retry >= renew:
            raise ConfigError("KUBETRAIN_RETRY_PERIOD_SECONDS", str(retry),
                              f"must be below KUBETRAIN_RENEW_DEADLINE_SECONDS ({renew:g})")
        interval = _number(env, "KUBETRAIN_PROGRESS_INTERVAL_SECONDS", 30.0, 0, 3600)
        if 0 < interval < 1:
            raise ConfigError("KUBETRAIN_PROGRESS_INTERVAL_SECONDS", str(interval), "must be 0 (off) or 1..3600")
        timeout = _number(env, "KUBETRAIN_PROGRESS_TIMEOUT_SECONDS", 3.0, 0.1, 60)
        if interval and timeout > interval / 2:
            raise ConfigError("KUBETRAIN_PROGRESS_TIMEOUT_SECONDS", str(timeout),
                              f"must be at most half of KUBETRAIN_PROGRESS_INTERVAL_SECONDS ({interval:g})")
        test_url = env.get("KUBETRAIN_TEST_PROGRESS_URL", "").strip()
        if test_url and not test_url.startswith(("http://", "https://")):
            raise ConfigError("KUBETRAIN_TEST_PROGRESS_URL", test_url, "must be an http:// or https:// URL template")
        return cls(
            metrics_port=_whole(env, "KUBETRAIN_METRICS_PORT", 0, 0, 65535),
            progress_interval_seconds=interval, progress_timeout_seconds=timeout,
            progress_concurrency=_whole(env, "KUBETRAIN_PROGRESS_CONCURRENCY", 16, 1, 256),
            test_progress_url=test_url,
            namespaces=namespaces, log_level=level, default_image=image,  # type: ignore[arg-type]
            max_concurrent_reconciles=_whole(env, "KUBETRAIN_MAX_CONCURRENT_RECONCILES", 1024, 1, 8192),
            api_threads=_whole(env, "KUBETRAIN_API_THREADS", 32, 1, 256),
            resync_seconds=_number(env, "KUBETRAIN_RESYNC_SECONDS", 60.0, 1, 3600),
            leader_election=_BOOLEANS[raw_le], leader_election_namespace=le_namespace,
            leader_election_id=le_id, leader_election_identity=identity,
            lease_duration_seconds=lease, renew_deadline_seconds=renew, retry_period_seconds=retry,
        )


def _number(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, raw, "must be a number") from None
    if not low <= value <= high:
        raise ConfigError(name, raw, f"must be between {low:g} and {high:g}")
    return value


def _whole(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    """An integer setting: a fraction (9400.9) is refused, not cut down to 9400."""
    value = _number(env, name, default, low, high)
    if value != int(value):
        raise ConfigError(name, env.get(name, "").strip(), "must be a whole number")
    return int(value)
