r"""`causalqwen evaluate`: score models on held-out text, a base and CausalQwen adapters (in every mode) side by side.

    causalqwen evaluate \
        --model_name_or_path build/demo-base out/heads out/heads-softmax \
        --dataset_name held_out.jsonl --inference_mode compatible standard causal --max_length 160 \
        --output_dir out/eval --reliability_diagram

Each model is a base causal LM (scored with its softmax) or a CausalQwen adapter (scored in each `--inference_mode`).
The data's rows hold what `causalqwen train` reads: plain `text`, `prompt`/`completion` (scored on the completion)
or chat `messages`, in a local .jsonl/.json/.parquet/.csv file or a `datasets` name. Writes `metrics.json` and
`metrics.md` (the tables printed at the end: the next-token metrics, and the AUROC of each confidence signal for "the
top-1 is right") to `--output_dir`, and `reliability.png` with `--reliability_diagram` (needs matplotlib). The
metrics are described in `causalqwen_adapter/evaluation.py`. The models run on `--device` (default `auto`: CUDA if
available, else MPS, else the CPU), one at a time.
"""

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.adapter_io import MODEL_HINT, check_found
from causalqwen_adapter.cauchy import INFERENCE_MODES
from causalqwen_adapter.configuration_causalqwen import OVR_DISTRIBUTIONS, check_choice, check_number
from causalqwen_adapter.data import batches, check_data_source, load_text_dataset, tokenize_for_evaluation
from causalqwen_adapter.devices import AUTO, DEVICE_HELP, resolve_device
from causalqwen_adapter.evaluation import confidence_table, evaluate, load_model, markdown_table, reliability_diagram

from .parsing import CliHfArgumentParser, install_hint, missing_modules, usage_errors

ALIASES = {"--models": "--model_name_or_path", "--modes": "--inference_mode", "--mode": "--inference_mode",
           "--eval_inference_modes": "--inference_mode", "--batch_size": "--per_device_eval_batch_size"}


@dataclass
class EvaluationArguments:
    model_name_or_path: list[str] = field(
        metadata={"help": "Base causal LMs and CausalQwen adapters (folders or Hub ids), one or more."})
    dataset_name: str = field(metadata={"help": "A local .jsonl/.json/.parquet/.csv file, or a `datasets` name."})
    output_dir: str = field(metadata={"help": "Where metrics.json, metrics.md (and reliability.png) are written."})
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of the dataset."})
    dataset_split: str = field(default="train", metadata={"help": "The split to evaluate on."})
    inference_mode: list[str] = field(
        default_factory=lambda: ["compatible", "standard", "causal"],
        metadata={"help": f"Inference modes adapters are scored in ({', '.join(INFERENCE_MODES)})."},
    )
    causal_temperature: float | None = field(default=None, metadata={"help": "T of the modes' noise (default: config)."})
    ovr_distribution: str | None = field(
        default=None,
        metadata={"help": "The OvR modes' next-token distribution for every adapter: `accept` (softmax(loc_S)·P), "
                  "`accept_once` (one veto, then a fresh proposal) or `normalize` (P/ΣP). Default: each adapter's "
                  "config.", "choices": list(OVR_DISTRIBUTIONS)},
    )
    max_length: int = field(default=1024, metadata={"help": "Tokens per row (truncated beyond)."})
    max_rows: int | None = field(default=None, metadata={"help": "Evaluate the first N rows only."})
    per_device_eval_batch_size: int = field(default=4, metadata={"help": "Rows per forward pass."})
    dtype: str = field(default="bfloat16", metadata={"help": "Dtype the models load in.",
                                                     "choices": ["bfloat16", "float32", "auto"]})
    reliability_diagram: bool = field(default=False, metadata={"help": "Also write reliability.png."})
    seed: int = field(default=0, metadata={"help": "Seed of the sampling mode's noise."})
    device: str = field(default=AUTO, metadata={"help": DEVICE_HELP})


