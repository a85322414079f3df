"""The pre-registered comparison of docs/evidence.md ("Pre-registered protocol", declared 2026-11-29 before the run):
the declared family, the per-seed choice of rate on validation, the paired tests against the softmax with Holm's
adjustment, and the report. No torch here: `bench/evidence_preregistered.py` trains the runs and calls these.

A run is one (cell, arm, learning rate, seed); a cell is a task and a setting: `trec class:0.4` (label noise, KIND:RATE
or 0) or `trec known:0.25` (unknown classes, the fraction of TREC's fine classes known in training). Each run keeps
its validation score (what chooses its rate) and its test metrics; nothing on the test split chooses anything.
"""

import statistics

# the rate choice, the paired tests and the verdicts are the package's: causalqwen compare runs the same code
from causalqwen_adapter.comparison.stats import choose_rate
from causalqwen_adapter.comparison.verdicts import adjust, paired_row
from causalqwen_adapter.comparison.verdicts import number as _f
from causalqwen_adapter.comparison.verdicts import p_value as _p
from causalqwen_adapter.comparison.verdicts import verdict as _verdict

DECLARED_ON = "2026-11-29"
NOISE_SETTINGS = ("0", "uniform:0.2", "uniform:0.4", "class:0.2", "class:0.4")
KNOWN_FRACTIONS = (0.25, 0.5, 0.75)
OVR_ARMS = ("ovr_candidates", "ovr_alone", "ovr_alone_absolute", "ovr_alone_logistic", "ovr_alone_absolute_logistic")
BASELINE = "softmax"
FAMILY = {
    "declared_on": DECLARED_ON,
    # the names of bench/evidence.py's ARMS: the default recipe; the OvR loss alone, relative and absolute
    # thresholds; the same two with the logistic link; the softmax; GCE (q = 0.7)
    "arms": [*OVR_ARMS, BASELINE, "gce"],
    "baseline": BASELINE,
    "lrs": [1e-4, 1e-3, 1e-2],
    "seeds": list(range(10)),
    "cells": [f"{task} {setting}" for task in ("trec", "tweets") for setting in NOISE_SETTINGS]
    + [f"trec known:{fraction:g}" for fraction in KNOWN_FRACTIONS],
    "steps": 60,
    "batch_rows": 16,
    # per seed, the pool (the first 1,000 training and 538 validation rows of the data's seeded 70/10/20 split at
    # seed 0) is split again, stratified by class, into 1,000 training and 538 validation rows; the test rows
    # (the first 1,076 of that split's test part) are the same for every seed and never choose anything
    "pool": {"train": 1000, "validation": 538},
    "test": 1076,
    "alpha": 0.05,
}
# the test metrics reported, each with the direction that is better (the rate is chosen on validation accuracy in
# both protocols: the arm's own rule, on the validation labels as noisy as the training labels, or on the known
# classes' validation rows)
NOISE_METRICS = {"accuracy": "higher", "accuracy_softmax_rule": "higher", "ece": "lower", "confidence_auroc": "higher"}
UNKNOWN_METRICS = {"auroc": "higher", "fpr_at_95_tpr": "lower", "open_set_macro_f1": "higher"}
PRIMARY_NOISE_CELLS = [f"{task} {kind}:0.4" for task in ("trec", "tweets") for kind in ("uniform", "class")]
HYPOTHESIS_CELLS = ["trec 0", "tweets 0"]  # the ECE of P_top (the default recipe) against the softmax's max probability
HYPOTHESIS_ARM = "ovr_candidates"


def protocol(cell: str) -> str:
    return "unknown" if cell.split(" ", 1)[1].startswith("known:") else "noise"


def parse_cell(cell: str) -> tuple[str, str, float]:
    """(task, kind, value) of a cell: ("trec", "class", 0.4), ("trec", "none", 0.0), ("trec", "known", 0.25)."""
    task, setting = cell.split(" ", 1)
    if setting == "0":
        return task, "none", 0.0
    kind, _, value = setting.partition(":")
    return task, kind, float(value)


def rejection_score(arm: str) -> str:
    """The score an arm's open-set acceptance is read from: the OvR acceptance max_k P_k, or the energy score."""
    return "ovr_max_prob" if arm in OVR_ARMS else "energy"


