#!/usr/bin/env bash
# The local testbed (control plane + kwok + MinIO): up | down | status | env.
# Thin wrapper around `python -m kubetrain_testbed` with the repository's venv.
# See testbed/README.md.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py="${KUBETRAIN_PYTHON:-$root/.venv/bin/python}"
[[ -x "$py" ]] || py=python3
export PYTHONPATH="$root/testbed${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m kubetrain_testbed "$@"
