r"""`causalqwen classify`: classify with a trained adapter (or a base), scoring a label set at the end of each prompt.

The data are `prompt`/`completion` rows whose completion is the label (its leading space included), the format
`causalqwen train` trains on, in a local .jsonl/.json/.parquet/.csv file or a `datasets` name:

    causalqwen train --model_name_or_path build/demo-base --dataset_name train.jsonl --output_dir out/cls ...
    causalqwen classify --model_name_or_path out/cls \
        --dataset_name test.jsonl --validation_dataset_name validation.jsonl \
        --output_dir out/cls-eval

Each label is scored by its first token at the prompt's last position (labels must differ in their first token).
An adapter is scored by two rules: `ovr` (argmax of the OvR probabilities P_k, confidence max P_k) and `softmax` (its
compatible mode: the label logits loc_S renormalised over the label set); a base by `softmax`. Per rule: accuracy,
macro-F1, ECE, and abstention: a confidence threshold chosen on `--validation_dataset_name` (rows of known labels
only) to keep `--coverage` of them, then the test coverage and accuracy on the kept rows. Writes `metrics.json`,
`metrics.md`, `reliability.png` and `accuracy_coverage.png` (needs matplotlib; `--no_plots` skips them) to
`--output_dir`; a folder holding an earlier run's is refused unless `--overwrite`. The library is
`causalqwen_adapter.classification`.
"""

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedConfig

from causalqwen_adapter.adapter_io import MODEL_HINT, check_found
from causalqwen_adapter.classification import (
    abstention_threshold,
    classification_metrics,
    label_scores,
    label_set,
    prompt_hidden_states,
    reliability_bins,
    tokenize_prompts,
)
from causalqwen_adapter.configuration_causalqwen import check_number
from causalqwen_adapter.data import check_data_source, load_text_dataset
from causalqwen_adapter.devices import AUTO, DEVICE_HELP, resolve_device
from causalqwen_adapter.evaluation import _format, load_model

from .parsing import CliHfArgumentParser, check_output_folder, install_hint, missing_modules, usage_errors

ALIASES = {"--model": "--model_name_or_path", "--test_file": "--dataset_name",
           "--validation_file": "--validation_dataset_name", "--mode": "--inference_mode",
           "--batch_size": "--per_device_eval_batch_size"}

OUTPUT_FILES = ("metrics.json", "metrics.md", "reliability.png", "accuracy_coverage.png")
# Files of which one is enough for a folder to hold a tokenizer (fast, slow BPE, sentencepiece, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model",
                   "vocab.txt")

TABLE_COLUMNS = ["accuracy", "macro_f1", "ece", "coverage", "selective_accuracy", "threshold", "none_accepted",
                 "num_rows"]


@dataclass
class ClassifyArguments:
    model_name_or_path: str = field(metadata={"help": "A CausalQwen adapter or a base causal LM (folder or Hub id)."})
    dataset_name: str = field(metadata={"help": "prompt/completion rows to classify: a .jsonl/.json/.parquet/.csv file "
                                        "or a `datasets` name."})
    output_dir: str = field(metadata={"help": "Where metrics.json, metrics.md and the plots are written."})
    validation_dataset_name: str | None = field(
        default=None, metadata={"help": "prompt/completion rows of known labels on which the abstention threshold is "
                                "chosen; without it no abstention is reported."})
    labels: list[str] | None = field(
        default=None, metadata={"help": "The label set (completion strings, leading spaces included). Default: every "
                                "completion of the validation and test files."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer folder or Hub id (default: the base's)."})
    coverage: float = field(default=0.95, metadata={"help": "Fraction of validation rows the threshold keeps."})
    inference_mode: str = field(default="standard", metadata={
        "help": "Mode of an adapter's OvR probabilities; `compatible` reads loc_S alone (the softmax rule only).",
        "choices": ["standard", "causal", "compatible"]})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "Prompts per forward pass."})
    dtype: str = field(default="bfloat16", metadata={"help": "Dtype the model loads in.",
                                                     "choices": ["bfloat16", "float32", "auto"]})
    device: str = field(default=AUTO, metadata={"help": DEVICE_HELP})
    plots: bool = field(default=True, metadata={"help": "Write reliability.png and accuracy_coverage.png."})
    overwrite: bool = field(default=False, metadata={
        "help": "Replace an earlier run's metrics.json, metrics.md and plots in output_dir (with --no_plots its plots "
        "are removed: none is left beside metrics it does not show). Other files there are never touched."})


def check_arguments(args: ClassifyArguments) -> None:
    """Every argument, before any data or model is loaded: nothing is written when one is wrong."""
    check_number("per_device_eval_batch_size", args.per_device_eval_batch_size, minimum=1, integer=True)
    coverage = check_number("coverage", args.coverage, minimum=0, strict=True)
    if coverage > 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}: the fraction of validation rows kept")
    check_found(args.model_name_or_path, "--model_name_or_path", MODEL_HINT)
    check_data_source(args.dataset_name, "--dataset_name")
    if args.validation_dataset_name is not None:
        check_data_source(args.validation_dataset_name, "--validation_dataset_name")
    check_output_folder(args.output_dir, OUTPUT_FILES, args.overwrite)


