"""The evidence bench's pieces (bench/evidence.py, bench/evidence_data.py): cached features, the recipe's loss on them,
the losses written there, label noise and splits, each against a direct computation."""

import sys
from collections import Counter

import pytest
import torch
from transformers import Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM

from conftest import REPO_ROOT, TINY_VOCAB

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence  # noqa: E402
from evidence_data import inject_noise, stratified_split  # noqa: E402

LABEL_IDS = [5, 17, 42]
EOS = TINY_VOCAB - 1
PROMPTS = [[3, 9, 11, 4], [7, 2], [8, 8, 30, 31, 32, 6, 1]]


@pytest.fixture(scope="module")
def base(tied_base):
    return Qwen2ForCausalLM.from_pretrained(tied_base, dtype=torch.float32).eval()


def _moved(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in (model.abduction.scale.weight, model.abduction.loc.weight, model.action.bias, model.action.weight):
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
        model.abduction.scale.bias.fill_(-2.0)
        model.action.b_noise.uniform_(0.05, 0.3, generator=generator)
    return model


def test_cached_features_are_the_backbones_states(base):
    features = evidence.extract(base.model, PROMPTS, [LABEL_IDS] * len(PROMPTS))
    for n, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            alone = base.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
            torch.testing.assert_close(features["z"][n], alone, rtol=1e-5, atol=1e-5)
            for k, label in enumerate(LABEL_IDS):
                after = base.model(input_ids=torch.tensor([prompt + [label]])).last_hidden_state[0, -1]
                torch.testing.assert_close(features["z_label"][n, k], after, rtol=1e-5, atol=1e-5)
    assert "z_label" not in evidence.extract(base.model, PROMPTS, None)


@pytest.mark.parametrize("heads", [{}, {"objective": "softmax"}, {"ovr_trains_location": True}])
def test_cached_loss_is_the_recipes_loss(base, heads):
    """heads_loss on the cached targets equals forward(labels=...) on prompt + label + EOS with the prompt masked,
    the loss the SFT trainer computes, over a batch of rows."""
    model = _moved(CausalQwenForCausalLM.from_base(base, **heads))
    features = evidence.extract(base.model, PROMPTS, [LABEL_IDS] * len(PROMPTS))
    noisy = [2, 0, 1]
    rows = torch.tensor([2, 0, 1])
    z, targets = evidence.training_targets(features, noisy, rows, LABEL_IDS, EOS)
    cached = model.heads_loss(z, targets).loss
    total, count = 0.0, 0
    for n in rows.tolist():
        ids = PROMPTS[n] + [LABEL_IDS[noisy[n]], EOS]
        labels = [-100] * len(PROMPTS[n]) + ids[len(PROMPTS[n]):]
        out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
        total, count = total + out.loss * 2, count + 2  # two targets per row
    torch.testing.assert_close(cached, total / count, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads", [{}, {"ovr_trains_location": True}, {"ovr_relative_threshold": False, "ovr_threshold_init": 0.5},
                                   evidence.CANDIDATES, evidence.ALONE, {**evidence.ALONE, "learnable_threshold": True}])
