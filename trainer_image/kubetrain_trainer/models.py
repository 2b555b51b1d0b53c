"""Tiny models and deterministic synthetic data for the built-in tasks, tests and benchmarks.

`TinyGPT` is a small decoder-only transformer (pre-norm, causal attention)
with the hooks the Trainer uses on real models: `get_input_embeddings`
(NEFTune), `gradient_checkpointing_enable`, a `config` saved as config.json.
The datasets are pure functions of (seed, index), so every process and every
attempt sees the same data without downloading anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset


@dataclass
class TinyGPTConfig:
    """Shape of a `TinyGPT`."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    model_type: str = "kubetrain-tiny-gpt"


class Block(nn.Module):
    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.mlp = nn.Sequential(nn.Linear(c.d_model, 4 * c.d_model), nn.GELU(), nn.Linear(4 * c.d_model, c.d_model))
        self.drop = nn.Dropout(c.dropout)
        self.n_heads = c.n_heads
        self.p = c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """A decoder-only LM: forward(input_ids, labels=None) -> {"loss", "logits"}."""

    def __init__(self, config: TinyGPTConfig | None = None):
        super().__init__()
        self.config = c = config or TinyGPTConfig()
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.gradient_checkpointing = False

    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok

    def gradient_checkpointing_enable(self, **_: object) -> None:
        self.gradient_checkpointing = True

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        out = {"logits": logits}
        if labels is not None:
            # Next-token prediction: position t predicts token t+1.
            out["loss"] = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                          labels[:, 1:].reshape(-1))
        return out


class SyntheticTokens(Dataset):
    """Token sequences x[t] = (x0 + b*t + a*t*(t-1)/2) mod V with per-sample a, b, x0: learnable, deterministic.

    The next token follows from the previous two, so a tiny model's loss falls quickly.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0):
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed
        t = torch.arange(seq_len, dtype=torch.long)
        self._t, self._tri = t, t * (t - 1) // 2

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        # A cheap integer hash of (seed, i): no generator object per item.
        h = (i * 2654435761 + self.seed * 97531) % (2**31)
        a, b, x0 = 1 + h % 7, (h // 7) % self.vocab_size, (h // 1031) % self.vocab_size
        ids = (x0 + b * self._t + a * self._tri) % self.vocab_size
        return {"input_ids": ids, "labels": ids}


class TinyMLP(nn.Module):
    """Regression MLP: forward(x, y=None) -> {"loss", "logits"}."""

    def __init__(self, in_features: int = 8, hidden: int = 32, dropout: float = 0.0):
        super().__init__()
        self.config = {"in_features": in_features, "hidden": hidden, "model_type": "kubetrain-tiny-mlp"}
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pred = self.net(x).squeeze(-1)
        out = {"logits": pred}
        if y is not None:
            out["loss"] = F.mse_loss(pred, y)
        return out


class SyntheticRegression(Dataset):
    """y = x . w + noise, with x, w and noise fixed by `seed`; `weights`: this w instead of one drawn (a held-out
    set of the same function: another seed's samples of a training set's `w`)."""

    def __init__(self, num_samples: int, in_features: int = 8, seed: int = 0, noise: float = 0.01,
                 weights: torch.Tensor | None = None):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, in_features, generator=g)
        drawn = torch.randn(in_features, generator=g)  # drawn either way: a seed's noise stays the same
        self.w = drawn if weights is None else weights
        self.y = self.x @ self.w + noise * torch.randn(num_samples, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}
