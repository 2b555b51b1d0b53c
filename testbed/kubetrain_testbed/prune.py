"""Old image builds out of the testbed's caches: buildah's store, the registry and containerd's store.

Every build of the images leaves its predecessor behind in three places, and a
change to the trainer's dependencies makes that predecessor a 5 GB layer:
unpacked and packed in containerd, packed in the registry, and in buildah's
layer cache. Nothing else removes them (the kubelet's image GC only starts at
85 % of the disk), so a few dependency changes fill the machine, and MinIO then
refuses the tests' writes. After a build this removes, per image built:

- from buildah, every image that is not on the chain of a named image (the
  layer cache of the current Dockerfile steps stays, so the next source change
  still rebuilds only its last layers; the previous dependency layer goes);
- from the registry, every tag but the build's own two (`0.1.0` and
  `0.1.0-<id>`), and the per-test copies (`kubetrain/late-*`), by the API
  (delete is enabled); their blobs go when the registry is next started
  (`garbage_collect`, offline, before it serves);
- from containerd, every reference to an image of those repositories other
  than the build's own, which lets containerd's GC drop its content and
  snapshots.

The choices are pure functions of listings, unit-tested on their own.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from .realnode_config import RealNodeLayout

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json, "
                  "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json")
COPIES = re.compile(r"^kubetrain/late-[0-9a-f]+$")
"""Repositories the e2e tier makes as copies of the trainer image (an image that appears late)."""


# ------------------------------------------------------------------ choices (pure)
def buildah_unused(images: list[dict], layers: list[dict]) -> list[str]:
    """IDs of images in a containers-storage store that no named image builds on.

    `images` and `layers` are the store's `images.json` and `layers.json`. An
    unnamed image is kept when its top layer lies on the layer chain of a named
    image (a cached step of a current build); images without a layer (all
    metadata steps of an empty base) are kept when unnamed ones are.
    """
    parent = {layer["id"]: layer.get("parent") for layer in layers}
    keep: set[str] = set()
    for image in images:
        if image.get("names"):
            layer = image.get("layer")
            while layer and layer not in keep:
                keep.add(layer)
                layer = parent.get(layer)
    return [image["id"] for image in images
            if not image.get("names") and image.get("layer") and image["layer"] not in keep]


def registry_deletions(tags: dict[str, dict[str, str]], keep: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(repository, manifest digest) pairs to delete.

    `tags` maps each repository to {tag: digest}; `keep` maps the repositories
    just built to the tags to keep. A repository of the build loses every other
    tag's manifest unless a kept tag points to the same digest (a delete by
    digest removes every tag of it); a per-test copy loses all of its manifests;
    any other repository is left alone.
    """
    out: list[tuple[str, str]] = []
    for repo, by_tag in sorted(tags.items()):
        if repo in keep:
            kept = {by_tag[t] for t in keep[repo] if t in by_tag}
            doomed = {d for t, d in by_tag.items() if t not in keep[repo]} - kept
        elif COPIES.match(repo):
            doomed = set(by_tag.values())
        else:
            continue
        out.extend((repo, d) for d in sorted(doomed))
    return out


def containerd_removals(rows: list[tuple[str, str]], registry: str, keep: dict[str, set[str]]) -> list[str]:
    """References to remove from containerd's image store.

    `rows` are (reference, target digest) pairs as `ctr images ls` lists them;
    the CRI keeps three references per pulled image (`repo:tag`,
    `repo@sha256:...` and `sha256:<config>`), all with the same target. An image
    of a repository just built (or of a per-test copy) goes, with all of its
    references, unless a kept `repo:tag` names it.
    """
    def repository(ref: str) -> str | None:
        if not ref.startswith(registry + "/"):
            return None
        name = ref[len(registry) + 1:]
        return name.split("@", 1)[0].rsplit(":", 1)[0] if "@" in name or ":" in name else name

    ours, kept = set(), set()
    for ref, digest in rows:
        repo = repository(ref)
        if repo is None or not (repo in keep or COPIES.match(repo)):
            continue
        ours.add(digest)
        if repo in keep and ref.rsplit(":", 1)[-1] in keep[repo] and "@" not in ref:
            kept.add(digest)
    other = {digest for ref, digest in rows if (repo := repository(ref)) is not None
             and not (repo in keep or COPIES.match(repo))}
    doomed = ours - kept - other
    return [ref for ref, digest in rows if digest in doomed]


