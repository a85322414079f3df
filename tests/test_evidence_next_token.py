"""The pre-registered hypothesis's next-token half (bench/evidence_next_token.py, bench/evidence_next_token_report.py):
per-seed records written and resumed on the tiny stand-in base, the ECEs against a naive float64 loop over the
evaluation's own signals, and the report's paired t and Holm over the hypothesis against naive float64 arithmetic."""

import json
import math
import random
import sys

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence_next_token as next_token  # noqa: E402
import evidence_next_token_report as next_token_report  # noqa: E402
import evidence_preregistered as driver  # noqa: E402
import evidence_protocol as protocol  # noqa: E402
from test_evidence_preregistered import _runs  # noqa: E402


def naive_ece(confidence, hit, bins=15) -> float:
    """Σ_b |Σ confidence − Σ hits| / n over 15 equal-width bins of [0, 1] (1 in the last), one position at a time."""
    confidence_sum, hit_sum, n = [0.0] * bins, [0.0] * bins, 0
    for c, h in zip(confidence.double().tolist(), hit.tolist()):
        b = min(int(c * bins), bins - 1)
        confidence_sum[b] += c
        hit_sum[b] += float(h)
        n += 1
    return sum(abs(a - b) for a, b in zip(confidence_sum, hit_sum)) / n


def naive_t_p(t: float, df: int, points: int = 200_000) -> float:
    """P(|T| ≥ |t|) by Simpson's rule on Student's t density from 0 to |t| (float64): 1 − 2∫₀^|t| f."""
    f = lambda x: math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)  # noqa: E731
                           - (df + 1) / 2 * math.log1p(x * x / df))
    h = abs(t) / points
    total = f(0) + f(abs(t)) + sum((4 if k % 2 else 2) * f(k * h) for k in range(1, points))
    return 1 - 2 * total * h / 3


def naive_holm(pvalues) -> list[float]:
    """Holm step-down by the book: sort, multiply the i-th smallest by (m − i), never below the one before, cap at 1;
    an undefined p counts as 1."""
    values = [1.0 if math.isnan(p) else p for p in pvalues]
    order = sorted(range(len(values)), key=lambda i: values[i])
    adjusted, running = [0.0] * len(values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(values) - rank) * values[i]))
        adjusted[i] = running
    return adjusted


# ---------------------------------------------------------------------------------------------- the runs


def test_records_are_written_per_seed_and_a_rerun_skips_them(sft_base, tmp_path, monkeypatch):
    out, workdir = tmp_path / "next-token.json", tmp_path / "work"
    records = next_token.run_seeds([0, 1], str(sft_base), out, workdir, steps=2, keep_adapters=True,
                                   log=lambda _: None)
    saved = json.loads(out.read_text())
    assert saved["family"] == next_token.DECLARATION and set(saved["runs"]) == {"0", "1"} == set(records)
    for seed, record in records.items():
        assert record["seed"] == int(seed) and record["steps"] == 2 and record["seconds"] > record["train_seconds"] > 0
        assert record["cpu_seconds"] > 0
        assert 0 <= record["ece_P_top"] <= 1 and 0 <= record["ece_softmax_max_prob"] <= 1
        assert record["num_tokens"] > 0 and record["held_out"]["texts"] == len(next_token.demo.held_out_texts())

    # the ECEs are the declared ones: recomputed by a loop from the reloaded adapter's own signals
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from causalqwen_adapter.data import batches
    from causalqwen_adapter.evaluation import evaluate

    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    model = AutoModelForCausalLM.from_pretrained(workdir / "seed-1", trust_remote_code=True, dtype=torch.float32)
    results = evaluate(model.eval(), batches(next_token.demo.held_out_rows(tokenizer), 4, tokenizer.pad_token_id or 0),
                       ("compatible", "standard"))
    standard, compatible = results["accumulators"]["standard"], results["accumulators"]["compatible"]
    assert records["1"]["ece_P_top"] == pytest.approx(
        naive_ece(torch.cat(standard.signals["P_top"]), torch.cat(standard.hits)), abs=1e-9)
    assert records["1"]["ece_softmax_max_prob"] == pytest.approx(
        naive_ece(torch.cat(compatible.signals["max_prob"]), torch.cat(compatible.hits)), abs=1e-9)

    # a second invocation trains only the seed not in the file, and keeps the others' records as they were
    trained = []

    def counting(seed, *args, **kwargs):
        trained.append(seed)
        return {**records["0"], "seed": seed}

    monkeypatch.setattr(next_token, "run_seed", counting)
    again = next_token.run_seeds([0, 1, 2], str(sft_base), out, workdir, steps=2, log=lambda _: None)
    assert trained == [2] and {k: again[k] for k in ("0", "1")} == records
    assert set(driver.load(out, next_token.DECLARATION)) == {"0", "1", "2"}
    with pytest.raises(ValueError, match="another family"):
        driver.load(out, {**next_token.DECLARATION, "seeds": [0, 1]})


