"""Decisions on the records in storage: commit, fence, retention, restore choice. Pure: no I/O, no boto3.

Each function takes what storage holds (`RemoteCheckpoint`s, node parts,
claims, multipart uploads, as `storage.py` lists them) plus who is asking, and
returns what to do; `commit.py`, `retention.py` and the launcher's restore do the
I/O around them. That is the shape of the operator's `plan.py`, and the tests are
tables like its own
(tests/unit/trainer_storage/test_ckpt_commit_plan.py, test_ckpt_manifest.py).
An import-linter contract keeps boto3 and storage out of this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterable, Literal, Mapping

from kubetrain_trainer.layout import metric_key, parse_corrupt_marker
from kubetrain_trainer.manifest import FileEntry, Manifest, ManifestError, NodePart


class MissingPartsError(ManifestError):
    """Some nodes have not written their part of a multi-node checkpoint (yet): node rank 0 waits, or gives up."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = tuple(sorted(ranks))
        super().__init__(f"node parts missing for node ranks {list(self.ranks)}")


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
        """Committed, every file there at its size, and no node found a file of this commit corrupt."""
        return (self.manifest is not None and self.manifest.step == self.step
                and not self.manifest.mismatches(self.listing)
                and self.manifest.writer not in map(parse_corrupt_marker, self.listing))


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
    this wrong on node rank 0 un-commits its own newest checkpoint on a retry
    (another node first checks its own part: `commit.CommitProtocol`).
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
        return metric_key(m) if m else None


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
            # HF ranks only by the eval_-prefixed metric: a checkpoint without it at
            # its step (an emergency save between evaluations) is never the best.
            value = c.manifest.metrics.get(key)
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


def _parts_of(parts: Iterable[NodePart], *, step: int, attempt: int, incarnation: int) -> dict[int, NodePart]:
    """This writer's parts of `step`, by node rank: parts of another attempt, incarnation or step never
    count (a zombie's upload is not ours)."""
    return {p.node_rank: p for p in parts if p.step == step and p.writer == (incarnation, attempt)}


def merge_parts(parts: Iterable[NodePart], *, step: int, attempt: int, nnodes: int,
                incarnation: int = 0) -> tuple[FileEntry, ...]:
    """All nodes' files for one checkpoint; MissingPartsError while some node has not written its part,
    ManifestError when the parts can never be committed.

    A path that several nodes wrote with different content is node rank 0's: with HF's
    `save_on_each_node=True` every node writes the whole folder, and `trainer_state.json` (its
    `is_world_process_zero`) or `training_args.bin` differ by node. Node rank 0 then uploads its copy
    again, after every part is in (`rewrites`), so storage holds the bytes the manifest names. A path
    node rank 0 lacks must have one content: otherwise which copy is in storage depends on upload order.
    """
    by_rank = _parts_of(parts, step=step, attempt=attempt, incarnation=incarnation)
    missing = [r for r in range(nnodes) if r not in by_rank]
    if missing:
        raise MissingPartsError(missing)
    merged: dict[str, FileEntry] = {}
    node_zero = {f.path for f in by_rank[0].files}
    for rank in sorted(by_rank):
        for f in by_rank[rank].files:
            other = merged.get(f.path)
            if other is None:
                merged[f.path] = f
            elif (other.algorithm, other.digest) != (f.algorithm, f.digest) and f.path not in node_zero:
                raise ManifestError(f"{f.path}: written with different content by several nodes (not node rank 0)")
    return tuple(sorted(merged.values(), key=lambda f: f.path))


def rewrites(parts: Iterable[NodePart], merged: Iterable[FileEntry], *, step: int, attempt: int,
             incarnation: int = 0) -> tuple[str, ...]:
    """The paths of `merged` (node rank 0's entries) that another node's part lists with other content:
    that node may have uploaded its copy after node rank 0's, so node rank 0 uploads these again before
    the manifest (each node writes its part only once its own uploads are done)."""
    by_rank = _parts_of(parts, step=step, attempt=attempt, incarnation=incarnation)
    mine = {f.path: (f.algorithm, f.digest) for f in merged}
    return tuple(sorted({f.path for rank, part in by_rank.items() if rank != 0 for f in part.files
                         if f.path in mine and mine[f.path] != (f.algorithm, f.digest)}))


@dataclass(frozen=True)
class CommitPlan:
    """What the uploader does with one local checkpoint, given what storage holds at its step."""

    action: Literal["fenced", "committed", "upload"]
    """fenced: a newer writer is in the way, commit nothing; committed: storage already holds this
    writer's commit of these files (a retry after the commit went through); upload: upload, then commit."""
    reason: str
    uncommit_first: bool = False
    """Storage holds another commit at this step (an older writer's, or other content): its manifest goes
    first, so the folder is torn while it is rewritten, never a mix of two checkpoints."""


def plan_commit(
    remote: Iterable[RemoteCheckpoint],
    *,
    step: int,
    files: Iterable[FileEntry],
    attempt: int,
    incarnation: int = 0,
    nnodes: int = 1,
    history: frozenset[tuple[int, int, int]] = frozenset(),
    claims: Iterable[tuple[int, int]] = (),
) -> CommitPlan:
    """The commit decision for this node's `files` of checkpoint `step`, from the remote listing.

    Invariants (table-tested): a fenced writer (`check_fence`) never uploads;
    a checkpoint this writer already committed with these files is not
    uploaded again (multi-node: this node's files are part of the merged
    manifest); any other manifest at this step is removed before the first
    file is written; a torn folder (no manifest) is simply overwritten.
    """
    remote = list(remote)
    files = tuple(files)
    fence = check_fence(remote, step=step, attempt=attempt, history=history, incarnation=incarnation, claims=claims)
    if not fence.allowed:
        return CommitPlan("fenced", fence.reason)
    existing = next((c for c in remote if c.step == step), None)
    if existing is None or existing.manifest is None:
        return CommitPlan("upload", "nothing committed at this step")
    if is_already_committed(existing, attempt=attempt, files=files, nnodes=nnodes, incarnation=incarnation):
        return CommitPlan("committed", "already committed with the same content")
    return CommitPlan("upload", "another commit holds this step: uncommit it first", uncommit_first=True)


__all__ = [
    "CommitPlan",
    "Fence",
    "MissingPartsError",
    "MultipartUpload",
    "RemoteCheckpoint",
    "RetentionPlan",
    "RetentionPolicy",
    "best_step",
    "check_fence",
    "plan_commit",
    "is_already_committed",
    "merge_parts",
    "newest_complete",
    "plan_retention",
    "rewrites",
    "stale_multipart_uploads",
]
