"""The event reasons the integration and e2e tiers wait for are reasons the operator posts.

Those tiers wait for an event with a timeout: one that waits for a reason the operator no longer posts (a reason
folded into `Failed`, a typo) fails only there, after its timeout, on a machine with a control plane. This reads
both sides from the source: the reasons the operator's planners and reconciler can post (a literal, a module
constant, or a refusal's reason from `errors.py`), and the reasons the tests name in `event_messages(job, reason)`
and in the conditions of `wait_until(lambda: jobs.event_reasons(job), <condition>)`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OPERATOR = ROOT / "operator" / "kubetrain"
TIERS = [ROOT / "tests" / "integration", ROOT / "tests" / "e2e"]


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _called(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def posted_reasons() -> set[str]:
    reasons: set[str] = set()
    for path in OPERATOR.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = _constants(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = _called(node)
            if called in ("event", "Event") and len(node.args) >= 2:
                arg = node.args[1]  # (type, reason, message)
            elif called.endswith("RejectedError") and node.args:
                arg = node.args[0]  # (reason, message): posted by the rejected plans as the Warning's reason
            else:
                continue
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                reasons.add(arg.value)
            elif isinstance(arg, ast.Name) and arg.id in names:
                reasons.add(names[arg.id])
    return reasons


def waited_for() -> dict[str, str]:
    """Each event reason a test waits for, with where."""
    out: dict[str, str] = {}
    for tier in TIERS:
        for path in tier.rglob("test_*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if _called(node) == "event_messages" and len(node.args) >= 2:
                    reason = node.args[1]
                    if isinstance(reason, ast.Constant) and isinstance(reason.value, str):
                        out[reason.value] = where
                elif _called(node) == "wait_until" and len(node.args) >= 2 and any(
                        isinstance(n, ast.Call) and _called(n) == "event_reasons" for n in ast.walk(node.args[0])):
                    for n in ast.walk(node.args[1]):
                        if isinstance(n, ast.Constant) and isinstance(n.value, str):
                            out[n.value] = where
    return out


def test_the_derivation_finds_both_sides() -> None:
    posted, waited = posted_reasons(), waited_for()
    assert {"Created", "Failed", "Preempted", "QuotaExceeded", "QueueLabelRemoved"} <= posted, posted
    assert {"Created", "Failed", "Preempted", "QuotaExceeded"} <= set(waited), waited


def test_every_event_reason_a_slower_tier_waits_for_is_posted() -> None:
    """Before: test_lifecycle waited 60 s for a `DeadlineExceeded` event after the planner had folded it into
    the one `Failed` Warning every failure gets."""
    posted = posted_reasons()
    missing = {reason: where for reason, where in waited_for().items() if reason not in posted}
    assert not missing, f"waited for, never posted by the operator: {missing}"
