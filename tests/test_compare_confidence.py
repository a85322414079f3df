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
                                 "p_top_p90": percentile(p_top, 0.9)}, rel=1e-12)
    # a collapsed head: x ≈ 0 on every row (scale_S huge), P_top = ½ whatever the argmax
    flat = p_top_spread(arm, SimpleNamespace(x=x * 1e-6))
    assert flat["p_top_p90"] - flat["p_top_p10"] < FLAT_SPREAD and flat["p_top_median"] == pytest.approx(0.5, abs=1e-5)


def test_the_warning_counts_the_seeds_whose_p_top_is_flat():
    graded = {"p_top_p10": 0.3, "p_top_median": 0.6, "p_top_p90": 0.9}
    flat = {"p_top_p10": 0.4999, "p_top_median": 0.5, "p_top_p90": 0.5001}
    per_seed = {"ovr_candidates": {0: flat, 1: graded, 2: flat}, "ovr_alone": {0: graded, 1: graded, 2: graded},
                "softmax": {0: {"accuracy": 0.8}, 1: {"accuracy": 0.7}, 2: {"accuracy": 0.9}}}
    lines = confidence_lines(per_seed)
    assert len(lines) == 2  # the softmax has no P_top
    assert lines[0].startswith("- ovr_candidates: P_top on the test rows 0.500 (10–90 %: 0.500–0.500")
    assert "On 2 of 3 seeds it is the same for every row" in lines[0]
    assert lines[1] == "- ovr_alone: P_top on the test rows 0.600 (10–90 %: 0.300–0.900; medians over the seeds)."


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
