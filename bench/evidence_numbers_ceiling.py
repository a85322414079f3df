"""Evidence, numbers: how far can a head on z go? The ceilings of the regression arms, linear and not, and a nonlinear
Cauchy head.

Every regression arm of bench/evidence_numbers.py — the package's `<NUM>` head (loc_Y = w·loc_U + b, loc_U linear in
z), the Gaussian, Student-t and `cauchy_free` heads — predicts a median that is a linear function of the frozen base's
final hidden state z. The best such function for these texts bounds what any of them can reach by training better:
ridge regression on z (the intercept not penalised), in closed form in float64, its penalty λ picked per seed and
condition by the validation rows' median absolute error (validation targets corrupted like the training ones, as in
the protocol). Same cached z, texts, seeds, splits and shuffles as the JSON of an evidence_numbers run, whose per-seed
rows (learning rates re-picked by `--select`) give the paired differences.

Beside it, a nonlinear one: kernel ridge regression with a Gaussian (RBF) kernel on z standardised by the training
rows' mean and spread (the base's outlier dimensions would otherwise set every distance), its penalty and bandwidth
(multiples of the median distance between training rows) picked the same way. A head on z of any shape that the
training rows can pin down should not do much better than it: if it trails the digits LM too, the numbers cell is out
of reach for any head that reads z alone.

And a probe of what a nonlinear Cauchy head reaches (`cauchy_mlp`, not the package's `<NUM>` head): one hidden layer
(256 GELU units) from the standardised z to the location and scale of a Cauchy law, trained on the Cauchy NLL (the
package head's loss) by full-batch AdamW for 400 steps, the step (every 10th) and the (learning rate, weight decay)
kept by the validation MedAE; its central intervals the Cauchy law's, raw and split-conformal calibrated on the
validation rows as every arm of evidence_numbers is.

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

from causalqwen_adapter.cauchy import cauchy_nll  # noqa: E402

PENALTIES = tuple(10.0**k for k in range(-3, 7))
KERNEL_PENALTIES = tuple(10.0**k for k in range(-4, 2))
BANDWIDTHS = (0.25, 0.5, 1.0, 2.0, 4.0)  # × the median distance between training rows


def ridge_fit(x: torch.Tensor, y: torch.Tensor, penalty: float) -> torch.Tensor:
    """[w; b] minimising ‖x w + b − y‖² + penalty·‖w‖² (b not penalised), in float64."""
    design = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    gram = design.T @ design
    gram.diagonal()[:-1] += penalty
    return torch.linalg.solve(gram, design.T @ y.double())


def ridge_predict(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    return x.double() @ coef[:-1] + coef[-1]


def kernel_fit(x: torch.Tensor, y: torch.Tensor, bandwidth: float, penalty: float):
    """Kernel ridge with k(a, b) = exp(−‖a − b‖² / 2h²) in float64: the dual coefficients α = (K + penalty·I)⁻¹ (y − ȳ)
    and ȳ (the mean as an unpenalised offset)."""
    x = x.double()
    gram = torch.exp(-torch.cdist(x, x).square() / (2 * bandwidth**2))
    gram.diagonal().add_(penalty)
    offset = y.double().mean()
    return x, torch.linalg.solve(gram, y.double() - offset), offset, bandwidth


def kernel_predict(x: torch.Tensor, fit) -> torch.Tensor:
    rows, alpha, offset, bandwidth = fit
    return torch.exp(-torch.cdist(x.double(), rows).square() / (2 * bandwidth**2)) @ alpha + offset


def standardised(z: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """z by the training rows' per-dimension mean and standard deviation (a constant dimension left at 0)."""
    mean, std = z[train].double().mean(0), z[train].double().std(0)
    return (z.double() - mean) / torch.where(std > 0, std, 1.0)


def ceiling_rows(z, ratings, seeds, fraction, fit_and_pick, arm) -> list[dict]:
    """One row per (seed, condition) of `arm` on evidence_numbers' splits and shuffles: `fit_and_pick(seed, train,
    y_train, val, y_val, test)` fits on the training rows, picks on the validation ones and returns what it picked and
    `score(y_test)`, the metrics of its predictions for the test rows against those targets."""
    rows = []
    for seed in range(seeds):
        (train, val, test), (shuffle_train, shuffle_val, shuffle_test) = numbers.split_and_corrupt(
            len(ratings), seed, fraction)
        for training, tests in (("clean", {"clean": ratings[test]}),
                                ("shuffled", {"shuffled": ratings[test], "shuffled_test": ratings[test][shuffle_test]})):
            y_train, y_val = ratings[train], ratings[val]
            if training == "shuffled":
                y_train, y_val = y_train[shuffle_train], y_val[shuffle_val]
            score, picked = fit_and_pick(seed, train, y_train, val, y_val, test)
            for condition, y_test in tests.items():
                rows.append({"seed": seed, "condition": condition, "arm": arm, **picked, **score(y_test)})
    return rows


