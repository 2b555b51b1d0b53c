"""Bring your HF script: a plain transformers-Trainer training script, plus ONE kubetrain line.

Runs as is on a laptop (`python examples/hf_trainer_script.py --output_dir runs/hf --max_steps 40`), and in a
TrainingJob as a command job (examples/trainingjob-hf.yaml):

    trainer:
      command: ["python", "examples/hf_trainer_script.py", "--output_dir", "$(KUBETRAIN_LOCAL_CHECKPOINT_DIR)"]

The launcher restores the newest complete checkpoint into that folder before the script starts, so
the script's ordinary `get_last_checkpoint` resume picks it up; the launcher uploads each
`checkpoint-<step>` the Trainer writes. The one added line, `KubetrainCheckpointCallback`, marks each
folder complete once the Trainer finished writing it, so a save cut short by a preemption is never
committed (docs/contract.md, "When a local checkpoint is complete").

The model is a small GPT-2 built from a config (no download) and the data is synthetic: a pure
function of the index, so every run and every resume sees the same batches.
"""

import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from kubetrain_trainer.hf import KubetrainCheckpointCallback


class SyntheticTokens(Dataset):
    """Sequences that follow a fixed rule (next = 3 * token + 1 mod vocab) from a seeded random start."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        steps = torch.arange(seq_len).unsqueeze(0)
        self.ids = (starts * (3 ** steps) + (3 ** steps - 1) // 2) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    config = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=args, train_dataset=SyntheticTokens(512, 16, config.vocab_size, seed=0))
    trainer.add_callback(KubetrainCheckpointCallback())  # the one kubetrain line: exact commit points

    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    result = trainer.train(resume_from_checkpoint=last)
    trainer.save_model()  # the final model, from_pretrained layout, in output_dir
    print(f"trained to step {result.global_step}, resumed from {last}, loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
