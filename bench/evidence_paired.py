"""Paired differences between the label-noise arms of `bench/evidence.py`, from one or more of its JSON files.

Each file holds rows of (task, noise, rate, arm, lr) with one clean test accuracy per seed. Runs of the same arm at
the same rate from several invocations (seeds 0–4 in one, 5–9 in another) merge by seed; a seed that two files give
different accuracies is refused. For each noise setting, every arm at each of its rates is compared with the
baseline arm at each of its rates, over the seeds both have: the mean of the per-seed differences ± their standard
deviation / √n (the seeds draw the noise and the data order, the same for both arms), and on how many seeds the
arm is higher.

    python bench/evidence_paired.py bench/results/evidence_label_noise_trec_full_*.json --against softmax
"""

import argparse
import json
import math
import statistics
from pathlib import Path


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


def paired(arm: dict[int, dict], baseline: dict[int, dict], rule=own_rule) -> dict:
    """Per-seed differences arm − baseline over the seeds both ran: mean, standard error, n and wins."""
    seeds = sorted(set(arm) & set(baseline))
    diffs = [rule(arm[s]) - own_rule(baseline[s]) for s in seeds]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return {"seeds": seeds, "mean": statistics.fmean(diffs) if diffs else float("nan"), "se": se,
            "higher": sum(d > 0 for d in diffs)}


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
                lines.append(f"| {task} | {setting} | {arm} ({lr:g}) | {mean_arm:.4f} | {against} ({base_lr:g}) | "
                             f"{mean_base:.4f} | {len(d['seeds'])} | {d['mean']:+.4f} ± {d['se']:.4f} | "
                             f"{d['mean'] / d['se']:+.2f} | {d['higher']} of {len(d['seeds'])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="label_noise JSON files of bench/evidence.py")
    parser.add_argument("--against", default="softmax", help="the baseline arm")
    args = parser.parse_args()
    print("\n".join(table(merged_runs(args.files), args.against)))


if __name__ == "__main__":
    main()
