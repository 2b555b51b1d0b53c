"""Evaluation and prediction, kept apart from the training loop (a mixin of `Trainer`).

Every rank evaluates its shard of the (padded) eval set; losses are averaged
across ranks weighted by the real (non-padding) sample count, and predictions
are gathered and re-interleaved into dataset order for `compute_metrics`.

As in the HF Trainer, a batch that carries its labels is scored through
`compute_loss` (`prediction_step`), so a subclass's loss is the `eval_loss`
that `metric_for_best_model="loss"` ranks checkpoints by.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from . import distributed as dist_util
from .args import ConfigError
from .data import ResumableDistributedSampler, batch_size_of, has_length, make_loader
from .state import EvalPrediction, PredictionOutput


def extract_loss(outputs: Any) -> torch.Tensor | None:
    """The loss of a model's outputs: a tensor, a dict's "loss", an object's `.loss`, or a tuple's first item."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict):
        return outputs.get("loss")
    if hasattr(outputs, "loss"):
        return outputs.loss
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    return None


def extract_logits(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, dict):
        return outputs.get("logits")
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, (tuple, list)) and len(outputs) > 1:
        return outputs[1]
    return None


def call_model(model: Any, inputs: Any) -> Any:
    if type(inputs) is dict or isinstance(inputs, Mapping):  # a dict, or a collator's BatchEncoding (a UserDict)
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def count_items(inputs: Any) -> torch.Tensor | None:
    """`num_items_in_batch` of one micro-batch: its label items that are not -100 (a 0-dim tensor), or None."""
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    return labels.ne(-100).sum() if isinstance(labels, torch.Tensor) else None


@functools.lru_cache(maxsize=None)
def label_names(model_class: type) -> tuple[str, ...]:
    """The model's label arguments as HF finds them (forward parameters named like "label"), else ("labels",)."""
    params = inspect.signature(model_class.forward).parameters
    qa = ("start_positions", "end_positions") if "QuestionAnswering" in model_class.__name__ else ()
    return tuple(p for p in params if "label" in p or p in qa) or ("labels",)


def check_eval_dataset(dataset: Any) -> None:
    """Refuse a dict of eval sets (HF evaluates each under its name; kubetrain takes one), before any step."""
    if isinstance(dataset, dict):
        raise ConfigError(f"eval_dataset: a dict of datasets ({', '.join(map(repr, dataset))}) is not supported: "
                          "pass one dataset, and evaluate the others with trainer.evaluate(dataset)")


