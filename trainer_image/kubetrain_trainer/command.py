"""The user's command line: `$(NAME)` references to the variables only the launcher sets.

Kubernetes expands `$(NAME)` in a container's command from the env the pod
spec lists, and leaves a reference to any other name as written (a variable
baked into the image with ENV included). The launcher sets some variables
only when it starts the workers: the local checkpoint folder, the resume
folder and the ranks. So a command such as

    command: ["python", "train.py", "--output_dir", "$(KUBETRAIN_LOCAL_CHECKPOINT_DIR)"]

reaches the launcher with the reference intact, and the launcher expands
exactly those names (`LAUNCHER_SET`), with the value the worker gets. The
operator never lists them in a pod's env, so Kubernetes never had them to
expand. Every other reference stays as written, as Kubernetes leaves it.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

LAUNCHER_SET = frozenset({
    "KUBETRAIN_LOCAL_CHECKPOINT_DIR", "KUBETRAIN_RESUME_FROM", "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
})
"""The names `launch.worker_env` sets for each worker that the pod's env does not carry."""

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_command(command: Sequence[str], worker_env: Mapping[str, str]) -> list[str]:
    """`command` with `$(NAME)` replaced for each NAME in `LAUNCHER_SET` that `worker_env` has."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        return worker_env[name] if name in LAUNCHER_SET and name in worker_env else m.group(0)

    return [_REF.sub(sub, arg) for arg in command]