# ---------------------------------------------------------------------------------------------- the report


def _records(seeds, seed=0, digest="abc"):
    rng = random.Random(seed)
    return {str(s): {"seed": s, "ece_P_top": rng.uniform(0.02, 0.08), "ece_softmax_max_prob": rng.uniform(0.04, 0.09),
                     "auroc_P_top": rng.uniform(0.8, 0.9), "auroc_softmax_max_prob": rng.uniform(0.8, 0.9),
                     "top1_standard": 0.58, "top1_compatible": 0.58, "num_tokens": 1000, "seconds": 100.0 + 2 * s,
                     "train_seconds": 50.0, "held_out": {"digest": digest, "texts": 40, "python": "3.11"}}
            for s in seeds}


def _classification_file(tmp_path):
    """A classification result file with the hypothesis cells complete: ovr_candidates and the softmax, every rate,
    every seed, each seed's chosen rate (by validation) carrying the test ECE the comparison reads."""
    rng = random.Random(7)
    values, chosen = {}, {}
    for cell in protocol.HYPOTHESIS_CELLS:
        for seed in protocol.FAMILY["seeds"]:
            softmax = rng.uniform(0.03, 0.1)  # on TREC the OvR ECE is 0.02 ± 0.005 lower, on tweets 0 ± 0.005
            eces = {protocol.BASELINE: softmax,
                    protocol.HYPOTHESIS_ARM: softmax - 0.02 * (cell == "trec 0") + rng.uniform(-0.005, 0.005)}
            for arm, ece in eces.items():
                chosen[cell, arm, seed] = ece
                values[cell, arm, seed] = {1e-4: (0.5, 0.9), 1e-3: (0.8, ece), 1e-2: (0.7, 0.9)}
    path = tmp_path / "classification.json"
    driver.save(path, protocol.FAMILY, _runs(protocol.FAMILY, values), {})
    return path, chosen


