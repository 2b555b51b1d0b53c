"""A tiny transformers GPT-2 and token rows for the tests that run HF's Trainer beside kubetrain's."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

SEQ = 8


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=SEQ))


def token_rows(n: int = 12, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (n, SEQ), generator=g)]
