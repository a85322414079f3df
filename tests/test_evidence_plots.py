"""bench/evidence_plots.py: the plotted points are the result files' figures, and every plot is written."""

import ast
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


def test_full_split_points_are_each_arm_and_rate_over_its_seeds():
    """Against a direct reading of the run lines ("trec uniform:0.4 softmax seed 3 lr 0.01: validation (noisy) ...,
    clean test {...}"): every seed's own-rule accuracy of (arm, lr, setting)."""
    points = plots.full_split_points(min_seeds=5)
    labels = {(n, r): label for n, r, label in plots.FULL_SPLIT_SETTINGS}
    seen: dict[tuple, dict[int, float]] = {}
    for line in (BENCH / "results" / plots.FULL_SPLIT_RUNS).read_text().splitlines():
        head, _, test = line.partition(", clean test ")
        words = head.split()
        if not test or words[0] != "trec" or words[2] not in plots.FULL_SPLIT_ARMS:
            continue
        noise, rate = words[1].split(":")
        accuracy = ast.literal_eval(test[: test.index("}") + 1])
        own = accuracy["ovr"] if "ovr" in accuracy else accuracy["softmax"]
        seen.setdefault((words[2], float(words[6].rstrip(":")), labels.get((noise, float(rate)))), {})[int(words[4])] = own
    expected = {key: values for key, values in seen.items() if len(values) >= 5 and key[2] is not None}
    got = {(arm, lr, setting): (mean, se, n) for (arm, lr), series in points.items() for setting, mean, se, n in series}
    assert set(got) == set(expected)
    for key, values in expected.items():
        v = list(values.values())
        assert got[key] == pytest.approx((statistics.fmean(v), statistics.stdev(v) / len(v) ** 0.5, len(v)))
    assert ("ovr_alone", 0.001, "40 % class-dep.") in got  # the cell the README leads with


def test_every_plot_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["evidence_plots.py", "--out", str(tmp_path)])
    plots.main()
    for name in ("evidence-label-noise-full.png", "evidence-label-noise.png", "evidence-numbers.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
