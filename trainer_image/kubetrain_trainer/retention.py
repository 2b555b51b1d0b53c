"""Remote retention after a commit (node rank 0): delete what the policy drops, abort uploads left torn.

The I/O around `decisions.plan_retention` and `decisions.stale_multipart_uploads`.
Invariants:

- the newest complete checkpoint is never deleted: it is what the next attempt
  restores, also while another one may still be uploading;
- a zombie may waste space, never delete: once a newer writer (attempt or
  incarnation) has committed or claimed, this writer deletes nothing, not even
  its own old steps, and no writer ever deletes a checkpoint a newer writer
  committed; the claims fence is re-read before every delete;
- best effort: the commit before it stands whatever fails here (a failure never
  sends the committed step back through the upload path); what is left over is
  retried after the next commit.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING, Callable

from kubetrain_trainer.commit import ClaimsFence, FencedError, SyncSettings
from kubetrain_trainer.decisions import check_fence, plan_retention, stale_multipart_uploads
from kubetrain_trainer.storage_errors import StorageError

if TYPE_CHECKING:
    from kubetrain_trainer.storage import CheckpointStore

log = logging.getLogger(__name__)


def apply_retention(store: CheckpointStore, settings: SyncSettings, fence: ClaimsFence, *,
                    pending_steps: Callable[[], list[int]], started_at: datetime) -> None:
    """Node rank 0, after a commit: remote retention, then aborting uploads an earlier attempt left torn.

    `pending_steps()` are this node's checkpoints not yet committed (never
    deleted); multipart uploads begun before `started_at` (this attempt's
    uploader start, less the clock skew margin) are an earlier attempt's.
    """
    s = settings
    if s.node_rank != 0:
        return
    try:
        remote = store.list_checkpoints()
        fenced = check_fence(remote, step=-1, attempt=s.attempt, history=s.history, incarnation=s.incarnation,
                             claims=fence.new_claims())
        if not fenced.allowed:
            log.warning("remote retention skipped: %s", fenced.reason)
            return
        mine_or_older = [c for c in remote if c.manifest is None or c.manifest.writer <= (s.incarnation, s.attempt)]
        plan = plan_retention(mine_or_older, s.retention, in_flight=pending_steps())
        newest = max((c.step for c in remote if c.complete), default=None)
        for step in plan.delete:
            if step == newest:
                continue  # the newest committed checkpoint is what the next attempt restores
            fence.check(step)  # per delete: a newer attempt may be restoring this very step
            log.info("deleting remote checkpoint-%d (retention; kept %s)", step, dict(plan.protected))
            store.delete_checkpoint(step)
        for upload in stale_multipart_uploads(store.list_multipart_uploads(), attempt_started=started_at,
                                              margin_s=s.stale_upload_margin_s):
            log.info("aborting an incomplete multipart upload of %s left by an earlier attempt", upload.key)
            store.abort_multipart_upload(upload)
    except FencedError as e:
        log.warning("remote retention stopped: %s", e)
    except (StorageError, OSError) as e:
        log.warning("remote retention incomplete (%s); retried after the next commit", e)
    except Exception:  # a bug here must not make a committed checkpoint look failed
        log.exception("remote retention failed on an unexpected error; retried after the next commit")
