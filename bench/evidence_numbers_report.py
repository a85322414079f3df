"""bench/evidence_numbers.py, its report: result files of the same protocol merged, mean ± standard error per
(condition, arm), paired differences against the package's head and the digits LM, the markdown tables."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence_numbers_intervals import LEVELS, mean_and_standard_error  # noqa: E402

CONDITIONS = {
    "clean": "clean training targets (test targets clean)",
    "shuffled": "shuffled training and validation targets (test targets clean)",
    "shuffled_test": "shuffled targets everywhere: the same heads as above, scored on test targets shuffled alike",
}


PROTOCOL_KEYS = ("texts", "seeds", "steps", "batch_size", "learning_rates", "shuffle_fraction", "prompt")


def merge_runs(saved: list[dict]) -> tuple[dict, list[dict]]:
    """(meta, runs) of several JSON files this script wrote for the same protocol (texts, seeds, steps, rates, ...:
    the same splits and shuffles), as one run of all their arms: an arm run later pairs with the arms run before.
    The constant predictor's rows, which every file has, are taken once. Refuses files of different protocols, and an
    arm in two files."""
    meta = saved[0]["meta"]
    for other in saved[1:]:
        differ = [key for key in PROTOCOL_KEYS if other["meta"].get(key) != meta.get(key)]
        if differ:
            raise ValueError(f"these runs are not of the same protocol ({', '.join(differ)} differ: "
                             f"{[other['meta'].get(k) for k in differ]} against {[meta.get(k) for k in differ]}): "
                             "only runs with the same splits pair")
    runs, owner = [], {}
    for index, file in enumerate(saved):
        for row in file["runs"]:
            if row["arm"] == "constant" and index > 0:
                continue
            if owner.setdefault(row["arm"], index) != index:
                raise ValueError(f"arm {row['arm']!r} ran in two of these files: keep one of them")
            runs.append(row)
    return meta, runs


INTERVAL_METRICS = [f"{m}_{lv}" for m in ("coverage", "width", "winkler") for lv in LEVELS]
CALIBRATED_METRICS = INTERVAL_METRICS + ["calibrated_" + m for m in INTERVAL_METRICS]
METRICS = (["median_abs_error", "nll"] + CALIBRATED_METRICS + ["truncated_median_abs_error"]
           + ["truncated_" + m for m in CALIBRATED_METRICS])


def summarize(results: list[dict]) -> list[dict]:
    """Mean ± standard error over seeds for each (condition, arm)."""
    summary = []
    for condition in (c for c in CONDITIONS if any(r["condition"] == c for r in results)):
        for arm in dict.fromkeys(r["arm"] for r in results):
            rows = [r for r in results if r["condition"] == condition and r["arm"] == arm]
            entry = {"condition": condition, "arm": arm, "seeds": len(rows),
                     "diverged": sum(bool(r.get("diverged")) for r in rows)}
            finite = [r for r in rows if not r.get("diverged")]
            for metric in METRICS + ["df"]:
                values = [r[metric] for r in finite if metric in r]
                if values:
                    entry[metric] = mean_and_standard_error(values)
            entry["lr"] = sorted(r["lr"] for r in rows if "lr" in r)
            summary.append(entry)
    return summary


PAIRED_METRICS = (["median_abs_error"] + [f"winkler_{lv}" for lv in LEVELS]
                  + [f"calibrated_winkler_{lv}" for lv in LEVELS])
TRUNCATED_PAIRED_METRICS = ["truncated_" + m for m in PAIRED_METRICS]


def paired_differences(results: list[dict], reference: str = "cauchy") -> list[dict]:
    """Mean ± standard error over seeds of (arm − `reference`) on the same split, per condition: the seeds share
    their test set across arms, so the paired difference is the sharper comparison. Seeds where either diverged are
    left out."""
    by_key = {(r["seed"], r["condition"], r["arm"]): r for r in results}
    out = []
    for condition in (c for c in CONDITIONS if any(r["condition"] == c for r in results)):
        for arm in dict.fromkeys(r["arm"] for r in results):
            if arm == reference:
                continue
            entry = {"condition": condition, "arm": arm, "reference": reference}
            for metric in PAIRED_METRICS + TRUNCATED_PAIRED_METRICS:
                diffs = [by_key[s, condition, arm][metric] - by_key[s, condition, reference][metric]
                         for s in sorted({r["seed"] for r in results})
                         if metric in by_key.get((s, condition, arm), {})
                         and metric in by_key.get((s, condition, reference), {})]
                if diffs:
                    entry[metric] = mean_and_standard_error(diffs)
            out.append(entry)
    return out


def all_paired_differences(results: list[dict]) -> list[dict]:
    """Paired differences against the package's head, and against the digits LM when it ran (the strongest
    baseline)."""
    references = [arm for arm in ("cauchy", "digits") if any(r["arm"] == arm for r in results)]
    return [entry for reference in references for entry in paired_differences(results, reference)]


def markdown(summary: list[dict], paired: list[dict] = ()) -> str:
    def cell(entry, metric, digits=3):
        if metric not in entry:
            return "–"
        mean, se = entry[metric]
        return f"{mean:.{digits}f} ± {se:.{digits}f}"

    lines = []
    for condition in dict.fromkeys(e["condition"] for e in summary):
        lines += [f"\n**{CONDITIONS[condition]}**\n",
                  "| arm | MedAE | NLL | " + " | ".join(f"cov {lv:.0%}" for lv in LEVELS) + " | "
                  + " | ".join(f"width {lv:.0%}" for lv in LEVELS) + " | "
                  + " | ".join(f"Winkler {lv:.0%}" for lv in LEVELS) + " | ν | lr picked |",
                  "|---" * (3 + 3 * len(LEVELS) + 2) + "|"]
        for entry in (e for e in summary if e["condition"] == condition):
            cells = [cell(entry, m) for m in ["median_abs_error", "nll"]]
            cells += [cell(entry, f"{m}_{lv}") for m in ("coverage", "width", "winkler") for lv in LEVELS]
            cells += [cell(entry, "df", 2), ", ".join(f"{lr:g}" for lr in entry["lr"]) or "–"]
            diverged = f" ({entry['diverged']} diverged)" if entry["diverged"] else ""
            lines.append(f"| {entry['arm']}{diverged} | " + " | ".join(cells) + " |")
        calibrated = [e for e in summary if e["condition"] == condition and "calibrated_winkler_0.5" in e]
        if calibrated:
            lines += ["\nThe same heads' intervals calibrated on the validation rows (split-conformal offset per level)\n",
                      "| arm | " + " | ".join(f"cov {lv:.0%}" for lv in LEVELS) + " | "
                      + " | ".join(f"width {lv:.0%}" for lv in LEVELS) + " | "
                      + " | ".join(f"Winkler {lv:.0%}" for lv in LEVELS) + " |",
                      "|---" * (1 + 3 * len(LEVELS)) + "|"]
            lines += [f"| {e['arm']} | " + " | ".join(cell(e, "calibrated_" + m) for m in INTERVAL_METRICS) + " |"
                      for e in calibrated]
        truncated = [e for e in summary if e["condition"] == condition and "truncated_winkler_0.5" in e]
        if truncated:
            lines += ["\nThe same heads' laws restricted to the digits LM's range (SUPPORT: a location-scale law "
                      "truncated there), as they are and calibrated\n",
                      "| arm | MedAE | " + " | ".join(f"cov {lv:.0%}" for lv in LEVELS) + " | "
                      + " | ".join(f"Winkler {lv:.0%}" for lv in LEVELS) + " | "
                      + " | ".join(f"Winkler {lv:.0%} calibrated" for lv in LEVELS) + " |",
                      "|---" * (2 + 3 * len(LEVELS)) + "|"]
            metrics = (["truncated_median_abs_error"] + [f"truncated_coverage_{lv}" for lv in LEVELS]
                       + [f"truncated_winkler_{lv}" for lv in LEVELS]
                       + [f"truncated_calibrated_winkler_{lv}" for lv in LEVELS])
            lines += [f"| {e['arm']} | " + " | ".join(cell(e, m) for m in metrics) + " |" for e in truncated]
        for reference in dict.fromkeys(e["reference"] for e in paired):
            rows = [e for e in paired if e["condition"] == condition and e["reference"] == reference]
            if not rows:
                continue
            for title, metrics in (("", PAIRED_METRICS), (", laws restricted to the range", TRUNCATED_PAIRED_METRICS)):
                if not any(metrics[0] in e for e in rows):
                    continue
                lines += [f"\nPaired over seeds, arm − {reference}{title} (negative: the arm is better)\n",
                          "| arm | ΔMedAE | " + " | ".join(f"ΔWinkler {lv:.0%}" for lv in LEVELS) + " | "
                          + " | ".join(f"ΔWinkler {lv:.0%} calibrated" for lv in LEVELS) + " |",
                          "|---" * (2 + 2 * len(LEVELS)) + "|"]
                lines += [f"| {e['arm']} | " + " | ".join(cell(e, m) for m in metrics) + " |" for e in rows]
    return "\n".join(lines) + "\n"
