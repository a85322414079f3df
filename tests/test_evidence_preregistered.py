"""The pre-registered comparison (bench/evidence_protocol.py, bench/evidence_preregistered.py, bench/stats.py): Holm's
procedure and the paired t-test against hand-worked numbers, the per-seed rate choice on validation only, the declared
family's counts and refusals, and the driver end to end on the tiny stand-in base (resumable)."""

import math
import statistics
import sys

import pytest
import torch
from transformers import Qwen2ForCausalLM

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence_preregistered as driver  # noqa: E402
import evidence_protocol as protocol  # noqa: E402
from evidence_paired import choose_rate  # noqa: E402

from stats import holm, paired_t, t_two_sided_p  # noqa: E402

# ---------------------------------------------------------------------------------------------- statistics


def test_holm_matches_a_hand_worked_example():
    """p = (0.01, 0.04, 0.03, 0.005), m = 4. Sorted: 0.005 × 4 = 0.02; 0.01 × 3 = 0.03; 0.03 × 2 = 0.06;
    0.04 × 1 = 0.04, raised to 0.06 by the step before (step-down: never below an earlier adjusted p)."""
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([float("nan"), 0.01]) == pytest.approx([1.0, 0.02])  # an undefined p stays in the family, as 1
    assert holm([]) == []
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm([1.2])


