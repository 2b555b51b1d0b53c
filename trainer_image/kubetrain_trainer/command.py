"""The user's command line: `$(NAME)` references to the variables only the launcher knows.

Kubernetes expands `$(NAME)` in a container's command from the pod's own
env, and leaves a reference to any other name as written. The launcher sets
some variables only when it starts the workers (the local checkpoint folder,
ranks, the resume folder), so a command such as

    command: ["python", "train.py", "--output_dir", "$(KUBETRAIN_LOCAL_CHECKPOINT_DIR)"]

reaches the launcher with the reference intact. The launcher expands exactly
those names, the ones it set and the pod's env did not have. A name the pod's
env has was Kubernetes' to expand: whatever `$(NAME)` is left of it is the
user's escaped literal (`$$(NAME)`) and stays. Unknown names stay as written,
as Kubernetes leaves them.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_command(command: Sequence[str], worker_env: Mapping[str, str], pod_env: Mapping[str, str]) -> list[str]:
    """`command` with `$(NAME)` replaced for each NAME in `worker_env` but not in `pod_env`."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        return worker_env[name] if name in worker_env and name not in pod_env else m.group(0)

    return [_REF.sub(sub, arg) for arg in command]
