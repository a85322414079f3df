"""`causalqwen compare` says what the OvR heads' P_top says across rows: its percentiles on the test rows (against a
float64 computation from x), and a warning under the table when on some seeds it is the same for every row — heads
whose scale ran away keep the accuracy while their probabilities carry nothing (docs/evidence.md, the hypothesis's
result)."""

import math
from types import SimpleNamespace

import pytest
import torch
from test_compare import argv, base_folder, tokenizer_dir, write_rows  # noqa: F401 (fixtures)

from causalqwen_adapter.cli import compare
from causalqwen_adapter.comparison.metrics import FLAT_SPREAD, p_top_spread
from causalqwen_adapter.comparison.verdicts import confidence_lines


def percentile(values: list[float], q: float) -> float:
    """The linear-interpolation percentile (numpy's and torch.quantile's default), by hand."""
    s = sorted(values)
    position = q * (len(s) - 1)
    lo, hi = math.floor(position), math.ceil(position)
    return s[lo] + (s[hi] - s[lo]) * (position - lo)


@pytest.mark.parametrize("arm, link", [("ovr_candidates", lambda x: 0.5 + math.atan(x) / math.pi),
                                       ("ovr_alone_logistic", lambda x: 1 / (1 + math.exp(-x)))])
def test_p_top_percentiles_are_the_links_of_the_largest_x(arm, link):
    x = torch.randn(37, 4, generator=torch.Generator().manual_seed(0)) * 3
    got = p_top_spread(arm, SimpleNamespace(x=x))
    p_top = [link(max(row)) for row in x.double().tolist()]
    assert got == pytest.approx({"p_top_p10": percentile(p_top, 0.1), "p_top_median": percentile(p_top, 0.5),
                                 "p_top_p90": percentile(p_top, 0.9), "p_top_rows": 37}, rel=1e-12)
    # a collapsed head: x ≈ 0 on every row (scale_S huge), P_top = ½ whatever the argmax
    flat = p_top_spread(arm, SimpleNamespace(x=x * 1e-6))
    assert flat["p_top_p90"] - flat["p_top_p10"] < FLAT_SPREAD and flat["p_top_median"] == pytest.approx(0.5, abs=1e-5)


def p_top(p10, median, p90, rows=50):
    return {"p_top_p10": p10, "p_top_median": median, "p_top_p90": p90, "p_top_rows": rows}


def test_the_warning_names_a_runaway_scale_only_at_one_half():
    graded, half, zero = p_top(0.3, 0.6, 0.9), p_top(0.4999, 0.5, 0.5001), p_top(0.0, 0.0001, 0.0002)
    per_seed = {"ovr_candidates": {0: half, 1: graded, 2: half}, "ovr_alone": {0: graded, 1: graded, 2: graded},
                "ovr_alone_logistic": {0: zero, 1: graded, 2: half},
                "softmax": {0: {"accuracy": 0.8}, 1: {"accuracy": 0.7}, 2: {"accuracy": 0.9}}}
    lines = confidence_lines(per_seed)
    assert len(lines) == 3  # the softmax has no P_top
    assert lines[0].startswith("- ovr_candidates: P_top on the test rows 0.500 (10–90 %: 0.500–0.500")
    assert "On 2 of 3 seeds P_top is ½ for 80 % of the test rows**: the heads' scale ran away" in lines[0]
    assert "about the same" not in lines[0]
    assert lines[1] == "- ovr_alone: P_top on the test rows 0.600 (10–90 %: 0.300–0.900; medians over the seeds)."
    # near 0 (heads that accept nothing yet): flat, but no runaway scale and no advice to lower the rate for it
    assert "On 1 of 3 seeds P_top is ½" in lines[2]
    assert "On 1 of 3 seeds P_top is about the same for 80 % of the test rows (0.000)" in lines[2]


def test_too_few_test_rows_say_nothing_of_the_spread():
    one_row = p_top(0.5, 0.5, 0.5, rows=1)
    lines = confidence_lines({"ovr_candidates": {0: one_row, 1: one_row}})
    assert lines == ["- ovr_candidates: P_top on the test rows 0.500 (10–90 %: 0.500–0.500; medians over the seeds)."]


def test_compare_reports_the_p_top_of_each_ovr_run(base_folder, tokenizer_dir, tmp_path):  # noqa: F811
    data = write_rows(tmp_path / "rows.jsonl")
    out = compare.main(argv(base_folder, data, tmp_path / "out", tokenizer=tokenizer_dir))
    for run in out["runs"]:
        keys = {"p_top_p10", "p_top_median", "p_top_p90"}
        if run["arm"] == "softmax":
            assert not keys & set(run["test"])
        else:
            t = run["test"]
            assert 0 <= t["p_top_p10"] <= t["p_top_median"] <= t["p_top_p90"] <= 1
    text = (tmp_path / "out" / "comparison.md").read_text()
    assert "What the OvR heads' P_top says, at the chosen rates:" in text
    assert confidence_lines(out["per_seed"])[0] in text
