"""Which old image builds the testbed removes from buildah, the registry and containerd (pure choices)."""

from __future__ import annotations

from kubetrain_testbed.prune import buildah_unused, containerd_removals, registry_deletions

REG = "127.0.0.1:30500"


def _store():
    """base -> deps-old -> src-old (old trainer), base -> deps-new -> src-new (trainer:0.1.0), base -> op."""
    layers = [{"id": "base"}, {"id": "deps-old", "parent": "base"}, {"id": "src-old", "parent": "deps-old"},
              {"id": "deps-new", "parent": "base"}, {"id": "src-new", "parent": "deps-new"},
              {"id": "op", "parent": "base"}]
    images = [
        {"id": "python", "names": ["localhost/kubetrain/python:3.11-slim-debian"], "layer": "base"},
        {"id": "env-step", "names": None, "layer": "base"},          # a metadata step over the base: cached
        {"id": "old-deps", "names": None, "layer": "deps-old"},      # the previous dependency layer
        {"id": "old-final", "names": [], "layer": "src-old"},        # the previous trainer:0.1.0, untagged
        {"id": "new-deps", "names": None, "layer": "deps-new"},      # the current build's cached step
        {"id": "trainer", "names": [f"{REG}/kubetrain/trainer:0.1.0"], "layer": "src-new"},
        {"id": "operator", "names": [f"{REG}/kubetrain/operator:0.1.0"], "layer": "op"},
        {"id": "scratch", "names": None},                             # no layer at all: left alone
    ]
    return images, layers


def test_buildah_removes_what_no_named_image_builds_on():
    images, layers = _store()
    assert buildah_unused(images, layers) == ["old-deps", "old-final"]


def test_buildah_keeps_everything_when_every_chain_is_named():
    images, layers = _store()
    images = [i for i in images if i["id"] not in ("old-deps", "old-final")]
    assert buildah_unused(images, layers) == []


def test_buildah_store_without_named_images_loses_its_unnamed_ones():
    images, layers = _store()
    unnamed = [{**i, "names": None} for i in images]
    assert set(buildah_unused(unnamed, layers)) == {i["id"] for i in images if i.get("layer")}


def test_registry_keeps_the_build_s_tags_and_drops_older_builds_and_test_copies():
    tags = {
        "kubetrain/trainer": {"0.1.0": "sha256:new", "0.1.0-new": "sha256:new", "0.1.0-old": "sha256:old",
                              "0.1.0-older": "sha256:older"},
        "kubetrain/operator": {"0.1.0": "sha256:op", "0.1.0-op": "sha256:op"},
        "kubetrain/late-0a1b2c": {"0.1.0": "sha256:old"},
        "kubetrain/pause": {"1": "sha256:pause"},
        "someone/else": {"latest": "sha256:x"},
    }
    keep = {"kubetrain/trainer": {"0.1.0", "0.1.0-new"}}
    assert registry_deletions(tags, keep) == [
        ("kubetrain/late-0a1b2c", "sha256:old"),
        ("kubetrain/trainer", "sha256:old"), ("kubetrain/trainer", "sha256:older")]


def test_registry_never_deletes_a_digest_a_kept_tag_points_to():
    tags = {"kubetrain/trainer": {"0.1.0": "sha256:same", "0.1.0-same": "sha256:same", "rc": "sha256:same"}}
    assert registry_deletions(tags, {"kubetrain/trainer": {"0.1.0", "0.1.0-same"}}) == []


def test_containerd_drops_every_reference_of_an_old_build_and_nothing_else():
    rows = [
        (f"{REG}/kubetrain/trainer:0.1.0-new", "sha256:new"),
        (f"{REG}/kubetrain/trainer@sha256:new", "sha256:new"),
        ("sha256:cfg-new", "sha256:new"),
        (f"{REG}/kubetrain/trainer:0.1.0-old", "sha256:old"),
        (f"{REG}/kubetrain/trainer@sha256:old", "sha256:old"),
        ("sha256:cfg-old", "sha256:old"),
        (f"{REG}/kubetrain/late-0a1b2c:0.1.0", "sha256:late"),
        ("sha256:cfg-late", "sha256:late"),
        (f"{REG}/kubetrain/pause:1", "sha256:pause"),
        ("sha256:cfg-pause", "sha256:pause"),
        (f"{REG}/kubetrain/operator:0.1.0-op", "sha256:op"),  # not built this time: left alone
    ]
    keep = {"kubetrain/trainer": {"0.1.0", "0.1.0-new"}}
    assert containerd_removals(rows, REG, keep) == [
        f"{REG}/kubetrain/trainer:0.1.0-old", f"{REG}/kubetrain/trainer@sha256:old", "sha256:cfg-old",
        f"{REG}/kubetrain/late-0a1b2c:0.1.0", "sha256:cfg-late"]


def test_containerd_keeps_an_image_another_repository_also_names():
    rows = [(f"{REG}/kubetrain/trainer:0.1.0-old", "sha256:old"), (f"{REG}/kubetrain/pause:1", "sha256:old")]
    assert containerd_removals(rows, REG, {"kubetrain/trainer": {"0.1.0"}}) == []


def test_a_digest_reference_never_counts_as_a_kept_tag():
    rows = [(f"{REG}/kubetrain/trainer@sha256:0.1.0", "sha256:odd")]
    assert containerd_removals(rows, REG, {"kubetrain/trainer": {"0.1.0"}}) == [rows[0][0]]
