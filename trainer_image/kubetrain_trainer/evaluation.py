"""Evaluation and prediction, kept apart from the training loop (a mixin of `Trainer`).

Every rank evaluates its shard of the (padded) eval set (an iterable set: its
batches dealt round-robin, `_dealt`); losses are averaged
across ranks weighted by the real (non-padding) sample count, and predictions
are gathered and re-interleaved into dataset order for `compute_metrics`.

As in the HF Trainer, a batch that carries its labels is scored through
`compute_loss` (`prediction_step`), so a subclass's loss is the `eval_loss`
that `metric_for_best_model="loss"` ranks checkpoints by.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import itertools
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

from . import distributed as dist_util
from .args import ConfigError
from .data import ResumableDistributedSampler, batch_size_of, has_length, make_loader, with_last
from .layout import metric_key
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


def extract_logits(outputs: Any, ignore_keys: Any = ()) -> Any:
    """The predictions in a model's outputs: its `logits`; else, as HF, every output but the loss and
    `ignore_keys` (one tensor, or a tuple: a QA model's start and end logits); a tuple's second item on."""
    if isinstance(outputs, dict):
        if "logits" in outputs:
            return outputs["logits"]
        # Tensors only: a nested output (a vision tower's own ModelOutput) or a KV cache is not a prediction.
        rest = tuple(v for k, v in outputs.items() if k != "loss" and k not in (ignore_keys or ())
                     and isinstance(v, torch.Tensor))
        return None if not rest else rest[0] if len(rest) == 1 else rest
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, (tuple, list)) and len(outputs) > 1:
        return outputs[1] if len(outputs) == 2 else tuple(outputs[1:])
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


PLAIN_EVAL_METRICS = ("eval_loss", "eval_runtime", "eval_samples_per_second")
"""What `evaluate` reports of one eval set without `compute_metrics` (and with `evaluate` and `evaluation_loop`
not overridden, no callback adding to its metrics): a `metric_for_best_model` outside these is never found."""


def check_eval_dataset(dataset: Any, trainer: Any) -> None:
    """Refuse, before any step, `eval_on_start` without an eval set, and a dict of eval sets that cannot work: keys
    that are not names, none to evaluate periodically, or a `metric_for_best_model` that none of its sets' metrics
    (`eval_<name>_<metric>`) can be."""
    if dataset is None and trainer.args.eval_on_start:  # HF fails at train(), after loading everything
        raise ConfigError("eval_on_start needs an eval_dataset: pass one or set eval_on_start: false")
    if not isinstance(dataset, dict):
        return
    if not all(isinstance(name, str) for name in dataset):
        raise ConfigError(f"eval_dataset: the keys of a dict of eval sets are their names (str), not "
                          f"{', '.join(repr(k) for k in dataset if not isinstance(k, str))}")
    args = trainer.args
    if args.eval_strategy == "no":
        return
    if not dataset:
        raise ConfigError(f"eval_strategy is {args.eval_strategy!r} but eval_dataset is an empty dict: "
                          "give it an eval set or set eval_strategy: no")
    name, cls = args.metric_for_best_model, type(trainer)
    if (name and cls.evaluate is EvaluationMixin.evaluate and cls.evaluation_loop is EvaluationMixin.evaluation_loop
            and not any(metric_key(name).startswith(f"eval_{n}_") for n in dataset)):  # an override may name it
        example = f"eval_{next(iter(dataset))}_loss"
        raise ConfigError(f"metric_for_best_model {name!r} names no metric of a dict eval_dataset: each set's "
                          f"metrics are named eval_<name>_<metric> (e.g. {example!r}): set metric_for_best_model "
                          "to the one that ranks checkpoints")


def plain_metrics(value: Any) -> Any:
    """A compute_metrics value as HF logs it (`denumpify_detensorize`), and JSON-able as trainer_state.json needs:
    numpy scalars and one-element tensors become Python numbers, numpy arrays and other tensors lists, in
    lists, tuples and dicts too; anything else (a string, a Python number) is kept as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(plain_metrics(v) for v in value)
    if isinstance(value, dict):
        return {k: plain_metrics(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()  # an ndarray's nested lists; a numpy scalar's (or 0-d array's) .item()
    return value


PAD_INDEX = -100
"""What fills predictions and labels of different lengths (per batch, per rank) up to one shape, as in HF."""


def _nested(fn: Any, value: Any) -> Any:
    """`fn` on each tensor of a tensor, or of a tuple/list of them (several outputs or label arguments)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_nested(fn, v) for v in value)
    return None if value is None else fn(value)


def _padded(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t` with every dimension after the first filled up to `shape` with PAD_INDEX."""
    if tuple(t.shape[1:]) == shape:
        return t
    out = t.new_full((len(t), *shape), PAD_INDEX)
    out[(slice(None), *(slice(0, n) for n in t.shape[1:]))] = t
    return out


def _common_shape(parts: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(max(p.shape[d] for p in parts) for d in range(1, parts[0].dim()))


def _concat(parts: list) -> Any:
    """Batches of predictions (or labels) as one, in order; lengths that differ are padded (HF's nested_concat)."""
    if isinstance(parts[0], (tuple, list)):
        return type(parts[0])(_concat([p[i] for p in parts]) for i in range(len(parts[0])))
    parts = [p.reshape(1) if p.dim() == 0 else p for p in parts]
    shape = _common_shape(parts)
    return torch.cat([_padded(p, shape) for p in parts])


def _rows(value: Any) -> int:
    """Samples in a tensor, or in the first of a tuple/list of them (several outputs: as many rows each)."""
    return _rows(value[0]) if isinstance(value, (tuple, list)) else len(value)


def _interleave(per_rank: list, total: int) -> Any:
    """Undo round-robin sharding: element j of rank r is global sample j*W + r."""
    if isinstance(per_rank[0], (tuple, list)):
        return type(per_rank[0])(_interleave([r[i] for r in per_rank], total) for i in range(len(per_rank[0])))
    shape = _common_shape(per_rank)
    stacked = torch.stack([_padded(t, shape) for t in per_rank], dim=1)
    return stacked.reshape(-1, *stacked.shape[2:])[:total]


def _dealt(batches: Any, world: int, rank: int) -> Any:
    """(batch, real) of an iterable set on one of `world` ranks, as HF deals it: every rank reads every batch and
    takes batch k where k % world == rank; in a last round short of this rank's batch it takes a copy of the
    round's first, not real, so every rank runs as many forwards (and reaches every collective)."""
    batches = iter(batches)
    while round_ := list(itertools.islice(batches, world)):
        yield (round_[rank], True) if rank < len(round_) else (round_[0], False)


def main_input_of(batch: Any, name: str) -> Any:
    """The model's main input in a batch (`include_for_metrics: [inputs]`): HF's `batch[main_input_name]`."""
    if not isinstance(batch, Mapping) or name not in batch:
        raise ValueError(f"include_for_metrics 'inputs' takes the model's main input {name!r} from each eval batch: "
                         "this batch has none (the batches must be dicts holding it)")
    return batch[name]


def metrics_format(metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` as HF's `log_metrics` shows them: `*_runtime` as h:mm:ss.cc, `total_flos` in GF (2**30 flos),
    `*_mem_*` in MB, other floats rounded to 4 places."""
    shown = dict(metrics)
    for key, value in metrics.items():
        if "_mem_" in key:
            shown[key] = f"{int(value) >> 20}MB"
        elif "_runtime" in key:
            shown[key] = f"{datetime.timedelta(seconds=int(value))}.{int(abs(value - int(value)) * 100):02d}"
        elif key == "total_flos":
            shown[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            shown[key] = round(value, 4)
    return shown


def _numpy(value: Any):
    return _nested(lambda t: (t.float() if t.is_floating_point() else t).numpy(), value)


class EvaluationMixin:
    """`evaluate`, `predict`, `prediction_step` and the eval and test dataloaders of `Trainer`."""

    _eval_loaders: dict[str, DataLoader] | None = None
    """With `dataloader_persistent_workers`: the eval loaders kept with their workers, by set name ("eval")."""

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        """The eval set's loader; a str names one entry of a dict `eval_dataset` (as in HF)."""
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        if isinstance(eval_dataset, str):
            if not isinstance(self.eval_dataset, dict) or eval_dataset not in self.eval_dataset:
                names = ", ".join(map(repr, self.eval_dataset)) if isinstance(self.eval_dataset, dict) else None
                raise KeyError(f"eval set {eval_dataset!r}: " + (f"the eval_dataset dict has {names}" if names
                                                                  else "eval_dataset is not a dict of eval sets"))
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluation needs an eval_dataset")
        if isinstance(dataset, dict):
            raise ValueError(f"eval_dataset is a dict: name one of its sets ({', '.join(map(repr, dataset))}), "
                             "or call evaluate(), which evaluates each")
        if not (self.args.dataloader_persistent_workers and self.args.dataloader_num_workers):
            return self._ordered_loader(dataset)
        # As HF: the loader is kept, so the next evaluation finds its workers running instead of starting new ones
        # (never dropped, each loader's would stay). One per set name; another set passed replaces it (HF's would
        # evaluate the first set again).
        kept = self._eval_loaders = self._eval_loaders or {}
        if key not in kept or kept[key].dataset is not dataset:
            kept[key] = self._ordered_loader(dataset)
        return kept[key]

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        """The loader `predict` runs over."""
        return self._ordered_loader(test_dataset)

    def _ordered_loader(self, dataset: Dataset) -> DataLoader:
        sampler = None
        if has_length(dataset):
            sampler = ResumableDistributedSampler(len(dataset), num_replicas=dist_util.world_size(),
                                                  rank=dist_util.rank(), shuffle=False)
        return make_loader(dataset, batch_size=self.args.per_device_eval_batch_size, sampler=sampler,
                           collate_fn=self._collator("evaluation data"), num_workers=self.args.dataloader_num_workers,
                           pin_memory=self._pin_memory, drop_last=False, generator_seed=self.args.data_seed,
                           rank=dist_util.rank(), persistent_workers=self.args.dataloader_persistent_workers,
                           prefetch_factor=self.args.dataloader_prefetch_factor)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys: list[str] | None = None):
        """Forward pass without gradients: (loss, logits, labels), any of which may be None.

        A batch with its labels (see `label_names`) is scored by `compute_loss`
        (with `return_outputs=True`); any other batch by the model's own loss,
        when it returns one (models that take their targets under another
        name still report an eval loss).
        """
        inputs = self._prepare_inputs(inputs)
        names = self._label_names()
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
        if ignore_keys is None:  # as HF: what the model's config says is no prediction (a KV cache)
            ignore_keys = getattr(getattr(self._unwrapped_model(), "config", None),
                                  "keys_to_ignore_at_inference", None)
        return loss, _nested(torch.Tensor.detach, extract_logits(outputs, ignore_keys)), labels

    def evaluation_loop(self, dataloader: DataLoader, *, prefix: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None):
        args = self.args
        # evaluate() collects predictions only for compute_metrics; predict() always (whatever its prefix).
        loss_only = (args.prediction_loss_only or self.compute_metrics is None) if prediction_loss_only is None \
            else prediction_loss_only
        model = self.model_wrapped if self.model_wrapped is not None else self.model.to(self.device)
        was_training = model.training
        model.eval()
        world, rank = dist_util.world_size(), dist_util.rank()
        dataset_len = len(dataloader.dataset) if has_length(dataloader.dataset) else None
        # An iterable set has no sampler to shard it: its batches are dealt to the ranks (each row once, as HF).
        dealt = dataset_len is None and world > 1 and isinstance(dataloader.dataset, IterableDataset)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        preds, labels, inputs, losses = [], [], [], []
        main_input = getattr(self._unwrapped_model(), "main_input_name", "input_ids")  # HF's, for include_for_metrics
        seen = rows = 0  # samples of this rank so far (to tell padding from real samples), and the real ones
        start = time.perf_counter()
        batches, computed = 0, None
        per_batch = args.batch_eval_metrics and self.compute_metrics is not None  # batch_metrics.py
        keep = not per_batch or prediction_loss_only is not None  # as HF: then evaluate() keeps no predictions
        self.callback_handler.objects = {**self.callback_handler.objects, "eval_dataloader": dataloader}  # HF's
        source = _dealt(dataloader, world, rank) if dealt else zip(dataloader, itertools.repeat(True))
        for (batch, mine), last in with_last(source):
            batches += 1
            n = batch_size_of(batch)
            real = (n if mine else 0) if dataset_len is None else sum(1 for j in range(seen, seen + n)
                                                                     if j * world + rank < dataset_len)
            seen, rows = seen + n, rows + real
            loss, logits, label = self.prediction_step(model, batch, loss_only, ignore_keys=ignore_keys)
            self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)
            if logits is not None and self.preprocess_logits_for_metrics is not None:  # as HF: before gathering
                logits = self.preprocess_logits_for_metrics(logits, label)
            if per_batch:  # every rank, each batch: HF's last return is the metrics
                computed = self._batch_eval_metrics(batch, logits, label, loss, real=real, last=last, dealt=dealt,
                                                    previous=computed)
            if not mine:  # run for the collectives only
                continue
            if "inputs" in args.include_for_metrics and keep:
                inputs.append(_nested(torch.Tensor.cpu, main_input_of(batch, main_input)))
            if "loss" in args.include_for_metrics and loss is not None and keep:  # as HF: the batch's loss per sample
                losses.append(loss.reshape(1).expand(n).cpu())
            if loss is not None and real:
                loss_sum += loss.double() * real
                count += real
            if logits is not None and keep:
                preds.append(_nested(torch.Tensor.cpu, logits))
            if label is not None and keep:
                labels.append(_nested(torch.Tensor.cpu, label))
        if world > 1:
            totals = torch.stack([loss_sum, count, torch.tensor(float(rows), dtype=torch.float64, device=self.device)])
            dist.all_reduce(totals)
            loss_sum, count, rows = totals[0], totals[1], int(totals[2].item())
        if was_training:
            model.train()
        metrics: dict[str, float] = {}
        if count.item() > 0:
            metrics[f"{prefix}_loss"] = (loss_sum / count).item()
        all_preds = self._gather(preds, dataset_len, dealt)
        all_labels = self._gather(labels, dataset_len, dealt)
        extra = {"inputs": self._gather(inputs, dataset_len, dealt) if "inputs" in args.include_for_metrics else None,
                 "losses": self._gather(losses, dataset_len, dealt) if "loss" in args.include_for_metrics else None}
        # As HF: no metrics of a set without the labels the model takes (predict() on a test set without them);
        # a model that takes none (its targets under another name) gets them with label_ids None, as before.
        if not per_batch and self.compute_metrics is not None and all_preds is not None and (
                all_labels is not None or not self._takes_labels()):
            given = EvalPrediction(_numpy(all_preds), _numpy(all_labels), **{k: _numpy(v) for k, v in extra.items()})
            computed = self.compute_metrics(given)
        for key, value in (computed or {}).items():
            metrics[key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"] = plain_metrics(value)
        runtime = time.perf_counter() - start
        metrics[f"{prefix}_runtime"] = round(runtime, 4)
        if dataset_len or rows:  # an iterable set's: the rows it yielded (HF's observed count)
            metrics[f"{prefix}_samples_per_second"] = round((dataset_len or rows) / max(runtime, 1e-9), 3)
        metrics[f"{prefix}_steps_per_second"] = round(batches / max(runtime, 1e-9), 3)
        return all_preds, all_labels, metrics

    def _label_names(self) -> tuple[str, ...]:
        """`args.label_names`, else the model's label arguments as HF finds them."""
        return tuple(self.args.label_names or label_names(type(self._unwrapped_model())))

    def _takes_labels(self) -> bool:
        model_class = type(self._unwrapped_model())
        params = inspect.signature(model_class.forward).parameters
        return any(name in params for name in self._label_names())

    def _gather(self, chunks: list[torch.Tensor], dataset_len: int | None, dealt: bool = False) -> torch.Tensor | None:
        """*Collective.* This rank's batches → the whole eval set's tensor in dataset order (every rank); `dealt`:
        batch j of rank r is the set's batch j * world + r (`_dealt`)."""
        if dealt:
            per_rank = dist_util.gather_objects(chunks)
            ordered = [c for round_ in itertools.zip_longest(*per_rank) for c in round_ if c is not None]
            return _concat(ordered) if ordered else None
        local = _concat(chunks) if chunks else None
        if dist_util.world_size() == 1:
            return local
        per_rank = dist_util.gather_objects(local)
        if any(t is None for t in per_rank):
            return None
        return _interleave(per_rank, dataset_len or sum(_rows(t) for t in per_rank))

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print `metrics` under `***** {split} metrics *****`, one aligned line each (`metrics_format`), values
        right-aligned, on the main process (HF's)."""
        if not self.is_world_process_zero():
            return
        shown = {k: str(v) for k, v in metrics_format(metrics).items()}
        width, value_width = (max((len(x) for x in xs), default=0) for xs in (shown, shown.values()))
        print(f"***** {split} metrics *****")
        for key in sorted(shown):
            print(f"  {key: <{width}} = {shown[key]:>{value_width}}")

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """`<output_dir>/{split}_results.json` and, with `combined`, `all_results.json` updated with them (HF's)."""
        if not self.is_world_process_zero():
            return
        out = Path(self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True))
        if combined:
            path = out / "all_results.json"
            every = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps({**every, **metrics}, indent=4, sort_keys=True))

    def evaluate(self, eval_dataset: Dataset | dict[str, Dataset] | str | None = None, ignore_keys=None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """*Collective.* Evaluate, log the metrics and fire `on_evaluate`.

        As in HF, a dict (given, or the Trainer's `eval_dataset`) evaluates each set in turn under the prefix
        `<metric_key_prefix>_<name>` (each logged and reported on its own) and returns all their metrics; a
        str evaluates that set of the Trainer's dict, under `metric_key_prefix`."""
        override = eval_dataset is not None
        datasets = eval_dataset if override else self.eval_dataset
        if isinstance(datasets, dict):
            metrics: dict[str, float] = {}
            for name, dataset in datasets.items():  # as HF: the Trainer's own sets go by name (a str)
                metrics.update(self.evaluate(eval_dataset=dataset if override else name, ignore_keys=ignore_keys,
                                             metric_key_prefix=f"{metric_key_prefix}_{name}"))
            return metrics
        dataloader = self.get_eval_dataloader(eval_dataset)
        _, _, metrics = self.evaluation_loop(dataloader, prefix=metric_key_prefix, ignore_keys=ignore_keys)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def predict(self, test_dataset: Dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        """*Collective.* Predictions (numpy, dataset order), labels and metrics on `test_dataset`."""
        dataloader = self.get_test_dataloader(test_dataset)
        preds, labels, metrics = self.evaluation_loop(dataloader, prefix=metric_key_prefix, prediction_loss_only=False,
                                                      ignore_keys=ignore_keys)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics=metrics)
        return PredictionOutput(_numpy(preds), _numpy(labels), metrics)