def restrict(family: dict = FAMILY, *, arms=None, lrs=None, seeds=None, cells=None) -> dict:
    """The family with a subset of its arms, rates, seeds or cells (to share the runs among processes): anything not
    declared is refused with the declared list, and fewer than two seeds (no standard error) too. The baseline arm
    stays whatever is asked: every comparison is against it."""
    out = dict(family)
    for name, asked in (("arms", arms), ("lrs", lrs), ("seeds", seeds), ("cells", cells)):
        if asked is None:
            continue
        undeclared = [value for value in asked if value not in family[name]]
        if undeclared:
            raise ValueError(f"not in the pre-registered family: {name} {undeclared}; declared {name}: "
                             f"{family[name]} (docs/evidence.md, Pre-registered protocol)")
        out[name] = [value for value in family[name] if value in asked]  # the declared order
    if len(out["seeds"]) < 2:
        raise ValueError(f"{len(out['seeds'])} seed(s): a paired comparison needs two seeds or more (a standard "
                         f"error); declared seeds: {family['seeds']}")
    if family["baseline"] not in out["arms"]:
        out["arms"] = [a for a in family["arms"] if a in out["arms"] or a == family["baseline"]]
    return out


def run_key(cell: str, arm: str, lr: float, seed: int) -> str:
    return f"{cell} | {arm} | lr {lr:g} | seed {seed}"


def planned_runs(family: dict = FAMILY) -> list[tuple[str, str, float, int]]:
    """Every (cell, arm, lr, seed) of the family, seeds outermost within a cell (a cell's first seeds finish first)."""
    return [(cell, arm, lr, seed) for cell in family["cells"] for seed in family["seeds"] for arm in family["arms"]
            for lr in family["lrs"]]


def comparisons(family: dict = FAMILY) -> list[dict]:
    """Every declared comparison against the baseline, with its family: `primary` (the decision), `hypothesis` (the
    ECE hypothesis from exploration) or `secondary` (reported, Holm-adjusted within its protocol's secondary
    comparisons, no claim made on them)."""
    out = []
    for cell in family["cells"]:
        kind = protocol(cell)
        for arm in family["arms"]:
            if arm == family["baseline"]:
                continue
            for metric in NOISE_METRICS if kind == "noise" else UNKNOWN_METRICS:
                if kind == "noise":
                    primary = metric == "accuracy" and cell in PRIMARY_NOISE_CELLS
                else:
                    primary = metric == "auroc"
                hypothesis = kind == "noise" and metric == "ece" and arm == HYPOTHESIS_ARM and cell in HYPOTHESIS_CELLS
                group = "primary" if primary else "hypothesis" if hypothesis else f"secondary {kind}"
                out.append({"cell": cell, "arm": arm, "metric": metric, "family": group})
    return out


def describe(family: dict = FAMILY) -> list[str]:
    """The --dry-run: the family's counts, nothing trained."""
    runs = planned_runs(family)
    by_protocol = {p: sum(protocol(c) == p for c, *_ in runs) for p in ("noise", "unknown")}
    tests = comparisons(family)
    groups = {}
    for t in tests:
        groups.setdefault(t["family"], []).append(t)
    lines = [f"pre-registered family (declared {family['declared_on']}; docs/evidence.md)",
             f"arms ({len(family['arms'])}): {' '.join(family['arms'])}; baseline {family['baseline']}",
             f"learning rates ({len(family['lrs'])}): {' '.join(f'{lr:g}' for lr in family['lrs'])}, chosen per seed "
             "on validation accuracy, ties to the smaller rate",
             f"seeds ({len(family['seeds'])}): {' '.join(map(str, family['seeds']))}, each its own train/validation split",
             f"cells ({len(family['cells'])}): {'; '.join(family['cells'])}",
             f"runs: {len(runs)} (label noise {by_protocol['noise']}, unknown classes {by_protocol['unknown']}) = "
             f"cells × arms × rates × seeds, {family['steps']} steps of {family['batch_rows']} rows each"]
    for name in sorted(groups):
        lines.append(f"{name} comparisons: {len(groups[name])}, Holm-adjusted together at α = {family['alpha']}")
    for t in groups.get("primary", []):
        lines.append(f"  primary: {t['cell']} | {t['arm']} − {family['baseline']} | {t['metric']}")
    for t in groups.get("hypothesis", []):
        lines.append(f"  hypothesis: {t['cell']} | {t['arm']} P_top − {family['baseline']} max probability | {t['metric']}")
    return lines


# ---------------------------------------------------------------------------------------------- analysis


def chosen_runs(runs: dict, family: dict = FAMILY) -> dict[tuple[str, str], dict[int, dict]]:
    """{(cell, arm): {seed: the run at the rate that seed's validation chose}} over the seeds that ran every rate of
    the grid (an incomplete seed is left out, never chosen from part of the grid)."""
    out = {}
    for cell in family["cells"]:
        for arm in family["arms"]:
            for seed in family["seeds"]:
                by_lr = {lr: runs.get(run_key(cell, arm, lr, seed)) for lr in family["lrs"]}
                if any(run is None for run in by_lr.values()):
                    continue
                lr = choose_rate({lr: run["validation"] for lr, run in by_lr.items()})
                out.setdefault((cell, arm), {})[seed] = by_lr[lr]
    return out


