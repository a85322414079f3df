"""The pre-registered hypothesis's next-token half (docs/evidence.md, "Pre-registered protocol", declared 2026-11-29):
the ECE (15 bins) of the OvR `P_top` (the one-vs-rest probability of the top-1 token) used as the confidence that the
top-1 next token is right, against the softmax's maximum probability, over held-out text; 10 adapters, seeds 0–9.

Each seed trains one adapter on the demo base with the recipe `make demo` runs (recipes/demo.py `train_heads`: the
package's default recipe, CausalSFTTrainer on standard-library docstrings, 30 steps of 2 rows of 128 tokens; the seed
draws the data order and the trainer's seed), then scores the held-out docstrings (modules the training never sees,
the first 160 tokens of each) with `causalqwen_adapter.evaluation` in two readings of the same adapter: the standard
mode (its top-1, and `P_top` as its confidence) and the compatible mode (the softmax of loc_S, its maximum
probability as the confidence). Per seed the difference ECE(P_top) − ECE(softmax max) (lower is better); the paired
t-test over the seeds and Holm's adjustment over the hypothesis's comparisons: this one and the classification half's
(bench/evidence_preregistered.py, its `hypothesis` rows), read from that driver's result files with --classification.

One JSON record per seed in --out, written as it ends; a second invocation with the same --out skips the seeds there.
Each stage is logged (timestamped, flushed) as it starts, and a seed's trained adapter is kept, with a marker, until
its record is written: a process that dies in the evaluation is resumed from the evaluation, not from training.

    python bench/evidence_next_token.py --dry-run                     # the plan and its estimated time; trains nothing
    OMP_NUM_THREADS=2 python bench/evidence_next_token.py --base build/demo-base --out bench/results/next-token.json
    python bench/evidence_next_token.py --report bench/results/next-token.json \\
        --classification bench/results/preregistered.json --out bench/results/next-token.json   # the report alone
"""

import argparse
import faulthandler
import gc
import hashlib
import json
import platform
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import evidence_next_token_report as next_token_report  # noqa: E402
import evidence_protocol as protocol  # noqa: E402
from evidence_preregistered import _commit, load, save  # noqa: E402

import demo  # noqa: E402

DECLARATION = {
    "declared_on": protocol.DECLARED_ON,
    "hypothesis": "ECE of the OvR P_top (standard mode) against the softmax's maximum probability (compatible mode)",
    "seeds": list(range(10)),
    "recipe": {"script": "recipes/demo.py train_heads", "steps": demo.TRAIN_STEPS, "batch_rows": demo.TRAIN_BATCH_ROWS,
               "max_length": demo.TRAIN_MAX_LENGTH, "dtype": "float32"},
    "held_out": {"modules": list(demo.HELD_OUT_MODULES), "tokens_per_text": demo.HELD_OUT_TOKENS,
                 "batch_rows": demo.HELD_OUT_BATCH},
    "ece_bins": 15,
    "alpha": protocol.FAMILY["alpha"],
}
# declared seeds (30 steps, then the held-out evaluation in two modes) measured on this project's 2-core machine, one
# thread, shared with other jobs, 2026-11-29: the 10 declared seeds took 601–943 s of wall clock, 750 s on average
# (bench/results/next-token.md; docs/evidence.md)
MEASURED_SECONDS_PER_SEED = 750.0


def held_out_digest(texts: list[str]) -> str:
    """The held-out text's fingerprint: the docstrings come from the running Python's standard library, so two
    Python versions may score different text; records of different text are never compared."""
    return hashlib.sha256("\n\x00".join(texts).encode()).hexdigest()[:16]


def next_token_metrics(results: dict) -> dict:
    """The declared metrics from `evaluation.evaluate`'s output (with its accumulators) in the compatible and standard
    modes: ECE of P_top against the standard mode's top-1 being right, ECE of the softmax's maximum probability
    against the compatible mode's top-1 being right (its `ece_top1`), the AUROC of each, and both top-1 accuracies."""
    from causalqwen_adapter.classification import expected_calibration_error

    standard, compatible = results["standard"], results["compatible"]
    accumulator = results["accumulators"]["standard"]
    hits = torch.cat(accumulator.hits)
    return {"ece_P_top": expected_calibration_error(torch.cat(accumulator.signals["P_top"]), hits),
            "ece_softmax_max_prob": compatible["ece_top1"],
            "auroc_P_top": standard["auroc_P_top"], "auroc_softmax_max_prob": compatible["auroc_max_prob"],
            "top1_standard": standard["top1_accuracy"], "top1_compatible": compatible["top1_accuracy"],
            "ece_standard_top1": standard["ece_top1"], "num_tokens": standard["num_tokens"]}


TRAINED_MARKER = "trained.json"  # written in a seed's folder once its adapter is saved: what trained it, how long


