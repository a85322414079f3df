r"""`causalqwen train`: train CausalQwen heads with the one-vs-rest loss, TRL's `trl sft` for causal heads.

The model is a base causal LM (fresh heads are attached) or a CausalQwen adapter (training continues). The dataset is a
`datasets` name or a local .jsonl/.json/.parquet/.csv file or folder whose rows hold plain `text`, a
`prompt`/`completion` pair (loss on the completion only) or chat `messages`; with --numeric, a `text` column whose
numbers become <NUM> tokens with their values (docs/design.md, Numbers).

    causalqwen train \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name data/train.jsonl \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 \
        --num_train_epochs 1 --output_dir my-causal-adapter

    # the same on two GPUs (or `--cpu` for two CPU processes); sharded with FSDP2 or DeepSpeed ZeRO-3 (the
    # configurations are the clone's recipes/configs/; `recipes/sft_ovr.py` may replace `-m causalqwen_adapter.cli train`)
    accelerate launch --num_processes 2 -m causalqwen_adapter.cli train <same arguments>
    accelerate launch --config_file recipes/configs/fsdp2.yaml -m causalqwen_adapter.cli train <same arguments>

    # LoRA on the backbone too (saved in my-causal-adapter/lora/)
    causalqwen train ... --use_peft --lora_r 16 --lora_target_modules q_proj v_proj

    # numeric-aware heads: numbers in the `text` column become <NUM> tokens with values
    causalqwen train ... --numeric

Every option of `CausalSFTConfig` (TRL's `SFTConfig` plus the head options) is a flag; `--config recipe.yaml` reads
them from a YAML file.
"""

import hashlib
import os
from dataclasses import fields
from pathlib import Path

import yaml
from accelerate import PartialState
from transformers import AutoTokenizer, PreTrainedConfig
from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser, get_peft_config

from causalqwen_adapter.adapter_io import MODEL_HINT, check_found
from causalqwen_adapter.configuration_causalqwen import CausalQwenConfig
from causalqwen_adapter.data import check_data_source, check_text_dataset, load_text_dataset
from causalqwen_adapter.numeric import add_num_token, default_num_token_id, encode_with_numbers
from causalqwen_adapter.tokenization_causalqwen import CausalQwenTokenizer
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer
from causalqwen_adapter.training.checkpoints import check_output_dir
from causalqwen_adapter.training.resume import check_resumable

from .parsing import HelpFormatter, SuggestingParser, lead_with, usage_errors

# the options most runs set, listed before the hundreds of SFTConfig / TrainingArguments
TRAINING_OPTIONS = ("output_dir", "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs",
                    "max_steps", "learning_rate", "max_length", "bf16", "eval_strategy", "eval_steps", "save_strategy",
                    "save_steps", "logging_steps", "report_to", "seed", "resume_from_checkpoint", "push_to_hub",
                    "hub_model_id")


def check_arguments(script_args: ScriptArguments, training_args: CausalSFTConfig, model_args: ModelConfig) -> None:
    """The files and folders the flags name, before any model or data loads (`main` reports a failure as a usage
    error)."""
    check_model_args(model_args)
    if script_args.dataset_name is None:
        raise ValueError("--dataset_name is required: a `datasets` name or a local .jsonl/.json/.parquet/.csv file or folder")
    check_data_source(script_args.dataset_name, "--dataset_name")
    if training_args.resume_from_checkpoint:
        check_resumable(Path(training_args.resume_from_checkpoint), CausalSFTTrainer.__name__)
    check_output_dir(training_args.output_dir)


def check_model_args(model_args: ModelConfig) -> None:
    """TRL's model flags that a causal-heads run cannot honour are refused, not ignored."""
    if model_args.model_name_or_path is None:
        raise ValueError("--model_name_or_path is required: a base causal LM (Hub id or folder) or a CausalQwen adapter")
    check_found(model_args.model_name_or_path, "--model_name_or_path", MODEL_HINT)
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ValueError(
            "--load_in_4bit/--load_in_8bit are not supported: the heads compute in float32 on the backbone's hidden "
            "states and an adapter folder references a full-precision base. Drop the flag (use --bf16 for speed)."
        )


def numeric_data(dataset, model_args: ModelConfig, training_args: CausalSFTConfig):
    """For numeric heads: the base's tokenizer with <NUM>, and every `text` turned into input_ids + numeric_values."""
    config, _ = PreTrainedConfig.get_config_dict(model_args.model_name_or_path, revision=model_args.model_revision)
    # an adapter (training continues) names its base, whose tokenizer it uses: the package's own class reads it
    tokenizer_class = CausalQwenTokenizer if config.get("model_type") == CausalQwenConfig.model_type else AutoTokenizer
    tokenizer = tokenizer_class.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    if training_args.num_token_id is None and config.get("numeric") and config.get("num_token_id") is not None:
        training_args.num_token_id = config["num_token_id"]  # the adapter's own <NUM> row
    if training_args.num_token_id is None:
        vocab_size = config.get("text_config", config)["vocab_size"]  # an adapter's config holds its base's
        training_args.num_token_id = default_num_token_id(tokenizer, vocab_size, model_args.model_name_or_path)
    add_num_token(tokenizer, training_args.num_token_id)
    for split, data in dataset.items():
        if "text" not in (data.column_names or []):
            raise ValueError(f"--numeric reads numbers from a `text` column; the {split} split has {data.column_names}")
        check_text_dataset(data, split)  # a null text, named by its row, not a TypeError from inside the map
        dataset[split] = data.map(
            lambda row: encode_with_numbers(tokenizer, row["text"], training_args.num_token_id,
                                            decimal_comma=training_args.numeric_decimal_comma),
            remove_columns=data.column_names,
        )
    return dataset, tokenizer


