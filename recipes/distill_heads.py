"""Stage 2 of offline distillation: train the causal heads on stored teacher features (docs/design.md, Offline distillation).

No transformer runs: each step scores the stored hidden states with the heads and fits the OvR probabilities of the
teacher's top-K tokens to the teacher's (top-K MSE). The model is the base the features came from (fresh
heads) or a CausalQwen adapter to continue; the result is an adapter folder.

    python recipes/extract_features.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name data/train.jsonl --output_dir features/train
    python recipes/distill_heads.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --features features/train \
        --action_weight tied --per_device_train_batch_size 256 --num_train_epochs 5 \
        --output_dir my-distilled-adapter

Every option of `CausalDistillConfig` (transformers' `TrainingArguments` plus the head options) is a flag. Run with
`--help` for the list.
"""

from dataclasses import dataclass, field

from transformers import HfArgumentParser

from causalqwen_adapter.distill import CausalDistillConfig, CausalDistillTrainer


@dataclass
class DistillArguments:
    model_name_or_path: str = field(
        metadata={"help": "The base the features were extracted from (fresh heads), or a CausalQwen adapter."}
    )
    features: str = field(metadata={"help": "Feature folder written by recipes/extract_features.py."})
    eval_features: str | None = field(default=None, metadata={"help": "Feature folder to evaluate on."})
    model_revision: str | None = field(default=None, metadata={"help": "Revision (branch, tag, commit) of the model."})
    dtype: str = field(
        default="float32",
        metadata={"help": "Dtype the model is loaded in.", "choices": ["auto", "bfloat16", "float16", "float32"]},
    )


def main(script_args: DistillArguments, training_args: CausalDistillConfig) -> CausalDistillTrainer:
    training_args.model_init_kwargs = {
        "revision": script_args.model_revision, "dtype": script_args.dtype, **(training_args.model_init_kwargs or {})
    }
    trainer = CausalDistillTrainer(
        script_args.model_name_or_path,
        args=training_args,
        train_dataset=script_args.features,
        eval_dataset=script_args.eval_features,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Adapter saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return trainer


if __name__ == "__main__":
    main(*HfArgumentParser((DistillArguments, CausalDistillConfig)).parse_args_into_dataclasses())
