"""Evidence: does the Cauchy `<NUM>` head give better numbers with intervals than the heads a user would pick instead?

Task: VADER's human sentiment ratings (Hutto & Gilbert, ICWSM 2014; the `*_GroundTruth.txt` files of
`additional_resources/hutto_ICWSM_2014.tar.gz` in the vaderSentiment 3.3.2 sdist): text → the mean rating of about ten
people, in [−4, 4], 23,703 texts (tweets, movie and Amazon review snippets, New York Times editorial sentences).

The frozen demo base runs once over a prompt per text; its final hidden state z at the prompt's last token (the
position whose next token would be the answer's `<NUM>`) is cached under --cache, with, when a digits arm runs, the
states before every token of every answer the LM may write (evidence_digits). Every arm then trains on these frozen
states, with the same optimiser, steps and learning-rate grid (picked per arm on validation):

- `cauchy`: the package's numeric path as bench/numeric.py trains it: `AbductionNetwork` (identity location, its scale
  path trained) and `NumericHead` (w, b, s trained) on the standard-mode fused individual, loss `cauchy_nll`, the
  numeric term of `heads_loss` (the OvR term over the vocabulary is left out: it needs a [V × C] product per row and
  trains nothing of the number's law but the same scale path);
- `gaussian`: mean w·z + b, log σ read from softplus(W z + c) (W the size of the abduction scale path);
- `student_t`: the same with a Student-t law and ν learned;
- `cauchy_free`: the baselines' parametrisation with the Cauchy law (separates the law from the parametrisation);
- `digits`: the softmax LM writing the rating with one decimal, its output rows of the answer's tokens trained by the
  SFT cross-entropy, decoding constrained to −4.0 … 4.0 and read exactly (evidence_digits: no regression head at all);
- `digits_zero_shot`: the same with the base's rows untrained (what the base writes when asked);
- `constant`: the training targets' median and empirical quantiles for every text (the floor).

Targets are clean, or with 20% of the training (and validation) targets permuted among their rows ("shuffled": a user
has no clean labels to validate on). The heads trained on shuffled targets are scored on clean test targets
("shuffled") and on test targets shuffled alike ("shuffled_test": the outliers are in the data the intervals must
cover, not only in the training labels). On test: the median absolute error of the
predictive median, and for the 50/80/90/95% central intervals their coverage, mean width and interval (Winkler)
score, each family through its exact quantiles; and the same for each arm's intervals calibrated on the validation
rows (`calibrated_*`: split-conformal offsets per level, the same rule for every arm, so a head whose law has the wrong
shape is judged on how well its intervals rank the texts' uncertainty). Mean ± standard error over seeds (each seed:
split, initialisation, corruption), and the paired differences against `cauchy` on the same splits. Writes
OUTPUT.json and OUTPUT.md.

    python bench/evidence_numbers.py --base /work/demo-base --quick
    python bench/evidence_numbers.py --base /work/demo-base --texts 768 --seeds 5    # BENCHMARKS.md; bench/results/evidence-numbers.md
    python bench/evidence_numbers.py --summarize RUN.json OTHER_ARMS.json --select nll --output BOTH
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the protocol's parts, one concern per module; the names other scripts and the tests read from here stay importable
from evidence_numbers_arms import (  # noqa: E402, F401
    ARMS,
    DIGIT_ARMS,
    PackageCauchyHead,
    score_constant,
    score_head,
    train_head,
)
from evidence_numbers_data import (  # noqa: E402, F401
    PROMPT,
    answer_features,
    extract_features,
    feature_cache_path,
    read_vader_ratings,
)
from evidence_numbers_intervals import (  # noqa: E402, F401
    LEVELS,
    calibrated_intervals,
    central_interval,
    interval_metrics,
    mean_and_standard_error,
    median_absolute_error,
)
from evidence_numbers_report import all_paired_differences, markdown, merge_runs, summarize  # noqa: E402

# --- protocol ---------------------------------------------------------------------------------------------------


def split_and_corrupt(n: int, seed: int, fraction: float, train_share=0.6, validation_share=0.2):
    """(train, validation, test) indices of a seeded split, and for the shuffled conditions a permutation of each
    part's targets: `fraction` of the part's rows, chosen at random, each get the target of another chosen row (a
    cycle, so no chosen row keeps its own)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g)
    n_train, n_val = int(n * train_share), int(n * validation_share)
    parts = order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
    shuffles = []
    for part in parts:
        chosen = torch.randperm(len(part), generator=g)[: round(fraction * len(part))]
        mapping = torch.arange(len(part))
        mapping[chosen] = chosen.roll(1)
        shuffles.append(mapping)
    return parts, shuffles


