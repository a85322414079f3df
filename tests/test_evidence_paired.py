"""bench/evidence_paired.py: runs merge by seed across files, and the paired differences are the per-seed ones."""

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SPEC = importlib.util.spec_from_file_location("evidence_paired", BENCH / "evidence_paired.py")
paired = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(paired)


def _row(arm, lr, seeds, accuracies, rate=0.4):
    return {"task": "trec", "noise": "uniform", "rate": rate, "arm": arm, "lr": lr, "seeds": seeds,
            "test_accuracy": accuracies}


def _write(path, rows):
    fresh = {"task": "trec", "noise": "none", "rate": 0.0, "arm": "fresh heads", "lr": 0.0, "seeds": [],
             "test_accuracy": [{"softmax": 0.3, "ovr": 0.3}]}
    path.write_text(json.dumps({"results": [fresh, *rows]}))
    return path


def test_seed_ranges_merge_and_the_difference_is_paired(tmp_path):
    ovr = [0.70, 0.66, 0.73, 0.67, 0.71, 0.69]
    soft = [0.70, 0.66, 0.66, 0.61, 0.71, 0.60]
    first = _write(tmp_path / "a.json", [
        _row("ovr_alone", 0.01, [0, 1, 2], [{"softmax": 0.0, "ovr": v} for v in ovr[:3]]),
        _row("softmax", 0.01, [0, 1, 2, 3], [{"softmax": v} for v in soft[:4]])])
    second = _write(tmp_path / "b.json", [
        _row("ovr_alone", 0.01, [3, 4, 5], [{"softmax": 0.0, "ovr": v} for v in ovr[3:]]),
        _row("softmax", 0.01, [3, 4, 5], [{"softmax": v} for v in soft[3:]])])
    runs = paired.merged_runs([first, second])
    assert sorted(runs[("trec", "uniform", 0.4, "ovr_alone", 0.01)]) == [0, 1, 2, 3, 4, 5]
    d = paired.paired(runs[("trec", "uniform", 0.4, "ovr_alone", 0.01)], runs[("trec", "uniform", 0.4, "softmax", 0.01)])
    diffs = [a - b for a, b in zip(ovr, soft)]  # the OvR arm by its own rule (P_k), not its softmax rule
    assert d["mean"] == pytest.approx(statistics.fmean(diffs))
    assert d["se"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(6))
    assert d["higher"] == sum(x > 0 for x in diffs) == 3  # ties are not higher
    lines = paired.table(runs, "softmax")
    assert len(lines) == 3 and "| 6 |" in lines[2] and "3 of 6" in lines[2]


def test_only_common_seeds_are_compared(tmp_path):
    path = _write(tmp_path / "a.json", [_row("gce", 0.01, [0, 1, 2], [{"softmax": v} for v in (0.5, 0.6, 0.7)]),
                                        _row("softmax", 0.001, [1, 2, 3], [{"softmax": v} for v in (0.4, 0.4, 0.4)])])
    runs = paired.merged_runs([path])
    d = paired.paired(runs[("trec", "uniform", 0.4, "gce", 0.01)], runs[("trec", "uniform", 0.4, "softmax", 0.001)])
    assert d["seeds"] == [1, 2] and d["mean"] == pytest.approx(0.25)


def test_a_seed_with_two_results_is_refused(tmp_path):
    a = _write(tmp_path / "a.json", [_row("softmax", 0.01, [0], [{"softmax": 0.5}])])
    b = _write(tmp_path / "b.json", [_row("softmax", 0.01, [0], [{"softmax": 0.6}])])
    with pytest.raises(ValueError, match="seed 0 .* two results"):
        paired.merged_runs([a, b])
    assert paired.merged_runs([a, a])  # the same run twice is one run


def _line(arm, seed, lr, validation, test, setting="uniform:0.4"):
    return f"trec {setting} {arm} seed {seed} lr {lr:g}: validation (noisy) {validation:.4f}, clean test {test}, heads None (9s)"


