"""The README's evidence plots, drawn from the result files in bench/results/ (nothing is rerun):

- `evidence-label-noise-full.png`: TREC question type on the full split (1,000 training rows, 60 steps), clean test
  accuracy of each arm at each learning rate it ran with 5–10 seeds (mean ± standard error), by label-noise setting;
- `evidence-label-noise.png`: the same at 160 training rows and 20 steps, against the share of flipped training labels
  (uniform and class-dependent), each arm at its searched learning rate, mean ± standard error over 5 seeds;
- `evidence-numbers.png`: VADER ratings as numbers, the coverage of each arm's central intervals against their
  nominal level (clean targets) and their interval (Winkler) score at each level (clean, and 20 % shuffled targets
  everywhere), learning rates picked by validation NLL.

    python bench/evidence_plots.py [--out docs/images]
"""

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))

FULL_SPLIT_RUNS = "evidence-trec-full-runs.log"  # every full-split 60-step run's line, as bench/evidence.py prints it
FULL_SPLIT_ARMS = {  # arm → legend
    "softmax": "softmax head (--objective softmax)",
    "ovr_candidates": "causal heads, default recipe",
    "ovr_alone": "causal heads, OvR loss alone",
    "ovr_alone_logistic": "OvR loss alone, logistic link",
    "gce": "generalised cross-entropy (q = 0.7)",
}
FULL_SPLIT_SETTINGS = [("none", 0.0, "clean"), ("uniform", 0.2, "20 % uniform"), ("uniform", 0.4, "40 % uniform"),
                       ("class", 0.2, "20 % class-dep."), ("class", 0.4, "40 % class-dep.")]
LABEL_NOISE_FILES = ("evidence_label_noise_5seeds.json", "evidence_label_noise_trec_20pct_5seeds.json",
                     "evidence_label_noise_trec_candidates_5seeds.json")
NOISE_ARMS = {  # arm → legend
    "softmax": "softmax head (--objective softmax)",
    "ovr_candidates": "causal heads, default recipe",
    "ovr": "causal heads, OvR over the vocabulary",
    "ovr_location": "causal heads, OvR moving the locations",
    "ovr_logistic": "OvR with a logistic link",
    "gce": "generalised cross-entropy (q = 0.7)",
}
NUMBER_ARMS = {
    "digits": "the LM writing the digits",
    "cauchy": "Cauchy <NUM> head (the package)",
    "gaussian": "Gaussian head",
    "student_t": "Student-t head",
    "constant": "constant",
}


def label_noise_points(task: str = "trec") -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """(arm, kind) → [(rate, mean, standard error)] of the arm's own rule on clean test labels; noise 0 belongs to
    both kinds."""
    points = {}
    for name in LABEL_NOISE_FILES:
        for row in json.loads((RESULTS / name).read_text())["results"]:
            if row.get("task") != task or row["arm"] not in NOISE_ARMS:
                continue
            rule = "ovr" if "ovr_mean" in row else "softmax"
            kinds = ("uniform", "class") if row["rate"] == 0 else (row["noise"],)
            for kind in kinds:
                points.setdefault((row["arm"], kind), []).append((row["rate"], row[f"{rule}_mean"], row[f"{rule}_se"]))
    return {key: sorted(set(value)) for key, value in points.items()}


def full_split_points(min_seeds: int = 5) -> dict[tuple[str, float], list[tuple[str, float, float, int]]]:
    """(arm, lr) → [(setting label, mean, standard error, seeds)] of the arm's own rule on clean test labels, over
    the seeds that ran the arm at that rate in that setting (the run lines of FULL_SPLIT_RUNS); an (arm, lr,
    setting) with fewer than `min_seeds` seeds is left out."""
    import statistics

    from evidence_paired import own_rule, runs_by_rate

    runs = runs_by_rate([RESULTS / FULL_SPLIT_RUNS])
    points = {}
    for (task, noise, rate, arm, lr), seeds in runs.items():
        setting = next((label for n, r, label in FULL_SPLIT_SETTINGS if (n, r) == (noise, rate)), None)
        if task != "trec" or arm not in FULL_SPLIT_ARMS or setting is None or len(seeds) < min_seeds:
            continue
        values = [own_rule(accuracy) for accuracy in seeds.values()]
        se = statistics.stdev(values) / len(values) ** 0.5
        points.setdefault((arm, lr), []).append((setting, statistics.fmean(values), se, len(values)))
    return points


