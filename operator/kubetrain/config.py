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
    """KUBETRAIN_API_THREADS: threads (and HTTP connections) for API writes (1..256)."""
    resync_seconds: float = 60.0
    """KUBETRAIN_RESYNC_SECONDS: every job is re-planned at least this often (1..3600)."""

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
        return cls(
            namespaces=namespaces, log_level=level, default_image=image,  # type: ignore[arg-type]
            max_concurrent_reconciles=int(_number(env, "KUBETRAIN_MAX_CONCURRENT_RECONCILES", 1024, 1, 8192)),
            api_threads=int(_number(env, "KUBETRAIN_API_THREADS", 32, 1, 256)),
            resync_seconds=_number(env, "KUBETRAIN_RESYNC_SECONDS", 60.0, 1, 3600),
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