def test_the_report_is_the_paired_t_and_holm_over_the_hypothesis(tmp_path):
    records = _records(range(10))
    path, chosen = _classification_file(tmp_path)
    rows = next_token_report.hypothesis_family(
        next_token_report.next_token_row(records, next_token.DECLARATION),
        next_token_report.classification_rows([path]), next_token.DECLARATION["alpha"])
    assert [r["cell"] for r in rows] == ["trec 0", "tweets 0", next_token_report.NEXT_TOKEN]

    def naive(differences):
        n = len(differences)
        mean = sum(differences) / n
        se = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1) / n)
        return mean, se, naive_t_p(mean / se, n - 1)

    want = [naive([chosen[cell, protocol.HYPOTHESIS_ARM, s] - chosen[cell, protocol.BASELINE, s] for s in range(10)])
            for cell in protocol.HYPOTHESIS_CELLS]
    want.append(naive([records[str(s)]["ece_P_top"] - records[str(s)]["ece_softmax_max_prob"] for s in range(10)]))
    for row, (mean, se, p) in zip(rows, want):
        assert (row["mean"], row["se"]) == pytest.approx((mean, se), rel=1e-12)
        assert row["p"] == pytest.approx(p, abs=1e-7)
    for row, adjusted in zip(rows, naive_holm([p for _, _, p in want])):
        assert row["p_holm"] == pytest.approx(adjusted, abs=1e-6)
        expected = "tie" if adjusted > 0.05 else "ahead" if row["mean"] < 0 else "behind"  # lower ECE is better
        assert row["verdict"] == expected and row["complete"]
    assert rows[0]["verdict"] == "ahead"  # TREC's OvR ECE: 0.02 lower on every seed
    text = next_token_report.report(records, next_token.DECLARATION, next_token_report.classification_rows([path]))
    assert "Next-token seeds: 10 of 10." in text and f"{rows[2]['mean']:+.4f} ± {rows[2]['se']:.4f}" in text


def test_without_the_classification_half_its_comparisons_count_as_p_1():
    records = _records([0, 1, 2, 3])
    rows = next_token_report.hypothesis_family(next_token_report.next_token_row(records, next_token.DECLARATION),
                                               None, 0.05)
    p = rows[2]["p"]
    assert [r["p_holm"] for r in rows] == pytest.approx([1.0, 1.0, min(1.0, 3 * p)])
    assert [r["verdict"] for r in rows] == ["incomplete"] * 3  # 4 of 10 seeds: incomplete too
    text = next_token_report.report(records, next_token.DECLARATION)
    assert "Next-token seeds: 4 of 10: **incomplete" in text and "were not given" in text


def test_records_of_other_held_out_text_are_refused():
    records = {**_records([0, 1]), **_records([2], digest="other")}
    with pytest.raises(ValueError, match="different held-out texts"):
        next_token_report.next_token_row(records, next_token.DECLARATION)


def test_shares_merge_and_a_seed_with_two_records_is_refused(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    driver.save(a, next_token.DECLARATION, _records([0, 1]), {})
    driver.save(b, next_token.DECLARATION, _records([2, 3], seed=0), {})
    driver.save(c, next_token.DECLARATION, _records([1], seed=5), {})
    assert set(next_token.merge([a, b, a])) == {"0", "1", "2", "3"}
    with pytest.raises(ValueError, match="seed 1 has two different records"):
        next_token.merge([a, c])


# ---------------------------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "two seeds or more"),
    (["--seeds", "0", "0"], "two seeds or more"),
    (["--seeds", "0", "10"], r"seeds \[10\] are not in the pre-registered family"),
])
def test_seeds_outside_the_declaration_or_fewer_than_two_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        next_token.main(["--dry-run", *argv])
    assert __import__("re").search(message, capsys.readouterr().err)


def test_dry_run_estimates_from_the_seeds_run_or_says_unmeasured(tmp_path, capsys, monkeypatch):
    out = tmp_path / "next-token.json"
    monkeypatch.setattr(next_token, "MEASURED_SECONDS_PER_SEED", None)
    next_token.main(["--dry-run", "--out", str(out)])
    assert "estimated time: unmeasured" in capsys.readouterr().out
    monkeypatch.setattr(next_token, "MEASURED_SECONDS_PER_SEED", 360.0)
    next_token.main(["--dry-run", "--out", str(out)])
    assert "10 × 360 s ≈ 1.00 h" in capsys.readouterr().out
    driver.save(out, next_token.DECLARATION, _records([0, 1]), {})  # seconds 100 and 102: the mean, for 8 seeds left
    next_token.main(["--dry-run", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "8 to run, 2 already in" in printed and "8 × 101 s ≈ 0.22 h" in printed
    assert not (tmp_path / "work").exists()  # nothing trained