def number_summary(select: str = "nll") -> list[dict]:
    import evidence_numbers

    runs = json.loads((RESULTS / "evidence_numbers_full.json").read_text())["runs"]
    return evidence_numbers.summarize(evidence_numbers.reselect(runs, select))


def plot_label_noise(path: Path) -> None:
    import matplotlib.pyplot as plt

    points = label_noise_points()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind, title in zip(axes, ("uniform", "class"), ("uniform flips", "class-dependent flips")):
        for arm, label in NOISE_ARMS.items():
            series = points.get((arm, kind), [])
            if series:
                rate, mean, se = zip(*series)
                ax.errorbar([100 * r for r in rate], mean, yerr=se, marker="o", capsize=3, label=label,
                            linewidth=2.5 if arm in ("softmax", "ovr_candidates") else 1.2)
        ax.set_title(f"TREC question type, {title}")
        ax.set_xlabel("training labels flipped (%)")
        ax.set_xticks([0, 20, 40])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("clean test accuracy (5 seeds, ± s.e.)")
    axes[1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_label_noise_full(path: Path) -> None:
    import matplotlib.pyplot as plt

    points = full_split_points()
    present = {setting for series in points.values() for setting, *_ in series}
    labels = [label for _, _, label in FULL_SPLIT_SETTINGS if label in present]
    series = sorted(points, key=lambda key: (list(FULL_SPLIT_ARMS).index(key[0]), key[1]))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = {arm: f"C{i}" for i, arm in enumerate(FULL_SPLIT_ARMS)}
    width = 0.8 / max(len(series), 1)
    for i, (arm, lr) in enumerate(series):
        x = [labels.index(setting) - 0.4 + (i + 0.5) * width for setting, *_ in points[arm, lr]]
        mean = [m for _, m, _, _ in points[arm, lr]]
        se = [e for _, _, e, _ in points[arm, lr]]
        filled = lr < 5e-3
        ax.errorbar(x, mean, yerr=se, fmt="o" if filled else "s", capsize=3, color=colors[arm],
                    markerfacecolor=colors[arm] if filled else "white", label=f"{FULL_SPLIT_ARMS[arm]}, lr {lr:g}")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("training (and validation) labels flipped")
    ax.set_ylabel("clean test accuracy (5–10 seeds, ± s.e.)")
    ax.set_title("TREC question type, full split (1,000 training rows, 60 steps)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_numbers(path: Path) -> None:
    import matplotlib.pyplot as plt
    from evidence_numbers import LEVELS

    summary = {(e["condition"], e["arm"]): e for e in number_summary()}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    levels = [100 * lv for lv in LEVELS]
    axes[0].plot([45, 100], [45, 100], color="grey", linestyle=":", label="calibrated")
    for arm, label in NUMBER_ARMS.items():
        entry = summary[("clean", arm)]
        axes[0].errorbar(levels, [100 * entry[f"coverage_{lv}"][0] for lv in LEVELS],
                         yerr=[100 * entry[f"coverage_{lv}"][1] for lv in LEVELS], marker="o", capsize=3, label=label)
    axes[0].set(title="coverage of central intervals, clean targets", xlabel="nominal level (%)",
                ylabel="test targets inside (%)")
    for ax, condition, title in zip(axes[1:], ("clean", "shuffled_test"),
                                    ("clean targets", "20 % shuffled everywhere")):
        for arm, label in NUMBER_ARMS.items():
            entry = summary[(condition, arm)]
            ax.errorbar(levels, [entry[f"winkler_{lv}"][0] for lv in LEVELS],
                        yerr=[entry[f"winkler_{lv}"][1] for lv in LEVELS], marker="o", capsize=3, label=label)
        ax.set(title=f"interval score, {title}", xlabel="nominal level (%)", ylabel="Winkler score (lower is better)",
               yscale="log")
        ticks = [3, 4, 6, 10, 20, 30]
        ax.set_yticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("VADER sentiment ratings as numbers (768 texts, 5 seeds, ± s.e.)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "images"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "evidence-label-noise-full.png", out / "evidence-label-noise.png", out / "evidence-numbers.png"]
    plot_label_noise_full(written[0])
    plot_label_noise(written[1])
    plot_numbers(written[2])
    print("wrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
