"""TrainingArguments: parsing from CLI, files and dicts; bad input fails before training, saying what to change."""

from __future__ import annotations

import json

import pytest

from kubetrain_trainer import ConfigError, TrainingArguments
from kubetrain_trainer.args import parse_cli


def test_cli_flags_are_typed():
    args = TrainingArguments.from_cli(["--max_steps", "10", "--bf16", "--learning_rate=3e-4",
                                       "--report_to", "tensorboard,jsonl", "--save_total_limit", "null"])
    assert args.max_steps == 10 and isinstance(args.max_steps, int)
    assert args.bf16 is True
    assert args.learning_rate == 3e-4
    assert args.report_to == ["tensorboard", "jsonl"]
    assert args.save_total_limit is None


def test_yaml_and_json_files(tmp_path):
    (tmp_path / "a.yaml").write_text("max_steps: 7\nlr_scheduler_type: cosine\nfsdp_config: {a: 1}\nstrategy: fsdp\n")
    (tmp_path / "a.json").write_text(json.dumps({"max_steps": 8, "warmup_ratio": 0.1}))
    y = TrainingArguments.from_file(tmp_path / "a.yaml")
    j = TrainingArguments.from_file(tmp_path / "a.json")
    assert (y.max_steps, y.lr_scheduler_type, y.fsdp_config) == (7, "cosine", {"a": 1})
    assert (j.max_steps, j.warmup_ratio) == (8, 0.1)
    # flags win over the file
    assert TrainingArguments.from_cli(["--config", str(tmp_path / "a.json"), "--max_steps", "3"]).max_steps == 3


def test_dict_with_json_string_for_deepspeed(tmp_path):
    args = TrainingArguments.from_dict({"strategy": "zero3", "deepspeed": '{"zero_optimization": {"stage": 3}}'})
    assert args.deepspeed == {"zero_optimization": {"stage": 3}}


def test_unknown_argument_suggests_nearest_name():
    with pytest.raises(ConfigError, match=r"unknown argument 'learning_rat'; did you mean 'learning_rate'"):
        TrainingArguments.from_dict({"learning_rat": 1e-3})
    with pytest.raises(ConfigError, match=r"'per_device_batch_size'.*did you mean 'per_device_\w+_batch_size'"):
        TrainingArguments.from_cli(["--per_device_batch_size", "4"])


def test_bad_value_names_the_argument_and_the_choices():
    with pytest.raises(ConfigError, match=r"max_steps: expected an integer, got 'ten'"):
        TrainingArguments.from_dict({"max_steps": "ten"})
    with pytest.raises(ConfigError, match=r"lr_scheduler_type: 'cosin' is not one of .*did you mean 'cosine'"):
        TrainingArguments(lr_scheduler_type="cosin")


@pytest.mark.parametrize("name", ["save_steps", "logging_steps", "eval_steps", "warmup_steps", "num_train_epochs",
                                  "learning_rate", "warmup_ratio", "max_grad_norm"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("nan"), float("inf"), 10**400])
def test_non_finite_numbers_are_refused_naming_the_argument(name, value):
    with pytest.raises(ConfigError, match=rf"{name}: expected a finite number, got"):
        TrainingArguments.from_dict({name: value})


@pytest.mark.parametrize("kwargs, message", [
    (dict(load_best_model_at_end=True), r"load_best_model_at_end needs evaluation: set eval_strategy"),
    (dict(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps"),
     r"save_strategy == eval_strategy.*set save_strategy: epoch"),
    (dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=3, save_steps=4),
     r"save_steps \(4\) to be a multiple of eval_steps \(3\)"),
    (dict(strategy="zero3"), r"strategy 'zero3' needs a DeepSpeed config"),
    (dict(deepspeed={"a": 1}), r"set strategy: zero3"),
    (dict(fsdp_config={"a": 1}), r"set strategy: fsdp"),
    (dict(bf16=True, fp16=True), r"pick one"),
    (dict(save_strategy="best"), r"save_strategy 'best' needs evaluation"),
    (dict(max_steps=-1, num_train_epochs=0), r"nothing to train"),
    (dict(save_steps=2.5), r"whole number of steps"),
    (dict(eval_strategy="steps", eval_steps=0, logging_strategy="no", logging_steps=0),
     r"eval_strategy 'steps' needs eval_steps > 0, or logging_steps > 0"),
    (dict(eval_strategy="steps", logging_strategy="no", logging_steps=0), r"needs eval_steps > 0"),
    (dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0, logging_steps=3, save_steps=4),
     r"save_steps \(4\) to be a multiple of eval_steps \(3\)"),
    (dict(learning_rate=-1e-4), r"learning_rate must be >= 0, got -0.0001"),
    (dict(weight_decay=-0.1), r"weight_decay must be >= 0"),
    (dict(adam_epsilon=-1e-8), r"adam_epsilon must be >= 0"),
    (dict(adam_beta1=1.5), r"adam_beta1 must be within \[0, 1\), got 1.5"),
    (dict(adam_beta2=1), r"adam_beta2 must be within \[0, 1\)"),
    (dict(adam_beta1=-0.1), r"adam_beta1 must be within \[0, 1\)"),
    (dict(ddp_timeout=0), r"ddp_timeout must be > 0"),
    (dict(ddp_timeout=-5), r"ddp_timeout must be > 0"),
])
def test_incompatible_settings_fail_with_what_to_change(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainingArguments(**kwargs)


def test_eval_steps_0_means_logging_steps_as_in_hf():
    assert TrainingArguments(eval_strategy="steps", eval_steps=0, logging_steps=7).eval_steps == 7
    assert TrainingArguments(eval_strategy="steps", eval_steps=0, logging_strategy="no", logging_steps=5).eval_steps == 5


def test_fractional_step_arguments_and_defaults():
    args = TrainingArguments(logging_steps=0.25, save_steps=0.5, eval_strategy="steps", warmup_steps=0.1)
    assert args.resolve_steps(args.logging_steps, 10) == 3  # ceil(2.5)
    assert args.resolve_steps(args.save_steps, 10) == 5
    assert args.resolve_steps(args.eval_steps, 10) == 3  # eval_steps defaults to logging_steps
    assert args.warmup_for(100) == 10
    assert TrainingArguments(warmup_ratio=0.2).warmup_for(10) == 2


def test_best_metric_defaults():
    args = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=5, save_steps=10)
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False
    assert TrainingArguments(metric_for_best_model="accuracy").greater_is_better is True


