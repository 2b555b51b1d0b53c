"""The finished model's upload (`final_model.upload_final_model`): its manifest last, and stopped, with no
manifest, by what `still_allowed` raises (the grace period is over, or a newer attempt claimed the
location: a zombie must not write `final/`). The store is a recorder at the storage boundary; the real
upload to MinIO is in tests/integration/trainer_storage/test_ckpt_launcher_minio.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain_trainer.commit import FencedError, SyncSettings, UploadStopped
from kubetrain_trainer.final_model import upload_final_model


class Store:
    def __init__(self) -> None:
        self.writes: list[str] = []
        self.uncommitted: list[str] = []

    def uncommit(self, step, *, folder=None) -> None:
        self.uncommitted.append(f"{folder} ({len(self.writes)} writes before)")

    def upload_file(self, step, local, rel, *, folder=None, still_allowed=None) -> None:
        if still_allowed is not None:
            still_allowed()  # as a transfer's progress callback, before the object exists
        self.writes.append(f"{folder}/{rel}")

    def put_bytes(self, step, rel, data, *, folder=None) -> None:
        self.writes.append(f"{folder}/{rel}")

    def folder_uri(self, folder: str) -> str:
        return f"s3://b/{folder}"


def _outputs(tmp_path: Path) -> Path:
    (tmp_path / "model.safetensors").write_bytes(b"w" * 100)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoint-5").mkdir()  # checkpoints have their own folders: not part of final/
    return tmp_path


SETTINGS = SyncSettings(attempt=2, world_size=1, strategy="ddp")


def test_the_outputs_go_first_and_the_manifest_last_each_checked_before_it_goes(tmp_path):
    store, checks = Store(), []
    uri = upload_final_model(store, _outputs(tmp_path), SETTINGS, step=5, deadline=1e12,
                             still_allowed=lambda: checks.append(len(store.writes)))
    assert uri == "s3://b/final"
    assert store.writes == ["final/config.json", "final/model.safetensors", "final/manifest.json"]
    assert 0 in checks and 2 in checks  # before the first file, and before the manifest


@pytest.mark.parametrize("refusal", [FencedError("attempt 3 claimed the location"),
                                     UploadStopped("the grace period after SIGTERM is over")])
def test_a_refusal_mid_way_stops_it_before_the_manifest(tmp_path, refusal):
    store = Store()

    def still_allowed() -> None:
        if store.writes:  # the first file went out; then the fence (or the clock) says no
            raise refusal

    with pytest.raises(type(refusal)):
        upload_final_model(store, _outputs(tmp_path), SETTINGS, step=5, deadline=1e12, still_allowed=still_allowed,
                           cancelled=lambda: True)
    assert store.writes == ["final/config.json"]  # no manifest: a torn final/ is recognisable as such


def test_a_fence_once_found_raises_at_every_later_check_even_within_its_interval():
    # A check raised from a transfer's progress callback can be swallowed by the HTTP client's retry of that
    # request; the retry's own check (within the rate limit's second) must not pass as "just checked".
    from kubetrain_trainer.commit import ClaimsFence

    class Claims:
        def __init__(self) -> None:
            self.lists = 0

        def list_claims(self):
            self.lists += 1
            return [(0, 3)]  # attempt 3 claimed after this writer (attempt 2) started

    store = Claims()
    fence = ClaimsFence(store, SETTINGS)
    for _ in range(3):
        with pytest.raises(FencedError, match="3"):
            fence.check(5, at_most_every_s=60.0)
    assert store.lists == 1  # found once, then remembered


def test_an_older_final_manifest_is_removed_before_any_file_is_overwritten(tmp_path):
    store = Store()
    upload_final_model(store, _outputs(tmp_path), SETTINGS, step=5, deadline=1e12)
    assert store.uncommitted == ["final (0 writes before)"]


def test_an_interrupted_re_upload_leaves_no_old_manifest_over_mixed_files(tmp_path, mem_s3, mem_store):
    store = mem_store()
    old, new = tmp_path / "old", tmp_path / "new"
    for d in (old, new):
        d.mkdir()
        (d / "config.json").write_text('{"tag": "%s"}' % d.name)
        (d / "model.safetensors").write_bytes(d.name.encode() * 1000)
    upload_final_model(store, old, SyncSettings(attempt=1, world_size=1, strategy="ddp", incarnation=100), step=10,
                       deadline=1e12)
    assert store.read_named_manifest("final").step == 10

    def still_allowed() -> None:  # the clock runs out once the new config.json is there
        if mem_s3.objects.get("ns/job/final/config.json") == b'{"tag": "new"}':
            raise UploadStopped("the grace period after SIGTERM is over")

    with pytest.raises(UploadStopped):
        upload_final_model(store, new, SyncSettings(attempt=1, world_size=1, strategy="ddp", incarnation=200),
                           step=20, deadline=1e12, still_allowed=still_allowed, cancelled=lambda: True)
    assert mem_s3.objects["ns/job/final/config.json"] == b'{"tag": "new"}'  # the re-upload got that far
    assert store.read_named_manifest("final") is None  # torn, not the old manifest over new files
