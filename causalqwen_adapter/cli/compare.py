r"""`causalqwen compare`: do causal heads help on your task? The evidence bench's paired comparison, on your own rows.

The data are labelled `prompt`/`completion` rows whose completion is the label (its leading space included), the
format `causalqwen train` and `causalqwen classify` read, in a local .jsonl/.json/.parquet/.csv file or a `datasets`
name. Every label must have a first token of its own (a label is scored by it); the heads train, as TRL's SFT does on
a one-token label, on the label's first token at the prompt's end and an end-of-text after it.

    causalqwen compare --model_name_or_path build/demo-base --dataset_name rows.jsonl \
        --output_dir out/compare --noise class:0.4 --seeds 0 1 2 3 4

The base runs once over the rows and its final hidden states are cached in `--cache_dir` (a later run on the same
base and rows reuses them; a cache of another base or other rows is refused). Then, per seed: a stratified
train/validation/test split (60/20/20), `--noise` flips on the training and validation labels (the test labels stay
clean), `--unknown_fraction` of the classes held out of training (present at test); each of `--arms` is trained at
every rate of `--lrs` (fresh heads, the trainer's optimizer, one epoch unless `--max_steps`) and each seed keeps the
rate its own validation split scores best. The table: per arm mean ± s.e. over the seeds and the paired difference
against `--baseline` (the softmax), a two-sided paired t-test, Holm-adjusted over every comparison printed, and the
verdict ahead / behind / tie at α = 0.05. Metrics: accuracy, macro-F1 and ECE of the arm's own rule (argmax P_k for
the OvR arms, the label logits otherwise) on the test rows of known classes; with held-out classes also the AUROC,
FPR at 95 % TPR and open-set macro-F1 of the arm's rejection score (max_k P_k, or the softmax's energy score). Under
the table, each OvR arm's P_top on the test rows, and a warning where it is about the same for 80 % of the rows (at ½:
heads whose scale ran away at the chosen rate; the accuracy stays, P_top as a probability is uncalibrated).
Writes `comparison.json` (every run) and `comparison.md` to `--output_dir`, and the plots (needs matplotlib, the
`plots` extra; `--no_plots` skips them): `comparison_differences.png`, per metric each arm's per-seed differences from
the baseline with their mean and its Bonferroni α/m interval, and `comparison_rates.png`, the rate each seed chose.
`python -m causalqwen_adapter.comparison.plots comparison.json` draws them again from a saved run. Each run is kept
in `--output_dir`'s `comparison_runs.jsonl` as it ends: the same command again after an interruption trains only the
runs still missing (the results are an uninterrupted run's); the file goes once comparison.json is written. The library is
`causalqwen_adapter.comparison`; docs/evidence.md, "On your own data", says how to read it. `--num_proc N` trains N
runs at once in forked processes (one per core with `--threads 1` is the fastest on a CPU). `--device` (default
`auto`: CUDA when available, else the CPU) is where the base extracts the features and the heads train: on a GPU the
runs go one after another in this process (a forked process cannot share the CUDA context, so `--num_proc` stays 1);
the cached features and the metrics stay on the CPU.
"""

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from causalqwen_adapter.adapter_io import MODEL_HINT, check_found
from causalqwen_adapter.classification import label_set, tokenize_prompts
from causalqwen_adapter.comparison.arms import ARMS
from causalqwen_adapter.comparison.features import cached_features, data_fingerprint
from causalqwen_adapter.comparison.plots import PLOT_FILES, write_plots
from causalqwen_adapter.comparison.progress import RunLog, comparison_key
from causalqwen_adapter.comparison.runs import (
    NOISE_METRICS,
    UNKNOWN_METRICS,
    Protocol,
    check_num_proc,
    check_protocol,
    run_comparison,
)
from causalqwen_adapter.comparison.splits import parse_noise
from causalqwen_adapter.comparison.verdicts import confidence_lines, markdown, paired_table
from causalqwen_adapter.configuration_causalqwen import check_number
from causalqwen_adapter.data import check_data_source
from causalqwen_adapter.devices import AUTO, resolve_device

from .classify import read_rows, tokenizer_source
from .parsing import CliHfArgumentParser, check_output_folder, install_hint, missing_modules, usage_errors

ALIASES = {"--base": "--model_name_or_path", "--data": "--dataset_name", "--batch_rows": "--per_device_train_batch_size",
           "--steps": "--max_steps", "--cache": "--cache_dir"}
OUTPUT_FILES = ("comparison.json", "comparison.md", *PLOT_FILES)
DEFAULT_ARMS = ["ovr_candidates", "ovr_alone", "softmax"]


