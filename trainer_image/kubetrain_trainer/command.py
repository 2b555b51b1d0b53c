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


_SECRET_WORD = (r"(?<![a-z])(?:secrets?|token|passw(?:or)?ds?|credentials?|api[_-]?keys?|access[_-]?keys?"
                r"|private[_-]?keys?)(?![a-z])")
"""A word of a name that holds a secret, on its own (`hub_token`, not `tokenizer_name`)."""
_SECRET_NAME = re.compile(rf"(?i)(?:{_SECRET_WORD}|_key$|^key$)")
"""An environment variable whose value is a secret, by its name (AWS_SECRET_ACCESS_KEY, HF_TOKEN, WANDB_API_KEY,
DB_PASSWORD, ...)."""
_SECRET_FLAG = re.compile(rf"(?i)^--?[\w.-]*(?:{_SECRET_WORD})[\w.-]*$")
_INLINE_FLAG_VALUE = re.compile(rf"(?i)((?<!\S)--?[\w.-]*(?:{_SECRET_WORD})[\w.-]*(?:=|\s+))[^\s\-][^\s\"']*")
"""`--hub_token X` / `--password=X` anywhere in an argument (`bash -c "python train.py --hub_token X"` too)."""
_USERINFO = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@")
MASK = "***"


def _secret_values(env: Mapping[str, str]) -> list[str]:
    """Values of the variables named like secrets that look like one: not a plain word or number (AUTH_MODE=true
    would mask every "true")."""
    return sorted((v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= 8 and not v.isalpha()
                   and not v.isdigit()), key=len, reverse=True)


def shown_command(command: Sequence[str], env: Mapping[str, str]) -> str:
    """`command` as it may be logged. The kubelet has already put the pod's env into `$(NAME)` references,
    Secret values included (`--hub_token $(HF_TOKEN)` arrives as the token itself), and the launcher's log
    line goes where anyone who reads pod logs, or a pod's termination message, sees it. So the value of
    every variable named like a secret is masked wherever it appears, and so are the value of any flag
    named like one (`--hub_token X`, `--password=X`, also inside one argument such as `bash -c "..."`) and a
    URL's password (`s3://user:pass@host`)."""
    values = _secret_values(env)
    shown: list[str] = []
    hide_next = False
    for arg in command:
        if hide_next:
            shown.append(MASK)
            hide_next = False
            continue
        hide_next = bool(_SECRET_FLAG.match(arg))
        for value in values:
            arg = arg.replace(value, MASK)
        arg = _INLINE_FLAG_VALUE.sub(lambda m: m.group(1) + MASK, arg)
        shown.append(_USERINFO.sub(lambda m: m.group(1) + MASK + "@", arg))
    return " ".join(shown)