def median_error(prediction: torch.Tensor):
    """`score` of a median prediction: its median absolute error."""
    return lambda y_test: {"median_abs_error": numbers.median_absolute_error(prediction, y_test)}


def kernel_ceiling(z: torch.Tensor, ratings: torch.Tensor, seeds: int, fraction: float,
                   penalties=KERNEL_PENALTIES, bandwidths=BANDWIDTHS) -> list[dict]:
    """The RBF kernel ridge fit whose (penalty, bandwidth) has the lowest validation median absolute error."""

    def fit_and_pick(seed, train, y_train, val, y_val, test):
        x = standardised(z, train)
        scale = torch.cdist(x[train], x[train]).median().item()
        fits = [(kernel_fit(x[train], y_train, h * scale, p), p, h) for h in bandwidths for p in penalties]
        _, fit, penalty, bandwidth = min(
            ((numbers.median_absolute_error(kernel_predict(x[val], f), y_val), f, p, h) for f, p, h in fits),
            key=lambda scored: scored[0])
        return median_error(kernel_predict(x[test], fit)), {"penalty": penalty, "bandwidth": bandwidth}

    return ceiling_rows(z, ratings, seeds, fraction, fit_and_pick, "kernel")


def linear_ceiling(z: torch.Tensor, ratings: torch.Tensor, seeds: int, fraction: float,
                   penalties=PENALTIES) -> list[dict]:
    """One row per (seed, condition): the test median absolute error of the ridge fit whose penalty has the lowest
    validation median absolute error, on evidence_numbers' splits and shuffles."""

    def fit_and_pick(seed, train, y_train, val, y_val, test):
        fits = [(p, ridge_fit(z[train], y_train, p)) for p in penalties]
        _, penalty, coef = min(((numbers.median_absolute_error(ridge_predict(z[val], c), y_val), p, c) for p, c in fits),
                               key=lambda scored: scored[0])
        return median_error(ridge_predict(z[test], coef)), {"penalty": penalty}

    return ceiling_rows(z, ratings, seeds, fraction, fit_and_pick, "ridge")


MLP_LEARNING_RATES = (1e-3, 3e-4)
MLP_WEIGHT_DECAYS = (1e-2, 1e-1)
LEVELS = (0.5, 0.8, 0.9, 0.95)


def train_cauchy_mlp(x, y, x_val, y_val, *, hidden, learning_rate, weight_decay, steps, seed):
    """(the network at its best validation MedAE, that MedAE): full-batch AdamW on the Cauchy NLL."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 2))
    optimizer = torch.optim.AdamW(net.parameters(), lr=learning_rate, weight_decay=weight_decay)
    best, kept = float("inf"), None
    for step in range(steps):
        loc, scale = cauchy_law(net(x))
        loss = cauchy_nll(y, loc, scale).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 9:
            with torch.no_grad():
                error = numbers.median_absolute_error(net(x_val)[:, 0], y_val)
            if error < best:
                best, kept = error, {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(kept)
    return net, best


def cauchy_law(out: torch.Tensor):
    """(location, scale) of the network's two outputs; the scale floored at 1e-3."""
    return out[:, 0], torch.nn.functional.softplus(out[:, 1]) + 1e-3