def run_protocol(z, ratings, *, seeds, steps, batch_size, learning_rates, fraction, arms, select="score",
                 answers=None, log=print) -> list[dict]:
    """One row per (seed, condition, arm): the test metrics at the learning rate whose validation `select` ("score",
    the mean Winkler score, or "nll") is lowest; `candidates` keeps every rate's validation and test metrics, so
    another rule can be applied to the JSON afterwards. The digits arms read `answers` (evidence_digits'
    AnswerFeatures of the same texts) instead of z. The heads trained on shuffled targets are scored twice: on clean
    test targets ("shuffled") and on test targets shuffled alike ("shuffled_test")."""
    if any(arm in DIGIT_ARMS for arm in arms) and (answers is None or len(answers) != len(ratings)):
        raise ValueError("the digits arms need the answer states of the same texts: extract them with answers=True")
    results = []
    for seed in range(seeds):
        (train, val, test), (shuffle_train, shuffle_val, shuffle_test) = split_and_corrupt(len(ratings), seed, fraction)
        tests = {"clean": {"clean": ratings[test]},
                 "shuffled": {"shuffled": ratings[test], "shuffled_test": ratings[test][shuffle_test]}}
        for training, y_tests in tests.items():
            y_train, y_val = ratings[train], ratings[val]
            if training == "shuffled":
                y_train, y_val = y_train[shuffle_train], y_val[shuffle_val]
            for condition, y_test in y_tests.items():
                results.append({"seed": seed, "condition": condition, "arm": "constant",
                                **score_constant(y_train, y_test, y_val)})
            for arm in arms:
                x = answers if arm in DIGIT_ARMS else z
                candidates = []
                for lr in learning_rates if arm != "digits_zero_shot" else [0.0]:
                    head = train_head(arm, x[train], y_train, lr=lr, steps=steps, batch_size=batch_size, seed=seed)
                    candidates.append({"lr": lr, "validation": score_head(head, x[val], y_val),
                                       **{condition: score_head(head, x[test], y, (x[val], y_val))
                                          for condition, y in y_tests.items()}})
                best = min(candidates, key=lambda c: c["validation"].get(select, float("inf")))
                for condition in y_tests:
                    row = {"seed": seed, "condition": condition, "arm": arm, "lr": best["lr"],
                           "validation_" + select: best["validation"].get(select, float("inf")), **best[condition],
                           "candidates": [{"lr": c["lr"], "validation": c["validation"], "test": c[condition]}
                                          for c in candidates]}
                    results.append(row)
                    log(f"  seed {seed} {condition:>13} {arm:>16}: lr {row['lr']:g}, test MedAE "
                        f"{row.get('median_abs_error', float('nan')):.3f}, 90% coverage "
                        f"{row.get('coverage_0.9', float('nan')):.3f}, mean Winkler {row['score']:.3f}")
    return results


