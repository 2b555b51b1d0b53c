"""Writing the final model in the layout `from_pretrained` loads: config.json + model.safetensors.

Hugging Face models save themselves (`save_pretrained`, given the
consolidated state dict so sharded strategies work too), with config.json's
dtype that of the weights written. Any other module is written as
`model.safetensors`, with a `config.json` when it carries a config (a
dataclass, a dict or an object with `to_dict`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from .strategies.ddp import safetensors_ready


def config_dict(module: nn.Module) -> dict[str, Any] | None:
    config = getattr(module, "config", None)
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return None


def save_model_config(module: nn.Module, out: Path, *, processing_class: Any = None) -> None:
    """What `from_pretrained` needs next to a checkpoint's weights, as the HF Trainer writes it into each
    checkpoint-N: the config (and a generation config), and the processing class (a tokenizer)."""
    config = getattr(module, "config", None)
    if hasattr(config, "save_pretrained"):  # a transformers config
        config.save_pretrained(out)
        generation = getattr(module, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained") and getattr(module, "can_generate",
                                                                                          lambda: False)():
            generation.save_pretrained(out)
    else:
        _write_plain_config(module, out)
    _save_processing_class(processing_class, out)


def _write_plain_config(module: nn.Module, out: Path) -> None:
    """config.json from a module's plain config; a value JSON has no type for (a torch.dtype) as its str."""
    if (plain := config_dict(module)) is not None:
        (out / "config.json").write_text(json.dumps(plain, indent=2, sort_keys=True, default=str) + "\n")


def _save_processing_class(processing_class: Any, out: Path) -> None:
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(out)


def save_model_files(module: nn.Module, state_dict: dict[str, torch.Tensor] | None, out: Path, *,
                     safe_serialization: bool = True, processing_class: Any = None) -> None:
    if state_dict is None:
        raise RuntimeError("no consolidated state dict on the main process: refusing to write an incomplete model")
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(module, "save_pretrained"):
        saved = _parameters_dtype(module, state_dict)  # before: save_pretrained empties the dict as it writes
        module.save_pretrained(out, state_dict=state_dict, safe_serialization=safe_serialization)
        _config_names_saved_dtype(module, saved, out)
    else:
        if safe_serialization:
            save_file(safetensors_ready(state_dict), str(out / "model.safetensors"), metadata={"format": "pt"})
        else:
            torch.save(state_dict, out / "pytorch_model.bin")
        _write_plain_config(module, out)
    _save_processing_class(processing_class, out)


def _parameters_dtype(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype of the state dict's first floating parameter (as `PreTrainedModel.dtype` reads the module's)."""
    parameters = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return next((t.dtype for k, t in state_dict.items() if k in parameters and t.is_floating_point()), None)


def _config_names_saved_dtype(module: nn.Module, saved: torch.dtype | None, out: Path) -> None:
    """Rewrite config.json when its dtype is not the saved weights': `from_pretrained` loads them in it.

    `save_pretrained` writes the module's own dtype. Under ZeRO-3 with bf16, DeepSpeed cast the module to
    bf16 in place while the weights saved are the fp32 master copy, so the config said bfloat16 and every
    tensor came back rounded. (With `stage3_gather_16bit_weights_on_model_save` the weights are the bf16
    ones, as the HF Trainer saves them, and the two agree.) The config written is a copy: the module's own
    is left as `save_pretrained` set it.
    """
    config = getattr(module, "config", None)
    if saved is None or not hasattr(config, "save_pretrained") or _dtype_name(config.dtype) == _dtype_name(saved):
        return
    written = copy.deepcopy(config)
    written.dtype = saved
    written.save_pretrained(out)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")  # a config holds "bfloat16" or torch.bfloat16
