"""Distributed strategies: the loop talks to DDP, FSDP2 and DeepSpeed ZeRO-3 through one seam.

Only the seam is public here; each strategy module is imported on demand by
`get_strategy`, so a DDP run never imports DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from .base import Prepared, Strategy, get_strategy, strategy_names


def strategy_options(args: Any) -> dict[str, Any]:
    """The keyword options `get_strategy(args.strategy, ...)` takes from `TrainingArguments`."""
    if args.strategy == "fsdp":
        return dict(args.fsdp_config or {})
    if args.strategy == "zero3":
        return {"config": args.deepspeed}
    return {}


__all__ = ["Prepared", "Strategy", "get_strategy", "strategy_names", "strategy_options"]
