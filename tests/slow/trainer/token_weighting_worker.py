"""One rank of a one-step GPT-2 run for test_token_weighting.py: SGD, lr 1, no clipping, rows of 1 to 24 label
tokens; writes the updated lm_head weight and the logged loss (rank 0).

Usage: python token_weighting_worker.py <per_device_batch> <accumulation> <out.pt> (RANK/WORLD_SIZE/... set or not)
"""

import os
import sys

import torch
import transformers

from kubetrain_trainer import Trainer, TrainingArguments
from kubetrain_trainer.exiting import exit_at_once

torch.set_num_threads(1)
ROWS = [[3, 4], list(range(5, 30)), [7, 8, 9, 10], list(range(11, 20))]


def collate(feats):
    n = max(len(f) for f in feats)
    return {"input_ids": torch.tensor([f + [0] * (n - len(f)) for f in feats]),
            "labels": torch.tensor([f + [-100] * (n - len(f)) for f in feats])}


def main() -> None:
    batch, accumulation, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = TrainingArguments(output_dir=f"{out}.run{os.environ.get('RANK', '0')}", per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, max_steps=1, optim="sgd", learning_rate=1.0,
                             max_grad_norm=0.0, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                             report_to=["none"], disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=ROWS, data_collator=collate)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"weight": model.lm_head.weight.detach(), "loss": trainer.state.log_history[0]["loss"]}, out)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # As the built-in trainer leaves: no interpreter teardown, where gloo's threads can hang or abort a finished run.
    exit_at_once(0)


if __name__ == "__main__":
    main()