def log_stage(message: str) -> None:
    """A timestamped line, flushed at once: a process killed from outside leaves the stage it was in."""
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", flush=True)


def reset_peak_rss() -> bool:
    """Reset the process's peak resident set (VmHWM) to its current size (Linux ≥ 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """The peak resident set since the last `reset_peak_rss` (VmHWM), else of the whole process (ru_maxrss)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def train_or_reuse(seed: int, base: str, tokenizer, steps: int, folder: Path, log) -> dict:
    """The seed's adapter in `folder`: reused when its marker says it was trained from `base` with `steps` (a run that
    died after training), else trained; the marker's training seconds, CPU seconds and peak RSS."""
    marker = folder / TRAINED_MARKER
    wanted = {"seed": seed, "steps": steps, "base": str(base)}
    if marker.exists():
        trained = json.loads(marker.read_text())
        if {key: trained.get(key) for key in wanted} == wanted:
            log(f"seed {seed}: reusing the adapter trained earlier in {folder} ({trained['train_seconds']:.0f} s)")
            return trained
        log(f"seed {seed}: {folder} holds an adapter of {trained}; training again")
    shutil.rmtree(folder, ignore_errors=True)  # a half-written folder from a death in training
    log(f"seed {seed}: training {steps} steps into {folder}")
    commit = _commit()  # the code that trains: HEAD may move before the record is saved
    exact_peak = reset_peak_rss()
    start, cpu = time.perf_counter(), time.process_time()  # CPU time too: on a shared machine wall time says little
    demo.train_heads(base, tokenizer, steps, folder, seed=seed)
    gc.collect()  # the trainer's reference cycles would keep the trained model beside the reloaded one
    trained = {**wanted, "train_seconds": time.perf_counter() - start, "train_cpu_seconds": time.process_time() - cpu,
               "train_peak_rss_mib": peak_rss_mib() if exact_peak else None, "commit": commit}
    marker.write_text(json.dumps(trained))
    return trained


def run_seed(seed: int, base: str, tokenizer, rows, workdir: Path, *, steps: int = demo.TRAIN_STEPS,
             keep_adapter: bool = False, log=log_stage) -> dict:
    """One seed: the demo's training with `seed`, then the held-out metrics of the adapter it saved, reloaded as a
    user would (AutoModelForCausalLM, trust_remote_code). The adapter is deleted only once its metrics are in hand."""
    from transformers import AutoModelForCausalLM

    from causalqwen_adapter.data import batches
    from causalqwen_adapter.evaluation import evaluate

    folder = workdir / f"seed-{seed}"
    trained = train_or_reuse(seed, base, tokenizer, steps, folder, log)
    log(f"seed {seed}: reloading the adapter")
    start, cpu = time.perf_counter(), time.process_time()
    exact_peak = reset_peak_rss()
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    log(f"seed {seed}: evaluating {len(rows)} held-out texts in the compatible and standard modes")
    results = evaluate(model, batches(rows, demo.HELD_OUT_BATCH, tokenizer.pad_token_id or 0),
                       ("compatible", "standard"))
    metrics = next_token_metrics(results)
    evaluate_seconds, evaluate_cpu = time.perf_counter() - start, time.process_time() - cpu
    log(f"seed {seed}: evaluated in {evaluate_seconds:.0f} s")
    if not keep_adapter:  # an adapter of the 0.5B base is hundreds of MB; the record is what the report reads
        shutil.rmtree(folder)
    return {"seed": seed, **metrics, "train_seconds": trained["train_seconds"],
            "seconds": trained["train_seconds"] + evaluate_seconds,
            "cpu_seconds": trained["train_cpu_seconds"] + evaluate_cpu, "evaluate_seconds": evaluate_seconds,
            "train_peak_rss_mib": trained["train_peak_rss_mib"],
            "evaluate_peak_rss_mib": peak_rss_mib() if exact_peak else None,
            "commit": trained.get("commit", "unknown")}  # HEAD when the adapter's training started


def run_seeds(seeds, base: str, out: Path, workdir: Path, *, steps: int = demo.TRAIN_STEPS, keep_adapters=False,
              log=log_stage) -> dict:
    """Every seed of `seeds` not yet in `out`, each record written as it ends; the records by seed."""
    from transformers import AutoTokenizer

    records = load(out, DECLARATION)
    todo = [seed for seed in seeds if str(seed) not in records]
    log(f"{len(todo)} seeds to go ({len(records)} in {out})")
    if not todo:
        return records
    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = demo.held_out_texts()
    rows = demo.held_out_rows(tokenizer)
    digest = held_out_digest(texts)
    held_out = {"digest": digest, "texts": len(texts), "python": platform.python_version()}
    torch.manual_seed(0)
    for seed in todo:
        record = {**run_seed(seed, base, tokenizer, rows, workdir, steps=steps, keep_adapter=keep_adapters,
                                     log=log),
                  "held_out": held_out, "steps": steps, "base": str(base)}
        records[str(seed)] = record
        save(out, DECLARATION, records, {"base": str(base)})
        log(f"seed {seed}: ECE P_top {record['ece_P_top']:.4f}, softmax max {record['ece_softmax_max_prob']:.4f}, "
            f"AUROC {record['auroc_P_top']:.4f} / {record['auroc_softmax_max_prob']:.4f} ({record['seconds']:.0f}s)")
    return records


