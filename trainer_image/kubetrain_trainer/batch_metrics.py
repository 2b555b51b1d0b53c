"""`batch_eval_metrics`: `compute_metrics` called on every eval batch, as HF 5 calls it (a mixin of `Trainer`).

With it, an evaluation keeps no predictions: each batch's (after
`preprocess_logits_for_metrics`, gathered over the ranks, padding rows left
out) is handed to `compute_metrics(EvalPrediction(...), compute_result=...)`
at once, `compute_result` True on the last batch only, and what that last call
returns is the evaluation's metrics. As in HF: `compute_metrics` must take
`compute_result` (refused when the Trainer is built), a batch without
predictions or labels gets no call, `EvalPrediction.losses` is the batch loss
once per sample and `.inputs` the batch as the loader gave it (this rank's,
not gathered), and `predict()` calls it per batch too but still returns every
prediction.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from . import distributed as dist_util
from .args import ConfigError
from .data import batch_size_of
from .evaluation import _concat, _interleave, _nested
from .state import EvalPrediction


def check_batch_metrics(args: Any, compute_metrics: Callable | None) -> None:
    """HF's check when the Trainer is built: with `batch_eval_metrics`, `compute_metrics` takes `compute_result`."""
    if args.batch_eval_metrics and compute_metrics is not None \
            and "compute_result" not in inspect.signature(compute_metrics).parameters:
        raise ConfigError("batch_eval_metrics: compute_metrics must take a boolean `compute_result` argument (True "
                          "after the eval set's last batch: return the metrics then), as in HF")


class BatchMetricsMixin:
    """`_batch_eval_metrics` of `Trainer`: one eval batch's `compute_metrics` call."""

    def _batch_eval_metrics(self, batch: Any, logits: Any, labels: Any, loss: torch.Tensor | None, *, real: int,
                            last: bool, dealt: bool, previous: Any = None) -> Any:
        """*Collective.* `compute_metrics` of this batch on every rank (see the module docstring); `real`: its
        rows that are samples of the set (0 for an iterable set's copy only run for the collectives; `dealt`).
        A batch without predictions or labels gets no call: `previous` (the last call's return) is returned."""
        losses = None if loss is None else loss.reshape(1).expand(batch_size_of(batch))
        if dist_util.world_size() > 1:
            mine = (_nested(torch.Tensor.cpu, logits), _nested(torch.Tensor.cpu, labels),
                    _nested(torch.Tensor.cpu, losses), real)
            per_rank = [r for r in dist_util.gather_objects(mine) if not dealt or r[3]]
            rows = sum(r[3] for r in per_rank)
            parts = [[r[i] for r in per_rank] for i in range(3)]
            logits, labels, losses = (None if any(p is None for p in part) else
                                      _nested(lambda t: t.to(self.device), _concat(part) if dealt
                                              else _interleave(part, rows)) for part in parts)
        if logits is None or labels is None:  # as HF: no call for this batch
            return previous
        include = self.args.include_for_metrics
        given = EvalPrediction(logits, labels, inputs=batch if "inputs" in include else None,
                               losses=losses if "loss" in include else None)
        return self.compute_metrics(given, compute_result=last)