def test_link_loss_with_the_cauchy_link_is_the_packages(base, heads):
    """The bench's OvR loss on [N, V] tensors, Cauchy link: the package's heads_loss over the vocabulary or over each
    position's candidates, value and every gradient."""
    heads = {"ovr_candidates": None, **heads}
    reference = _moved(CausalQwenForCausalLM.from_base(base, **heads))
    written = _moved(CausalQwenForCausalLM.from_base(base, **heads))
    z = torch.randn(6, base.config.hidden_size, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([5, 17, 42, EOS, 3, 5])
    expected = reference.heads_loss(z, targets).loss
    loss = evidence.link_ovr_loss(written, z, targets, "cauchy")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    expected.backward()
    loss.backward()
    for (name, p), q in zip(reference.named_parameters(), written.parameters()):
        if p.grad is None:
            assert q.grad is None or q.grad.abs().max() == 0, name
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the logistic link: the same formula with σ, from a float64 loop over the vocabulary
    logistic = evidence.link_ovr_loss(written, z, targets, "logistic").item()
    with torch.no_grad():
        loc_U, scale_U = written.abduction(z)
        W, b = written.action.weight.double(), written.action.bias.double()
        loc = loc_U.double() @ W.T + b
        scale = (scale_U.double() + written.action.b_noise.double().abs()) @ W.abs().T
        ref = loc - loc.logsumexp(-1, keepdim=True) if written.config.ovr_relative_threshold else loc
        x = (ref - written.ovr.threshold.double()) / scale
        k = written.config.ovr_candidates
        total = 0.0
        for n, y in enumerate(targets.tolist()):
            P = torch.sigmoid(x[n])
            negatives = range(len(P)) if k is None else loc[n].topk(k).indices.tolist()
            ovr = -P[y].log() - sum((1 - P[j]).log() for j in negatives if j != y)
            total += (ovr - written.config.softmax_loss_weight * torch.log_softmax(loc[n], 0)[y]).item()
    assert logistic == pytest.approx(total / len(targets), rel=1e-4)


@pytest.mark.parametrize("arm", ["ovr_alone", "ovr_alone_logistic", "ovr_alone_absolute", "ovr_alone_absolute_logistic",
                                 "softmax"])
def test_head_outputs_are_the_label_probabilities_summaries(base, arm):
    """P_k over the labels from its definition in float64 (the link's CDF of the standardised location, relative to
    the log-partition except in the absolute arm), then the picked label's median P and scale, the share with no P
    above ½ and the median Σ_k P_k."""
    from causalqwen_adapter.classification import LabelSet

    model = _moved(CausalQwenForCausalLM.from_base(base, **evidence.ARMS[arm]["heads"]))
    labels = LabelSet([" a", " b", " c"], LABEL_IDS)
    z = torch.randn(9, base.config.hidden_size, generator=torch.Generator().manual_seed(3))
    out = evidence.head_outputs(model, arm, z, labels)
    if arm == "softmax":
        assert out is None
        return
    with torch.no_grad():
        _, _, loc_S, scale_S = model.causal_heads(z, "standard", model.config.causal_temperature)
    loc, scale = loc_S.double(), scale_S.double()
    reference = 0.0 if arm.startswith("ovr_alone_absolute") else loc.logsumexp(-1, keepdim=True)
    x = (loc - reference - model.ovr.threshold.double()) / scale
    P = torch.sigmoid(x) if arm.endswith("_logistic") else 0.5 + torch.atan(x) / torch.pi
    P, scale = P[:, LABEL_IDS], scale[:, LABEL_IDS]
    top, pick = P.max(-1)
    assert out["picked_prob"] == pytest.approx(top.median().item(), rel=1e-5)
    assert out["none_accepted"] == (top <= 0.5).double().mean().item()
    assert out["label_prob_sum"] == pytest.approx(P.sum(-1).median().item(), rel=1e-5)
    assert out["picked_scale"] == pytest.approx(scale.gather(1, pick[:, None]).median().item(), rel=1e-5)


@pytest.mark.parametrize("arm", ["ovr_candidates", "ovr_candidates_slow_scale"])
def test_first_step_moves_the_scale_path_by_its_rate(base, arm):
    """AdamW's first step moves each weight with a gradient by its group's rate: the scale path (W_scale from 0) by
    learning_rate, or by location_lr_ratio × learning_rate in the slow-scale arm, as W_loc moves."""
    from causalqwen_adapter.classification import LabelSet
    from causalqwen_adapter.trainer import CausalSFTConfig

    generator = torch.Generator().manual_seed(4)
    H = base.config.hidden_size
    features = {"z": torch.randn(6, H, generator=generator), "z_label": torch.randn(6, 3, H, generator=generator)}
    defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    lr, seen = 1e-2, []
    model = evidence.train_arm(base, arm, features, torch.arange(6), [0, 1, 2, 0, 1, 2], LabelSet([" a", " b", " c"],
                               LABEL_IDS), EOS, lr, 1, 4, 0, defaults,
                               on_step=lambda step, m, loss: seen.append((step, m.abduction.scale.weight.grad.norm())))
    assert len(seen) == 1 and seen[0][0] == 0 and seen[0][1] > 0  # after the step, its gradient in place
    scale_step = model.abduction.scale.weight.abs().max().item()
    loc_step = (model.abduction.loc.weight - torch.eye(H)).abs().max().item()
    assert loc_step == pytest.approx(defaults.location_lr_ratio * lr, rel=1e-3)
    expected = defaults.location_lr_ratio * lr if arm == "ovr_candidates_slow_scale" else lr
    assert scale_step == pytest.approx(expected, rel=1e-3)


def test_absolute_arms_calibrate_their_threshold_on_the_training_rows(base):
    """Fresh heads with absolute thresholds start at the C where their standard-mode argmax best agrees with the
    base's on the training rows' prompts (as the trainer calibrates), not at the config's default."""
    from causalqwen_adapter.classification import LabelSet
    from causalqwen_adapter.trainer import CausalSFTConfig
    from causalqwen_adapter.training import calibrate_threshold_on_features

    generator = torch.Generator().manual_seed(5)
    H = base.config.hidden_size
    features = {"z": 3 * torch.randn(8, H, generator=generator), "z_label": torch.randn(8, 3, H, generator=generator)}
    defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    rows = torch.tensor([1, 4, 6])
    model = evidence.train_arm(base, "ovr_alone_absolute", features, rows, [0, 1, 2] * 3, LabelSet([" a", " b", " c"],
                               LABEL_IDS), EOS, 0.0, 1, 2, 0, defaults)  # rate 0: the threshold stays where it began
    fresh = CausalQwenForCausalLM.from_base(base, **evidence.ARMS["ovr_alone_absolute"]["heads"])
    default = fresh.ovr.threshold.clone()
    expected = calibrate_threshold_on_features(fresh, features["z"][rows])
    assert not model.config.ovr_relative_threshold
    assert model.ovr.threshold.unique().tolist() == pytest.approx([expected])
    assert expected != pytest.approx(default.unique().item())


def test_gce_loss_matches_its_formula(base):
    model = _moved(CausalQwenForCausalLM.from_base(base, objective="softmax"))
    z = torch.randn(4, base.config.hidden_size, generator=torch.Generator().manual_seed(2))
    targets = torch.tensor([5, 17, 42, EOS])
    with torch.no_grad():
        loc = model.abduction(z)[0].double() @ model.action.weight.double().T + model.action.bias.double()
        p = torch.softmax(loc, -1)[torch.arange(4), targets]
    assert evidence.gce_loss(model, z, targets).item() == pytest.approx(((1 - p**0.7) / 0.7).mean().item(), rel=1e-5)


@pytest.mark.parametrize("kind", ["uniform", "class"])
def test_noise_flips_exactly_the_rate(kind):
    labels = [i % 4 for i in range(203)]
    noisy, flipped = inject_noise(labels, 4, 0.4, kind, seed=3)
    assert sum(flipped) == round(0.4 * 203)
    for y, z, f in zip(labels, noisy, flipped):
        assert (z != y) == f
        if f and kind == "class":
            assert z == (y + 1) % 4
    if kind == "uniform":  # every wrong class is drawn
        assert len(Counter((y, z) for y, z, f in zip(labels, noisy, flipped) if f)) == 12
    assert inject_noise(labels, 4, 0.4, kind, seed=3) == (noisy, flipped)
    assert inject_noise(labels, 4, 0.4, kind, seed=4) != (noisy, flipped)
    with pytest.raises(ValueError, match="noise kind 'pair'"):
        inject_noise(labels, 4, 0.4, "pair", seed=0)
    with pytest.raises(ValueError, match="two classes or more"):
        inject_noise([0, 0], 1, 0.2, kind, seed=0)


def test_stratified_split_keeps_every_row_once():
    rows = [{"id": i, "label": i % 3 if i < 90 else 0} for i in range(100)]
    splits = stratified_split(rows, "label", {"train": 0.7, "validation": 0.1, "test": 0.2}, seed=0)
    ids = [r["id"] for split in splits.values() for r in split]
    assert sorted(ids) == list(range(100))
    for label, n in Counter(r["label"] for r in rows).items():
        assert Counter(r["label"] for r in splits["train"])[label] == round(0.7 * n)
    assert stratified_split(rows, "label", {"a": 0.5, "b": 0.5}, seed=1) == stratified_split(rows, "label", {"a": 0.5, "b": 0.5}, seed=1)


def _tiny_features(base, n, classes, fine_count, seed):
    """Features of random prompts on the tiny base, as cached_features stores them (coarse labels, a fine label)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 100, (int(torch.randint(2, 6, (1,), generator=generator)),), generator=generator).tolist()
               for _ in range(n)]
    fine = torch.randint(0, fine_count, (n,), generator=generator)
    out = evidence.extract(base.model, prompts, [LABEL_IDS[:classes] + [60 + f] for f in fine.tolist()])
    return {**out, "label": fine % classes, "fine": fine}


def test_protocols_run_end_to_end_and_write_their_tables(base, tmp_path):
    """Both protocols on the tiny base: every arm trains, the tables have one row per arm and setting (per score),
    and accuracies, AUROCs and F1s are proportions."""
    from argparse import Namespace

    from causalqwen_adapter.classification import LabelSet
    from causalqwen_adapter.trainer import CausalSFTConfig

    features = {split: _tiny_features(base, n, 3, 6, seed) for seed, (split, n) in
                enumerate({"train": 24, "validation": 12, "test": 18}.items())}
    labels = LabelSet([" a", " b", " c"], LABEL_IDS)
    args = Namespace(arms=list(evidence.ARMS), seeds=[0, 1], lrs=[1e-3, 1e-2], steps=2, batch_rows=4, out=str(tmp_path),
                     task="tiny", quick=False, known=[0.5])
    defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    evidence.label_noise(args, [("none", 0.0), ("class", 0.4)], base, features, labels, EOS, defaults)
    results = __import__("json").loads((tmp_path / "label_noise-tiny.json").read_text())["results"]
    assert [(r["noise"], r["arm"]) for r in results] == [("none", "fresh heads")] + \
        [(k, a) for k in ("none", "class") for a in evidence.ARMS]
    for row in results[1:]:
        assert row["lr"] in (1e-3, 1e-2) and len(row["test_accuracy"]) == 2
        assert 0 <= row["softmax_mean"] <= 1 and ("ovr_mean" in row) == (row["arm"] not in ("softmax", "gce"))
        assert ("heads" in row) == ("ovr_mean" in row)  # the OvR heads' own outputs, per seed at the chosen rate
        # every run: both rates at the first seed, the chosen one after; the row's accuracies are its chosen runs'
        assert [(r["seed"], r["lr"]) for r in row["runs"]] == [(0, 1e-3), (0, 1e-2), (1, row["lr"])]
        assert [r["test_accuracy"] for r in row["runs"] if r["lr"] == row["lr"]] == row["test_accuracy"]
        for heads in row.get("heads", []):
            assert 0 <= heads["picked_prob"] <= 1 and 0 <= heads["none_accepted"] <= 1 and heads["picked_scale"] > 0
    assert (tmp_path / "label_noise-tiny.md").read_text().count("\n") == 2 + len(results)

    fine = LabelSet([f" f{i}" for i in range(6)], [60 + i for i in range(6)])
    args.arms = ["ovr", "softmax"]
    evidence.unknown_classes(args, base, features, fine, 3, EOS, defaults)
    results = __import__("json").loads((tmp_path / "unknown_classes-tiny.json").read_text())["results"]
    assert {r["score"] for r in results if r["arm"] == "ovr"} == {"ovr_max_prob", "softmax_label_max", "softmax_vocab_top",
                                                                  "softmax_vocab_label_mass", "energy", "max_logit"}
    assert "ovr_max_prob" not in {r["score"] for r in results if r["arm"] == "softmax"}
    for row in results:
        assert 0 <= row["auroc"] <= 1 and 0 <= row["fpr_at_95_tpr"] <= 1 and 0 <= row["open_set_macro_f1"] <= 1
        assert len(row["per_seed"]) == 2 and row["auroc"] == pytest.approx(  # each seed's scores, for pairing
            sum(s["auroc"] for s in row["per_seed"]) / 2)
