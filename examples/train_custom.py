"""A user training script, written as an HF Trainer user would write it.

Runs as is on a laptop (`python examples/train_custom.py --max_steps 20`; `--help`
lists every argument), and in a TrainingJob with
`trainer.command: ["python", "examples/train_custom.py"]`:
the launcher restores the newest complete checkpoint first and sets
KUBETRAIN_RESUME_FROM, so the same script resumes after a preemption.
"""

import logging
import os
import sys

import torch
from torch import nn
from torch.utils.data import Dataset

from kubetrain_trainer import EarlyStoppingCallback, Trainer, TrainingArguments


class Squares(Dataset):
    """y = x² + noise, a pure function of the index (every rank sees the same data)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 1, generator=g) * 2 - 1
        self.y = self.x**2 + 0.01 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x, labels=None):
        pred = self.net(x)
        return {"loss": nn.functional.mse_loss(pred, labels), "logits": pred}


def main(argv):
    args = TrainingArguments.from_cli(
        ["--output_dir", os.environ.get("KUBETRAIN_LOCAL_CHECKPOINT_DIR", "runs/custom"),
         "--learning_rate", "0.01", "--per_device_train_batch_size", "16", "--eval_strategy", "steps",
         "--eval_steps", "10", "--save_strategy", "steps", "--save_steps", "10", "--save_total_limit", "2",
         "--load_best_model_at_end", "true", "--metric_for_best_model", "eval_loss", *argv])
    # The HF examples' logging habit: info on the process that should log, then the Trainer applies
    # log_level / log_level_replica (the default log_level, "passive", keeps this choice).
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.should_log:
        logging.getLogger("kubetrain_trainer").setLevel(logging.INFO)
    trainer = Trainer(MLP(), args, train_dataset=Squares(1024, seed=0), eval_dataset=Squares(128, seed=1),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=3)])
    out = trainer.train(resume_from_checkpoint=os.environ.get("KUBETRAIN_RESUME_FROM") or True)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    print(f"trained to step {out.global_step}, loss {out.training_loss:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
