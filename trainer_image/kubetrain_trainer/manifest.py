"""The checkpoint commit record: `manifest.json` and its sibling records, built, parsed and validated.

A checkpoint in storage exists for resume only when its `manifest.json` is
present, valid, and matches the files beside it (docs/contract.md). This
module is that format and nothing else: the manifest, each node's part of a
multi-node checkpoint and the attempt claim, each a frozen value with
`to_json`/`from_json` that refuses a malformed record with `ManifestError`.
Where the records live is `layout.py`; hashing a local folder into one is
`hashing.py`; what to do given the records in storage is `decisions.py`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import PurePosixPath
from typing import Any, Mapping

from kubetrain_trainer.layout import MANIFEST_NAME, claim_name, is_manifest_name

FORMAT = 1


class ManifestError(ValueError):
    """A manifest (or part manifest) is malformed: the checkpoint is incomplete."""


def rfc3339(epoch_s: float | None = None) -> str:
    """A record's time (``epoch_s``, or now): RFC 3339 in UTC to the second. The trainer's only time formatter."""
    when = datetime.now(timezone.utc) if epoch_s is None else datetime.fromtimestamp(epoch_s, timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_now_rfc3339() -> str:
    """Now, as `rfc3339` writes it."""
    return rfc3339()


XXH128 = "xxh128"
SHA256 = "sha256"
DIGESTS = {XXH128: 32, SHA256: 64}
"""The digests a file's entry may carry, by their key in the entry and their length in hex digits.
New records carry `xxh128` (its definition: `hashing.py`); `sha256` is what records written before it
carry, still read and checked."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, relative to the checkpoint folder (POSIX separators)."""

    path: str
    size: int
    digest: str
    algorithm: str = XXH128

    def for_storage(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, self.algorithm: self.digest}

    @classmethod
    def from_storage(cls, raw: Any) -> "FileEntry":
        if not isinstance(raw, Mapping):
            raise ManifestError(f"files: entry must be an object, got {type(raw).__name__}")
        path, size = raw.get("path"), raw.get("size")
        if not isinstance(path, str) or not is_safe_relpath(path):
            raise ManifestError(f"files: unsafe or missing path {path!r}")
        if is_manifest_name(path):
            raise ManifestError(f"files: {path!r} is a commit record, not a checkpoint file")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"files[{path}]: size must be a non-negative integer")
        named = [a for a in DIGESTS if a in raw]
        if len(named) != 1:
            raise ManifestError(f"files[{path}]: needs exactly one digest, xxh128 or sha256; got "
                                f"{', '.join(named) or 'none'}")
        algorithm = named[0]
        digest = raw[algorithm]
        if not isinstance(digest, str) or not re.fullmatch(f"[0-9a-f]{{{DIGESTS[algorithm]}}}", digest):
            raise ManifestError(f"files[{path}]: {algorithm} must be {DIGESTS[algorithm]} lowercase hex digits")
        return cls(path=path, size=size, digest=digest, algorithm=algorithm)


def is_safe_relpath(path: str) -> bool:
    """A relative POSIX path that cannot escape the checkpoint folder."""
    if not path or path.startswith("/") or "\\" in path:
        return False
    parts = PurePosixPath(path).parts
    return all(p not in ("", ".", "..") for p in parts)


