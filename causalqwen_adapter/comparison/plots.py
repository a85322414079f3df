"""The plots of a comparison, drawn from the result dict `causalqwen compare` returns and writes (comparison.json)
and from nothing else, so a saved run can be drawn again:

    python -m causalqwen_adapter.comparison.plots out/compare/comparison.json [--output_dir DIR]

- `comparison_differences.png`: one panel per metric of the table (with held-out classes, the open-set metrics too):
  each arm's per-seed difference from the baseline (points), their mean and its interval at the Bonferroni level α/m
  over the table's m comparisons (a simultaneous interval; where it leaves out 0, Holm's adjustment rejects too), and
  the table's verdict under each arm.
- `comparison_rates.png`: the learning rate each seed's validation split chose, per arm.

Needs matplotlib (the `plots` extra). Drawn on `matplotlib.figure.Figure`, not pyplot: no backend is switched and no
figure is left open in the caller's session."""

import argparse
import json
import math
from pathlib import Path

from .stats import t_critical
from .verdicts import BETTER

PLOT_FILES = ("comparison_differences.png", "comparison_rates.png")


def differences(results: dict) -> dict[str, dict[str, dict]]:
    """{metric: {arm: {seeds, differences (arm − baseline per seed), mean, se, half_width, verdict}}} of the table's
    rows, in the table's metric order. half_width: t at α/m (two-sided, n − 1 degrees of freedom) × the s.e.; NaN
    below two seeds. Seeds are read as JSON writes them (strings) or as compare returns them (integers)."""
    baseline = results["args"]["baseline"]
    table = results["table"]
    alpha = results.get("alpha", 0.05) / max(len(table), 1)
    per_seed = {arm: {str(seed): metrics for seed, metrics in by_seed.items()}
                for arm, by_seed in results["per_seed"].items()}
    out: dict[str, dict[str, dict]] = {}
    for row in sorted(table, key=lambda r: list(BETTER).index(r["metric"])):
        seeds = [str(seed) for seed in row["seeds"]]
        metric = row["metric"]
        diffs = [per_seed[row["arm"]][s][metric] - per_seed[baseline][s][metric] for s in seeds]
        half = t_critical(alpha, len(seeds) - 1) * row["se"] if len(seeds) >= 2 else math.nan
        out.setdefault(metric, {})[row["arm"]] = {"seeds": seeds, "differences": diffs, "mean": row["mean"],
                                                  "se": row["se"], "half_width": half, "verdict": row["verdict"]}
    return out


def _grid(n: int) -> tuple[int, int]:
    cols = min(3, n)
    return math.ceil(n / cols), cols


def draw_differences(results: dict):
    from matplotlib.figure import Figure

    baseline, by_metric = results["args"]["baseline"], differences(results)
    rows, cols = _grid(len(by_metric))
    fig = Figure(figsize=(4.2 * cols, 3.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    m = len(results["table"])
    for ax, (metric, arms) in zip(axes, by_metric.items()):
        for i, (arm, d) in enumerate(arms.items()):
            n = len(d["differences"])
            jitter = [i - 0.15 + 0.3 * j / max(n - 1, 1) for j in range(n)]
            ax.scatter(jitter, d["differences"], s=14, color="grey", alpha=0.7, zorder=2,
                       label="per seed" if i == 0 else None)
            ax.errorbar([i + 0.3], [d["mean"]], yerr=[[d["half_width"]], [d["half_width"]]], fmt="o", capsize=4,
                        color=f"C{i}", zorder=3, label=f"mean, α/{m} interval" if i == 0 else None)
        ax.axhline(0, color="black", linewidth=0.8, linestyle=":")
        ax.set_xticks(range(len(arms)), [f"{arm}\n{d['verdict']}" for arm, d in arms.items()], fontsize=8)
        ax.set_title(f"{metric} ({BETTER[metric]} is better)", fontsize=10)
        ax.set_ylabel(f"arm − {baseline}")
        ax.grid(alpha=0.3, axis="y")
    for ax in axes[len(by_metric):]:
        fig.delaxes(ax)
    axes[0].legend(fontsize=7)
    seeds = len(next(iter(results["per_seed"].values())))
    fig.suptitle(f"paired differences from {baseline} over {seeds} seeds (Holm over the {m} comparisons: verdicts)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def draw_rates(results: dict):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 3.6))
    ax = fig.subplots()
    arms = list(results["chosen"])
    seeds = sorted({str(s) for by_seed in results["chosen"].values() for s in by_seed}, key=_seed_order)
    for i, arm in enumerate(arms):
        chosen = {str(s): lr for s, lr in results["chosen"][arm].items()}
        x = [seeds.index(s) + 0.25 * (i - (len(arms) - 1) / 2) / max(len(arms), 1) for s in chosen]
        ax.scatter(x, list(chosen.values()), label=arm, color=f"C{i}", s=24)
    ax.set_yscale("log")
    lrs = results["args"].get("lrs") or sorted({lr for by in results["chosen"].values() for lr in by.values()})
    ax.set_yticks(lrs, [f"{lr:g}" for lr in lrs])
    ax.minorticks_off()
    ax.set_xticks(range(len(seeds)), seeds)
    ax.set(xlabel="seed", ylabel="learning rate", title="rate chosen on each seed's validation split")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _seed_order(seed: str):
    return (0, int(seed), "") if seed.lstrip("-").isdigit() else (1, 0, seed)


def draw(results: dict) -> dict:
    """{file name: matplotlib Figure} of PLOT_FILES."""
    return dict(zip(PLOT_FILES, (draw_differences(results), draw_rates(results))))


def write_plots(results: dict, output_dir) -> list[Path]:
    """Draw `results` into `output_dir`; the paths written."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)  # a redraw's --output_dir may be new
    written = []
    for name, fig in draw(results).items():
        fig.savefig(output_dir / name, dpi=110)
        written.append(output_dir / name)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m causalqwen_adapter.comparison.plots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="A comparison.json that `causalqwen compare` wrote.")
    parser.add_argument("--output_dir", help="Where the plots go (default: the folder of the results file).")
    args = parser.parse_args(argv)
    from ..cli.parsing import install_hint, missing_modules

    if missing_modules(["matplotlib"]):
        parser.error(f"the plots are drawn with matplotlib, not installed here: {install_hint('plots')}")
    path = Path(args.results)
    try:
        results = json.loads(path.read_text())
        missing = [key for key in ("args", "table", "per_seed", "chosen") if key not in results]
    except (OSError, json.JSONDecodeError) as err:
        parser.error(f"cannot read {path}: {err}")
    if missing:
        parser.error(f"{path} has no {', '.join(missing)}: pass the comparison.json `causalqwen compare` wrote")
    written = write_plots(results, args.output_dir or path.parent)
    print("wrote " + ", ".join(map(str, written)))
    return written


if __name__ == "__main__":
    main()
