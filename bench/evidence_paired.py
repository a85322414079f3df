"""Paired differences between the label-noise arms of `bench/evidence.py`, from one or more of its JSON files.

Each file holds rows of (task, noise, rate, arm, lr) with one clean test accuracy per seed. Runs of the same arm at
the same rate from several invocations (seeds 0–4 in one, 5–9 in another) merge by seed; a seed that two files give
different accuracies is refused. For each noise setting, every arm at each of its rates is compared with the
baseline arm at each of its rates, over the seeds both have: the mean of the per-seed differences ± their standard
deviation / √n (the seeds draw the noise and the data order, the same for both arms), and on how many seeds the
arm is higher.

    python bench/evidence_paired.py bench/results/evidence_label_noise_trec_full_*.json --against softmax

With `--runs LOG...` it reads the per-run lines bench/evidence.py prints ("trec uniform:0.4 softmax seed 3 lr 0.01:
validation (noisy) 0.4442, clean test {...}"), or the runs its JSON rows keep, and lets each seed choose its own
rate, the best validation accuracy among the rates that seed ran at: every arm then gets the search the protocol
gives its first seed, on every seed (seeds without every rate of their arm's grid are left out).

    python bench/evidence_paired.py --runs bench/results/evidence-trec-full-runs.log --against softmax

`--runs ... --by-rate` keeps every rate of every arm as its own row instead (the runs at one rate held for both).

With `--unknown` the files are unknown-classes JSON files (`--protocol unknown`, rows with each seed's scores):
for each fraction of known classes, the OvR acceptance (`ovr_max_prob`) of every other arm against every rejection
score of the baseline arm, paired by seed on `--metric` (AUROC by default; the seeds draw the known classes).

    python bench/evidence_paired.py --unknown bench/results/evidence_unknown_trec_full_5seeds.json
"""

import argparse
import ast
import json
import re
import statistics
from pathlib import Path

from causalqwen_adapter.comparison.stats import choose_rate  # noqa: F401 (the rate choice, shared with causalqwen compare)
from causalqwen_adapter.comparison.stats import paired as paired_differences


def own_rule(accuracy: dict) -> float:
    """The arm's own decision rule: argmax P_k over the labels for the OvR arms, the label logits otherwise."""
    return accuracy["ovr"] if "ovr" in accuracy else accuracy["softmax"]


