r"""`causalqwen distill`: stage 2 of offline distillation, train the causal heads on stored teacher features
(docs/design.md, Offline distillation).

No transformer runs: each step scores the stored hidden states with the heads and fits the OvR probabilities of the
teacher's top-K tokens to the teacher's (top-K MSE). The model is the base the features came from (fresh heads) or a
CausalQwen adapter to continue; the data is a feature folder written by `causalqwen extract-features` (rows of
`hidden_state`, `topk_ids`, `topk_probs`); the result is an adapter folder.

    causalqwen extract-features --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name data/train.jsonl --output_dir features/train
    causalqwen distill \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name features/train \
        --action_weight tied --per_device_train_batch_size 256 --num_train_epochs 5 \
        --output_dir my-distilled-adapter

Every option of `CausalDistillConfig` (transformers' `TrainingArguments` plus the head options) is a flag.
"""

from dataclasses import dataclass, field, fields
from pathlib import Path

from transformers import TrainingArguments

from causalqwen_adapter.adapter_io import MODEL_HINT, check_found
from causalqwen_adapter.distill import CausalDistillConfig, CausalDistillTrainer
from causalqwen_adapter.features import check_feature_store
from causalqwen_adapter.training.checkpoints import check_output_dir
from causalqwen_adapter.training.resume import check_resumable

from .parsing import CliHfArgumentParser, lead_with, usage_errors

ALIASES = {"--features": "--dataset_name", "--eval_features": "--eval_dataset_name"}
TRAINING_OPTIONS = ("output_dir", "per_device_train_batch_size", "num_train_epochs", "max_steps", "learning_rate",
                    "bf16", "eval_strategy", "save_strategy", "logging_steps", "report_to", "seed",
                    "resume_from_checkpoint", "push_to_hub", "hub_model_id")


@dataclass
class DistillArguments:
    model_name_or_path: str = field(
        metadata={"help": "The base the features were extracted from (fresh heads), or a CausalQwen adapter."}
    )
    dataset_name: str = field(metadata={"help": "Feature folder written by `causalqwen extract-features`."})
    eval_dataset_name: str | None = field(default=None, metadata={"help": "Feature folder to evaluate on."})
    model_revision: str | None = field(default=None, metadata={"help": "Revision (branch, tag, commit) of the model."})
    dtype: str = field(
        default="float32",
        metadata={"help": "Dtype the model is loaded in.", "choices": ["auto", "bfloat16", "float16", "float32"]},
    )


def check_arguments(script_args: DistillArguments, training_args: CausalDistillConfig) -> None:
    """The folders the flags name, before any model or feature loads (`main` reports a failure as a usage error)."""
    check_found(script_args.model_name_or_path, "--model_name_or_path", MODEL_HINT)
    for name in (script_args.dataset_name, script_args.eval_dataset_name):
        if name is not None:
            check_feature_store(Path(name))
    if training_args.resume_from_checkpoint:
        check_resumable(Path(training_args.resume_from_checkpoint), CausalDistillTrainer.__name__)
    check_output_dir(training_args.output_dir)


def run(script_args: DistillArguments, training_args: CausalDistillConfig) -> CausalDistillTrainer:
    check_arguments(script_args, training_args)
    training_args.model_init_kwargs = {
        "revision": script_args.model_revision, "dtype": script_args.dtype, **(training_args.model_init_kwargs or {})
    }
    trainer = CausalDistillTrainer(
        script_args.model_name_or_path,
        args=training_args,
        train_dataset=script_args.dataset_name,
        eval_dataset=script_args.eval_dataset_name,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Adapter saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return trainer


def make_parser(prog: str | None = None) -> CliHfArgumentParser:
    parser = CliHfArgumentParser(
        (DistillArguments, CausalDistillConfig), aliases=ALIASES, prog=prog, description=__doc__,
        usage="%(prog)s --model_name_or_path MODEL --dataset_name FEATURES --output_dir DIR [options]")
    own = [f.name for f in fields(CausalDistillConfig) if f.name not in {g.name for g in fields(TrainingArguments)}]
    lead_with(parser, [
        ("options", ["help"]),
        ("model and data", [f.name for f in fields(DistillArguments)]),
        ("causal heads (CausalDistillConfig)", own),
        ("training (the most used)", TRAINING_OPTIONS),
    ], rest="every other option (transformers' TrainingArguments)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> CausalDistillTrainer:
    parser = make_parser(prog)
    arguments = parser.parse(argv)
    with usage_errors(parser):
        check_arguments(*arguments)
    return run(*arguments)


if __name__ == "__main__":
    main()
