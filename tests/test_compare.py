"""`causalqwen compare` (causalqwen_adapter/cli/compare.py, causalqwen_adapter/comparison/) on a tiny random base with
a word-level tokenizer: the table against a direct computation of the paired tests, the same numbers as the bench's
path, the feature cache reused and never mistaken for another's, the reused heads equal to fresh ones, and every bad
input refused before any training."""

import json
import math
import random
import shutil
import statistics
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from causalqwen_adapter.classification import LabelSet
from causalqwen_adapter.cli import compare
from causalqwen_adapter.comparison import runs as runs_module
from causalqwen_adapter.comparison.metrics import noise_metrics
from causalqwen_adapter.comparison.plots import PLOT_FILES, draw
from causalqwen_adapter.comparison.runs import Protocol, run_comparison, seed_data
from causalqwen_adapter.comparison.training import FreshHeads, RecipeRates, train_arm
from causalqwen_adapter.comparison.verdicts import paired_table

from conftest import REPO_ROOT, build_tiny_base_with_tokenizer

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence_preregistered as driver  # noqa: E402
import evidence_protocol as bench_protocol  # noqa: E402

import evidence  # noqa: E402

WORDS = ["what", "is", "two", "plus", "hello", "how", "are", "you", "the", "sky", "a", "dog", "cat", "sat", "on", "park"]
LABELS = [" blue", " mat", " four"]


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    return build_tiny_base_with_tokenizer(tmp_path_factory.mktemp("compare-base"))


@pytest.fixture(scope="module")
def tokenizer_dir(base_folder, tmp_path_factory):
    """The tiny base's tokenizer alone (beside the base's config.json transformers loads a Qwen2Tokenizer that maps
    these words to nothing: tests/test_classify.py)."""
    folder = tmp_path_factory.mktemp("compare-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base_folder / name, folder / name)
    return str(folder)


def write_rows(path, labels=LABELS, n=60, seed=0):
    rng = random.Random(seed)
    rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))), "completion": labels[i % len(labels)]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def argv(base, data, out, *extra, tokenizer=None):
    return ["--model_name_or_path", str(base), "--tokenizer", tokenizer, "--dataset_name", str(data), "--output_dir", str(out),
            "--arms", "ovr_candidates", "softmax", "--lrs", "1e-3", "1e-2", "--seeds", "0", "1", "2",
            "--max_steps", "3", "--per_device_train_batch_size", "4", "--threads", "1", *extra]


def test_the_table_is_the_paired_tests_of_the_chosen_runs(base_folder, tokenizer_dir, tmp_path, capsys):
    """Each seed keeps its best validation rate (ties to the smaller); the table's means, differences, s.e., p and
    Holm-adjusted p are recomputed here from the runs; a second run reads the cache and gives the same numbers."""
    data = write_rows(tmp_path / "rows.jsonl")
    out = compare.main(argv(base_folder, data, tmp_path / "out", "--noise", "class:0.4", tokenizer=tokenizer_dir))
    assert "extracted" in capsys.readouterr().out
    runs = out["runs"]
    assert len(runs) == 2 * 2 * 3 and {r["steps"] for r in runs} == {3}
    chosen = {}
    for arm in ("ovr_candidates", "softmax"):
        for seed in (0, 1, 2):
            mine = {r["lr"]: r for r in runs if r["arm"] == arm and r["seed"] == seed}
            best = max(mine.values(), key=lambda r: (r["validation"], -r["lr"]))
            chosen[arm, seed] = best["test"]
            assert out["chosen"][arm][seed] == best["lr"]
    table = out["table"]
    assert {(r["arm"], r["metric"]) for r in table} == {("ovr_candidates", m) for m in ("accuracy", "macro_f1", "ece")}
    pvalues = []
    for row in table:
        diffs = [chosen["ovr_candidates", s][row["metric"]] - chosen["softmax", s][row["metric"]] for s in (0, 1, 2)]
        mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(3)
        assert row["mean"] == pytest.approx(mean, abs=1e-12) and row["se"] == pytest.approx(se, abs=1e-12)
        if se > 0:  # df 2: P(|T| ≥ t) = 1 − t / √(t² + 2)
            t = abs(mean / se)
            assert row["p"] == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)
        pvalues.append(row["p"])
        assert row["arm_mean"] == pytest.approx(statistics.fmean(chosen["ovr_candidates", s][row["metric"]] for s in (0, 1, 2)))
    order = sorted(range(3), key=lambda i: pvalues[i])  # Holm by hand, m = 3
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (3 - rank) * pvalues[i]))
        assert table[i]["p_holm"] == pytest.approx(running)
        better_if_higher = table[i]["metric"] != "ece"
        expected = "tie" if running > 0.05 else "ahead" if (table[i]["mean"] > 0) == better_if_higher else "behind"
        assert table[i]["verdict"] == expected
    text = (tmp_path / "out" / "comparison.md").read_text()
    assert "| accuracy (higher is better) | ovr_candidates |" in text and "Holm-adjusted over the 3 comparisons" in text

    again = compare.main(argv(base_folder, data, tmp_path / "out", "--noise", "class:0.4", "--overwrite",
                              tokenizer=tokenizer_dir))
    assert "read from" in capsys.readouterr().out
    assert [r["test"] for r in again["runs"]] == [r["test"] for r in runs]


