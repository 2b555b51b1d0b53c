"""The project's images, built from its Dockerfiles with buildah and pushed to the real node's registry.

No public container registry is reachable here, so the base image the
Dockerfiles default to (`python:3.11-slim`) is replaced, through their
`BASE_IMAGE` build argument, by an equivalent the testbed makes itself: a
Debian bookworm root file system (mmdebstrap, Debian's Python 3.11 and pip)
that trusts the host's CA bundle, so pip inside a build reaches the package
index exactly as the host does (host network). Layers are cached by buildah
(`--layers`) in the testbed cache, so a rebuild after a source change only
redoes the last layers.

    python -m kubetrain_testbed images        # build and push both; prints refs, sizes, times
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .config import REPO_ROOT
from . import prune
from .procs import TestbedError
from .realnode import buildah_argv
from .realnode_config import RealNodeLayout

BASE_REF = "localhost/kubetrain/python:3.11-slim-debian"
"""Kept in buildah's local store (never pushed): only the Dockerfiles' FROM uses it."""
BASE_PACKAGES = "python3,python3-pip,python3-venv,python-is-python3,libpython3.11-dev,ca-certificates,passwd"
"""What python:3.11-slim has: Python 3.11 with pip, its C headers (extensions build against them)."""
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


@dataclass(frozen=True)
class Image:
    name: str
    dockerfile: Path
    repo: str
    tag: str = "0.1.0"

    def ref(self, registry: str) -> str:
        return f"{registry}/{self.repo}:{self.tag}"


IMAGES = (
    Image("operator", REPO_ROOT / "operator" / "Dockerfile", "kubetrain/operator"),
    Image("trainer", REPO_ROOT / "trainer_image" / "Dockerfile", "kubetrain/trainer"),
)


def _run(argv: list[str], *, log, timeout: float = 3600) -> str:
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise TestbedError(f"{argv[0]} {' '.join(argv[1:4])}... failed ({proc.returncode}); see {log.name}")
    return proc.stdout


def base_image(n: RealNodeLayout, *, log) -> str:
    """The python:3.11-slim equivalent in buildah's store; made once per cache."""
    ref = BASE_REF
    b = buildah_argv(n)
    if subprocess.run([*b, "inspect", "--type", "image", ref], capture_output=True).returncode == 0:
        return ref
    if shutil.which("mmdebstrap") is None:
        raise TestbedError("building the base image needs mmdebstrap (Debian: apt-get install mmdebstrap)")
    with tempfile.TemporaryDirectory(prefix="kt-base-") as tmp:
        tar = Path(tmp) / "rootfs.tar"
        _run(["mmdebstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(tar)], log=log)
        ctr = _run([*b, "from", "scratch"], log=log).strip()
        try:
            _run([*b, "add", ctr, str(tar), "/"], log=log)
            # As in python:3.11-slim: pip may install into the system Python; plus the host's CA bundle
            # (the package index is reached through it here).
            _run([*b, "copy", ctr, str(HOST_CA), "/etc/ssl/certs/ca-certificates.crt"], log=log)
            pip_conf = Path(tmp) / "pip.conf"
            pip_conf.write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\nbreak-system-packages = true\n")
            _run([*b, "copy", ctr, str(pip_conf), "/etc/pip.conf"], log=log)
            _run([*b, "config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "--env", "LANG=C.UTF-8", "--cmd", "python3", ctr], log=log)
            _run([*b, "commit", "--rm", ctr, ref], log=log)
            ctr = ""
        finally:
            if ctr:
                subprocess.run([*b, "rm", ctr], capture_output=True)
    return ref


def build(n: RealNodeLayout, image: Image, *, log, push: bool = True) -> dict:
    """buildah bud of one Dockerfile (layers cached), pushed to the registry; returns ref, size, seconds."""
    base = base_image(n, log=log)
    ref = image.ref(n.registry)
    b = buildah_argv(n)
    t0 = time.monotonic()
    _run([*b, "bud", "--layers", "--network", "host", "--pull=never", "--build-arg", f"BASE_IMAGE={base}",
          "-f", str(image.dockerfile), "-t", ref, str(REPO_ROOT)], log=log)
    built = time.monotonic() - t0
    # Also pushed under a tag unique to this build: a node that pulled an older `0.1.0` keeps using it
    # (IfNotPresent), so tests name the build they mean.
    image_id = _run([*b, "images", "--no-trunc", "--format", "{{.ID}}", ref], log=log).split()[0].split(":")[-1]
    unique = f"{n.registry}/{image.repo}:{image.tag}-{image_id[:12]}"
    if push:
        for target in (ref, unique):
            _run([*b, "push", "--tls-verify=false", "--disable-compression", ref, f"docker://{target}"], log=log)
    size = _run([*b, "images", "--format", "{{.Size}}", ref], log=log).strip().splitlines()[0]
    return {"image": image.name, "ref": unique, "tag_ref": ref, "build_s": round(built, 1),
            "total_s": round(time.monotonic() - t0, 1), "size": size}


def build_all(n: RealNodeLayout, *, log_path: Path, names: tuple[str, ...] = ("operator", "trainer"),
              push: bool = True, prune_old: bool = True) -> list[dict]:
    """Build (and push) the named images; then remove their older builds from the caches (prune.py)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        rows = [build(n, img, log=log, push=push) for img in IMAGES if img.name in names]
        if prune_old:
            try:
                prune_builds(n, rows, pushed=push, log=log)
            except Exception as exc:  # noqa: BLE001 - tidying the caches never fails a build that succeeded
                log.write(f"prune: skipped after an error: {exc!r}\n")
        return rows


def prune_builds(n: RealNodeLayout, rows: list[dict], *, pushed: bool, log) -> None:
    """Older builds of the images in `rows` out of buildah's store and, once pushed, the registry and containerd."""
    b = buildah_argv(n)
    prune.prune_buildah(b, Path(b[b.index("--root") + 1]), log=log)
    if not rows or not pushed:
        return  # built only: the registry and the node keep what they have
    keep: dict[str, set[str]] = {}
    for r in rows:
        for ref in (r["tag_ref"], r["ref"]):
            repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
            keep.setdefault(repo, set()).add(tag)
    prune.prune_registry(n.registry, keep, log=log)
    prune.prune_containerd(n, keep, log=log)


def main(n: RealNodeLayout, log_path: Path, names: tuple[str, ...], *, push: bool = True,
         prune_old: bool = True) -> int:
    try:
        for row in build_all(n, log_path=log_path, names=names, push=push, prune_old=prune_old):
            print(json.dumps(row))
    except TestbedError as exc:
        print(f"images: {exc}", file=sys.stderr)
        return 1
    return 0