def tokenizer_source(args: ClassifyArguments) -> str:
    """Where the tokenizer comes from (--tokenizer, else the model's base); a local folder must hold one, or the
    tokenizer transformers builds from its config alone knows no word and every label would have no token."""
    if args.tokenizer is not None:
        source, what = args.tokenizer, "--tokenizer"
    else:
        config, _ = PreTrainedConfig.get_config_dict(args.model_name_or_path)
        source = config.get("base_model_name_or_path") or args.model_name_or_path
        what = "the adapter's base" if source != args.model_name_or_path else "--model_name_or_path"
    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"{what} {source!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): pass "
                         "--tokenizer <the folder or Hub id of the base's tokenizer>, or save the tokenizer into that "
                         "folder (tokenizer.save_pretrained)")
    return source


def read_rows(path: str) -> list[dict]:
    """The `prompt`/`completion` rows of `path`, each a string: a missing or non-text value is refused by row."""
    dataset = load_text_dataset(path)["train"]
    missing = {"prompt", "completion"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"{path} has columns {dataset.column_names}: classification needs `prompt` and `completion` "
                         "(the label) columns")
    if len(dataset) == 0:
        raise ValueError(f"{path} holds no rows: nothing to classify")
    rows = []
    for i, row in enumerate(dataset.select_columns(["prompt", "completion"])):
        for column, value in row.items():
            if not isinstance(value, str):
                what = "the label, as text with its leading space (e.g. ' 1', not 1)" if column == "completion" else \
                    "the text the label follows"
                raise ValueError(f"{path}, row {i} (counting from 0): `{column}` is {value!r} "
                                 f"({type(value).__name__}), not text: every row needs {what}. Fix or drop the row")
        rows.append(row)
    return rows


def markdown(results: dict) -> str:
    lines = ["| model | rule | " + " | ".join(TABLE_COLUMNS) + " |", "|---|---|" + "---:|" * len(TABLE_COLUMNS)]
    for rule, metrics in results["rules"].items():
        cells = [_format(metrics.get(c)) for c in TABLE_COLUMNS]
        lines.append(f"| {results['model']} | {rule} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(curves: dict, results: dict, output_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    for rule, (confidence, accuracy, _) in curves.items():
        ax.plot(confidence, accuracy, marker="o", markersize=3, label=f"{rule} (ECE {results['rules'][rule]['ece']:.3f})")
    ax.set(title="reliability", xlabel="confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output_dir / "reliability.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for rule, metrics in results["rules"].items():
        curve = metrics["accuracy_coverage"]
        ax.plot(curve["coverage"], curve["accuracy"], marker="o", markersize=3, label=f"{rule} (area {curve['area']:.3f})")
    ax.set(title="accuracy–coverage", xlabel="coverage (most confident first)", ylabel="accuracy", xlim=(0, 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output_dir / "accuracy_coverage.png", dpi=120)
    plt.close(fig)


def run(args: ClassifyArguments) -> dict:
    check_arguments(args)
    if args.plots and missing_modules(["matplotlib"]):  # before the scoring, not after
        raise ImportError(f"the plots are drawn with matplotlib, not installed here: {install_hint('plots')}; or pass "
                          "--no_plots")
    device = resolve_device(args.device)
    test = read_rows(args.dataset_name)
    validation = read_rows(args.validation_dataset_name) if args.validation_dataset_name else []
    source = tokenizer_source(args)
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model, _ = load_model(args.model_name_or_path, dtype)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    names = args.labels or sorted({r["completion"] for r in validation + test})
    labels = label_set(tokenizer, names, model.config.get_text_config().vocab_size)
    backbone = model.model

    def score(rows, desc):
        prompts, targets = tokenize_prompts(tokenizer, rows, labels)
        z = prompt_hidden_states(backbone, prompts, args.per_device_eval_batch_size, device, progress=True, desc=desc)
        return label_scores(model, z, labels, inference_mode=args.inference_mode), torch.tensor(targets)

    test_scores, test_targets = score(test, "scoring the test rows")
    val_scores = score(validation, "scoring the validation rows")[0] if validation else None
    results = {"model": Path(args.model_name_or_path).name or args.model_name_or_path, "labels": labels.labels, "coverage_target": args.coverage,
               "rules": {}}
    curves = {}
    for rule in test_scores.rules():
        pred, confidence = test_scores.decide(rule)
        threshold = None
        if val_scores is not None:
            threshold = abstention_threshold(val_scores.decide(rule)[1], args.coverage)
        metrics = classification_metrics(pred, test_targets, confidence, threshold)
        if rule == "ovr":  # each label accepted on its own: rows where none is (P_k ≤ ½ for every label)
            metrics["none_accepted"] = (test_scores.log_P.max(-1).values <= -math.log(2)).double().mean().item()
        results["rules"][rule] = metrics
        curves[rule] = reliability_bins(confidence, (pred == test_targets).double())

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    (output_dir / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
    (output_dir / "metrics.md").write_text(table + "\n")
    if args.plots:
        plots(curves, results, output_dir)
    else:  # only with --overwrite (checked above): an earlier run's plots would not match these metrics
        for name in OUTPUT_FILES[2:]:
            (output_dir / name).unlink(missing_ok=True)
    print(table)
    return results


def make_parser(prog: str | None = None) -> CliHfArgumentParser:
    return CliHfArgumentParser(
        ClassifyArguments, aliases=ALIASES, prog=prog, description=__doc__,
        usage="%(prog)s --model_name_or_path MODEL --dataset_name DATA --output_dir DIR [options]")


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    parser = make_parser(prog)
    (args,) = parser.parse(argv)
    with usage_errors(parser):  # argparse's exit 2 and message, no traceback
        check_arguments(args)
    return run(args)


if __name__ == "__main__":
    main()