@dataclass
class CompareArguments:
    model_name_or_path: str = field(metadata={"help": "The base the heads attach to (folder or Hub id)."})
    dataset_name: str = field(metadata={"help": "Labelled prompt/completion rows: a .jsonl/.json/.parquet/.csv file or "
                                        "a `datasets` name."})
    output_dir: str = field(metadata={"help": "Where comparison.json, comparison.md and the plots are written."})
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS), metadata={
        "help": f"The arms trained (the baseline among them). Choices: {', '.join(ARMS)}."})
    baseline: str = field(default="softmax", metadata={"help": "The arm every other is compared with."})
    lrs: list[float] = field(default_factory=lambda: [1e-4, 1e-3, 1e-2], metadata={
        "help": "The learning-rate grid, the same for every arm; each seed picks its rate on its validation split."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4], metadata={
        "help": "Seeds (two or more): each draws the split, the flips, the held-out classes and the data order."})
    noise: str = field(default="0", metadata={"help": "Label flips on the training and validation labels: 0, or "
                                              "KIND:RATE with KIND uniform (to any other class) or class (class k to "
                                              "k + 1), e.g. class:0.4."})
    unknown_fraction: float = field(default=0.0, metadata={
        "help": "Fraction of the classes held out of training and present at test (open-set metrics); 0: none."})
    max_steps: int = field(default=0, metadata={"help": "Optimizer steps per run; 0: one epoch of the training rows."})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Rows per step (two targets each)."})
    cache_dir: str | None = field(default=None, metadata={
        "help": "Folder of the cached features (default: <output_dir>/features)."})
    rebuild_cache: bool = field(default=False, metadata={
        "help": "Extract the features again into a cache_dir that holds another base's or other rows' features "
                "(the runs of a comparison cut short are then trained again too)."})
    labels: list[str] | None = field(default=None, metadata={
        "help": "The label set (completion strings, leading spaces included). Default: every completion of the rows."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer folder or Hub id (default: the base's)."})
    threads: int = field(default=0, metadata={"help": "CPU threads of the training and scoring, for this command only "
                                              "(0: torch's default; with --num_proc, 1 per process)."})
    num_proc: int = field(default=1, metadata={
        "help": "Processes training runs at once, one torch thread each (forked; tested on Linux). On a CPU, one per "
                "core trains the most runs per second (each holds about 4 copies of the head's V × H weights)."})
    device: str = field(default=AUTO, metadata={
        "help": "Where the features are extracted and the heads trained: auto (CUDA when available, else the CPU), "
                "cpu, cuda, cuda:1, ... (not mps: the training loss sums in float64)."})
    plots: bool = field(default=True, metadata={"help": f"Write {' and '.join(PLOT_FILES)} (needs matplotlib)."})
    overwrite: bool = field(default=False, metadata={
        "help": "Replace an earlier run's comparison.json, .md and plots (with --no_plots its plots are removed), "
                "and start again a comparison cut short instead of resuming it."})


def compare_device(spec: str) -> torch.device:
    """--device as a torch.device: `auto` is CUDA when available, else the CPU; MPS is refused (the training loss
    accumulates in float64, which MPS lacks)."""
    if spec.strip().lower() == AUTO:
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = resolve_device(spec)
    if device.type == "mps":
        raise ValueError(f"--device {spec}: the comparison's training loss sums in float64, which MPS does not "
                         "support: pass --device cpu")
    return device


def protocol_of(args: CompareArguments) -> Protocol:
    return Protocol(arms=list(args.arms), baseline=args.baseline, lrs=list(args.lrs), seeds=list(args.seeds),
                    noise=parse_noise(args.noise), unknown_fraction=args.unknown_fraction,
                    steps=args.max_steps or None, batch_rows=args.per_device_train_batch_size)


def check_arguments(args: CompareArguments) -> None:
    """Every argument that needs no data, before anything is loaded: nothing is written when one is wrong."""
    check_number("max_steps", args.max_steps, minimum=0, integer=True)
    check_number("per_device_train_batch_size", args.per_device_train_batch_size, minimum=1, integer=True)
    check_number("threads", args.threads, minimum=0, integer=True)
    check_number("num_proc", args.num_proc, minimum=1, integer=True)
    check_num_proc(args.num_proc, args.threads, compare_device(args.device))
    check_number("unknown_fraction", args.unknown_fraction, minimum=0)
    check_protocol(protocol_of(args))
    check_found(args.model_name_or_path, "--model_name_or_path", MODEL_HINT)
    check_data_source(args.dataset_name, "--dataset_name")
    check_output_folder(args.output_dir, OUTPUT_FILES, args.overwrite)
    if args.plots and missing_modules(["matplotlib"]):  # before the features and the runs, not after
        raise ValueError(f"the plots are drawn with matplotlib, not installed here: {install_hint('plots')}; or pass "
                         "--no_plots")


def prepare(args: CompareArguments):
    """(tokenizer, label set, prompts' tokens, label indices, protocol, the runs finished earlier): the rows read and
    checked, before the base loads (a dataset with one class, labels sharing a first token or absent from the
    tokenizer are refused here, and so are another comparison's runs in --output_dir)."""
    rows = read_rows(args.dataset_name)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(args))
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no end-of-text token (eos_token): the heads train on one after the label; "
                         "pass --tokenizer with the base's tokenizer")
    config = AutoConfig.from_pretrained(args.model_name_or_path)
    names = args.labels or sorted({r["completion"] for r in rows})
    labels = label_set(tokenizer, names, config.get_text_config().vocab_size)
    prompts, targets = tokenize_prompts(tokenizer, rows, labels)
    protocol = protocol_of(args)
    check_protocol(protocol, len(set(targets)))
    key = comparison_key(protocol, data_fingerprint(prompts, targets, labels.token_ids), args.model_name_or_path)
    progress = RunLog(args.output_dir, key, restart=args.overwrite or args.rebuild_cache)
    return tokenizer, labels, prompts, targets, protocol, progress


def summary(args: CompareArguments, labels, protocol: Protocol, out: dict, seconds: float) -> tuple[dict, str]:
    metrics = list(NOISE_METRICS) + (list(UNKNOWN_METRICS) if protocol.unknown_fraction else [])
    table = paired_table(out["per_seed"], protocol.baseline, metrics, protocol.seeds, protocol.alpha)
    setting = "no label flips" if not protocol.noise[1] else f"{protocol.noise[0]} flips at {protocol.noise[1]:.0%}"
    if protocol.unknown_fraction:
        setting += f", {protocol.unknown_fraction:.0%} of the classes held out"
    chosen = "; ".join(f"{arm} " + ", ".join(f"{lr:g}×{sum(v == lr for v in by_seed.values())}"
                                             for lr in protocol.lrs) for arm, by_seed in out["chosen"].items())
    others = [arm for arm in protocol.arms if arm != protocol.baseline]
    heads = confidence_lines(out["per_seed"])  # what the OvR arms' P_top says across rows
    heads = ["What the OvR heads' P_top says, at the chosen rates:", "", *heads, ""] if heads else []
    lines = [f"# {Path(args.dataset_name).name}: {', '.join(others)} against {protocol.baseline}", "",
             f"Base {args.model_name_or_path}; {len(labels.labels)} labels; {setting}; seeds "
             f"{' '.join(map(str, protocol.seeds))}; rates {' '.join(f'{lr:g}' for lr in protocol.lrs)}, each seed's "
             f"chosen on its validation split ({chosen}). Paired t on the seeds, two-sided, Holm-adjusted over the "
             f"{len(table)} comparisons below, α = {protocol.alpha}. A tie is a tie.", "",
             *markdown(table, protocol.baseline), "",
             *heads,
             f"{len(out['runs'])} runs in {seconds / 60:.1f} min of training and scoring ("
             + (f"{args.num_proc} processes of {args.threads or 1} thread(s))." if args.num_proc > 1
                else f"on {compare_device(args.device)}; CPU threads: {torch.get_num_threads()}).")]
    results = {"args": vars(args), "labels": labels.labels, "table": table, "alpha": protocol.alpha,
               "seconds": seconds, **out}
    return results, "\n".join(lines) + "\n"


def run(args: CompareArguments, prepared: tuple | None = None) -> dict:
    if prepared is None:
        check_arguments(args)
        prepared = prepare(args)
    threads = torch.get_num_threads()
    if args.threads:  # for this call only: the caller's process keeps its own setting
        torch.set_num_threads(args.threads)
    try:
        return _run(args, prepared)
    finally:
        torch.set_num_threads(threads)


def _run(args: CompareArguments, prepared: tuple) -> dict:
    tokenizer, labels, prompts, targets, protocol, progress = prepared
    device = compare_device(args.device)
    base = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32).to(device).eval()
    cache = args.cache_dir or os.path.join(args.output_dir, "features")
    features = cached_features(cache, base, prompts, targets, labels.token_ids, rebuild=args.rebuild_cache)
    start = time.perf_counter()
    out = run_comparison(base, features, labels, tokenizer.eos_token_id, protocol, on_run=progress.add,
                         done=progress.done, num_proc=args.num_proc, threads=args.threads or 1)
    results, text = summary(args, labels, protocol, out, time.perf_counter() - start)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "comparison.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (output_dir / "comparison.md").write_text(text)
    if args.plots:
        write_plots(results, output_dir)
    else:  # only with --overwrite (checked before): an earlier run's plots would not show these results
        for name in PLOT_FILES:
            (output_dir / name).unlink(missing_ok=True)
    progress.finish()  # comparison.json holds every run now
    print(text)
    return results


def make_parser(prog: str | None = None) -> CliHfArgumentParser:
    return CliHfArgumentParser(
        CompareArguments, aliases=ALIASES, prog=prog, description=__doc__,
        usage="%(prog)s --model_name_or_path BASE --dataset_name DATA --output_dir DIR [options]")


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    parser = make_parser(prog)
    (args,) = parser.parse(argv)
    with usage_errors(parser):  # flags, files and rows refused before the base loads: exit 2, no traceback
        check_arguments(args)
        prepared = prepare(args)
    return run(args, prepared)


if __name__ == "__main__":
    main()
