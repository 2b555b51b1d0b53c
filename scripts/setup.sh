#!/usr/bin/env bash
# Creates (or reuses) the project's Python environment and installs kubetrain
# with its dev extras. The environment lives in a cache folder keyed by the
# Python version and the hash of pyproject.toml, so a fresh clone on a warm
# machine reuses it in seconds; `.venv` in the repo is a symlink to it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)  # resolved, as pip records the editable path
cd "$root"
py=${PYTHON:-python3}
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# Only the dependency part of pyproject.toml keys the environment: tool
# settings (pytest, import-linter) can change without a reinstall.
key=$(sed -n '1,/^\[tool/p' pyproject.toml | sha256sum | cut -c1-12)
venv="${KUBETRAIN_CACHE:-$HOME/.cache/kubetrain}/venv/py$pyver-$key"
log="${venv}.log"
# Run a pip step with its chatter in a log; show the tail when it fails.
quiet() {
  mkdir -p "$(dirname "$log")"
  "$@" >>"$log" 2>&1 || { echo "[setup] FAILED: $* (last lines of $log):" >&2; tail -n 40 "$log" >&2; return 1; }
}
# One setup per environment at a time: two cold runs at once (demo.sh in one
# shell, test.sh in another) removed each other's half-built environment, and
# one marked it complete while the other was still installing. A second caller
# waits here and then finds the environment made.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
if command -v flock >/dev/null && ! flock -n 9; then  # no flock (macOS): no lock, as before
  echo "[setup] another setup of $venv is running; waiting for it" >&2
  flock 9
fi
# What the editable install was made from: this clone and its whole pyproject.toml
# (the key above leaves out [tool.setuptools], which says where the packages are).
stamp="$root $(sha256sum <pyproject.toml | cut -c1-12)"
# Whether the environment's kubetrain is an editable install of this clone.
editable_here() {
  [[ -f "$venv/.editable" && "$(cat "$venv/.editable")" == "$stamp" ]] || return 1
  "$venv/bin/python" - "$root" 2>/dev/null <<'PY'
import importlib.metadata, json, pathlib, sys
url = json.loads(importlib.metadata.distribution("kubetrain").read_text("direct_url.json") or "{}")
sys.exit(0 if url.get("dir_info", {}).get("editable") and url.get("url") == pathlib.Path(sys.argv[1]).as_uri() else 1)
PY
}
if [[ ! -x "$venv/bin/python" || ! -f "$venv/.complete" ]]; then
  echo "[setup] creating $venv (first run on this machine: installs torch, deepspeed, kopf... a few minutes)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  quiet "$venv/bin/pip" install --upgrade pip
  quiet "$venv/bin/pip" install -e ".[dev]"
  echo "$stamp" >"$venv/.editable"
  touch "$venv/.complete"
elif ! editable_here; then
  # The dependency set is unchanged; only point the editable install here. Built
  # with the environment's own setuptools: pip's isolated build fetches setuptools
  # from the package index every time, and `scripts/test.sh fast` failed offline.
  # An environment whose setuptools is too old for pyproject.toml (its license
  # string needs 77 or later) takes the isolated build.
  rm -f "$venv/.editable"
  "$venv/bin/pip" install --no-deps --no-build-isolation -e . >>"$log" 2>&1 ||
    quiet "$venv/bin/pip" install --no-deps -e .
  echo "$stamp" >"$venv/.editable"
fi
# The linter's pinned group (pyproject.toml [dependency-groups]; not part of the key above).
quiet "$venv/bin/pip" install --group lint
exec 9>&-
if [[ -L .venv || ! -e .venv ]]; then ln -sfn "$venv" .venv; fi
echo "[setup] ready: source .venv/bin/activate" >&2