def metric_value(run: dict, cell: str, arm: str, metric: str) -> float:
    """A run's test metric: in the unknown-classes protocol, read from the arm's declared rejection score."""
    if protocol(cell) == "unknown":
        return run["test"][rejection_score(arm)][metric]
    return run["test"][metric]


def analyse(runs: dict, family: dict = FAMILY) -> list[dict]:
    """Every declared comparison: the arm's and the baseline's mean, the paired difference ± s.e. over the seeds both
    have, the paired t-test's p, the Holm-adjusted p within its family and the verdict (ahead / behind / tie in the
    metric's better direction; "incomplete" while a seed of the family is missing)."""
    chosen = chosen_runs(runs, family)
    rows = []
    for test in comparisons(family):
        cell, arm, metric = test["cell"], test["arm"], test["metric"]
        mine = {seed: metric_value(run, cell, arm, metric) for seed, run in chosen.get((cell, arm), {}).items()}
        base = {seed: metric_value(run, cell, family["baseline"], metric)
                for seed, run in chosen.get((cell, family["baseline"]), {}).items()}
        row = {**test, **paired_row(mine, base, family["seeds"]),
               "arm_lrs": [chosen[cell, arm][s]["lr"] for s in sorted(set(mine) & set(base))]}
        rows.append(row)
    adjust(rows, group=lambda row: row["family"])
    for row in rows:
        row["verdict"] = verdict(row, family["alpha"])
    return rows


def verdict(row: dict, alpha: float) -> str:
    return _verdict(row, (NOISE_METRICS | UNKNOWN_METRICS)[row["metric"]], alpha)


def _mean(values):
    return statistics.fmean(values) if values else float("nan")


def report(runs: dict, family: dict = FAMILY, meta: dict | None = None) -> str:
    """The markdown report: per protocol one table (every arm, every metric, against the baseline), the rates each
    seed chose, and the wall time."""
    rows = analyse(runs, family)
    planned = planned_runs(family)
    done = sum(run_key(*r) in runs for r in planned)
    lines = [f"# The pre-registered comparison (declared {family['declared_on']}; docs/evidence.md)", ""]
    if meta:
        lines += [f"Run from commit {meta.get('commit', '?')}; base {meta.get('base', '?')}.", ""]
    lines += [f"Runs: {done} of {len(planned)} planned" + ("." if done == len(planned) else
              ": **incomplete, no verdict is a result of the protocol until every run is in**."), "",
              f"Every difference is arm − {family['baseline']} per seed at the rate that seed's validation chose; "
              "paired t on the seeds, two-sided; Holm-adjusted within its family (primary, hypothesis, or the "
              f"protocol's secondary comparisons); α = {family['alpha']}. Only the primary and hypothesis verdicts are "
              "claims; a tie is a tie.", ""]
    titles = {"noise": "Label noise (clean test; accuracy by the arm's own rule)",
              "unknown": "Unknown classes (TREC fine classes; OvR arms by max_k P_k, softmax and GCE by energy)"}
    for kind, title in titles.items():
        mine = [row for row in rows if protocol(row["cell"]) == kind]
        if not mine:
            continue
        lines += [f"## {title}", "", f"| cell | arm | metric | arm | {family['baseline']} | arm − {family['baseline']} "
                  "(s.e.) | seeds | p | p (Holm) | family | verdict |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for row in mine:
            lines.append(f"| {row['cell']} | {row['arm']} | {row['metric']} | {_f(row['arm_mean'])} | "
                         f"{_f(row['baseline_mean'])} | {_f(row['mean'], sign=True)} ± {_f(row['se'])} | "
                         f"{len(row['seeds'])} | {_p(row['p'])} | {_p(row['p_holm'])} | {row['family']} | "
                         f"{'**' + row['verdict'] + '**' if row['family'] in ('primary', 'hypothesis') else row['verdict']} |")
        lines.append("")
    lines += ["## Rates chosen (per seed, on validation)", "", "| cell | arm | " +
              " | ".join(f"{lr:g}" for lr in family["lrs"]) + " |", "|---|---|" + "---:|" * len(family["lrs"])]
    for (cell, arm), seeds in chosen_runs(runs, family).items():
        lines.append(f"| {cell} | {arm} | " + " | ".join(str(sum(run["lr"] == lr for run in seeds.values()))
                                                        for lr in family["lrs"]) + " |")
    seconds = [runs[run_key(*r)]["seconds"] for r in planned if run_key(*r) in runs]
    lines += ["", f"Wall time: {sum(seconds) / 3600:.2f} h of training over {len(seconds)} runs "
              f"({_f(_mean(seconds), 1)} s per run; one thread each)."]
    return "\n".join(lines) + "\n"
