r"""`causalqwen extract-features`: stage 1 of offline distillation, store the frozen teacher's features
(docs/design.md, Offline distillation).

For every real token of the corpus: the final hidden state z and the teacher's top-K next-token ids and
probabilities, in a `datasets` folder that `causalqwen distill` trains on (run this once, train many epochs). The
dataset is a `datasets` name or a local .jsonl/.json/.parquet/.csv file or folder whose rows hold a text column
(`--text_field`, default `text`) or `input_ids`.

    causalqwen extract-features \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name data/train.jsonl --text_field text \
        --top_k 32 --max_length 1024 --per_device_eval_batch_size 8 \
        --output_dir features/train

The teacher runs on `--device` (default `auto`: CUDA if available, else MPS, else the CPU). On several devices, each
process runs the teacher on its share of the sequences, on its own device, and the first writes the one store, in
corpus order:

    accelerate launch --num_processes 4 -m causalqwen_adapter.cli extract-features ...     # GPUs
    torchrun --nproc_per_node 2 -m causalqwen_adapter.cli extract-features ...             # CPU processes (gloo)
"""

from dataclasses import dataclass, field
from pathlib import Path

from accelerate import PartialState

from causalqwen_adapter.adapter_folder import check_can_write
from causalqwen_adapter.data import load_text_dataset  # the data sources of `causalqwen train`
from causalqwen_adapter.devices import AUTO, DEVICE_HELP, resolve_device
from causalqwen_adapter.features import extract_features

from .parsing import CliHfArgumentParser

ALIASES = {"--batch_size": "--per_device_eval_batch_size"}


@dataclass
class ExtractArguments:
    model_name_or_path: str = field(metadata={"help": "The teacher: the base the heads attach to (Hub id or folder)."})
    dataset_name: str = field(
        metadata={"help": "A `datasets` name on the Hub, or a local .jsonl/.json/.parquet/.csv file or data folder."}
    )
    output_dir: str = field(metadata={"help": "Folder to write the features to (must not exist, or --overwrite)."})
    model_revision: str | None = field(default=None, metadata={"help": "Revision (branch, tag, commit) of the teacher."})
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of the dataset."})
    dataset_split: str = field(default="train", metadata={"help": "Split to extract."})
    text_field: str = field(default="text", metadata={"help": "Column holding the texts (ignored when `input_ids` exists)."})
    top_k: int = field(default=32, metadata={"help": "Teacher tokens kept per position."})
    max_length: int = field(default=1024, metadata={"help": "Texts are truncated to this many tokens."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Sequences per teacher forward."})
    dtype: str = field(
        default="auto",
        metadata={"help": "Dtype of the teacher (use the one you will run the adapter in).",
                  "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    feature_dtype: str = field(
        default="float32", metadata={"help": "Dtype of the stored hidden states.", "choices": ["float32", "float16"]}
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace an existing output_dir."})
    device: str = field(default=AUTO, metadata={"help": DEVICE_HELP})


def run(args: ExtractArguments):
    check_can_write(Path(args.output_dir), "the features")  # before the dataset and the teacher load
    device = resolve_device(args.device)  # this process's device (cuda:$LOCAL_RANK under a launcher)
    # Starts the process group a launcher asked for (nccl between GPUs, gloo between CPU processes); a no-op in a
    # single process.
    state = PartialState(cpu=device.type == "cpu")
    with state.main_process_first():  # one process builds the datasets cache, the others read it
        dataset = load_text_dataset(args.dataset_name, args.dataset_config, streaming=False)
    if args.dataset_split not in dataset:
        raise ValueError(f"{args.dataset_name} has no split {args.dataset_split!r}: it has {list(dataset)}")
    features = extract_features(
        args.model_name_or_path,
        dataset[args.dataset_split],
        args.output_dir,
        top_k=args.top_k,
        max_length=args.max_length,
        batch_size=args.per_device_eval_batch_size,
        text_field=args.text_field,
        feature_dtype=args.feature_dtype,
        dtype=args.dtype,
        revision=args.model_revision,
        overwrite=args.overwrite,
        device=device,
        progress=True,
    )
    if state.is_main_process:
        print(f"Features of {len(features)} tokens saved to {args.output_dir}.")
    return features


def make_parser(prog: str | None = None) -> CliHfArgumentParser:
    return CliHfArgumentParser(
        ExtractArguments, aliases=ALIASES, prog=prog, description=__doc__,
        usage="%(prog)s --model_name_or_path TEACHER --dataset_name DATA --output_dir DIR [options]")


def main(argv: list[str] | None = None, prog: str | None = None):
    return run(*make_parser(prog).parse(argv))


if __name__ == "__main__":
    main()