def test_held_out_classes_add_the_open_set_metrics(base_folder, tokenizer_dir, tmp_path):
    labels = [" blue", " mat", " four", " friends"]
    data = write_rows(tmp_path / "rows.jsonl", labels, n=80)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        out = compare.main(argv(base_folder, data, tmp_path / "out", "--unknown_fraction", "0.25",
                                tokenizer=tokenizer_dir))
        assert torch.get_num_threads() == 3  # --threads 1 held for the command only, not the caller's process
    finally:
        torch.set_num_threads(threads)
    assert {r["metric"] for r in out["table"]} == {"accuracy", "macro_f1", "ece", "auroc", "fpr_at_95_tpr",
                                                   "open_set_macro_f1"}
    for seed, known in out["known"].items():
        assert len(known) == 3 and set(known) < set(labels)
    for run in out["runs"]:
        assert run["test"]["rejection_score"] == ("ovr_max_prob" if run["arm"] == "ovr_candidates" else "energy")
        assert 0 <= run["test"]["auroc"] <= 1 and 0 <= run["test"]["open_set_macro_f1"] <= 1
    # the plots, beside the JSON: one panel per metric of the table, the open-set ones included
    assert all((tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG" for name in PLOT_FILES)
    saved = json.loads((tmp_path / "out" / "comparison.json").read_text())
    assert [ax.get_title().split(" (")[0] for ax in draw(saved)["comparison_differences.png"].axes] == \
        ["accuracy", "macro_f1", "ece", "auroc", "fpr_at_95_tpr", "open_set_macro_f1"]


def _features(base, n=30, seed=0):
    generator = torch.Generator().manual_seed(seed)
    H = base.config.hidden_size
    return {"z": 3 * torch.randn(n, H, generator=generator), "z_label": torch.randn(n, 3, H, generator=generator),
            "label": torch.arange(n) % 3}


def test_reused_heads_train_to_the_same_weights_as_fresh_ones(base_folder):
    """FreshHeads puts the heads back where from_base starts them: every run of a sequence (two arms, an absolute arm
    whose threshold calibration moves the config) gives bit for bit the weights of heads built afresh."""
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    features, labels = _features(base), LabelSet([" a", " b", " c"], [10, 11, 12])
    y = features["label"].tolist()
    heads = FreshHeads(base)
    for arm, lr in [("ovr_alone_absolute", 1e-2), ("ovr_alone_absolute", 1e-3), ("softmax", 1e-2),
                    ("ovr_alone_absolute", 1e-2)]:
        reused = train_arm(base, arm, features, torch.arange(30), y, labels, 2, lr, 3, 4, 0, RecipeRates(), heads=heads)
        reused = {k: v.clone() for k, v in reused.state_dict().items()} | {"threshold": reused.ovr.threshold.clone()}
        fresh = train_arm(base, arm, features, torch.arange(30), y, labels, 2, lr, 3, 4, 0, RecipeRates())
        fresh = fresh.state_dict() | {"threshold": fresh.ovr.threshold}
        for name, value in fresh.items():
            assert torch.equal(reused[name], value), (arm, lr, name)


def test_compare_gives_the_benchs_numbers(base_folder):
    """Each run of compare (reused heads, one scoring of the test rows) equals the bench's path on the same rows:
    bench/evidence.py's train_arm from a fresh from_base, its accuracies on validation, bench/evidence_preregistered's
    noise_metrics on test; and compare's table of those runs is the pre-registered analysis's."""
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    features, labels = _features(base, n=45), LabelSet([" a", " b", " c"], [10, 11, 12])
    protocol = Protocol(arms=["ovr_alone_logistic", "softmax"], lrs=[1e-3, 1e-2], seeds=[0, 1], noise=("uniform", 0.2),
                        steps=3, batch_rows=4)
    lines = []
    out = run_comparison(base, features, labels, 2, protocol, log=lines.append)
    # a line per run, numbered, with the time left estimated from the runs so far
    assert [line.split("]")[0] for line in lines] == [f"[{i}/8" for i in range(1, 9)]
    assert all(" left)" in line for line in lines[:-1]) and " left" not in lines[-1]
    for run in out["runs"]:
        d = seed_data(features, labels, protocol, run["seed"])
        model = evidence.train_arm(base, run["arm"], d.features, d.train_rows, d.train_labels, d.labels, 2, run["lr"],
                                   3, 4, run["seed"], RecipeRates())
        validation = evidence.accuracies(model, run["arm"], features["z"][d.val_rows], d.val_target, d.labels)
        assert run["validation"] == validation["ovr" if "ovr" in validation else "softmax"]
        test = driver.noise_metrics(model, run["arm"], features["z"][d.test_rows], features["label"][d.test_rows],
                                    d.labels)
        assert {k: run["test"][k] for k in test} == pytest.approx(test, rel=1e-6, nan_ok=True)

    # the table: bench/evidence_protocol.py's analysis of the same runs (one cell, its four metrics one Holm family)
    cell = "tiny uniform:0.2"
    family = {**bench_protocol.FAMILY, "arms": protocol.arms, "lrs": protocol.lrs, "seeds": protocol.seeds,
              "cells": [cell]}
    runs = {bench_protocol.run_key(cell, r["arm"], r["lr"], r["seed"]): r for r in out["runs"]}
    bench_rows = {row["metric"]: row for row in bench_protocol.analyse(runs, family)}
    mine = paired_table(out["per_seed"], "softmax", list(bench_protocol.NOISE_METRICS), protocol.seeds)
    assert [row["metric"] for row in mine] == list(bench_rows)
    for row in mine:
        theirs = bench_rows[row["metric"]]
        for key in ("arm_mean", "baseline_mean", "mean", "se", "p", "p_holm", "verdict", "seeds"):
            assert row[key] == pytest.approx(theirs[key], nan_ok=True), (row["metric"], key)


def test_recipe_rates_are_the_trainers_defaults():
    from causalqwen_adapter.trainer import CausalSFTConfig

    defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    rates = RecipeRates()
    assert (rates.location_lr_ratio, rates.threshold_lr_ratio, rates.max_grad_norm) == \
        (defaults.location_lr_ratio, defaults.threshold_lr_ratio, defaults.max_grad_norm)


@pytest.mark.parametrize("case, extra, message", [
    ("one class", [], "has 1 label"),
    ("shared first token", [], "share their first token"),
    ("absent label", [], "absent from the tokenizer"),
    ("no known class", ["--unknown_fraction", "0.5"], "leaves 1 known"),
    ("one seed", ["--seeds", "0"], "two different seeds or more"),
    ("unknown arm", ["--arms", "ovr_candidates", "sofmax"], "unknown arm(s) 'sofmax'"),
    ("bad noise", ["--noise", "pair:0.2"], "noise setting 'pair:0.2'"),
    ("missing data file", [], "was not found"),
])
def test_bad_input_is_refused_before_any_training(base_folder, tokenizer_dir, tmp_path, monkeypatch, capsys, case, extra,
                                                  message):
    monkeypatch.setattr(runs_module, "train_arm", lambda *a, **k: pytest.fail("trained"))
    labels = {"one class": [" blue"], "shared first token": [" blue", " blue today", " mat"],
              "absent label": [" blue", " zebra", " mat"]}.get(case, LABELS)
    data = write_rows(tmp_path / "rows.jsonl", labels)
    args = argv(base_folder, data, tmp_path / "out", tokenizer=tokenizer_dir)
    for flag in ("--seeds", "--arms"):
        if flag in extra:  # the case's own values replace the defaults of argv
            i = args.index(flag)
            args[i : i + 1 + (3 if flag == "--seeds" else 2)] = []
    if case == "missing data file":
        args[args.index("--dataset_name") + 1] = str(tmp_path / "absent.jsonl")
    with pytest.raises(SystemExit) as error:  # argparse's usage error, no traceback
        compare.main(args + extra)
    assert error.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "comparison.json").exists() and not (tmp_path / "out" / "features").exists()


def test_a_cache_of_another_base_or_other_rows_is_refused(base_folder, tokenizer_dir, tmp_path, tmp_path_factory):
    data = write_rows(tmp_path / "rows.jsonl", n=30)
    cache = tmp_path / "cache"
    compare.main(argv(base_folder, data, tmp_path / "a", "--cache_dir", str(cache), "--max_steps", "1", "--lrs", "1e-3",
                      tokenizer=tokenizer_dir))
    other_rows = write_rows(tmp_path / "other.jsonl", n=30, seed=1)
    with pytest.raises(ValueError, match="another base or other data .*data_sha256"):
        compare.main(argv(base_folder, other_rows, tmp_path / "b", "--cache_dir", str(cache), tokenizer=tokenizer_dir))
    other_base = build_tiny_base_with_tokenizer(tmp_path_factory.mktemp("other-base"))
    with pytest.raises(ValueError, match="another base or other data .*base"):
        compare.main(argv(other_base, data, tmp_path / "c", "--cache_dir", str(cache), tokenizer=tokenizer_dir))
    out = compare.main(argv(other_base, data, tmp_path / "d", "--cache_dir", str(cache), "--rebuild_cache",
                            "--max_steps", "1", "--lrs", "1e-3", tokenizer=tokenizer_dir))
    assert len(out["runs"]) == 6


def _naive_open_set(log_P_test, pred_test, log_P_val, fine_test, known, coverage=0.95):
    """AUROC, FPR at 95 % TPR, threshold and open-set macro-F1 by loops over Python floats (log P in float64 ranks as
    P does, without underflow)."""
    is_known = [f in known for f in fine_test]
    pos = [s for s, k in zip(log_P_test, is_known) if k]
    neg = [s for s, k in zip(log_P_test, is_known) if not k]
    pairs = [(a > b) + 0.5 * (a == b) for a in pos for b in neg]
    t95 = sorted(pos)[math.floor(0.05 * len(pos))]
    threshold = sorted(log_P_val)[math.floor((1 - coverage) * len(log_P_val))]
    pred = [p if s >= threshold else -1 for p, s in zip(pred_test, log_P_test)]
    target = [known.index(f) if f in known else -1 for f in fine_test]
    f1 = []
    for k in sorted(set(pred) | set(target)):
        tp = sum(p == k and t == k for p, t in zip(pred, target))
        f1.append(2 * tp / (2 * tp + sum(p == k and t != k for p, t in zip(pred, target))
                            + sum(p != k and t == k for p, t in zip(pred, target))))
    return {"auroc": sum(pairs) / len(pairs), "fpr_at_95_tpr": sum(b >= t95 for b in neg) / len(neg),
            "threshold": math.exp(threshold), "open_set_macro_f1": sum(f1) / len(f1)}


@pytest.mark.parametrize("arm, lr", [("ovr_alone_logistic", 1e-3), ("ovr_alone_absolute_logistic", 1e-2)])
def test_open_set_reads_a_logistic_arm_under_its_own_link(base_folder, arm, lr):
    """The OvR acceptance max_k P_k of a logistic arm, on test and validation rows, is max_k σ(x_k): its AUROC, FPR at
    95 % TPR, threshold and open-set macro-F1 equal a naive float64 computation from σ(x). At 1e-3 this arm leaves x
    ≈ −700 on every row, where float32's σ is 0: read through P the AUROC would be ½; read through the Cauchy CDF the
    threshold would be ≈ 1/(π|x|), not σ(x)."""
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    H, n, known = base.config.hidden_size, 80, [0, 1, 2]
    features = {"z": 3 * torch.randn(n, H, generator=generator), "z_label": torch.randn(n, 3, H, generator=generator)}
    fine = torch.arange(n) % 4  # class 3 never trained: the unknown one
    labels = LabelSet([" a", " b", " c"], [10, 11, 12])
    rows = torch.tensor([r for r in range(40) if fine[r] in known])
    model = train_arm(base, arm, features, rows, [f % 3 for f in fine.tolist()], labels, 2, lr, 8, 4, 0, RecipeRates())
    test, val = torch.arange(40, 80), torch.arange(0, 40)
    got = evidence.open_set(model, arm, features["z"][test], fine[test], known, features["z"][val], fine[val],
                            labels)["ovr_max_prob"]

    def log_sigmoid(x):  # log σ(x) in float64, written for both signs without overflow
        return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))

    with torch.no_grad():
        _, _, loc_S, scale_S = model.causal_heads(features["z"], "standard", model.config.causal_temperature)
        x = model.ovr(loc_S, scale_S)[:, labels.token_ids].double()
    log_P = [max(log_sigmoid(v) for v in row) for row in x.tolist()]
    pred = [max(range(3), key=lambda k: row[k]) for row in x.tolist()]
    expected = _naive_open_set([log_P[r] for r in test], [pred[r] for r in test],
                               [log_P[r] for r in val if fine[r] in known], fine[test].tolist(), known)
    # compare scores x at the label columns alone (`label_heads`), which rounds x differently in float32 from the whole
    # forward above (|Δx| ≈ 1e-6 at |x| ≈ 20): the threshold σ(x) carries that as a relative error e^|Δx| − 1
    assert got == pytest.approx(expected, rel=2e-5, abs=1e-300)
    if lr == 1e-3:
        assert max(log_P) < -104  # σ(x) is 0 in float32 on every row: the case P itself could not rank