def test_each_seed_chooses_its_rate_by_validation(tmp_path):
    log = tmp_path / "runs.log"
    log.write_text("\n".join([
        "Loading weights: 100%",
        _line("softmax", 0, 1e-3, 0.44, {"softmax": 0.70}), _line("softmax", 0, 1e-2, 0.45, {"softmax": 0.60}),
        _line("softmax", 1, 1e-3, 0.47, {"softmax": 0.72}), _line("softmax", 1, 1e-2, 0.41, {"softmax": 0.59}),
        _line("softmax", 2, 1e-2, 0.50, {"softmax": 0.50}),  # one rate of two: left out
        _line("ovr_alone", 0, 1e-3, 0.40, {"softmax": 0.1, "ovr": 0.69}),
        _line("ovr_alone", 1, 1e-3, 0.40, {"softmax": 0.1, "ovr": 0.71}),
        _line("ovr_alone", 0, 1e-3, 0.50, {"softmax": 0.5, "ovr": 0.5}, setting="none:0.0"),
    ]) + "\n")
    chosen = paired.per_seed_choice([log])
    assert chosen[("trec", "uniform", 0.4, "softmax", "per seed")] == {0: {"softmax": 0.60}, 1: {"softmax": 0.72}}
    assert chosen[("trec", "none", 0.0, "ovr_alone", "per seed")] == {0: {"softmax": 0.5, "ovr": 0.5}}
    d = paired.paired(chosen[("trec", "uniform", 0.4, "ovr_alone", "per seed")],
                      chosen[("trec", "uniform", 0.4, "softmax", "per seed")])
    assert d["seeds"] == [0, 1] and d["mean"] == pytest.approx(((0.69 - 0.60) + (0.71 - 0.72)) / 2)
    assert "ovr_alone (per seed)" in "\n".join(paired.table(chosen, "softmax"))
    by_rate = paired.runs_by_rate([log])  # every rate its own arm, on the seeds that ran it
    assert by_rate[("trec", "uniform", 0.4, "softmax", 1e-2)] == {0: {"softmax": 0.60}, 1: {"softmax": 0.59},
                                                                   2: {"softmax": 0.50}}
    assert by_rate[("trec", "uniform", 0.4, "softmax", 1e-3)] == {0: {"softmax": 0.70}, 1: {"softmax": 0.72}}
    log.write_text(log.read_text() + _line("softmax", 1, 1e-3, 0.47, {"softmax": 0.73}) + "\n")
    with pytest.raises(ValueError, match="two results"):
        paired.per_seed_choice([log])


def test_the_runs_of_a_json_file_choose_like_the_log(tmp_path):
    row = _row("softmax", 0.01, [0, 1], [{"softmax": 0.60}, {"softmax": 0.59}])
    row["runs"] = [{"seed": 0, "lr": 1e-3, "validation": 0.44, "test_accuracy": {"softmax": 0.70}},
                   {"seed": 0, "lr": 1e-2, "validation": 0.45, "test_accuracy": {"softmax": 0.60}},
                   {"seed": 1, "lr": 1e-2, "validation": 0.41, "test_accuracy": {"softmax": 0.59}}]
    chosen = paired.per_seed_choice([_write(tmp_path / "a.json", [row])])
    assert chosen == {("trec", "uniform", 0.4, "softmax", "per seed"): {0: {"softmax": 0.60}}}  # seed 1 ran one rate


def _unknown(path, rows):
    path.write_text(json.dumps({"results": rows}))
    return path


def _scores(aurocs):
    return [{"auroc": a, "fpr_at_95_tpr": 1 - a, "open_set_macro_f1": a / 2} for a in aurocs]


def test_unknown_classes_pair_the_ovr_acceptance_with_every_baseline_score(tmp_path):
    ovr = {0: 0.70, 1: 0.74, 2: 0.69, 3: 0.80}
    energy = {0: 0.75, 1: 0.73, 2: 0.74, 3: 0.76}
    rows = lambda seeds: [  # noqa: E731
        {"known": 0.5, "arm": "ovr_candidates", "score": "ovr_max_prob", "lr": 0.01, "seeds": seeds,
         "per_seed": _scores([ovr[s] for s in seeds])},
        {"known": 0.5, "arm": "ovr_candidates", "score": "energy", "lr": 0.01, "seeds": seeds,
         "per_seed": _scores([0.5] * len(seeds))},
        {"known": 0.5, "arm": "softmax", "score": "energy", "lr": 0.01, "seeds": seeds,
         "per_seed": _scores([energy[s] for s in seeds])},
    ]
    files = [_unknown(tmp_path / "a.json", rows([0, 1])), _unknown(tmp_path / "b.json", rows([2, 3]))]
    lines = paired.unknown_table(paired.unknown_runs(files), "softmax", "auroc")[2:]
    assert len(lines) == 1 and "ovr_candidates (0.01)" in lines[0] and "energy" in lines[0]
    diffs = [ovr[s] - energy[s] for s in range(4)]
    se = statistics.stdev(diffs) / math.sqrt(4)
    assert f"{statistics.fmean(diffs):+.4f} ± {se:.4f}" in lines[0] and "| 2 of 4 |" in lines[0]
    fpr = paired.unknown_table(paired.unknown_runs(files), "softmax", "fpr_at_95_tpr")[2]
    assert f"{-statistics.fmean(diffs):+.4f}" in fpr


def test_unknown_rows_without_per_seed_scores_are_refused(tmp_path):
    row = {"known": 0.5, "arm": "softmax", "score": "energy", "lr": 0.01, "seeds": [0], "auroc": 0.7}
    with pytest.raises(ValueError, match="no per-seed scores"):
        paired.unknown_runs([_unknown(tmp_path / "old.json", [row])])
