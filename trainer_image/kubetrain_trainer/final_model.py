"""Uploads the finished run's model (the `from_pretrained` layout) to `<uri>/final/`, manifest last.

Node rank 0, after the workers succeeded and every checkpoint is committed:
the top-level files of the output folder (not the checkpoint folders, not
hidden staging folders), each retried with the uploader's backoff until the
deadline, then `final/manifest.json`, so a torn final upload is recognisable. An older
`final/manifest.json` is removed first, before any of its files is overwritten.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from kubetrain_trainer.commit import SyncSettings
from kubetrain_trainer.hashing import file_digest, scan_folder
from kubetrain_trainer.layout import FINAL_FOLDER, MANIFEST_NAME, TMP_PREFIX, parse_checkpoint_dirname
from kubetrain_trainer.manifest import FileEntry, Manifest, utc_now_rfc3339
from kubetrain_trainer.retry import retrying
from kubetrain_trainer.storage import CheckpointStore

log = logging.getLogger(__name__)


def upload_final_model(store: CheckpointStore, output_dir: Path, settings: SyncSettings, *, step: int,
                       deadline: float, still_allowed: Callable[[], None] | None = None,
                       cancelled: Callable[[], bool] = lambda: False,
                       before_manifest: Callable[[], None] | None = None) -> str | None:
    """Upload the finished run's top-level outputs (the `from_pretrained` layout) to `<uri>/final/`.

    Everything directly produced in `output_dir` except checkpoint folders and
    hidden staging folders; `manifest.json` is written last, as for checkpoints,
    so a torn final upload is recognisable. Returns the folder's URI, or None
    when there was nothing to upload. `still_allowed` is called before each file and the manifest and
    as bytes go out; what it raises (out of time, a newer attempt's claim) stops the upload; `cancelled()`
    true: no retry. `before_manifest` (default: `still_allowed`) is the last word before the commit.
    """
    found: list[FileEntry] = []
    for entry in sorted(output_dir.iterdir()):
        name = entry.name
        if name.startswith((".", f"{TMP_PREFIX}-")) or parse_checkpoint_dirname(name) is not None:
            continue  # checkpoints have their own folders; hidden ones are staging
        if entry.is_file() and not entry.is_symlink():
            found.append(FileEntry(path=name, size=entry.stat().st_size, digest=file_digest(entry)))
        elif entry.is_dir() and not entry.is_symlink():
            found.extend(FileEntry(f"{name}/{f.path}", f.size, f.digest, f.algorithm) for f in scan_folder(entry))
    files = tuple(found)
    if not files:
        return None
    # An older run's complete `final/` may be there: uncommit it before any file of it is overwritten, so
    # an interrupted re-upload leaves a torn folder, never the old manifest over a mix of old and new files.
    if still_allowed is not None:
        still_allowed()
    retrying(lambda: store.uncommit(step, folder=FINAL_FOLDER), deadline=deadline, backoff=settings.backoff,
             what="uncommitting final/", cancelled=cancelled)
    for f in files:
        if still_allowed is not None:
            still_allowed()
        retrying(lambda: store.upload_file(step, output_dir / f.path, f.path, folder=FINAL_FOLDER,
                                           still_allowed=still_allowed),
                 deadline=deadline, backoff=settings.backoff, what=f"final/{f.path}", cancelled=cancelled)
    manifest = Manifest(step=step, attempt=settings.attempt, world_size=settings.world_size,
                        strategy=settings.strategy, files=files, created=utc_now_rfc3339(),
                        incarnation=settings.incarnation)
    check = before_manifest or still_allowed
    if check is not None:
        check()
    retrying(lambda: store.put_bytes(step, MANIFEST_NAME, manifest.to_json(), folder=FINAL_FOLDER),
             deadline=deadline, backoff=settings.backoff, what="final/manifest.json", cancelled=cancelled)
    log.info("final model uploaded to %s (%d files)", store.folder_uri(FINAL_FOLDER), len(files))
    return store.folder_uri(FINAL_FOLDER)
