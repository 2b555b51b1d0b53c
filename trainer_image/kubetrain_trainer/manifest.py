"""The checkpoint commit record and the rules that read it.

A checkpoint in storage exists for resume only when its `manifest.json` is
present, valid, and matches the files beside it (docs/contract.md). This module
holds everything about that record that needs no network: building it from a
local folder, parsing and validating it, choosing the newest complete
checkpoint, deciding whether a write is fenced off by a newer attempt, and
planning remote retention. `storage.py` and `sync.py` do the I/O around it;
keeping the rules here lets them be table-tested in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Mapping

from kubetrain_trainer.readiness import is_marker_name

FORMAT = 1
MANIFEST_NAME = "manifest.json"
_NODE_PART = re.compile(r"^manifest\.node-(\d+)\.json$")
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


class ManifestError(ValueError):
    """A manifest (or part manifest) is malformed: the checkpoint is incomplete."""


def checkpoint_dirname(step: int) -> str:
    return f"checkpoint-{step}"


def parse_checkpoint_dirname(name: str) -> int | None:
    """The step of a `checkpoint-<step>` folder name, None for any other name."""
    m = _CHECKPOINT_DIR.match(name)
    return int(m.group(1)) if m else None


def node_part_name(node_rank: int) -> str:
    return f"manifest.node-{node_rank}.json"


def is_manifest_name(name: str) -> bool:
    """Commit records are never listed as checkpoint files themselves."""
    return name == MANIFEST_NAME or _NODE_PART.match(name) is not None


def utc_now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, relative to the checkpoint folder (POSIX separators)."""

    path: str
    size: int
    sha256: str

    def for_storage(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_storage(cls, raw: Any) -> "FileEntry":
        if not isinstance(raw, Mapping):
            raise ManifestError(f"files: entry must be an object, got {type(raw).__name__}")
        path, size, digest = raw.get("path"), raw.get("size"), raw.get("sha256")
        if not isinstance(path, str) or not is_safe_relpath(path):
            raise ManifestError(f"files: unsafe or missing path {path!r}")
        if is_manifest_name(path):
            raise ManifestError(f"files: {path!r} is a commit record, not a checkpoint file")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"files[{path}]: size must be a non-negative integer")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ManifestError(f"files[{path}]: sha256 must be 64 lowercase hex digits")
        return cls(path=path, size=size, sha256=digest)


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


CLAIMS_FOLDER = "attempts"
"""`<uri>/attempts/<incarnation>-<attempt>.json`: one claim per attempt, written by node rank 0 at start."""


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
        return f"{self.incarnation}-{self.attempt}.json"

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


def parse_claim_name(name: str) -> tuple[int, int] | None:
    """(incarnation, attempt) from `<incarnation>-<attempt>.json`, None for anything else."""
    stem, dot, ext = name.partition(".")
    inc, dash, att = stem.partition("-")
    if not (dot and ext == "json" and dash and inc.isdigit() and att.isdigit()):
        return None
    return int(inc), int(att)


def merge_parts(parts: Iterable[NodePart], *, step: int, attempt: int, nnodes: int,
                incarnation: int = 0) -> tuple[FileEntry, ...]:
    """All nodes' files for one checkpoint, or ManifestError when they cannot be committed.

    Parts of another attempt, incarnation or step never count (a zombie's upload is not ours).
    The same path from two nodes must have the same content: otherwise which
    copy is in storage depends on upload order, and that is not a checkpoint.
    """
    by_rank = {p.node_rank: p for p in parts if p.step == step and p.writer == (incarnation, attempt)}
    missing = [r for r in range(nnodes) if r not in by_rank]
    if missing:
        raise ManifestError(f"node parts missing for node ranks {missing}")
    merged: dict[str, FileEntry] = {}
    for rank in sorted(by_rank):
        for f in by_rank[rank].files:
            other = merged.get(f.path)
            if other is not None and other.sha256 != f.sha256:
                raise ManifestError(f"{f.path}: written with different content by several nodes")
            merged[f.path] = f
    return tuple(sorted(merged.values(), key=lambda f: f.path))


