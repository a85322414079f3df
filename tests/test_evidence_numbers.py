"""bench/evidence_numbers.py, the protocol and its report: splits and shuffles, the per-arm choice of rate on
validation, paired differences against a loop, merging runs of other arms, re-picking the rate from the JSON."""

import json
import math
import random
import sys

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence_numbers as evidence  # noqa: E402
import evidence_numbers_report as report  # noqa: E402


def test_split_is_a_partition_and_the_shuffle_permutes_a_fraction_of_rows():
    (train, val, test), shuffles = evidence.split_and_corrupt(100, seed=3, fraction=0.2)
    assert sorted(torch.cat([train, val, test]).tolist()) == list(range(100))
    assert (len(train), len(val), len(test)) == (60, 20, 20)
    assert len(shuffles) == 3
    for part, mapping in zip((train, val, test), shuffles):
        assert sorted(mapping.tolist()) == list(range(len(part)))  # a permutation: the targets' multiset is kept
        assert (mapping != torch.arange(len(part))).sum().item() == round(0.2 * len(part))


def test_protocol_runs_every_arm_and_condition_on_a_learnable_task():
    torch.manual_seed(0)
    z = torch.randn(200, 8)
    ratings = (z[:, 0] * 1.5 + 0.1 * torch.randn(200)).clamp(-4, 4)
    regression = [arm for arm in evidence.ARMS if arm not in evidence.DIGIT_ARMS]  # the digits arms: test_evidence_digits
    results = evidence.run_protocol(z, ratings, seeds=1, steps=150, batch_size=32, learning_rates=[1e-2],
                                    fraction=0.2, arms=regression, log=lambda *_: None)
    assert {(r["condition"], r["arm"]) for r in results} == {
        (c, a) for c in ("clean", "shuffled", "shuffled_test") for a in ["constant", *regression]}
    by = {(r["condition"], r["arm"]): r for r in results}
    for arm in regression:  # every head reads the signal in z: it beats the constant predictor's error
        assert by["clean", arm]["median_abs_error"] < 0.6 * by["clean", "constant"]["median_abs_error"]
    for row in results:  # every arm's intervals are also scored calibrated on the validation rows
        assert 0.0 <= row["calibrated_coverage_0.9"] <= 1.0 and row["calibrated_score"] > 0
    for row in results:  # and read on the ratings' range: the constant's quantiles lie inside it, nothing changes
        assert 0.0 <= row["truncated_calibrated_coverage_0.9"] <= 1.0 and row["truncated_score"] > 0
        if row["arm"] == "constant":
            assert all(row["truncated_" + k] == pytest.approx(v, abs=1e-9) for k, v in row.items()
                       if "truncated_" + k in row)
    summary = evidence.summarize(results)
    table = evidence.markdown(summary)
    assert table.count("| cauchy |") == 9 and "Winkler 95%" in table and "calibrated on the validation rows" in table
    assert "restricted to the digits LM's range" in table


@pytest.mark.parametrize("select", ["score", "nll"])
def test_protocol_reports_the_rate_with_the_best_validation_metric(select):
    torch.manual_seed(0)
    z = torch.randn(120, 4)
    ratings = z[:, 0] + 0.2 * torch.randn(120)
    results = evidence.run_protocol(z, ratings, seeds=1, steps=20, batch_size=16, learning_rates=[1e-4, 1e-2, 1e-1],
                                    fraction=0.2, arms=["cauchy", "gaussian"], select=select, log=lambda *_: None)
    for row in (r for r in results if r["arm"] != "constant"):
        scores = [c["validation"][select] for c in row["candidates"]]
        best = row["candidates"][scores.index(min(scores))]
        assert row["lr"] == best["lr"] and row["median_abs_error"] == best["test"]["median_abs_error"]


def test_paired_differences_match_a_loop():
    rng = random.Random(4)
    results = [{"seed": seed, "condition": condition, "arm": arm, **{m: rng.uniform(0, 5) for m in report.PAIRED_METRICS}}
               for seed in range(5) for condition in ("clean", "shuffled") for arm in ("cauchy", "gaussian")]
    results.append({"seed": 5, "condition": "clean", "arm": "gaussian", "diverged": True, "score": float("inf")})
    results.append({"seed": 5, "condition": "clean", "arm": "cauchy", **{m: 1.0 for m in report.PAIRED_METRICS}})
    (clean,) = [e for e in report.paired_differences(results) if e["condition"] == "clean"]
    for metric in report.PAIRED_METRICS:
        diffs = []
        for seed in range(5):  # seed 5 diverged for gaussian: left out
            a = [r[metric] for r in results if (r["seed"], r["condition"], r["arm"]) == (seed, "clean", "gaussian")][0]
            b = [r[metric] for r in results if (r["seed"], r["condition"], r["arm"]) == (seed, "clean", "cauchy")][0]
            diffs.append(a - b)
        mean = sum(diffs) / 5
        se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4 / 5)
        assert clean[metric] == pytest.approx((mean, se), rel=1e-12)


def test_runs_of_other_arms_merge_into_the_run_of_all_of_them():
    torch.manual_seed(0)
    z = torch.randn(200, 4)  # 40 validation rows: enough for a finite conformal offset at 95 %
    ratings = z[:, 0] + 0.2 * torch.randn(200)
    protocol = dict(seeds=2, steps=10, batch_size=16, learning_rates=[1e-2], fraction=0.2, log=lambda *_: None)
    meta = {"texts": 200, "seeds": 2, "steps": 10, "batch_size": 16, "learning_rates": [1e-2], "shuffle_fraction": 0.2,
            "prompt": evidence.PROMPT}

    def saved(arms):
        return {"meta": meta, "runs": json.loads(json.dumps(evidence.run_protocol(z, ratings, arms=arms, **protocol)))}

    together = saved(["cauchy", "gaussian", "cauchy_range"])["runs"]
    _, merged = evidence.merge_runs([saved(["cauchy", "gaussian"]), saved(["cauchy_range"])])
    key = lambda r: (r["seed"], r["condition"], r["arm"])  # noqa: E731
    assert sorted(merged, key=key) == sorted(together, key=key)
    assert evidence.all_paired_differences(merged) == evidence.all_paired_differences(together)
    other = {**saved(["cauchy_range"]), "meta": {**meta, "steps": 20}}
    with pytest.raises(ValueError, match="steps differ"):
        evidence.merge_runs([saved(["cauchy"]), other])
    with pytest.raises(ValueError, match="'cauchy' ran in two"):
        evidence.merge_runs([saved(["cauchy"]), saved(["cauchy", "gaussian"])])


def test_reselect_picks_what_a_run_with_that_rule_picks():
    torch.manual_seed(0)
    z = torch.randn(120, 4)
    ratings = z[:, 0] + 0.2 * torch.randn(120)
    kwargs = dict(seeds=1, steps=20, batch_size=16, learning_rates=[1e-4, 1e-2, 1e-1], fraction=0.2,
                  arms=["cauchy", "gaussian"], log=lambda *_: None)
    by_score = evidence.run_protocol(z, ratings, select="score", **kwargs)
    by_nll = evidence.run_protocol(z, ratings, select="nll", **kwargs)
    assert evidence.reselect(by_score, "nll") == by_nll
    assert evidence.reselect(by_nll, "score") == by_score
    table = evidence.markdown(evidence.summarize(by_nll), evidence.all_paired_differences(by_nll))
    # two per condition (as read, and with the laws restricted to the range); no digits run
    assert table.count("arm − cauchy (") == 3 and table.count("arm − cauchy, laws restricted to the range") == 3
    assert "arm − digits" not in table
