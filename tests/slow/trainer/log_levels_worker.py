"""One rank of the log-level test: for each configuration, a Trainer, one real training step, then probes.

Usage: python log_levels_worker.py '<json list of configs>' with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* set.
Each config: name, log_level, log_level_replica, log_on_each_node, app_level (the level the application
gave the trainer's logger before building the Trainer, as the HF guide's logging recipe does). After the
step the worker logs one probe record per level through the trainer's logger and prints what
get_process_log_level() answered, each line prefixed with its rank.
"""

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
    # Both ranks are done; then out without any teardown. gloo aborted rank 1 at its exit twice in CI rehearsals
    # ("terminate called without an active exception", SIGABRT, after all its output), once with a barrier
    # before destroy_process_group. The process group outlives destroy_process_group here (held outside
    # Python's gc; the cause is not found), and this test is about log levels, not teardown.
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