def adapter_digest(model) -> str:
    """sha256 of the adapter tensors: equal on every rank when data-parallel training kept the replicas in sync, or
    when sharded training (FSDP2, ZeRO-3) gathers the same whole tensors. A collective: every rank calls it."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.gathered_adapter_state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run(script_args: ScriptArguments, training_args: CausalSFTConfig, model_args: ModelConfig) -> CausalSFTTrainer:
    check_arguments(script_args, training_args, model_args)
    model_init_kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype}
    if model_args.attn_implementation is not None:
        model_init_kwargs["attn_implementation"] = model_args.attn_implementation
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}

    # One process fills the datasets cache, the others read it.
    with PartialState().main_process_first():
        dataset = load_text_dataset(script_args.dataset_name, script_args.dataset_config, script_args.dataset_streaming)
    if script_args.dataset_train_split not in dataset:
        raise ValueError(f"{script_args.dataset_name} has no split {script_args.dataset_train_split!r}: it has {list(dataset)}")
    evaluate = training_args.eval_strategy != "no"
    tokenizer = None
    if training_args.numeric:
        dataset, tokenizer = numeric_data(dataset, model_args, training_args)

    trainer = CausalSFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if evaluate else None,
        peft_config=get_peft_config(model_args),
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    # The card names the data; a local file by its name only, not the path on this machine.
    data_path = Path(script_args.dataset_name)
    data_name = data_path.name if data_path.exists() else script_args.dataset_name
    trainer.create_model_card(dataset_name=data_name)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Adapter saved to {training_args.output_dir}.")

    state = trainer.accelerator.state
    digest = adapter_digest(trainer.accelerator.unwrap_model(trainer.model))
    print(f"rank {state.process_index}/{state.num_processes}: adapter sha256 {digest}", flush=True)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=data_name)
    # Rank 0 may still be writing while the others are done: tearing the group down on one side only can hang gloo.
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # finishes the trackers and the process group
    return trainer


class TrainParser(SuggestingParser, TrlParser):
    """TRL's parser (`--config` YAML included) whose unknown flags get close matches, not a ValueError."""

    extra_flags = ("--config",)

    def parse(self, args=None) -> tuple:
        args = self.canonical_args(args)
        config = args[args.index("--config") + 1] if "--config" in args[:-1] else None
        takes = "--config takes a YAML file of these flags (`learning_rate: 1.0e-4`, ...)"
        if config is not None and not os.path.isfile(config):
            self.error(f"--config {config!r}: {'a folder' if os.path.isdir(config) else 'no such file'}. {takes}")
        with usage_errors(self):  # the dataclasses' own checks of their values (--deepspeed, numbers)
            try:
                *outputs, remaining = self.parse_args_and_config(args, return_remaining_strings=True)
            except yaml.YAMLError as err:
                self.error(f"--config {config!r} is not valid YAML ({' '.join(str(err).split())}). {takes}")
        if remaining:
            self.error(f"unrecognized arguments: {' '.join(remaining)}")
        return tuple(outputs)


def make_parser(prog: str | None = None) -> TrainParser:
    """TRL's own script dataclasses, as in `trl sft`: data flags, training flags (`CausalSFTConfig`), model flags;
    --help lists the data, model and head options first, then the most used training options, then the rest."""
    parser = TrainParser((ScriptArguments, CausalSFTConfig, ModelConfig), prog=prog, description=__doc__,
                         usage="%(prog)s --model_name_or_path MODEL --dataset_name DATA --output_dir DIR [options]",
                         formatter_class=HelpFormatter)
    own = [f.name for f in fields(CausalSFTConfig) if f.name not in {g.name for g in fields(SFTConfig)}]
    lead_with(parser, [
        ("options", ["help"]),
        ("data (TRL's ScriptArguments)", [f.name for f in fields(ScriptArguments)]),
        ("model (TRL's ModelConfig)", [f.name for f in fields(ModelConfig)]),
        ("causal heads (CausalSFTConfig)", own),
        ("training (the most used)", TRAINING_OPTIONS),
    ], rest="every other option (TRL's SFTConfig, transformers' TrainingArguments)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> CausalSFTTrainer:
    parser = make_parser(prog)
    arguments = parser.parse(argv)
    with usage_errors(parser):
        check_arguments(*arguments)
    return run(*arguments)


if __name__ == "__main__":
    main()
