"""One rank of a 2-process CPU (gloo) training run, driven by the slow DDP tests.

Usage: python ddp_worker.py '<json spec>' with RANK/WORLD_SIZE/MASTER_* set.
Spec keys: out (output_dir), max_steps, stop_at (step to stop cleanly at),
sigterm_at ({"rank": r, "step": s}: that rank signals itself mid-step s),
resume (None, True or a path), result (folder for this rank's params + history),
async_save, hold_writes (background writes wait until the loop waits for them), best (evaluate every
save, load_best_model_at_end, save_total_limit 2), nodes (each rank its own node: output_dir <out>/node<rank>,
as on nodes that share no disk).
Exit code 83 when preempted, as the built-in entrypoint does.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from safetensors.torch import save_file  # noqa: E402

from kubetrain_trainer import Trainer, TrainerCallback, TrainingArguments, TrainingPreempted  # noqa: E402
from kubetrain_trainer.args import ConfigError  # noqa: E402
from kubetrain_trainer.builtin import exit_at_once  # noqa: E402
from kubetrain_trainer.models import SyntheticTokens, TinyGPT, TinyGPTConfig  # noqa: E402
from kubetrain_trainer.rng import set_seed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared harness
from kubetrain_strategy_harness import hold_background_writes  # noqa: E402


class Control(TrainerCallback):
    def __init__(self, spec):
        self.spec = spec

    def on_step_begin(self, args, state, control, **kwargs):
        s = self.spec.get("sigterm_at")
        if s and s["rank"] == int(os.environ["RANK"]) and state.global_step + 1 == s["step"]:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_step_end(self, args, state, control, **kwargs):
        if self.spec.get("stop_at") == state.global_step:
            control.should_training_stop = True


def main():
    spec = json.loads(sys.argv[1])
    set_seed(spec.get("init_seed", 0))
    model = TinyGPT(TinyGPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, dropout=0.1))
    out = f"{spec['out']}/node{os.environ['RANK']}" if spec.get("nodes") else spec["out"]
    best = {"eval_strategy": "steps", "eval_steps": 3, "load_best_model_at_end": True,
            "save_total_limit": 2} if spec.get("best") else {}
    args = TrainingArguments(output_dir=out, max_steps=spec["max_steps"], per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2,
                             lr_scheduler_type="cosine", logging_steps=1, save_steps=3, disable_tqdm=True,
                             report_to=["none"], async_save=spec.get("async_save", False), **best)
    trainer = Trainer(model=model, args=args, train_dataset=SyntheticTokens(30, 8, 32), callbacks=[Control(spec)],
                      eval_dataset=SyntheticTokens(8, 8, 32, seed=1) if best else None)
    if spec.get("hold_writes"):
        hold_background_writes(trainer)
    code = 0
    try:
        trainer.train(resume_from_checkpoint=spec.get("resume"))
    except TrainingPreempted:
        code = 83
    except ConfigError as e:  # refused before training: said, and exit 2
        print(f"ConfigError: {e}", flush=True)
        exit_at_once(2)
    result = Path(spec["result"])
    result.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(result / f"params_{rank}.safetensors"))
    (result / f"history_{rank}.json").write_text(json.dumps(trainer.state.log_history))
    torch.distributed.destroy_process_group()
    # As the built-in trainer leaves (builtin.exit_at_once): threads joined, atexit run, no interpreter teardown,
    # where gloo's threads can still turn a finished run's 0 into SIGABRT ("terminate called without an active
    # exception", seen once in a CI rehearsal). This test is about resume, not teardown.
    exit_at_once(code)


if __name__ == "__main__":
    main()