def reselect(results: list[dict], select: str) -> list[dict]:
    """The rows as if `select` had picked each arm's learning rate: every rate's validation and test metrics are kept
    in a row's `candidates`, so no head is retrained."""
    out = []
    for row in results:
        if "candidates" not in row:  # the constant predictor: nothing to pick
            out.append(row)
            continue
        best = min(row["candidates"], key=lambda c: c["validation"].get(select, float("inf")))
        kept = {k: row[k] for k in ("seed", "condition", "arm", "candidates")}
        out.append({**kept, "lr": best["lr"], "validation_" + select: best["validation"].get(select, float("inf")),
                    **best["test"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--data", default="/work/data/vaderSentiment-3.3.2.tar.gz", help="the vaderSentiment sdist")
    parser.add_argument("--cache", default="/work/data/evidence-numbers", help="where the extracted z are cached")
    parser.add_argument("--texts", type=int, default=768, help="rows of a fixed permutation of the 23,703 to use")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2])
    parser.add_argument("--shuffle-fraction", type=float, default=0.2)
    parser.add_argument("--select", choices=("score", "nll"), default="score",
                        help="the validation metric that picks each arm's learning rate: mean Winkler score, or NLL")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--quick", action="store_true",
                        help="a subset under 10 minutes: 200 texts, 3 seeds, 200 steps, rates 3e-4 and 3e-3")
    parser.add_argument("--output", default="bench/results/evidence_numbers", help="writes OUTPUT.json and OUTPUT.md")
    parser.add_argument("--summarize", metavar="JSON", nargs="+",
                        help="only re-render OUTPUT.md from JSON files this script wrote (with --select: re-picked); "
                             "several: runs of other arms on the same protocol, summarised and paired as one run")
    args = parser.parse_args()
    if args.summarize:
        saved = [json.loads(Path(path).read_text()) for path in args.summarize]
        try:
            meta, runs = merge_runs(saved)
        except ValueError as err:
            parser.error(str(err))
        results = reselect(runs, args.select)
        table = markdown(summarize(results), all_paired_differences(results))
        header = "\n".join(f"{m['command']}  ({m['date']}, {m['machine']}"
                           + (f"; learning rates re-picked by validation {args.select}" if args.select != m["select"]
                              else "") + ")" for m in (file["meta"] for file in saved))
        Path(f"{args.output}.md").write_text(f"{header}\n{table}")
        print(table)
        return
    if args.quick:
        args.texts, args.seeds, args.steps, args.learning_rates = 200, 3, 200, [3e-4, 3e-3]
    torch.set_num_threads(1)

    rows = read_vader_ratings(args.data)
    with_answers = any(arm in DIGIT_ARMS for arm in args.arms)
    store = extract_features(args.base, rows, args.texts, Path(args.cache), answers=with_answers)
    z = torch.as_tensor(store["z"])[: args.texts].float()
    answers = answer_features(store, args.texts) if with_answers else None
    ratings = torch.tensor(store["rating"][: args.texts], dtype=torch.float32)
    print(f"{len(ratings)} of {len(rows)} texts, z {tuple(z.shape)} ({store['seconds'] / len(store['keys']):.2f} s/text "
          "to extract)")
    began = time.perf_counter()
    results = run_protocol(z, ratings, seeds=args.seeds, steps=args.steps, batch_size=args.batch_size,
                           learning_rates=args.learning_rates, fraction=args.shuffle_fraction, arms=args.arms,
                           select=args.select, answers=answers)
    summary = summarize(results)
    paired = all_paired_differences(results)
    table = markdown(summary, paired)
    meta = {"command": "python bench/evidence_numbers.py " + " ".join(sys.argv[1:]), "texts": len(ratings),
            "seeds": args.seeds, "steps": args.steps, "batch_size": args.batch_size,
            "learning_rates": args.learning_rates, "shuffle_fraction": args.shuffle_fraction, "select": args.select,
            "prompt": PROMPT, "base": str(args.base), "arms": args.arms,
            "cauchy_head": {k: getattr(PackageCauchyHead.config(), k) for k in ("gamma_init", "b_noise_init")},
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 thread",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "protocol_seconds": round(time.perf_counter() - began, 1),
            "extract_seconds_per_text": store["seconds"] / len(store["keys"])}
    Path(f"{args.output}.json").write_text(json.dumps({"meta": meta, "summary": summary, "paired": paired,
                                                                "runs": results}, indent=1))
    Path(f"{args.output}.md").write_text(f"{meta['command']}  ({meta['date']}, {meta['machine']})\n{table}")
    print(table)


if __name__ == "__main__":
    main()
