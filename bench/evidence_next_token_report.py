"""The report of the pre-registered hypothesis (docs/evidence.md): its next-token comparison from the records of
bench/evidence_next_token.py, its classification comparisons from bench/evidence_preregistered.py's result files, one
Holm adjustment over all of them, and the markdown tables. No training here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_protocol as protocol  # noqa: E402
from evidence_protocol import _f, _mean, _p  # noqa: E402  (the driver's report's number formats)

from stats import holm, paired_t  # noqa: E402

NEXT_TOKEN = "next tokens (held-out docstrings)"


def hypothesis_names() -> list[str]:
    """The hypothesis's comparisons, in the report's order: the classification cells, then the next tokens."""
    return [t["cell"] for t in protocol.comparisons() if t["family"] == "hypothesis"] + [NEXT_TOKEN]


def classification_rows(paths) -> list[dict] | None:
    """The `hypothesis` rows of the classification driver's analysis of its merged result files (None: none given)."""
    if not paths:
        return None
    from evidence_preregistered import merge

    return [row for row in protocol.analyse(merge(paths, protocol.FAMILY)) if row["family"] == "hypothesis"]


def next_token_row(records: dict, declaration: dict) -> dict:
    """The next-token comparison: per seed ECE(P_top) − ECE(softmax max), its paired t-test over the seeds recorded,
    the means of both, and the AUROCs beside (reported, not tested). Records over different held-out text (another
    Python's docstrings) are refused."""
    digests = {record["held_out"]["digest"] for record in records.values()}
    if len(digests) > 1:
        raise ValueError(f"the records score different held-out texts ({sorted(digests)}: other Python versions' "
                         "docstrings); run every seed with one Python")
    seeds = sorted(int(seed) for seed in records)
    mine = [records[str(s)]["ece_P_top"] for s in seeds]
    base = [records[str(s)]["ece_softmax_max_prob"] for s in seeds]
    row = {"cell": NEXT_TOKEN, "arm": "ovr_candidates (the demo recipe)", "metric": "ece", "family": "hypothesis",
           "seeds": seeds, "complete": seeds == list(declaration["seeds"]), "arm_mean": _mean(mine),
           "baseline_mean": _mean(base), "higher": sum(a > b for a, b in zip(mine, base)),
           "auroc_P_top": _mean([records[str(s)]["auroc_P_top"] for s in seeds]),
           "auroc_softmax_max_prob": _mean([records[str(s)]["auroc_softmax_max_prob"] for s in seeds])}
    if len(seeds) >= 2:
        t = paired_t([a - b for a, b in zip(mine, base)])
        row.update({k: t[k] for k in ("mean", "se", "t", "p")})
    else:
        row.update(mean=float("nan"), se=float("nan"), t=float("nan"), p=float("nan"))
    return row


def hypothesis_family(next_token: dict, classification: list[dict] | None, alpha: float) -> list[dict]:
    """Every comparison of the hypothesis, Holm-adjusted together. A classification comparison whose result file was
    not given stays in the family with p undefined (counted as 1, never rejected: the family's size is what was
    declared) and the verdict "incomplete"."""
    given = {row["cell"]: row for row in classification or []}
    rows = []
    for name in hypothesis_names():
        if name == NEXT_TOKEN:
            rows.append(dict(next_token))
        else:
            rows.append(dict(given.get(name) or {
                "cell": name, "arm": protocol.HYPOTHESIS_ARM, "metric": "ece", "family": "hypothesis", "seeds": [],
                "complete": False, "arm_mean": float("nan"), "baseline_mean": float("nan"), "mean": float("nan"),
                "se": float("nan"), "t": float("nan"), "p": float("nan")}))
    for row, adjusted in zip(rows, holm([row["p"] for row in rows])):
        row["p_holm"] = adjusted
        row["verdict"] = protocol.verdict(row, alpha)
    return rows


def report(records: dict, declaration: dict, classification: list[dict] | None = None) -> str:
    """The markdown report: the hypothesis's table (every comparison, Holm over all of them), the per-seed records,
    the time they took."""
    rows = hypothesis_family(next_token_row(records, declaration), classification, declaration["alpha"])
    seeds = sorted(int(seed) for seed in records)
    lines = [f"# The pre-registered hypothesis: ECE of P_top against the softmax's maximum probability (declared "
             f"{declaration['declared_on']}; docs/evidence.md)", "",
             f"Next-token seeds: {len(seeds)} of {len(declaration['seeds'])}" + (
                 "." if len(seeds) == len(declaration["seeds"]) else
                 ": **incomplete, no verdict is a result of the protocol until every seed is in**.")]
    if classification is None:
        lines.append("The classification half's result files were not given: its comparisons count in the Holm "
                     "adjustment with p = 1 and read *incomplete*.")
    lines += ["", "Difference = arm − softmax per seed (lower ECE is better); paired t on the seeds, two-sided; Holm "
              f"over the {len(rows)} comparisons of the hypothesis; α = {declaration['alpha']}.", "",
              "| comparison | P_top ECE | softmax max ECE | difference (s.e.) | seeds | p | p (Holm) | verdict |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row['cell']} | {_f(row['arm_mean'])} | {_f(row['baseline_mean'])} | "
                     f"{_f(row['mean'], sign=True)} ± {_f(row['se'])} | {len(row['seeds'])} | {_p(row['p'])} | "
                     f"{_p(row['p_holm'])} | **{row['verdict']}** |")
    lines += ["", f"Next tokens, the confidence AUROC beside (mean over the seeds; reported, not tested): P_top "
              f"{_f(rows[-1]['auroc_P_top'])}, softmax max {_f(rows[-1]['auroc_softmax_max_prob'])}."]
    lines += ["", "## Next tokens, per seed", "",
              "| seed | ECE P_top | ECE softmax max | difference | AUROC P_top | AUROC softmax max | top-1 standard | "
              "top-1 compatible | tokens | seconds (CPU) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for seed in seeds:
        r = records[str(seed)]
        lines.append(f"| {seed} | {_f(r['ece_P_top'])} | {_f(r['ece_softmax_max_prob'])} | "
                     f"{_f(r['ece_P_top'] - r['ece_softmax_max_prob'], sign=True)} | {_f(r['auroc_P_top'])} | "
                     f"{_f(r['auroc_softmax_max_prob'])} | {_f(r['top1_standard'])} | {_f(r['top1_compatible'])} | "
                     f"{r['num_tokens']} | {r['seconds']:.0f} ({r.get('cpu_seconds', float('nan')):.0f}) |")
    seconds = [records[str(s)]["seconds"] for s in seeds]
    if seconds:
        held_out = records[str(seeds[0])]["held_out"]
        lines += ["", f"Held-out text: {held_out['texts']} docstrings (Python {held_out['python']}, digest "
                  f"{held_out['digest']}). Wall time: {sum(seconds) / 3600:.2f} h over {len(seconds)} seeds "
                  f"({_mean(seconds):.0f} s per seed: training and evaluation)."]
    return "\n".join(lines) + "\n"