def plain_metrics(value: Any) -> Any:
    """A compute_metrics value as HF logs it: numpy and one-element tensor numbers become Python numbers, in
    lists, tuples and dicts too; anything else (a list of per-class scores, a string) is kept as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(plain_metrics(v) for v in value)
    if isinstance(value, dict):
        return {k: plain_metrics(v) for k, v in value.items()}
    if (type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0) or \
            (isinstance(value, torch.Tensor) and value.numel() == 1):
        return value.item()
    return value


def _interleave(per_rank: list[torch.Tensor], total: int) -> torch.Tensor:
    """Undo round-robin sharding: element j of rank r is global sample j*W + r."""
    stacked = torch.stack(per_rank, dim=1)
    return stacked.reshape(-1, *stacked.shape[2:])[:total]


def _numpy(t: torch.Tensor | None):
    if t is None:
        return None
    return (t.float() if t.is_floating_point() else t).numpy()


class EvaluationMixin:
    """`evaluate`, `predict`, `prediction_step` and the eval and test dataloaders of `Trainer`."""

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        """The eval set's loader; a str names one entry of a dict `eval_dataset` (as in HF)."""
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        if dataset is None:
            dataset = self.eval_dataset
        if dataset is None:
            raise ValueError("evaluation needs an eval_dataset")
        check_eval_dataset(dataset)
        return self._ordered_loader(dataset)

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        """The loader `predict` runs over."""
        return self._ordered_loader(test_dataset)

    def _ordered_loader(self, dataset: Dataset) -> DataLoader:
        sampler = None
        if has_length(dataset):
            sampler = ResumableDistributedSampler(len(dataset), num_replicas=dist_util.world_size(),
                                                  rank=dist_util.rank(), shuffle=False)
        return make_loader(dataset, batch_size=self.args.per_device_eval_batch_size, sampler=sampler,
                           collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers,
                           pin_memory=self._pin_memory, drop_last=False, generator_seed=self.args.data_seed)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys: list[str] | None = None):
        """Forward pass without gradients: (loss, logits, labels), any of which may be None.

        A batch with its labels (see `label_names`) is scored by `compute_loss`
        (with `return_outputs=True`); any other batch by the model's own loss,
        when it returns one (models that take their targets under another
        name still report an eval loss).
        """
        inputs = self._prepare_inputs(inputs)
        names = label_names(type(self.strategy.unwrap() if self._prepared else self.model))
        has_labels = isinstance(inputs, Mapping) and all(inputs.get(k) is not None for k in names)
        # Taken before compute_loss runs: an override may pop them (the guide's example does).
        labels = (inputs[names[0]] if len(names) == 1 else tuple(inputs[k] for k in names)) if has_labels else None
        with torch.no_grad(), self._autocast():
            if has_labels:
                loss, outputs = self._compute_loss(model, inputs, return_outputs=True,
                                                   num_items_in_batch=count_items(inputs))
            else:
                outputs = call_model(model, inputs)
                loss = extract_loss(outputs)
        loss = loss.detach().float().mean() if loss is not None else None
        if prediction_loss_only:
            return loss, None, None
        logits = extract_logits(outputs)
        return loss, (logits.detach() if logits is not None else None), labels

    def evaluation_loop(self, dataloader: DataLoader, *, prefix: str, prediction_loss_only: bool | None = None):
        args = self.args
        # evaluate() collects predictions only for compute_metrics; predict() always (whatever its prefix).
        loss_only = (args.prediction_loss_only or self.compute_metrics is None) if prediction_loss_only is None \
            else prediction_loss_only
        model = self.model_wrapped if self.model_wrapped is not None else self.model.to(self.device)
        was_training = model.training
        model.eval()
        world, rank = dist_util.world_size(), dist_util.rank()
        dataset_len = len(dataloader.dataset) if has_length(dataloader.dataset) else None
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        preds, labels = [], []
        seen = 0  # samples of this rank so far, to tell padding from real samples
        start = time.perf_counter()
        for batch in dataloader:
            n = batch_size_of(batch)
            real = n if dataset_len is None else sum(1 for j in range(seen, seen + n) if j * world + rank < dataset_len)
            seen += n
            loss, logits, label = self.prediction_step(model, batch, loss_only)
            if loss is not None and real:
                loss_sum += loss.double() * real
                count += real
            if logits is not None:
                preds.append(logits.cpu())
            if label is not None:
                labels.append(label.cpu())
        if world > 1:
            totals = torch.stack([loss_sum, count])
            dist.all_reduce(totals)
            loss_sum, count = totals[0], totals[1]
        if was_training:
            model.train()
        metrics: dict[str, float] = {}
        if count.item() > 0:
            metrics[f"{prefix}_loss"] = (loss_sum / count).item()
        all_preds = self._gather(preds, dataset_len)
        all_labels = self._gather(labels, dataset_len)
        if self.compute_metrics is not None and all_preds is not None:
            for key, value in self.compute_metrics(EvalPrediction(_numpy(all_preds), _numpy(all_labels))).items():
                metrics[key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"] = plain_metrics(value)
        runtime = time.perf_counter() - start
        metrics[f"{prefix}_runtime"] = round(runtime, 4)
        if dataset_len:
            metrics[f"{prefix}_samples_per_second"] = round(dataset_len / max(runtime, 1e-9), 3)
        return all_preds, all_labels, metrics

    def _gather(self, chunks: list[torch.Tensor], dataset_len: int | None) -> torch.Tensor | None:
        """*Collective.* This rank's batches → the whole eval set's tensor in dataset order (every rank)."""
        local = torch.cat(chunks) if chunks else None
        if dist_util.world_size() == 1:
            return local
        per_rank = dist_util.gather_objects(local)
        if any(t is None for t in per_rank):
            return None
        return _interleave(per_rank, dataset_len or sum(len(t) for t in per_rank))

    def evaluate(self, eval_dataset: Dataset | None = None, ignore_keys=None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """*Collective.* Evaluate, log the metrics and fire `on_evaluate`."""
        dataloader = self.get_eval_dataloader(eval_dataset)
        _, _, metrics = self.evaluation_loop(dataloader, prefix=metric_key_prefix)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def predict(self, test_dataset: Dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        """*Collective.* Predictions (numpy, dataset order), labels and metrics on `test_dataset`."""
        dataloader = self.get_test_dataloader(test_dataset)
        preds, labels, metrics = self.evaluation_loop(dataloader, prefix=metric_key_prefix, prediction_loss_only=False)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics=metrics)
        return PredictionOutput(_numpy(preds), _numpy(labels), metrics)