# ---------------------------------------------------------------- local folders


def sha256_file(path: Path, *, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def scan_folder(folder: Path) -> tuple[FileEntry, ...]:
    """Every regular file under `folder` (commit records and ready markers excluded), hashed, sorted by path."""
    entries = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            full = Path(root) / name
            rel = full.relative_to(folder).as_posix()
            if is_manifest_name(rel) or is_marker_name(name) or full.is_symlink() or not full.is_file():
                continue
            entries.append(FileEntry(path=rel, size=full.stat().st_size, sha256=sha256_file(full)))
    return tuple(sorted(entries, key=lambda f: f.path))


def verify_local(folder: Path, files: Iterable[FileEntry]) -> list[str]:
    """Why the files under `folder` do not match `files`; [] when every one matches byte for byte."""
    problems = []
    for f in files:
        p = folder / f.path
        if not p.is_file():
            problems.append(f"{f.path}: missing")
        elif p.stat().st_size != f.size:
            problems.append(f"{f.path}: size {p.stat().st_size} != {f.size}")
        elif sha256_file(p) != f.sha256:
            problems.append(f"{f.path}: sha256 mismatch")
    return problems


def read_trainer_metrics(folder: Path, step: int) -> tuple[dict[str, float], BestCheckpoint | None]:
    """Metrics logged at `step` and the best-checkpoint record, from the HF-style trainer_state.json.

    Missing or unreadable state yields no metrics: an arbitrary user command
    may not write one, and that must not stop the upload.
    """
    path = folder / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, None
    metrics: dict[str, float] = {}
    for entry in state.get("log_history") or []:
        if isinstance(entry, Mapping) and entry.get("step") == step:
            metrics.update(_numeric_only(entry))
    metrics.pop("step", None)
    best = None
    best_value = state.get("best_metric")
    best_dir = state.get("best_model_checkpoint")
    best_step = state.get("best_global_step")
    if not isinstance(best_step, int) and isinstance(best_dir, str):
        best_step = parse_checkpoint_dirname(PurePosixPath(best_dir.rstrip("/")).name)
    if best_value is not None or best_step is not None:
        best = BestCheckpoint(
            metric=state.get("metric_for_best_model") if isinstance(state.get("metric_for_best_model"), str) else None,
            value=float(best_value) if isinstance(best_value, (int, float)) else None,
            step=best_step if isinstance(best_step, int) else None,
        )
    return metrics, best


def build_manifest(
    folder: Path,
    *,
    step: int,
    attempt: int,
    world_size: int,
    strategy: str,
    files: tuple[FileEntry, ...] | None = None,
    created: str | None = None,
    incarnation: int = 0,
) -> Manifest:
    """The manifest for a complete local checkpoint folder (files hashed unless given)."""
    metrics, best = read_trainer_metrics(folder, step)
    return Manifest(
        step=step,
        attempt=attempt,
        incarnation=incarnation,
        world_size=world_size,
        strategy=strategy,
        files=files if files is not None else scan_folder(folder),
        metrics=metrics,
        created=created or utc_now_rfc3339(),
        best=best,
    )


# ---------------------------------------------------------------- decisions


@dataclass(frozen=True)
class RemoteCheckpoint:
    """What storage holds under one `checkpoint-<step>/` prefix."""

    step: int
    manifest: Manifest | None
    """None when there is no manifest, or it did not parse: the folder is torn."""
    listing: Mapping[str, int] = field(default_factory=dict)
    """Relative object path -> size, as listed (commit records included)."""

    @property
    def complete(self) -> bool:
        return self.manifest is not None and self.manifest.step == self.step and not self.manifest.mismatches(self.listing)


def newest_complete(checkpoints: Iterable[RemoteCheckpoint], *, exclude: Iterable[int] = ()) -> RemoteCheckpoint | None:
    """The complete checkpoint with the highest step (skipping steps known bad), or None."""
    skip = set(exclude)
    best = None
    for c in checkpoints:
        if c.complete and c.step not in skip and (best is None or c.step > best.step):
            best = c
    return best


def is_already_committed(existing: RemoteCheckpoint | None, *, attempt: int, files: Iterable[FileEntry],
                         nnodes: int, incarnation: int = 0) -> bool:
    """Whether `existing` is this attempt's complete commit of a checkpoint holding this node's `files`.

    Single node: the manifest lists exactly these files. Multi-node: the
    manifest is the merge of every node's part, so this node's files must be
    a subset of it (same path, size and digest), never equal to it. Getting
    this wrong on node rank 0 un-commits its own newest checkpoint on a retry.
    """
    if existing is None or not existing.complete or existing.manifest is None \
            or existing.manifest.writer != (incarnation, attempt):
        return False
    own, committed = set(files), set(existing.manifest.files)
    return own == committed if nnodes == 1 else own <= committed


@dataclass(frozen=True)
class MultipartUpload:
    """An incomplete multipart upload under the job's prefix (what S3 bills for until it is aborted)."""

    key: str
    upload_id: str
    initiated: datetime


def stale_multipart_uploads(uploads: Iterable[MultipartUpload], *, attempt_started: datetime,
                            margin_s: float = 300.0) -> list[MultipartUpload]:
    """The incomplete multipart uploads that an earlier attempt left behind (killed mid-upload).

    Attempts never overlap, so an upload begun before this attempt started
    belongs to a writer that is gone. `margin_s` absorbs clock skew between
    this node and the S3 server; uploads begun within it are left alone (they
    waste space at worst, and a later attempt aborts them).
    """
    limit = attempt_started.timestamp() - margin_s
    return [u for u in uploads if u.initiated.timestamp() < limit]


@dataclass(frozen=True)
class Fence:
    """Whether an attempt may commit a checkpoint at a step."""

    allowed: bool
    reason: str


def check_fence(
    checkpoints: Iterable[RemoteCheckpoint],
    *,
    step: int,
    attempt: int,
    history: frozenset[tuple[int, int, int]] = frozenset(),
    incarnation: int = 0,
    claims: Iterable[tuple[int, int]] = (),
) -> Fence:
    """Write fencing: an older writer never overwrites, nor runs beside, a newer one.

    Writers are ordered by (incarnation, attempt): the job's creation time
    first (a TrainingJob deleted and re-created under the same name is a newer
    incarnation, whose attempts restart at 1), then the attempt.
    - A step committed by a newer writer is never overwritten.
    - Attempts never overlap (the operator removes attempt N before N+1
      starts), so a newer writer's manifest that appeared after this process
      started (not in `history`, the (step, incarnation, attempt) triples seen
      at start) means this process is a zombie: it commits nothing.
    Newer manifests already present at start are history (written before the
    incarnation was recorded, or by a job whose clock ran ahead): only their
    own steps are protected.
    - `claims`, the (incarnation, attempt) of every attempt that has started
      (`AttemptClaim`): a newer one means this process is a zombie even before
      the newer attempt commits anything (it may be restoring right now).
    """
    me = (incarnation, attempt)
    newer = [w for w in claims if w > me]
    if newer:
        return Fence(False, f"{_writer_name(max(newer), me)} has started")
    for c in checkpoints:
        if c.manifest is None or c.manifest.writer <= me:
            continue
        who = _writer_name(c.manifest.writer, me)
        if c.step == step:
            return Fence(False, f"checkpoint-{step} is committed by {who}")
        if (c.step, *c.manifest.writer) not in history:
            return Fence(False, f"{who} committed checkpoint-{c.step} while this writer runs")
    return Fence(True, "no newer writer is in the way")


def _writer_name(writer: tuple[int, int], me: tuple[int, int]) -> str:
    if writer[0] != me[0]:
        return f"a newer incarnation of the job (created at {writer[0]} > {me[0]}, attempt {writer[1]})"
    return f"attempt {writer[1]} > {me[1]}"


@dataclass(frozen=True)
class RetentionPolicy:
    """Remote retention, following the trainer's `save_total_limit` semantics."""

    save_total_limit: int | None = None
    """Complete checkpoints to keep (None or <= 0: keep all)."""
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    """None: HF default (True unless the metric name ends in 'loss')."""

    def better(self, a: float, b: float) -> bool:
        greater = self.greater_is_better
        if greater is None:
            greater = not (self.metric_for_best_model or "loss").endswith("loss")
        return a > b if greater else a < b

    def metric_key(self) -> str | None:
        m = self.metric_for_best_model
        if not m:
            return None
        return m if m.startswith("eval_") else f"eval_{m}"


@dataclass(frozen=True)
class RetentionPlan:
    delete: tuple[int, ...]
    keep: tuple[int, ...]
    protected: Mapping[int, str]
    """Step -> why it may not be deleted (newest, best, in flight)."""


def best_step(checkpoints: Iterable[RemoteCheckpoint], policy: RetentionPolicy) -> int | None:
    """The best complete checkpoint by the policy's metric, else as the newest manifest recorded it."""
    complete = sorted((c for c in checkpoints if c.complete), key=lambda c: c.step)
    key = policy.metric_key()
    winner: tuple[float, int] | None = None
    if key is not None:
        for c in complete:
            assert c.manifest is not None
            value = c.manifest.metrics.get(key, c.manifest.metrics.get(policy.metric_for_best_model or ""))
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            if winner is None or policy.better(value, winner[0]):
                winner = (value, c.step)
    if winner is not None:
        return winner[1]
    for c in reversed(complete):
        assert c.manifest is not None
        if c.manifest.best is not None and c.manifest.best.step is not None:
            return c.manifest.best.step
    return None


def plan_retention(
    checkpoints: Iterable[RemoteCheckpoint],
    policy: RetentionPolicy,
    *,
    in_flight: Iterable[int] = (),
) -> RetentionPlan:
    """Which remote checkpoints to delete.

    Invariants (table-tested):
    - the newest complete checkpoint is never deleted (it is what resume uses,
      and a newer one may still be uploading);
    - the best checkpoint (by metric_for_best_model) is never deleted;
    - a step still uploading (in_flight) is never deleted;
    - torn folders (no valid manifest) are deleted only below the newest
      complete step: above it they may be another node's upload in progress,
      and a later commit at the same step overwrites them anyway;
    - beyond that, the newest complete ones are kept up to save_total_limit.
    """
    checkpoints = list(checkpoints)
    flying = set(in_flight)
    newest = newest_complete(checkpoints)
    protected: dict[int, str] = {s: "uploading" for s in flying}
    if newest is not None:
        protected.setdefault(newest.step, "newest complete")
    best = best_step(checkpoints, policy)
    if best is not None and any(c.step == best and c.complete for c in checkpoints):
        protected.setdefault(best, "best")
    delete: list[int] = []
    keep: list[int] = []
    limit = policy.save_total_limit if policy.save_total_limit and policy.save_total_limit > 0 else None
    kept_complete = sum(1 for c in checkpoints if c.complete and c.step in protected)
    for c in sorted(checkpoints, key=lambda c: c.step, reverse=True):
        if c.step in protected:
            keep.append(c.step)
        elif not c.complete:
            if newest is not None and c.step < newest.step:
                delete.append(c.step)
            else:
                keep.append(c.step)
        elif limit is None or kept_complete < limit:
            keep.append(c.step)
            kept_complete += 1
        else:
            delete.append(c.step)
    return RetentionPlan(delete=tuple(sorted(delete)), keep=tuple(sorted(keep)), protected=protected)


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
    "FORMAT",
    "MANIFEST_NAME",
    "BestCheckpoint",
    "Fence",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "NodePart",
    "RemoteCheckpoint",
    "RetentionPlan",
    "RetentionPolicy",
    "best_step",
    "build_manifest",
    "check_fence",
    "is_already_committed",
    "stale_multipart_uploads",
    "MultipartUpload",
    "checkpoint_dirname",
    "merge_parts",
    "newest_complete",
    "node_part_name",
    "parse_checkpoint_dirname",
    "plan_retention",
    "scan_folder",
    "verify_local",
]
