"""The paired table: each arm against the baseline on each metric, per seed at the rate that seed's validation
chose: the arm's and the baseline's mean ± s.e., the paired difference ± s.e., the two-sided paired t-test's p,
Holm's adjustment over a family of comparisons, and the verdict (ahead / behind / tie in the metric's better
direction)."""

import math
import statistics

from .metrics import FLAT_MIN_ROWS, FLAT_SPREAD
from .stats import holm, mean_se, paired, paired_t

# the better direction of every metric a comparison reports
BETTER = {"accuracy": "higher", "accuracy_softmax_rule": "higher", "macro_f1": "higher", "ece": "lower",
          "confidence_auroc": "higher", "auroc": "higher", "fpr_at_95_tpr": "lower", "open_set_macro_f1": "higher"}


def paired_row(mine: dict[int, float], base: dict[int, float], seeds) -> dict:
    """One comparison from {seed: value} of the arm and of the baseline: the seeds both have, whether every one of
    `seeds` is there, on how many the arm is higher, both means, and the paired t-test (NaN below two seeds)."""
    d = paired(mine, base)
    row = {"seeds": d["seeds"], "complete": d["seeds"] == list(seeds), "higher": d["higher"],
           "arm_mean": _mean([mine[s] for s in d["seeds"]]), "baseline_mean": _mean([base[s] for s in d["seeds"]])}
    if len(d["seeds"]) >= 2:
        t = paired_t([mine[s] - base[s] for s in d["seeds"]])
        row.update({k: t[k] for k in ("mean", "se", "t", "p")})
    else:
        row.update(mean=float("nan"), se=float("nan"), t=float("nan"), p=float("nan"))
    return row


def adjust(rows: list[dict], group=lambda row: "all") -> None:
    """Holm-adjusted p (`p_holm`) within each group of rows (`group(row)`), in place."""
    for name in dict.fromkeys(group(row) for row in rows):
        members = [row for row in rows if group(row) == name]
        for row, adjusted in zip(members, holm([row["p"] for row in members])):
            row["p_holm"] = adjusted


def verdict(row: dict, better: str, alpha: float) -> str:
    """ahead / behind when the Holm-adjusted p ≤ α (in the metric's `better` direction), tie otherwise; incomplete
    while a seed is missing."""
    if not row["complete"]:
        return "incomplete"
    if math.isnan(row["p_holm"]) or row["p_holm"] > alpha:
        return "tie"
    return "ahead" if (row["mean"] > 0) == (better == "higher") else "behind"


def paired_table(per_seed: dict[str, dict[int, dict]], baseline: str, metrics, seeds, alpha: float = 0.05) -> list[dict]:
    """Every arm of `per_seed` ({arm: {seed: {metric: value}}}) but the baseline against it on each of `metrics`,
    Holm-adjusted over all of them together (the printed family), with each arm's own mean ± s.e."""
    rows = []
    for arm, by_seed in per_seed.items():
        if arm == baseline:
            continue
        for metric in metrics:
            mine = {s: r[metric] for s, r in by_seed.items()}
            base = {s: r[metric] for s, r in per_seed[baseline].items()}
            row = {"arm": arm, "metric": metric, **paired_row(mine, base, seeds)}
            row["arm_se"] = mean_se([mine[s] for s in row["seeds"]])[1] if row["seeds"] else float("nan")
            row["baseline_se"] = mean_se([base[s] for s in row["seeds"]])[1] if row["seeds"] else float("nan")
            rows.append(row)
    adjust(rows)
    for row in rows:
        row["verdict"] = verdict(row, BETTER[row["metric"]], alpha)
    return rows


def confidence_lines(per_seed: dict[str, dict[int, dict]]) -> list[str]:
    """Under the table, per OvR arm: its P_top on the test rows at the chosen rates (the seeds' median of the median,
    of the 10th and of the 90th percentile), and a warning for the seeds (of FLAT_MIN_ROWS test rows or more) where
    it is about the same for 80 % of the rows (a 10–90 % range under FLAT_SPREAD): at ½, the heads' scale ran away;
    elsewhere (near 0: heads that accept nothing yet), a P_top as uninformative. The accuracy does not show either;
    the ECE reads |accuracy − P_top|."""
    lines = []
    for arm, by_seed in per_seed.items():
        runs = [r for r in by_seed.values() if "p_top_median" in r]
        if not runs:
            continue
        median = {k: statistics.median(r[k] for r in runs) for k in ("p_top_p10", "p_top_median", "p_top_p90")}
        flat = [r for r in runs if r.get("p_top_rows", 0) >= FLAT_MIN_ROWS
                and r["p_top_p90"] - r["p_top_p10"] < FLAT_SPREAD]
        half = [r for r in flat if abs(r["p_top_median"] - 0.5) < FLAT_SPREAD]
        elsewhere = [r for r in flat if abs(r["p_top_median"] - 0.5) >= FLAT_SPREAD]
        line = (f"- {arm}: P_top on the test rows {median['p_top_median']:.3f} (10–90 %: {median['p_top_p10']:.3f}–"
                f"{median['p_top_p90']:.3f}; medians over the seeds)")
        if half:
            line += (f". **On {len(half)} of {len(runs)} seeds P_top is ½ for 80 % of the test rows**: the heads' "
                     "scale ran away at the chosen rate. The accuracy and the ranking by the largest score stay, but "
                     "as a probability P_top is uncalibrated (the ECE reads |accuracy − ½|): prefer a lower rate for "
                     "these heads (docs/training.md)")
        if elsewhere:
            values = ", ".join(f"{r['p_top_median']:.3f}" for r in elsewhere)
            line += (f". On {len(elsewhere)} of {len(runs)} seeds P_top is about the same for 80 % of the "
                     f"test rows ({values}): as a probability it says little about each row (the ECE reads "
                     "|accuracy − P_top|)")
        lines.append(line + ".")
    return lines


def _mean(values):
    return statistics.fmean(values) if values else float("nan")


def number(value, digits=4, sign=False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def p_value(value) -> str:
    return "–" if math.isnan(value) else f"{value:.2g}" if value >= 1e-3 else f"{value:.1e}"


def markdown(rows: list[dict], baseline: str) -> list[str]:
    """The table's lines: metric, arm, arm mean ± s.e., baseline mean ± s.e., difference ± s.e., seeds, p, Holm p,
    verdict."""
    lines = [f"| metric | arm | arm mean ± s.e. | {baseline} mean ± s.e. | arm − {baseline} ± s.e. | seeds | p | "
             "p (Holm) | verdict |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in sorted(rows, key=lambda r: (list(BETTER).index(r["metric"]), r["arm"])):
        lines.append(f"| {row['metric']} ({BETTER[row['metric']]} is better) | {row['arm']} | "
                     f"{number(row['arm_mean'])} ± {number(row['arm_se'])} | {number(row['baseline_mean'])} ± "
                     f"{number(row['baseline_se'])} | {number(row['mean'], sign=True)} ± {number(row['se'])} | "
                     f"{len(row['seeds'])} | {p_value(row['p'])} | {p_value(row['p_holm'])} | **{row['verdict']}** |")
    return lines