def merge(paths) -> dict:
    """The records of several result files of this declaration; a seed with two different records is refused."""
    records = {}
    for path in paths:
        for seed, record in load(Path(path), DECLARATION).items():
            timeless = dict.fromkeys(("seconds", "train_seconds", "cpu_seconds", "evaluate_seconds",
                                      "train_peak_rss_mib", "evaluate_peak_rss_mib"))
            if seed in records and {**records[seed], **timeless} != {**record, **timeless}:
                raise ValueError(f"{path}: seed {seed} has two different records; keep one of the files")
            records.setdefault(seed, record)
    return records


def dry_run(seeds, out: Path) -> list[str]:
    """What a run would do and how long it would take: the mean measured time of the seeds already in `out`, else
    the per-seed time measured once (MEASURED_SECONDS_PER_SEED), else unmeasured."""
    records = load(out, DECLARATION)
    todo = [seed for seed in seeds if str(seed) not in records]
    recipe, held_out = DECLARATION["recipe"], DECLARATION["held_out"]
    lines = [f"next-token half of the pre-registered hypothesis (declared {DECLARATION['declared_on']})",
             f"seeds: {' '.join(map(str, seeds))}; {len(todo)} to run, {len(records)} already in {out}",
             f"per seed: {recipe['script']} ({recipe['steps']} steps of {recipe['batch_rows']} rows, "
             f"{recipe['max_length']} tokens, {recipe['dtype']}), then held-out docstrings of "
             f"{', '.join(held_out['modules'])} ({held_out['tokens_per_text']} tokens each) in the compatible and "
             "standard modes",
             "comparison: ECE(P_top) − ECE(softmax max) per seed, paired t, Holm over the hypothesis's "
             f"{len(next_token_report.hypothesis_names())} comparisons"]
    done = [r["seconds"] for r in records.values()]
    per_seed = sum(done) / len(done) if done else MEASURED_SECONDS_PER_SEED
    source = (f"the mean of the {len(done)} seeds in {out}" if done else
              "declared seeds measured on the 2-core machine, docs/evidence.md" if per_seed else None)
    if per_seed is None:
        lines.append("estimated time: unmeasured (no seed has run on this machine and none was measured)")
    else:
        lines.append(f"estimated time: {len(todo)} × {per_seed:.0f} s ≈ {len(todo) * per_seed / 3600:.2f} h ({source})")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time; train nothing")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="merge these next-token result files into --out "
                        "and write the report; train nothing")
    parser.add_argument("--classification", nargs="+", metavar="JSON", help="result files of "
                        "bench/evidence_preregistered.py: their hypothesis rows join the Holm adjustment")
    parser.add_argument("--seeds", nargs="+", type=int, help="a share of the declared seeds (two or more)")
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--workdir", default="build/evidence/next-token", help="where each seed's adapter is trained")
    parser.add_argument("--keep-adapters", action="store_true", help="keep each seed's adapter folder")
    parser.add_argument("--out", default="build/evidence/next-token.json")
    args = parser.parse_args(argv)
    seeds = DECLARATION["seeds"] if args.seeds is None else args.seeds
    undeclared = sorted(set(seeds) - set(DECLARATION["seeds"]))
    if undeclared:
        parser.error(f"seeds {undeclared} are not in the pre-registered family; declared seeds: {DECLARATION['seeds']}")
    if len(set(seeds)) < 2:
        parser.error(f"{len(set(seeds))} seed(s): a paired comparison needs two seeds or more (a standard error); "
                     f"declared seeds: {DECLARATION['seeds']}")
    seeds = [seed for seed in DECLARATION["seeds"] if seed in seeds]
    out = Path(args.out)
    try:
        if args.dry_run:
            print("\n".join(dry_run(seeds, out)))
            return
        if args.report:
            records = merge(args.report)
            save(out, DECLARATION, records, {"merged": [str(p) for p in args.report]})
        else:
            records = run_seeds(seeds, args.base, out, Path(args.workdir), keep_adapters=args.keep_adapters)
        classification = next_token_report.classification_rows(args.classification)
    except ValueError as error:
        parser.error(str(error))
    text = next_token_report.report(records, DECLARATION, classification)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    faulthandler.enable()  # a crash in native code prints the Python stack of every thread before the process dies
    main()