def check_arguments(args: EvaluationArguments) -> None:
    """Every argument, before any model or data is loaded (the library checks them again where they enter)."""
    bad = [m for m in args.inference_mode if m not in INFERENCE_MODES]
    if bad:
        raise ValueError(f"unknown inference mode(s) {bad}: choose from {', '.join(INFERENCE_MODES)}")
    if args.ovr_distribution is not None:
        check_choice("ovr_distribution", args.ovr_distribution, OVR_DISTRIBUTIONS)
    if args.causal_temperature is not None:
        check_number("causal_temperature", args.causal_temperature, minimum=0)
    for name in ("per_device_eval_batch_size", "max_length"):
        check_number(name, getattr(args, name), minimum=1, integer=True)
    if args.max_rows is not None:
        check_number("max_rows", args.max_rows, minimum=1, integer=True)
    for name in args.model_name_or_path:
        check_found(name, "--model_name_or_path", MODEL_HINT)
    check_data_source(args.dataset_name, "--dataset_name")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):  # found now, not after the scoring
        raise FileExistsError(f"--output_dir {args.output_dir!r} is a file, not a folder: metrics.json and metrics.md "
                              "are written into a folder. Choose another --output_dir")
    if args.reliability_diagram and missing_modules(["matplotlib"]):  # before hours of scoring, not after
        raise ImportError(f"--reliability_diagram draws with matplotlib, not installed here: {install_hint('plots')}")


def run(args: EvaluationArguments) -> dict:
    check_arguments(args)
    device = resolve_device(args.device)  # before any loading: a wrong --device fails at once
    output_dir = Path(args.output_dir)
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    dataset = load_text_dataset(args.dataset_name, args.dataset_config)
    if args.dataset_split not in dataset:
        raise ValueError(f"{args.dataset_name} has no split {args.dataset_split!r}: it has {list(dataset)}")
    dataset = dataset[args.dataset_split]
    if args.max_rows is not None:
        dataset = dataset.select(range(min(args.max_rows, len(dataset))))

    results, accumulators, rows = {}, {}, None
    for name in args.model_name_or_path:
        model, base_name = load_model(name, dtype)
        model.to(device).eval()
        if args.ovr_distribution is not None and isinstance(model, CausalQwenForCausalLM):
            model.config.ovr_distribution = args.ovr_distribution
        if rows is None:  # the first model's tokenizer: every model must share the base's vocabulary
            tokenizer = AutoTokenizer.from_pretrained(base_name)
            rows = tokenize_for_evaluation(dataset, tokenizer, args.max_length)
        torch.manual_seed(args.seed)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        out = evaluate(model, batches(rows, args.per_device_eval_batch_size, pad), args.inference_mode,
                       causal_temperature=args.causal_temperature, progress=True, desc=Path(name).name or name,
                       total=math.ceil(len(rows) / args.per_device_eval_batch_size))
        accumulators[name] = out.pop("accumulators")
        results[name] = out
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next model gets the memory back

    table = markdown_table(results) + "\n\nConfidence for \"the top-1 is right\" (AUROC of each signal):\n\n" + \
        confidence_table(results)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
    (output_dir / "metrics.md").write_text(table + "\n")
    if args.reliability_diagram:
        reliability_diagram(accumulators, output_dir / "reliability.png")
    print(table)
    return results


def make_parser(prog: str | None = None) -> CliHfArgumentParser:
    return CliHfArgumentParser(
        EvaluationArguments, aliases=ALIASES, prog=prog, description=__doc__,
        usage="%(prog)s --model_name_or_path MODEL [MODEL ...] --dataset_name DATA --output_dir DIR [options]")


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    parser = make_parser(prog)
    (args,) = parser.parse(argv)
    with usage_errors(parser):
        check_arguments(args)
    return run(args)


if __name__ == "__main__":
    main()
