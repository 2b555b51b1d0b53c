"""One rank of the log-level test: for each configuration, a Trainer, one real training step, then probes.

Usage: python log_levels_worker.py '<json list of configs>' with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* set.
Each config: name, log_level, log_level_replica, log_on_each_node, app_level (the level the application
gave the trainer's logger before building the Trainer, as the HF guide's logging recipe does). After the
step the worker logs one probe record per level through the trainer's logger and prints what
get_process_log_level() answered, each line prefixed with its rank.
"""

import gc
import json
import logging
import os
import sys
import tempfile

import torch

torch.set_num_threads(1)

from kubetrain_trainer import Trainer, TrainingArguments  # noqa: E402
from kubetrain_trainer.models import SyntheticRegression, TinyMLP  # noqa: E402

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def main():
    rank = int(os.environ["RANK"])
    logging.basicConfig(stream=sys.stdout, format=f"rank={rank} %(levelname)s %(message)s", force=True)
    logger = logging.getLogger("kubetrain_trainer")
    out = tempfile.mkdtemp(prefix=f"loglevels-{rank}-")
    for config in json.loads(sys.argv[1]):
        name = config["name"]
        logger.setLevel(config["app_level"])
        args = TrainingArguments(output_dir=os.path.join(out, name), max_steps=1, save_strategy="no",
                                 report_to=["none"], disable_tqdm=True, use_cpu=True,
                                 log_level=config["log_level"], log_level_replica=config["log_level_replica"],
                                 log_on_each_node=config["log_on_each_node"])
        asked = args.get_process_log_level()
        trainer = Trainer(model=TinyMLP(), args=args, train_dataset=SyntheticRegression(8))
        trainer.train()
        for level in LEVELS:
            logger.log(getattr(logging, level), "probe %s", name)
        print(f"rank={rank} ASKED {name} {logging.getLevelName(asked)}", flush=True)
    # The trainers (and the DDP wrappers in them, which hold the process group and so gloo's threads) are
    # freed while the interpreter is alive: left to its finalization, gloo could abort the process at exit
    # ("terminate called without an active exception", SIGABRT) after all its output (CI, twice).
    del trainer
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