@dataclass(frozen=True)
class BestCheckpoint:
    """What the trainer believed was the best checkpoint when this one was saved."""

    metric: str | None
    value: float | None
    step: int | None

    def for_storage(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "step": self.step}

    @classmethod
    def from_storage(cls, raw: Any) -> "BestCheckpoint | None":
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ManifestError("best: must be an object")
        value = raw.get("value")
        step = raw.get("step")
        return cls(
            metric=raw.get("metric") if isinstance(raw.get("metric"), str) else None,
            value=float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None,
            step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        )


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint (`manifest.json`)."""

    step: int
    attempt: int
    world_size: int
    strategy: str
    files: tuple[FileEntry, ...]
    metrics: Mapping[str, float] = field(default_factory=dict)
    created: str = ""
    best: BestCheckpoint | None = None
    """Optional extension: the trainer's best checkpoint at save time (from trainer_state.json)."""
    incarnation: int = 0
    """KUBETRAIN_JOB_INCARNATION of the writer (0: unknown, e.g. written before it existed)."""
    format: int = FORMAT

    @property
    def writer(self) -> tuple[int, int]:
        """(incarnation, attempt): the order of writers the fence enforces."""
        return (self.incarnation, self.attempt)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def for_storage(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": self.format,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "files": [f.for_storage() for f in self.files],
            "metrics": dict(self.metrics),
            "created": self.created,
        }
        if self.incarnation:
            out["incarnation"] = self.incarnation
        if self.best is not None:
            out["best"] = self.best.for_storage()
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.for_storage(), indent=1, sort_keys=True).encode()

    @classmethod
    def from_storage(cls, raw: Any) -> "Manifest":
        if not isinstance(raw, Mapping):
            raise ManifestError("manifest must be a JSON object")
        if raw.get("format") != FORMAT:
            raise ManifestError(f"format: unsupported value {raw.get('format')!r}, expected {FORMAT}")
        step = _int_field(raw, "step", minimum=0)
        attempt = _int_field(raw, "attempt", minimum=1)
        world_size = _int_field(raw, "world_size", minimum=1)
        strategy = raw.get("strategy")
        if not isinstance(strategy, str) or not strategy:
            raise ManifestError("strategy: must be a non-empty string")
        files_raw = raw.get("files")
        if not isinstance(files_raw, list):
            raise ManifestError("files: must be a list")
        files = tuple(FileEntry.from_storage(f) for f in files_raw)
        seen: set[str] = set()
        for f in files:
            if f.path in seen:
                raise ManifestError(f"files: {f.path!r} listed twice")
            seen.add(f.path)
        metrics_raw = raw.get("metrics", {})
        if not isinstance(metrics_raw, Mapping):
            raise ManifestError("metrics: must be an object")
        created = raw.get("created", "")
        if not isinstance(created, str):
            raise ManifestError("created: must be an RFC3339 string")
        return cls(
            step=step,
            attempt=attempt,
            world_size=world_size,
            strategy=strategy,
            files=files,
            metrics=_numeric_only(metrics_raw),
            created=created,
            best=BestCheckpoint.from_storage(raw.get("best")),
            incarnation=_incarnation(raw),
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> "Manifest":
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        return cls.from_storage(raw)

    def mismatches(self, listing: Mapping[str, int]) -> list[str]:
        """Why the stored objects (relative path -> size) do not match this manifest; [] when they do.

        Extra objects are allowed (a torn earlier upload may have left some);
        only listed files are ever restored.
        """
        problems = []
        for f in self.files:
            if f.path not in listing:
                problems.append(f"{f.path}: missing")
            elif listing[f.path] != f.size:
                problems.append(f"{f.path}: size {listing[f.path]} != {f.size}")
        return problems


@dataclass(frozen=True)
class NodePart:
    """One node's share of a sharded checkpoint (`manifest.node-<r>.json`).

    With shared-nothing pods each node uploads the files it wrote and then this
    record; node rank 0 merges every node's part into the final manifest.
    """

    node_rank: int
    step: int
    attempt: int
    files: tuple[FileEntry, ...]
    incarnation: int = 0

    @property
    def writer(self) -> tuple[int, int]:
        return (self.incarnation, self.attempt)

    def to_json(self) -> bytes:
        out: dict[str, Any] = {
            "format": FORMAT,
            "node_rank": self.node_rank,
            "step": self.step,
            "attempt": self.attempt,
            "files": [f.for_storage() for f in self.files],
        }
        if self.incarnation:
            out["incarnation"] = self.incarnation
        return json.dumps(out, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "NodePart":
        raw = _load_record(data, "node part")
        files_raw = raw.get("files")
        if not isinstance(files_raw, list):
            raise ManifestError("node part files: must be a list")
        return cls(
            node_rank=_int_field(raw, "node_rank", minimum=0),
            step=_int_field(raw, "step", minimum=0),
            attempt=_int_field(raw, "attempt", minimum=1),
            files=tuple(FileEntry.from_storage(f) for f in files_raw),
            incarnation=_incarnation(raw),
        )


def _load_record(data: bytes | str, what: str) -> Mapping[str, Any]:
    """A small JSON record of this format (node part, attempt claim), or ManifestError naming it."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(raw, Mapping) or raw.get("format") != FORMAT:
        raise ManifestError(f"{what}: unsupported format")
    return raw


def _incarnation(raw: Mapping[str, Any]) -> int:
    """The writer's incarnation; 0 for records written before incarnations existed."""
    return _int_field(raw, "incarnation", minimum=0) if "incarnation" in raw else 0


@dataclass(frozen=True)
class AttemptClaim:
    """Node rank 0's record that an attempt has started, and (once decided) which step all its
    ranks restore. Its existence fences every older writer (a zombie attempt commits and deletes
    nothing once a newer one has started); its `restore_step` is the one decision every rank of
    the attempt follows, so no two ranks resume from different steps."""

    incarnation: int
    attempt: int
    decided: bool = False
    restore_step: int | None = None
    """The step every rank restores; None when decided: start from scratch."""

    @property
    def writer(self) -> tuple[int, int]:
        return (self.incarnation, self.attempt)

    @property
    def name(self) -> str:
        return claim_name(self.incarnation, self.attempt)

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "incarnation": self.incarnation, "attempt": self.attempt,
                           "decided": self.decided, "restore_step": self.restore_step}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "AttemptClaim":
        raw = _load_record(data, "attempt claim")
        step = raw.get("restore_step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ManifestError("attempt claim restore_step: must be a step or null")
        return cls(incarnation=_int_field(raw, "incarnation", minimum=0), attempt=_int_field(raw, "attempt", minimum=1),
                   decided=raw.get("decided") is True, restore_step=step)


def _int_field(raw: Mapping[str, Any], name: str, *, minimum: int) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ManifestError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


def _numeric_only(raw: Mapping[str, Any]) -> dict[str, float]:
    return {
        str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }



__all__ = [
    "DIGESTS",
    "FORMAT",
    "MANIFEST_NAME",
    "SHA256",
    "XXH128",
    "AttemptClaim",
    "BestCheckpoint",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "NodePart",
    "is_safe_relpath",
    "rfc3339",
    "utc_now_rfc3339",
]