# ------------------------------------------------------------------ doing it
def prune_buildah(buildah: list[str], store: Path, *, log) -> int:
    """Remove buildah images no named image builds on; returns how many."""
    try:
        images = json.loads((store / "overlay-images" / "images.json").read_text())
        layers = json.loads((store / "overlay-layers" / "layers.json").read_text())
    except (OSError, ValueError) as exc:
        log.write(f"prune: buildah store not read ({exc}); nothing removed\n")
        return 0
    unused = buildah_unused(images, layers)
    if unused:
        proc = subprocess.run([*buildah, "rmi", *unused], stdout=log, stderr=log, timeout=600)
        log.write(f"prune: buildah rmi of {len(unused)} image(s) exited {proc.returncode}\n")
    return len(unused)


def _http(method: str, url: str) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, method=method, headers={"Accept": MANIFEST_TYPES})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), b""


def registry_tags(registry: str) -> dict[str, dict[str, str]]:
    """Every repository of the registry with {tag: manifest digest}."""
    base = f"http://{registry}/v2"
    repos: list[str] = []
    url = f"{base}/_catalog?n=1000"
    while url:  # pages of at most 1000 (the registry's limit), linked by a `Link: <...>; rel="next"` header
        status, headers, body = _http("GET", url)
        if status != 200:
            raise OSError(f"registry catalog: HTTP {status}")
        repos += json.loads(body).get("repositories") or []
        link = re.match(r'<([^>]+)>;\s*rel="next"', headers.get("Link", ""))
        url = f"http://{registry}{link.group(1)}" if link else ""
    out: dict[str, dict[str, str]] = {}
    for repo in repos:
        status, _, body = _http("GET", f"{base}/{repo}/tags/list")
        tags = (json.loads(body).get("tags") or []) if status == 200 else []
        out[repo] = {}
        for tag in tags:
            status, headers, _ = _http("HEAD", f"{base}/{repo}/manifests/{tag}")
            digest = headers.get("Docker-Content-Digest")
            if status == 200 and digest:
                out[repo][tag] = digest
    return out


def prune_registry(registry: str, keep: dict[str, set[str]], *, log) -> int:
    """Delete old manifests (see `registry_deletions`); returns how many. Their blobs go at the next start."""
    try:
        doomed = registry_deletions(registry_tags(registry), keep)
    except (OSError, ValueError) as exc:
        log.write(f"prune: registry not listed ({exc}); nothing deleted\n")
        return 0
    for repo, digest in doomed:
        status, _, _ = _http("DELETE", f"http://{registry}/v2/{repo}/manifests/{digest}")
        log.write(f"prune: registry DELETE {repo}@{digest}: HTTP {status}\n")
    return len(doomed)


def prune_containerd(n: RealNodeLayout, keep: dict[str, set[str]], *, log) -> int:
    """Remove old images of the built repositories from containerd (its GC frees them); returns refs removed."""
    if not n.containerd_sock.exists():
        return 0
    ctr = [str(n.bin_dir / "ctr"), "--address", str(n.containerd_sock), "-n", "k8s.io"]
    listing = subprocess.run([*ctr, "images", "ls"], capture_output=True, text=True, timeout=60)
    if listing.returncode != 0:
        log.write(f"prune: ctr images ls exited {listing.returncode}; nothing removed\n")
        return 0
    rows = [(cols[0], cols[2]) for line in listing.stdout.splitlines()[1:] if len(cols := line.split()) >= 3]
    refs = containerd_removals(rows, n.registry, keep)
    if refs:
        proc = subprocess.run([*ctr, "images", "rm", "--sync", *refs], stdout=log, stderr=log, timeout=600)
        log.write(f"prune: ctr images rm of {len(refs)} reference(s) exited {proc.returncode}\n")
    return len(refs)


def garbage_collect(registry_bin: Path, config: Path, *, log) -> None:
    """The registry's offline GC (blobs of deleted or untagged manifests); run before it serves."""
    proc = subprocess.run([str(registry_bin), "garbage-collect", "--delete-untagged", str(config)],
                          stdout=subprocess.DEVNULL, stderr=log, timeout=600)
    if proc.returncode != 0:
        log.write(f"prune: registry garbage-collect exited {proc.returncode}\n")