def test_round_trip_through_json():
    args = TrainingArguments(max_steps=5, report_to=["all"], fsdp_config={"x": 1}, strategy="fsdp")
    again = TrainingArguments.from_dict(json.loads(args.to_json_string()))
    assert again == args


def test_bare_flag_and_bad_token():
    assert parse_cli(["--bf16", "--max_steps", "2"]) == {"bf16": "true", "max_steps": "2"}
    with pytest.raises(ConfigError, match="unexpected command-line token"):
        parse_cli(["max_steps", "2"])


def test_the_constructor_refuses_an_unknown_argument_with_the_nearest_name_as_a_config_error():
    """HF scripts build TrainingArguments(...) directly: an HF argument kubetrain has not was a bare TypeError
    (exit 1, retried until backoffLimit) where from_dict gave a ConfigError (exit 82) with a suggestion."""
    with pytest.raises(ConfigError, match=r"unknown argument 'max_step'; did you mean 'max_steps'"):
        TrainingArguments(output_dir="o", max_step=3)
    with pytest.raises(ConfigError, match=r"unknown argument 'label_smoothing_factor'"):
        TrainingArguments(output_dir="o", label_smoothing_factor=0.1)


def test_hf_s_script_flags_are_there_and_push_to_hub_only_false():
    args = TrainingArguments(output_dir="o", do_train=True, do_eval="true", push_to_hub=False)
    assert (args.do_train, args.do_eval, args.do_predict, args.push_to_hub) == (True, True, False, False)
    with pytest.raises(ConfigError, match="push_to_hub: kubetrain does not push"):
        TrainingArguments(output_dir="o", push_to_hub=True)


def test_a_dataclass_subclass_has_its_own_fields_coerced():
    from dataclasses import dataclass

    @dataclass
    class ScriptArguments(TrainingArguments):
        block_size: int = 128

    args = ScriptArguments(output_dir="o", block_size="64", max_steps="5")
    assert (args.block_size, args.max_steps) == (64, 5)


def test_hf_s_argument_parser_builds_kubetrain_s_arguments():
    """HF scripts (and examples/hf_trainer_script.py) parse their arguments with HfArgumentParser: report_to typed
    list[Literal] made it refuse `--report_to none`, and `--do_train` was unknown."""
    transformers = pytest.importorskip("transformers")
    parser = transformers.HfArgumentParser((TrainingArguments,))
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "x", "--report_to", "none", "--do_train",
                                                  "--max_steps", "5"])
    assert (args.report_to, args.do_train, args.max_steps) == ([], True, 5)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "x", "--report_to", "tensorboard", "jsonl"])
    assert args.report_to == ["tensorboard", "jsonl"]
    assert TrainingArguments(output_dir="x", report_to="tensorboard,jsonl").report_to == ["tensorboard", "jsonl"]
    with pytest.raises(ConfigError, match=r"report_to: 'wandb' is not one of tensorboard, jsonl, all, none"):
        TrainingArguments(output_dir="x", report_to="wandb")


def test_report_to_as_a_json_list_string_still_works():
    assert TrainingArguments.from_cli(["--report_to", '["jsonl","tensorboard"]']).report_to == ["jsonl", "tensorboard"]
    assert TrainingArguments.from_dict({"report_to": '["jsonl"]'}).report_to == ["jsonl"]
    with pytest.raises(ConfigError, match=r"report_to: 'wandb' is not one of"):
        TrainingArguments.from_dict({"report_to": '["wandb"]'})


def test_a_subclass_whose_annotations_do_not_resolve_here_still_builds():
    """`tokenizer: PreTrainedTokenizer | None` with the name imported under TYPE_CHECKING: get_type_hints raised
    NameError on the subclass (exit 1) once its own fields were looked up."""
    namespace: dict = {}
    exec("from __future__ import annotations\n"
         "from dataclasses import dataclass\n"
         "from kubetrain_trainer import TrainingArguments\n"
         "@dataclass\n"
         "class MyArgs(TrainingArguments):\n"
         "    tokenizer: PreTrainedTokenizer | None = None\n", namespace)
    args = namespace["MyArgs"](output_dir="o", max_steps="3")
    assert args.max_steps == 3 and args.tokenizer is None