@pytest.mark.parametrize("arm, lr", [("ovr_alone_logistic", 1e-3), ("ovr_alone", 1e-3)])
def test_noise_metrics_read_the_ovr_confidence_from_x(base_folder, arm, lr):
    """The own rule's confidence max_k P_k of an OvR arm: its ECE and its AUROC (right top-1 against wrong) equal a
    naive float64 computation from x, P = F(x) under the arm's link. The logistic arm at 1e-3 leaves x ≈ −700, where
    float32's σ is 0 on every row: read through a float32 P the AUROC was ½."""
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    H, n = base.config.hidden_size, 60
    features = {"z": 3 * torch.randn(n, H, generator=generator), "z_label": torch.randn(n, 3, H, generator=generator)}
    y = (torch.arange(n) % 3).tolist()
    labels = LabelSet([" a", " b", " c"], [10, 11, 12])
    model = train_arm(base, arm, features, torch.arange(30), y, labels, 2, lr, 8, 4, 0, RecipeRates())
    test = torch.arange(30, 60)
    target = torch.tensor(y)[test].roll(1)  # targets some rows' top-1 hits and others miss
    got = noise_metrics(model, arm, features["z"][test], target, labels)

    def link(v):  # F(x) in float64: σ, or the Cauchy CDF ½ + atan(x)/π
        if arm.endswith("logistic"):
            return 1 / (1 + math.exp(-v)) if v >= 0 else math.exp(v) / (1 + math.exp(v))
        return 0.5 + math.atan(v) / math.pi

    with torch.no_grad():
        _, _, loc_S, scale_S = model.causal_heads(features["z"][test], "standard", model.config.causal_temperature)
        x = model.ovr(loc_S, scale_S)[:, labels.token_ids].double().tolist()
    top = [max(row) for row in x]
    right = [max(range(3), key=lambda k: row[k]) == t for row, t in zip(x, target.tolist())]
    assert 0 < sum(right) < len(right)
    pos = [s for s, r in zip(top, right) if r]
    neg = [s for s, r in zip(top, right) if not r]
    auroc = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))
    bins = {}
    for s, r in zip(top, right):
        p = link(s)
        bins.setdefault(min(int(p * 15), 14), []).append((p, r))
    ece = sum(abs(sum(p for p, _ in b) - sum(r for _, r in b)) for b in bins.values()) / len(top)
    assert got["accuracy"] == pytest.approx(sum(right) / len(right))
    assert got["confidence_auroc"] == pytest.approx(auroc)
    assert got["ece"] == pytest.approx(ece, rel=1e-5, abs=1e-12)
    if arm.endswith("logistic"):
        assert max(top) < -104  # float32's σ(x) is 0 on every row
        assert auroc != 0.5
