"""How the launcher spends the pod's termination grace period after a SIGTERM.

The kubelet kills the pod `KUBETRAIN_TERMINATION_GRACE_SECONDS` after the
SIGTERM. In that time the workers finish their step and write the emergency
checkpoint, then the launcher uploads it. The upload always gets everything the
workers leave: it runs until the grace period (less the exit margin) is spent.
The split only decides when a worker that is still busy is killed, so it weighs
two losses: kill a save that would have finished (the emergency checkpoint is
lost), or let a hung save eat the time an upload needed. So:

- the workers get what a save needs, estimated from this pod's own measurements
  (twice the sum of the mean step time and the slowest recent save, plus 5 s: a save
  can be slower than the last one), and half of the usable time when nothing was measured yet;
- never less than 10 s (or what is usable, when the grace is shorter), and never
  more than two thirds of the usable time: the upload keeps at least a third;
- the exit margin (2 s, a tenth of very short graces) is for the termination
  message and the exit itself.

With 120 s, 1 s steps and a 5 s save the workers get 17 s and the upload 101 s; before,
a fixed third (at most 30 s) went to the upload, whatever the save needed.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_MARGIN_S = 2.0
"""Seconds kept for the termination message and the exit, before the kubelet's SIGKILL."""
MIN_STOP_S = 10.0
"""The workers always get this long to stop (when the grace allows it): a step and a small save."""
MAX_STOP_SHARE = 2 / 3
"""The workers never get more than this share of the usable time: the upload keeps the rest."""
SAVE_HEADROOM_S = 5.0


@dataclass(frozen=True)
class GraceSplit:
    """Seconds after the SIGTERM: workers are killed at `stop_s`; uploads run until `stop_s + upload_s`."""

    stop_s: float
    """How long the workers may take to finish their step and save, before SIGKILL."""
    upload_s: float
    """What the upload keeps at least (it also gets whatever the workers leave unused)."""
    margin_s: float
    """Kept for the termination message and the exit."""


def split_grace(grace_s: float, *, step_s: float | None = None, save_s: float | None = None) -> GraceSplit:
    """The split of `grace_s` (see the module docstring); `step_s`/`save_s` are this pod's measurements.

    Pure, so that the table test in tests/unit/trainer_storage/test_grace_split.py is the documentation.
    """
    margin = min(EXIT_MARGIN_S, grace_s / 10)
    usable = max(0.0, grace_s - margin)
    most = usable * MAX_STOP_SHARE
    if step_s is None and save_s is None:
        need = usable / 2
    else:
        need = 2 * ((step_s or 0.0) + (save_s or 0.0)) + SAVE_HEADROOM_S
    stop = min(most, max(min(MIN_STOP_S, usable), need))
    return GraceSplit(stop_s=stop, upload_s=usable - stop, margin_s=margin)
