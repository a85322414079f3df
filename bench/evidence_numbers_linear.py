"""Evidence, numbers: how far can a head whose median is linear in z go? The ceiling of the regression arms.

Every regression arm of bench/evidence_numbers.py — the package's `<NUM>` head (loc_Y = w·loc_U + b, loc_U linear in
z), the Gaussian, Student-t and `cauchy_free` heads — predicts a median that is a linear function of the frozen base's
final hidden state z. The best such function for these texts bounds what any of them can reach by training better:
ridge regression on z (the intercept not penalised), in closed form in float64, its penalty λ picked per seed and
condition by the validation rows' median absolute error (validation targets corrupted like the training ones, as in
the protocol). Same cached z, texts, seeds, splits and shuffles as the JSON of an evidence_numbers run, whose per-seed
rows (learning rates re-picked by `--select`) give the paired differences.

    python bench/evidence_numbers.py --base build/demo-base --texts 2304 --seeds 5 --output OUT   # writes OUT.json
    python bench/evidence_numbers_linear.py --features /work/data/evidence-numbers/vader-answers-<key>.pt \
        --runs OUT.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_numbers as numbers  # noqa: E402

PENALTIES = tuple(10.0**k for k in range(-3, 7))


def ridge_fit(x: torch.Tensor, y: torch.Tensor, penalty: float) -> torch.Tensor:
    """[w; b] minimising ‖x w + b − y‖² + penalty·‖w‖² (b not penalised), in float64."""
    design = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    gram = design.T @ design
    gram.diagonal()[:-1] += penalty
    return torch.linalg.solve(gram, design.T @ y.double())


def ridge_predict(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    return x.double() @ coef[:-1] + coef[-1]


def linear_ceiling(z: torch.Tensor, ratings: torch.Tensor, seeds: int, fraction: float,
                   penalties=PENALTIES) -> list[dict]:
    """One row per (seed, condition): the test median absolute error of the ridge fit whose penalty has the lowest
    validation median absolute error, on evidence_numbers' splits and shuffles."""
    rows = []
    for seed in range(seeds):
        (train, val, test), (shuffle_train, shuffle_val, shuffle_test) = numbers.split_and_corrupt(
            len(ratings), seed, fraction)
        for training, tests in (("clean", {"clean": ratings[test]}),
                                ("shuffled", {"shuffled": ratings[test], "shuffled_test": ratings[test][shuffle_test]})):
            y_train, y_val = ratings[train], ratings[val]
            if training == "shuffled":
                y_train, y_val = y_train[shuffle_train], y_val[shuffle_val]
            fits = [(p, ridge_fit(z[train], y_train, p)) for p in penalties]
            scored = [(numbers.median_absolute_error(ridge_predict(z[val], c), y_val), p, c) for p, c in fits]
            _, penalty, coef = min(scored, key=lambda s: s[0])
            for condition, y_test in tests.items():
                rows.append({"seed": seed, "condition": condition, "arm": "ridge", "penalty": penalty,
                             "median_abs_error": numbers.median_absolute_error(ridge_predict(z[test], coef), y_test)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", required=True, help="evidence_numbers' cached .pt (its z and ratings)")
    parser.add_argument("--runs", required=True, help="an evidence_numbers JSON on the same features: its texts, "
                        "seeds and shuffle fraction, and its arms' per-seed rows to pair with")
    parser.add_argument("--select", choices=("score", "nll"), default="nll",
                        help="the rule that picks the JSON arms' learning rates (default: NLL, as the tables)")
    args = parser.parse_args()
    saved = json.loads(Path(args.runs).read_text())
    meta = saved["meta"]
    store = torch.load(args.features, weights_only=False)
    texts = meta["texts"]
    if len(store["rating"]) < texts:
        raise ValueError(f"{args.features} holds {len(store['rating'])} texts; {args.runs} used {texts}")
    z = torch.as_tensor(store["z"])[:texts].float()
    ratings = torch.tensor(store["rating"][:texts], dtype=torch.float32)
    rows = linear_ceiling(z, ratings, meta["seeds"], meta["shuffle_fraction"])
    runs = numbers.reselect(saved["runs"], args.select) + rows
    print(f"{texts} texts, {meta['seeds']} seeds; the JSON's arms at the rates picked by validation {args.select}; "
          "ridge's λ picked by validation MedAE\n")
    print("| condition | arm | MedAE | ridge − arm, paired | λ picked |")
    print("|---|---|---:|---:|---|")
    by_key = {(r["seed"], r["condition"], r["arm"]): r for r in runs}
    for condition in ("clean", "shuffled", "shuffled_test"):
        for arm in ("ridge", "cauchy", "cauchy_free", "gaussian", "student_t", "digits"):
            seeds = [s for s in range(meta["seeds"]) if (s, condition, arm) in by_key
                     and not by_key[s, condition, arm].get("diverged")]
            if not seeds:
                continue
            mean, se = numbers.mean_and_standard_error([by_key[s, condition, arm]["median_abs_error"] for s in seeds])
            paired = "–"
            if arm != "ridge":
                d, dse = numbers.mean_and_standard_error([by_key[s, condition, "ridge"]["median_abs_error"]
                                                          - by_key[s, condition, arm]["median_abs_error"]
                                                          for s in seeds])
                paired = f"{d:+.3f} ± {dse:.3f}"
            penalties = ", ".join(f"{by_key[s, condition, 'ridge']['penalty']:g}" for s in seeds) if arm == "ridge" else ""
            print(f"| {condition} | {arm} | {mean:.3f} ± {se:.3f} | {paired} | {penalties} |")


if __name__ == "__main__":
    main()