def test_holm_rejects_what_the_sequential_procedure_rejects():
    """Adjusted p ≤ α exactly where the textbook procedure rejects: walk the sorted p-values, reject while
    p_(i) ≤ α / (m − i + 1), stop at the first that is not."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        m = int(torch.randint(1, 12, (1,), generator=generator))
        p = (torch.rand(m, generator=generator) ** 3 * 0.2).tolist()
        rejected = set()
        for i, index in enumerate(sorted(range(m), key=lambda k: p[k])):
            if p[index] > 0.05 / (m - i):
                break
            rejected.add(index)
        assert {k for k, a in enumerate(holm(p)) if a <= 0.05} == rejected


def test_t_test_p_values_against_tables_and_closed_forms():
    assert t_two_sided_p(2.262157, 9) == pytest.approx(0.05, abs=1e-6)  # t_{0.975, 9}
    assert t_two_sided_p(3.249836, 9) == pytest.approx(0.01, abs=1e-6)  # t_{0.995, 9}
    assert t_two_sided_p(1.0, 1) == pytest.approx(0.5)  # df 1 is the Cauchy: 2(1 − (½ + atan(1)/π))
    for t in (0.3, 1.7, 4.0):  # df 2: P(|T| ≥ t) = 1 − t / √(t² + 2)
        assert t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-10)
        assert t_two_sided_p(-t, 2) == t_two_sided_p(t, 2)
    # a naive reference: Simpson's rule on the density from 0 to |t|
    for t, df in ((0.8, 5), (2.5, 9), (5.0, 3)):
        density = lambda x: math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi) \
            * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
        n, h = 2000, t / 2000
        area = h / 3 * sum((1 if k in (0, n) else 4 if k % 2 else 2) * density(k * h) for k in range(n + 1))
        assert t_two_sided_p(t, df) == pytest.approx(1 - 2 * area, abs=1e-9)
    assert t_two_sided_p(0.0, 9) == pytest.approx(1.0)


def test_paired_t_of_per_seed_differences():
    out = paired_t([1.0, 2.0, 3.0])  # mean 2, sd 1, se 1/√3, t = 2√3, df 2
    assert out["mean"] == 2 and out["se"] == pytest.approx(1 / math.sqrt(3)) and out["t"] == pytest.approx(2 * math.sqrt(3))
    assert out["p"] == pytest.approx(1 - math.sqrt(12) / math.sqrt(14))
    assert paired_t([0.0, 0.0])["p"] == 1.0 and paired_t([0.1, 0.1])["p"] == 0.0
    with pytest.raises(ValueError, match="two seeds or more"):
        paired_t([0.3])


def test_the_rate_chosen_is_the_best_on_validation_ties_to_the_smaller():
    assert choose_rate({1e-2: 0.5, 1e-4: 0.7, 1e-3: 0.6}) == 1e-4
    assert choose_rate({1e-2: 0.7, 1e-3: 0.7, 1e-4: 0.6}) == 1e-3
    assert choose_rate({1e-2: 0.7, 1e-3: float("nan")}) == 1e-2


# ---------------------------------------------------------------------------------------------- the family


def test_dry_run_prints_the_declared_family(capsys):
    driver.main(["--dry-run"])
    out = capsys.readouterr().out
    family = protocol.FAMILY
    noise_cells = 2 * 5  # TREC and tweets × 0, uniform and class-dependent at 20 and 40 %
    runs = len(family["arms"]) * len(family["lrs"]) * len(family["seeds"])
    assert len(family["arms"]) == 7 and family["lrs"] == [1e-4, 1e-3, 1e-2] and family["seeds"] == list(range(10))
    assert f"runs: {(noise_cells + 3) * runs} (label noise {noise_cells * runs}, unknown classes {3 * runs})" in out
    # each non-softmax arm × (the four 40 % cells' accuracy + the three fractions' AUROC)
    assert f"primary comparisons: {6 * (4 + 3)}," in out and out.count("  primary: ") == 42
    assert "hypothesis comparisons: 2," in out


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "two seeds or more"),
    (["--seeds", "0", "10"], r"seeds \[10\]; declared seeds"),
    (["--arms", "ovr", "softmax"], r"arms \['ovr'\]; declared arms: \['ovr_candidates'"),
    (["--lrs", "1e-3", "3e-2"], r"lrs \[0.03\]; declared lrs"),
    (["--cells", "trec uniform:0.3"], r"cells \['trec uniform:0.3'\]; declared cells"),
])
def test_anything_outside_the_family_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        driver.main(["--dry-run", *argv])
    assert __import__("re").search(message, capsys.readouterr().err)


def test_a_share_of_the_family_keeps_the_baseline_and_the_declared_order():
    share = protocol.restrict(arms=["gce", "ovr_alone"], seeds=[3, 1])
    assert share["arms"] == ["ovr_alone", "softmax", "gce"] and share["seeds"] == [1, 3]
    assert len(protocol.planned_runs(share)) == 13 * 3 * 3 * 2


# ---------------------------------------------------------------------------------------------- analysis


def _runs(family, values):
    """Synthetic runs: values[(cell, arm, seed)] = {lr: (validation, test metric)}."""
    runs = {}
    for (cell, arm, seed), by_lr in values.items():
        for lr, (validation, metric) in by_lr.items():
            test = ({"energy": {"auroc": metric, "fpr_at_95_tpr": 1 - metric, "open_set_macro_f1": metric},
                     "ovr_max_prob": {"auroc": metric + 1, "fpr_at_95_tpr": -metric, "open_set_macro_f1": 0}}
                    if protocol.protocol(cell) == "unknown" else
                    {"accuracy": metric, "accuracy_softmax_rule": metric, "ece": metric, "confidence_auroc": metric})
            runs[protocol.run_key(cell, arm, lr, seed)] = {"cell": cell, "arm": arm, "lr": lr, "seed": seed,
                                                           "validation": validation, "test": test, "seconds": 2.0}
    return runs


def test_each_seed_chooses_on_validation_and_the_comparison_is_paired_and_holm_adjusted():
    family = protocol.restrict(arms=["ovr_alone", "gce"], lrs=[1e-3, 1e-2], seeds=[0, 1, 2],
                               cells=["trec class:0.4", "trec known:0.5"])
    cell, known = "trec class:0.4", "trec known:0.5"
    # the test metric always prefers the rate validation did not pick: a choice on test would show
    arm = {0: (0.70, 0.60), 1: (0.75, 0.66), 2: (0.72, 0.61)}  # seed: (test at the validation's pick, at the other)
    soft = {0: 0.55, 1: 0.60, 2: 0.58}
    values = {}
    for seed in range(3):
        pick, other = (1e-3, 1e-2) if seed != 1 else (1e-2, 1e-3)
        values[cell, "ovr_alone", seed] = {pick: (0.5, arm[seed][0]), other: (0.4, arm[seed][0] + 0.2)}
        values[cell, "softmax", seed] = {1e-3: (0.5, soft[seed]), 1e-2: (0.5, soft[seed] + 0.3)}  # a tie: 1e-3
        values[cell, "gce", seed] = {1e-3: (0.5, soft[seed]), 1e-2: (0.1, 0.0)}
        for a in family["arms"]:
            values[known, a, seed] = {1e-3: (0.5, 0.7 + 0.01 * seed), 1e-2: (0.4, 0.0)}
    rows = {(r["cell"], r["arm"], r["metric"]): r for r in protocol.analyse(_runs(family, values), family)}
    row = rows[cell, "ovr_alone", "accuracy"]
    assert row["arm_lrs"] == [1e-3, 1e-2, 1e-3] and row["complete"]
    diffs = [arm[s][0] - soft[s] for s in range(3)]
    assert row["mean"] == pytest.approx(statistics.fmean(diffs))
    assert row["se"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(3))
    assert row["p"] == pytest.approx(t_two_sided_p(row["mean"] / row["se"], 2))
    primary = [r for r in rows.values() if r["family"] == "primary"]
    # primary here: two arms' accuracy at class:0.4, two arms' AUROC at 50 % known
    assert sorted((r["cell"], r["arm"], r["metric"]) for r in primary) == sorted(
        [(cell, "ovr_alone", "accuracy"), (cell, "gce", "accuracy"), (known, "ovr_alone", "auroc"),
         (known, "gce", "auroc")])
    assert [r["p_holm"] for r in primary] == pytest.approx(holm([r["p"] for r in primary]))
    assert rows[cell, "gce", "accuracy"]["mean"] == 0 and rows[cell, "gce", "accuracy"]["verdict"] == "tie"
    # the OvR arm's acceptance (its test scores 1 above the energy's, every seed) is ahead; its FPR lower: ahead too
    assert rows[known, "ovr_alone", "auroc"]["mean"] == pytest.approx(1.0)
    assert rows[known, "ovr_alone", "auroc"]["verdict"] == "ahead"
    assert rows[known, "ovr_alone", "fpr_at_95_tpr"]["verdict"] == "ahead"
    # GCE reads the energy score, like the softmax: the same numbers, a tie
    assert rows[known, "gce", "auroc"]["mean"] == 0
    # a seed missing one rate is left out, and the comparison is incomplete
    runs = _runs(family, values)
    del runs[protocol.run_key(cell, "ovr_alone", 1e-2, 2)]
    row = {(r["cell"], r["arm"], r["metric"]): r for r in protocol.analyse(runs, family)}[cell, "ovr_alone", "accuracy"]
    assert row["seeds"] == [0, 1] and row["verdict"] == "incomplete"
    text = protocol.report(runs, family)
    assert "incomplete" in text and "## Label noise" in text and "## Unknown classes" in text


# ---------------------------------------------------------------------------------------------- the driver


def test_each_seed_splits_the_pool_its_own_way():
    labels = torch.tensor([0] * 40 + [1] * 25 + [2] * 12)
    splits = {seed: driver.seed_split(labels, seed) for seed in range(3)}
    share = 1000 / 1538
    for train, validation in splits.values():
        assert sorted(train + validation) == list(range(len(labels))) and not set(train) & set(validation)
        for k, n in ((0, 40), (1, 25), (2, 12)):
            assert sum(labels[i] == k for i in train) == round(share * n)
    assert splits[0] != splits[1] != splits[2] and driver.seed_split(labels, 1) == splits[1]


@pytest.fixture(scope="module")
def stand_in(tied_base):
    from test_evidence import LABEL_IDS, _tiny_features

    from causalqwen_adapter.classification import LabelSet

    base = Qwen2ForCausalLM.from_pretrained(tied_base, dtype=torch.float32).eval()
    data = {"pool": _tiny_features(base, 40, 3, 6, 0), "test": _tiny_features(base, 24, 3, 6, 1),
            "labels": LabelSet([" a", " b", " c"], LABEL_IDS),
            "fine": LabelSet([f" f{i}" for i in range(6)], [60 + i for i in range(6)])}
    return base, data


def test_the_family_runs_resumes_and_never_chooses_on_the_test_split(stand_in, tmp_path):
    from causalqwen_adapter.trainer import CausalSFTConfig

    from conftest import TINY_VOCAB

    base, data = stand_in
    family = {**protocol.restrict(arms=["ovr_alone_absolute_logistic"], lrs=[1e-3, 1e-2], seeds=[0, 1],
                                  cells=["trec class:0.4", "trec known:0.5"]), "steps": 2, "batch_rows": 4}
    defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    trained = []

    def counting(*args, **kwargs):
        trained.append(args[1])
        return driver.evidence.train_arm(*args, **kwargs)

    out = tmp_path / "runs.json"
    planned = protocol.planned_runs(family)
    first = driver.run_family(family, {"trec": data}, base, TINY_VOCAB - 1, defaults, out, planned=planned[:5],
                              log=lambda _: None, train=counting)
    assert len(first) == len(trained) == 5
    runs = driver.run_family(family, {"trec": data}, base, TINY_VOCAB - 1, defaults, out, log=lambda _: None,
                             train=counting)
    assert len(trained) == len(planned) == 2 * 2 * 2 * 2  # the five already in the file were not trained again
    assert set(runs) == {protocol.run_key(*r) for r in planned} and driver.load(out, family) == runs
    for run in runs.values():
        assert 0 <= run["validation"] <= 1 and run["seconds"] > 0
        if protocol.protocol(run["cell"]) == "noise":
            assert set(run["test"]) == set(protocol.NOISE_METRICS) and 0 <= run["test"]["ece"] <= 1
        else:
            read = run["test"][protocol.rejection_score(run["arm"])]
            assert read.keys() == protocol.UNKNOWN_METRICS.keys() | {"threshold"}  # the threshold: raw JSON only
            assert len(run["known"]) == 3
    text = driver.write_report(out, family, runs, {"commit": "test"})
    assert out.with_suffix(".md").read_text() == text and "Runs: 16 of 16 planned." in text
    with pytest.raises(ValueError, match="another family"):
        driver.load(out, {**family, "steps": 3})

    # the same family with the test split replaced by other rows and shuffled labels: every run's validation score,
    # hence every rate chosen, is unchanged; the test metrics are not
    generator = torch.Generator().manual_seed(9)
    other = {key: value[torch.randperm(len(value), generator=generator)] for key, value in
             driver.evidence.extract(base.model, [[7, 8, 9, k] for k in range(1, 25)], None).items()}
    swapped = {**data, "test": {**other, "label": data["test"]["label"].flip(0), "fine": data["test"]["fine"].flip(0)}}
    again = driver.run_family(family, {"trec": swapped}, base, TINY_VOCAB - 1, defaults, tmp_path / "swapped.json",
                              log=lambda _: None)
    assert {k: r["validation"] for k, r in again.items()} == {k: r["validation"] for k, r in runs.items()}
    chosen = lambda rs: {k: {s: r["lr"] for s, r in v.items()} for k, v in protocol.chosen_runs(rs, family).items()}  # noqa: E731
    assert chosen(again) == chosen(runs)
    assert any(again[k]["test"] != runs[k]["test"] for k in runs)
    # two processes' shares merge; a run with two results is refused
    assert driver.merge([out, out], family) == runs
    with pytest.raises(ValueError, match="two results"):
        driver.merge([out, tmp_path / "swapped.json"], family)


def test_features_are_kept_split_by_split(tmp_path, monkeypatch):
    """A process stopped in the test split keeps the pool's features: the same call extracts only the test split."""
    from types import SimpleNamespace

    rows = [{"text": f"row {n}", "label": n % 2} for n in range(6)]
    data = {"name": "tweets", "prompt": "{text}", "splits": {"train": rows[:3], "validation": rows[3:5],
                                                               "test": rows[5:]}}
    extracted = []

    def extract(model, prompts, ids):
        extracted.append(len(prompts))
        if len(extracted) == 2 and fail:
            raise KeyboardInterrupt  # stopped in the test split
        return {"z": torch.full((len(prompts), 2), float(len(extracted)))}

    monkeypatch.setattr(driver.evidence, "row_tokens", lambda tokenizer, text, ids: [1, 2])
    monkeypatch.setattr(driver.evidence, "extract", extract)
    monkeypatch.setattr(protocol, "FAMILY", {**protocol.FAMILY, "pool": {"train": 3, "validation": 2}, "test": 1})
    args, labels = SimpleNamespace(cache=str(tmp_path)), SimpleNamespace(token_ids=[5, 6])
    fail = True
    with pytest.raises(KeyboardInterrupt):
        driver.pool_features(args, SimpleNamespace(model=None), data, labels, None)
    assert [p.name for p in tmp_path.iterdir()] == ["preregistered-tweets-3-2-1.partial.pt"]
    fail = False
    features = driver.pool_features(args, SimpleNamespace(model=None), data, labels, None)
    assert extracted == [5, 1, 1]  # the pool once, the test split again
    assert [p.name for p in tmp_path.iterdir()] == ["preregistered-tweets-3-2-1.pt"]
    assert features["pool"]["z"].eq(1).all() and features["test"]["z"].eq(3).all()
    assert features["pool"]["label"].tolist() == [0, 1, 0, 1, 0] and features["test"]["label"].tolist() == [1]
    assert driver.pool_features(args, SimpleNamespace(model=None), data, labels, None).keys() == {"pool", "test"} and len(extracted) == 3