def merged_runs(paths) -> dict[tuple, dict[int, dict]]:
    """{(task, noise, rate, arm, lr): {seed: accuracies}} over every file's rows (not the fresh heads')."""
    runs: dict[tuple, dict[int, dict]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["results"]:
            if not row["seeds"]:
                continue
            key = (row["task"], row["noise"], row["rate"], row["arm"], row["lr"])
            seen = runs.setdefault(key, {})
            for seed, accuracy in zip(row["seeds"], row["test_accuracy"], strict=True):
                if seed in seen and seen[seed] != accuracy:
                    raise ValueError(f"{path}: seed {seed} of {key} is {accuracy}, another file has {seen[seed]}: "
                                     "the same run gave two results; pass the files of one protocol")
                seen[seed] = accuracy
    return runs


RUN_LINE = re.compile(r"^(?P<task>\S+) (?P<noise>\w+):(?P<rate>[\d.]+) (?P<arm>\w+) seed (?P<seed>\d+) lr (?P<lr>[\d.e+-]+): "
                      r"validation \(noisy\) (?P<validation>[\d.]+), clean test (?P<test>\{[^}]*\})")


def _runs_of(path):
    """(key, seed, lr, (validation, test accuracies)) of every run in a log's run lines, or in a label_noise JSON's
    rows (their "runs")."""
    if str(path).endswith(".json"):
        for row in json.loads(Path(path).read_text())["results"]:
            for run in row.get("runs", []):
                key = (row["task"], row["noise"], row["rate"], row["arm"], "per seed")
                yield key, run["seed"], run["lr"], (run["validation"], run["test_accuracy"])
        return
    for line in Path(path).read_text().splitlines():
        m = RUN_LINE.match(line)
        if m is not None:
            key = (m["task"], m["noise"], float(m["rate"]), m["arm"], "per seed")
            yield key, int(m["seed"]), float(m["lr"]), (float(m["validation"]), ast.literal_eval(m["test"]))


def _collect_runs(paths) -> dict[tuple, dict[int, dict[float, tuple]]]:
    """{(task, noise, rate, arm, "per seed"): {seed: {lr: (validation, test accuracies)}}}, a run given twice kept
    once, two different results for one run refused."""
    runs: dict[tuple, dict[int, dict[float, tuple]]] = {}
    for path in paths:
        for key, seed, lr, run in _runs_of(path):
            seen = runs.setdefault(key, {}).setdefault(seed, {})
            if seen.get(lr, run) != run:
                raise ValueError(f"{path}: seed {seed} lr {lr:g} of {key[:4]} has two results")
            seen[lr] = run
    return runs


def runs_by_rate(paths) -> dict[tuple, dict[int, dict]]:
    """{(task, noise, rate, arm, lr): {seed: accuracies}} from run lines or JSON runs: every rate that ran, each on
    the seeds that ran it (the pairs at one rate held for both arms, whatever the search chose)."""
    out: dict[tuple, dict[int, dict]] = {}
    for key, seeds in _collect_runs(paths).items():
        for seed, by_lr in seeds.items():
            for lr, (_, test) in by_lr.items():
                out.setdefault((*key[:4], lr), {})[seed] = test
    return out


def per_seed_choice(paths) -> dict[tuple, dict[int, dict]]:
    """{(task, noise, rate, arm, "per seed"): {seed: accuracies at the rate of best validation accuracy, ties to the
    smaller rate}} from the run lines of bench/evidence.py's logs or the runs its JSON rows keep; a seed is kept when
    it ran every rate its arm ran at in that setting."""
    chosen = {}
    for key, seeds in _collect_runs(paths).items():
        grid = set().union(*seeds.values())
        chosen[key] = {seed: by_lr[choose_rate({lr: run[0] for lr, run in by_lr.items()})][1]
                       for seed, by_lr in seeds.items() if set(by_lr) == grid}
    return chosen


def paired(arm: dict[int, dict], baseline: dict[int, dict], value=own_rule) -> dict:
    """Per-seed differences arm − baseline (`value` of each seed's result: the own rule's accuracy) over the seeds
    both ran: mean, standard error, n and wins."""
    return paired_differences(arm, baseline, value)


def table(runs: dict, against: str) -> list[str]:
    lines = ["| task | noise | arm (lr) | mean accuracy | against (lr) | its mean | seeds | arm − against | s.e.s | higher on |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    settings = sorted({key[:3] for key in runs}, key=lambda k: (k[0], k[2], k[1]))
    for task, noise, rate in settings:
        same = {key[3:]: seeds for key, seeds in runs.items() if key[:3] == (task, noise, rate)}
        baselines = {lr: seeds for (arm, lr), seeds in same.items() if arm == against}
        for (arm, lr), seeds in sorted(same.items()):
            if arm == against:
                continue
            for base_lr, base_seeds in sorted(baselines.items()):
                d = paired(seeds, base_seeds)
                if not d["seeds"]:
                    continue
                mean_arm = statistics.fmean(own_rule(seeds[s]) for s in d["seeds"])
                mean_base = statistics.fmean(own_rule(base_seeds[s]) for s in d["seeds"])
                setting = "0" if rate == 0 else f"{noise} {rate:.0%}"
                lines.append(f"| {task} | {setting} | {arm} ({_rate(lr)}) | {mean_arm:.4f} | {against} ({_rate(base_lr)}) | "
                             f"{mean_base:.4f} | {len(d['seeds'])} | {d['mean']:+.4f} ± {d['se']:.4f} | "
                             f"{d['mean'] / d['se']:+.2f} | {d['higher']} of {len(d['seeds'])} |")
    return lines


def unknown_runs(paths) -> dict[tuple, dict[int, dict]]:
    """{(known, arm, score, lr): {seed: {auroc, fpr_at_95_tpr, open_set_macro_f1}}} over the unknown-classes rows."""
    runs: dict[tuple, dict[int, dict]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["results"]:
            if "per_seed" not in row:
                raise ValueError(f"{path}: a row of {row['arm']} ({row['score']}) has no per-seed scores (written "
                                 "before bench/evidence.py kept them): rerun that protocol")
            seen = runs.setdefault((row["known"], row["arm"], row["score"], row["lr"]), {})
            for seed, scores in zip(row["seeds"], row["per_seed"], strict=True):
                if seen.get(seed, scores) != scores:
                    raise ValueError(f"{path}: seed {seed} of {row['arm']} ({row['score']}) has two results")
                seen[seed] = scores
    return runs


def unknown_table(runs: dict, against: str, metric: str) -> list[str]:
    lines = [f"| known | arm (lr), OvR acceptance | its mean {metric} | against (lr), score | its mean | seeds | "
             "arm − against | s.e.s | higher on |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for known in sorted({key[0] for key in runs}):
        same = {key[1:]: seeds for key, seeds in runs.items() if key[0] == known}
        for (arm, score, lr), seeds in sorted(same.items()):
            if arm == against or score != "ovr_max_prob":
                continue
            for (base_arm, base_score, base_lr), base_seeds in sorted(same.items()):
                if base_arm != against:
                    continue
                d = paired(seeds, base_seeds, value=lambda scores: scores[metric])
                if not d["seeds"]:
                    continue
                mean_arm = statistics.fmean(seeds[s][metric] for s in d["seeds"])
                mean_base = statistics.fmean(base_seeds[s][metric] for s in d["seeds"])
                lines.append(f"| {known:.0%} | {arm} ({_rate(lr)}) | {mean_arm:.4f} | {against} ({_rate(base_lr)}), "
                             f"{base_score} | {mean_base:.4f} | {len(d['seeds'])} | {d['mean']:+.4f} ± "
                             f"{d['se']:.4f} | {d['mean'] / d['se']:+.2f} | {d['higher']} of {len(d['seeds'])} |")
    return lines


def _rate(lr) -> str:
    return lr if isinstance(lr, str) else f"{lr:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", help="label_noise JSON files of bench/evidence.py")
    parser.add_argument("--runs", nargs="+", help="logs (or JSON files) of bench/evidence.py: each seed chooses its own rate")
    parser.add_argument("--by-rate", action="store_true",
                        help="with --runs: every rate its own row (each arm at each rate it ran), no choice")
    parser.add_argument("--against", default="softmax", help="the baseline arm")
    parser.add_argument("--unknown", action="store_true", help="the files are unknown-classes JSON files")
    parser.add_argument("--metric", default="auroc", choices=["auroc", "fpr_at_95_tpr", "open_set_macro_f1"],
                        help="with --unknown: the score compared (lower is better for fpr_at_95_tpr)")
    args = parser.parse_args()
    if bool(args.files) == bool(args.runs):
        parser.error("give label_noise JSON files, or --runs with logs or JSON files")
    if args.unknown:
        if args.runs:
            parser.error("--unknown reads unknown-classes JSON files: give them without --runs")
        print("\n".join(unknown_table(unknown_runs(args.files), args.against, args.metric)))
        return
    if args.by_rate and not args.runs:
        parser.error("--by-rate reads the run lines: give --runs")
    if args.runs:
        runs = runs_by_rate(args.runs) if args.by_rate else per_seed_choice(args.runs)
    else:
        runs = merged_runs(args.files)
    print("\n".join(table(runs, args.against)))


if __name__ == "__main__":
    main()
