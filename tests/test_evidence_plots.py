"""bench/evidence_plots.py: the plotted points are the result files' figures, and both plots are written."""

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
SPEC = importlib.util.spec_from_file_location("evidence_plots", BENCH / "evidence_plots.py")
plots = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(plots)


def test_label_noise_points_are_the_result_rows_with_noise_zero_in_both_kinds():
    points = plots.label_noise_points()
    rows = [r for name in plots.LABEL_NOISE_FILES for r in json.loads((BENCH / "results" / name).read_text())["results"]
            if r.get("task") == "trec" and r["arm"] in plots.NOISE_ARMS]
    assert rows
    for row in rows:
        rule = "ovr" if "ovr_mean" in row else "softmax"
        point = (row["rate"], row[f"{rule}_mean"], row[f"{rule}_se"])
        for kind in ("uniform", "class") if row["rate"] == 0 else (row["noise"],):
            assert point in points[(row["arm"], kind)]
    assert [rate for rate, _, _ in points[("ovr_candidates", "uniform")]] == [0.0, 0.2, 0.4]


def test_transcribed_rows_reproduce_their_recorded_means():
    rows = json.loads((BENCH / "results" / "evidence_label_noise_trec_candidates_5seeds.json").read_text())["results"]
    for row in rows:
        per_seed = [t["ovr"] for t in row["test_accuracy"]]
        assert statistics.fmean(per_seed) == pytest.approx(row["ovr_mean"], abs=1e-3)
        assert statistics.stdev(per_seed) / len(per_seed) ** 0.5 == pytest.approx(row["ovr_se"], abs=1e-3)


def test_both_plots_are_written(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["evidence_plots.py", "--out", str(tmp_path)])
    plots.main()
    for name in ("evidence-label-noise.png", "evidence-numbers.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