def cauchy_mlp_rows(z, ratings, seeds, fraction, *, hidden=256, learning_rates=MLP_LEARNING_RATES,
                    weight_decays=MLP_WEIGHT_DECAYS, steps=400) -> list[dict]:
    """One row per (seed, condition) of `cauchy_mlp`: MedAE, and coverage, width and Winkler score of the raw and the
    calibrated intervals at each of `LEVELS` (evidence_numbers' metric names)."""

    def fit_and_pick(seed, train, y_train, val, y_val, test):
        x = standardised(z, train).float()
        fits = [(train_cauchy_mlp(x[train], y_train, x[val], y_val, hidden=hidden, learning_rate=lr,
                                  weight_decay=decay, steps=steps, seed=seed), lr, decay)
                for lr in learning_rates for decay in weight_decays]
        (net, _), lr, decay = min(fits, key=lambda fit: fit[0][1])
        with torch.no_grad():
            test_law, val_law = cauchy_law(net(x[test])), cauchy_law(net(x[val]))
        intervals = {level: numbers.central_interval("cauchy", *test_law, level) for level in LEVELS}
        calibrated = numbers.calibrated_intervals(
            {level: numbers.central_interval("cauchy", *val_law, level) for level in LEVELS}, y_val, intervals)

        def score(y_test):
            return {**median_error(test_law[0])(y_test), **numbers.interval_metrics(intervals, y_test),
                    **numbers.interval_metrics(calibrated, y_test, "calibrated_")}

        return score, {"lr": lr, "weight_decay": decay}

    return ceiling_rows(z, ratings, seeds, fraction, fit_and_pick, "cauchy_mlp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", required=True, help="evidence_numbers' cached .pt (its z and ratings)")
    parser.add_argument("--runs", required=True, help="an evidence_numbers JSON on the same features: its texts, "
                        "seeds and shuffle fraction, and its arms' per-seed rows to pair with")
    parser.add_argument("--select", choices=("score", "nll"), default="nll",
                        help="the rule that picks the JSON arms' learning rates (default: NLL, as the tables)")
    parser.add_argument("--mlp", action="store_true", help="also the nonlinear Cauchy head (`cauchy_mlp`: minutes)")
    args = parser.parse_args()
    saved = json.loads(Path(args.runs).read_text())
    meta = saved["meta"]
    store = torch.load(args.features, weights_only=False)
    texts = meta["texts"]
    if len(store["rating"]) < texts:
        raise ValueError(f"{args.features} holds {len(store['rating'])} texts; {args.runs} used {texts}")
    z = torch.as_tensor(store["z"])[:texts].float()
    ratings = torch.tensor(store["rating"][:texts], dtype=torch.float32)
    rows = (linear_ceiling(z, ratings, meta["seeds"], meta["shuffle_fraction"])
            + kernel_ceiling(z, ratings, meta["seeds"], meta["shuffle_fraction"]))
    if args.mlp:
        rows += cauchy_mlp_rows(z, ratings, meta["seeds"], meta["shuffle_fraction"])
    runs = numbers.reselect(saved["runs"], args.select) + rows
    print(f"{texts} texts, {meta['seeds']} seeds; the JSON's arms at the rates picked by validation {args.select}; "
          "the ceilings' penalty (λ) and bandwidth (h, × the median distance) picked by validation MedAE\n")
    print("| condition | arm | MedAE | ridge − arm, paired | kernel − arm, paired | picked |")
    print("|---|---|---:|---:|---:|---|")
    by_key = {(r["seed"], r["condition"], r["arm"]): r for r in runs}

    def paired(ceiling, arm, seeds):
        if arm == ceiling:
            return "–"
        d, dse = numbers.mean_and_standard_error([by_key[s, condition, ceiling]["median_abs_error"]
                                                  - by_key[s, condition, arm]["median_abs_error"] for s in seeds])
        return f"{d:+.3f} ± {dse:.3f}"

    for condition in ("clean", "shuffled", "shuffled_test"):
        for arm in ("ridge", "kernel", "cauchy_mlp", "cauchy", "cauchy_free", "gaussian", "student_t", "digits"):
            seeds = [s for s in range(meta["seeds"]) if (s, condition, arm) in by_key
                     and not by_key[s, condition, arm].get("diverged")]
            if not seeds:
                continue
            mean, se = numbers.mean_and_standard_error([by_key[s, condition, arm]["median_abs_error"] for s in seeds])
            picked = ""
            if arm in ("ridge", "kernel"):
                picked = ", ".join(f"λ {by_key[s, condition, arm]['penalty']:g}"
                                   + (f" h {by_key[s, condition, arm]['bandwidth']:g}" if arm == "kernel" else "")
                                   for s in seeds)
            print(f"| {condition} | {arm} | {mean:.3f} ± {se:.3f} | {paired('ridge', arm, seeds)} | "
                  f"{paired('kernel', arm, seeds)} | {picked} |")
    if not args.mlp:
        return
    print("\nIntervals: Winkler score at 50 / 80 / 90 / 95 %, raw and calibrated on validation; coverage at 95 %\n")
    print("| condition | arm | Winkler | calibrated | coverage 95 %, raw / calibrated |")
    print("|---|---|---|---|---|")
    for condition in ("clean", "shuffled", "shuffled_test"):
        for arm in ("cauchy_mlp", "cauchy", "gaussian", "digits"):
            seeds = [s for s in range(meta["seeds"]) if (s, condition, arm) in by_key]
            if not seeds:
                continue

            def mean(key):
                return numbers.mean_and_standard_error([by_key[s, condition, arm][key] for s in seeds])[0]

            raw = " / ".join(f"{mean(f'winkler_{level}'):.2f}" for level in LEVELS)
            calibrated = " / ".join(f"{mean(f'calibrated_winkler_{level}'):.2f}" for level in LEVELS)
            print(f"| {condition} | {arm} | {raw} | {calibrated} | {mean('coverage_0.95'):.2f} / "
                  f"{mean('calibrated_coverage_0.95'):.2f} |")


if __name__ == "__main__":
    main()
