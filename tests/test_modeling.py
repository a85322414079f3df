"""The heads' initialisation and forward against the base model and a float64 reference (docs/design.md)."""

import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenConfig, CausalQwenForCausalLM
from causalqwen_adapter.cauchy import softplus_inverse

from conftest import TINY_HIDDEN, TINY_VOCAB, save_tiny_qwen2


def test_softplus_inverse_is_exact():
    for gamma in (1e-3, 0.5, 1.0, 10.0, 50.0):
        b = softplus_inverse(gamma)
        assert F.softplus(torch.tensor(b, dtype=torch.float64)).item() == pytest.approx(gamma, rel=1e-12)
    with pytest.raises(ValueError):
        softplus_inverse(0.0)


def test_loc_S_equals_base_logits(tiny_base, input_ids):
    base = Qwen2ForCausalLM.from_pretrained(tiny_base).eval()
    model = CausalQwenForCausalLM.from_base(tiny_base).eval()
    with torch.no_grad():
        out = model(input_ids, inference_mode="compatible")
        expected = base(input_ids).logits
    assert (out.loc_S - expected).abs().max().item() <= 1e-5
    assert torch.equal(out.logits, out.loc_S)  # compatible mode: logits are loc_S


def test_fresh_heads_follow_the_seed_initialisation(tiny_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tiny_base, gamma_init=3.0, b_noise_init=0.25)
    base = Qwen2ForCausalLM.from_pretrained(tiny_base)
    assert torch.equal(model.abduction.loc.weight, torch.eye(TINY_HIDDEN))
    assert torch.count_nonzero(model.abduction.scale.weight) == 0
    assert torch.equal(model.action.weight, base.lm_head.weight)
    assert model.action.weight.data_ptr() != base.lm_head.weight.data_ptr()  # a copy, not the base tensor
    assert torch.count_nonzero(model.action.bias) == 0
    assert torch.all(model.action.b_noise == 0.25)
    with torch.no_grad():
        scale_U = model(input_ids).scale_U
    assert torch.allclose(scale_U, torch.full_like(scale_U, 3.0), rtol=1e-6)


def test_causal_size_different_from_hidden(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base, causal_size=12, ovr_threshold_init=0.0)
    assert model.abduction.loc.weight.shape == (12, TINY_HIDDEN)
    assert model.action.weight.shape == (TINY_VOCAB, 12)
    bound = math.sqrt(6 / (12 + TINY_HIDDEN))  # Xavier-uniform bound; W_scale is 0.1 × Xavier
    assert model.abduction.loc.weight.abs().max() <= bound
    assert model.abduction.scale.weight.abs().max() <= 0.1 * bound
    assert model.abduction.scale.weight.abs().max() > 0
    assert torch.count_nonzero(model.abduction.loc.bias) == 0
    with torch.no_grad():
        out = model(input_ids)
    assert out.loc_S.shape == (2, 9, TINY_VOCAB) and torch.isfinite(out.logits).all()


def test_causal_size_above_hidden_still_reproduces_base_logits(tied_base, input_ids):
    base = Qwen2ForCausalLM.from_pretrained(tied_base).eval()
    model = CausalQwenForCausalLM.from_base(tied_base, causal_size=2 * TINY_HIDDEN).eval()
    with torch.no_grad():
        diff = (model(input_ids, inference_mode="compatible").logits - base(input_ids).logits).abs().max()
    assert diff.item() <= 1e-5


def test_backbone_frozen_heads_trainable(tied_base):
    model = CausalQwenForCausalLM.from_base(tied_base)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(model.adapter_keys())
    assert all(not n.startswith("model.") for n in trainable)


def _reference_forward(model, input_ids, mode, temperature):
    """docs/design.md in float64, written out plainly."""
    z = model.model(input_ids).last_hidden_state.double()
    loc_U = z @ model.abduction.loc.weight.double().T + model.abduction.loc.bias.double()
    scale_U = F.softplus(z @ model.abduction.scale.weight.double().T + model.abduction.scale.bias.double())
    if mode == "standard":
        scale_U = scale_U + temperature * model.action.b_noise.double().abs()
    W, b = model.action.weight.double(), model.action.bias.double()
    loc_S = loc_U @ W.T + b
    scale_S = scale_U @ W.abs().T
    # relative thresholds are compared with the log-probability log softmax(loc_S)_k
    reference = torch.log_softmax(loc_S, -1) if model.config.ovr_relative_threshold else loc_S
    x = (reference - model.ovr.threshold.double()) / scale_S
    return loc_S, scale_S, torch.log(0.5 + torch.atan(x) / math.pi)


@pytest.mark.parametrize("relative,threshold", [(True, -4.0), (False, 0.5)])
@pytest.mark.parametrize("distribution", ["accept", "accept_once", "normalize"])
@pytest.mark.parametrize("mode,temperature", [("standard", 1.0), ("standard", 0.3), ("causal", 1.0)])
def test_ovr_logits_match_float64_reference(tied_base, input_ids, mode, temperature, distribution, relative,
                                            threshold):
    # scales of the order of the logits: the plain atan of the reference is exact there
    model = CausalQwenForCausalLM.from_base(tied_base, ovr_threshold_init=threshold, gamma_init=1.0, b_noise_init=0.1,
                                            ovr_distribution=distribution, ovr_relative_threshold=relative)
    with torch.no_grad():
        model.action.weight[0].normal_(std=0.05)  # the padding row is zero: see the degenerate-row test
        model.action.bias.normal_()
        model.abduction.scale.weight.normal_(std=0.1)
        out = model(input_ids, inference_mode=mode, causal_temperature=temperature)
        loc_S, scale_S, log_p = _reference_forward(model, input_ids, mode, temperature)
    torch.testing.assert_close(out.loc_S.double(), loc_S, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.scale_S.double(), scale_S, rtol=1e-5, atol=1e-5)
    if distribution == "accept_once":  # log r_k + log(1 − Σ_j r_j P_j + P_k), written out
        r, P = torch.softmax(loc_S, -1), log_p.exp()
        expected = r.log() + (1 - (r * P).sum(-1, keepdim=True) + P).log()
    else:
        expected = log_p if distribution == "normalize" else loc_S + log_p  # log P_k, or the accepted proposal
    torch.testing.assert_close(out.logits.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.ovr_log_probs(out.loc_S, out.scale_S).double(), log_p, rtol=1e-5, atol=1e-6)


def test_accept_distribution_is_rejection_sampling_of_the_compatible_model(tied_base, input_ids):
    """`accept`: softmax(logits) is the law of "draw from softmax(loc_S), keep the draw with probability P_k,
    else draw again" — checked against that procedure run by Monte Carlo."""
    model = CausalQwenForCausalLM.from_base(tied_base, ovr_threshold_init=0.0, gamma_init=0.5, b_noise_init=0.05,
                                            ovr_distribution="accept", ovr_relative_threshold=False)
    with torch.no_grad():
        model.action.weight.mul_(4.0)  # a proposal spread over many tokens; P_k between 0.25 and 0.86
        out = model(input_ids[:1, :4], inference_mode="standard")
    loc, P = out.loc_S[0, -1].double(), model.ovr_log_probs(out.loc_S, out.scale_S)[0, -1].double().exp()
    q = torch.softmax(out.logits[0, -1].double(), 0)
    assert (q - torch.softmax(loc, 0)).abs().max() > 0.05  # the acceptance matters
    g = torch.Generator().manual_seed(0)
    proposals = torch.multinomial(torch.softmax(loc, 0), 400_000, replacement=True, generator=g)
    kept = proposals[torch.rand(len(proposals), generator=g, dtype=torch.float64) < P[proposals]]
    empirical = torch.bincount(kept, minlength=len(loc)).double() / len(kept)
    torch.testing.assert_close(empirical, q, rtol=0, atol=0.005)  # Monte Carlo σ ≈ 0.001


def test_accept_once_is_one_veto_then_a_fresh_proposal(tied_base, input_ids):
    """`accept_once`: softmax(logits) is the law of "draw from softmax(loc_S), keep the draw with probability P_k,
    else draw once more from softmax(loc_S) and keep that" — checked against the procedure run by Monte Carlo."""
    model = CausalQwenForCausalLM.from_base(tied_base, ovr_threshold_init=0.0, gamma_init=0.5, b_noise_init=0.05,
                                            ovr_distribution="accept_once", ovr_relative_threshold=False)
    with torch.no_grad():
        model.action.weight.mul_(4.0)
        out = model(input_ids[:1, :4], inference_mode="standard")
    loc, P = out.loc_S[0, -1].double(), model.ovr_log_probs(out.loc_S, out.scale_S)[0, -1].double().exp()
    q = torch.softmax(out.logits[0, -1].double(), 0)
    torch.testing.assert_close(out.logits[0, -1].double().exp().sum(), torch.tensor(1.0, dtype=torch.float64))
    r = torch.softmax(loc, 0)
    assert (q - r).abs().max() > 0.02  # the veto matters
    g = torch.Generator().manual_seed(0)
    first = torch.multinomial(r, 400_000, replacement=True, generator=g)
    second = torch.multinomial(r, 400_000, replacement=True, generator=g)
    kept = torch.rand(len(first), generator=g, dtype=torch.float64) < P[first]
    drawn = torch.where(kept, first, second)
    empirical = torch.bincount(drawn, minlength=len(loc)).double() / len(drawn)
    torch.testing.assert_close(empirical, q, rtol=0, atol=0.005)  # Monte Carlo σ ≈ 0.001


@pytest.mark.parametrize("threshold", [math.log(0.5), math.log(1 / 3), math.log(0.05)])
def test_relative_threshold_accepts_exactly_the_tokens_above_e_to_the_c(tied_base, input_ids, threshold):
    """Relative thresholds: P_k > ½ exactly where softmax(loc_S)_k > e^C, so fewer than e^−C tokens per position —
    whatever the locations' per-position offset, which an absolute threshold would see."""
    model = CausalQwenForCausalLM.from_base(tied_base, ovr_threshold_init=threshold, gamma_init=0.05)
    with torch.no_grad():
        model.action.weight.mul_(8.0)  # peaked and flat positions alike
        model.action.weight[0].normal_(std=0.05)  # no degenerate row (P is a step there)
        out = model(input_ids, inference_mode="standard")
        P = model.ovr_log_probs(out.loc_S, out.scale_S).exp()
        r = torch.softmax(out.loc_S.double(), -1)
        assert torch.equal(P > 0.5, r > math.exp(threshold))
        assert (P > 0.5).sum(-1).max() < math.exp(-threshold)
        assert (r.max(-1).values > math.exp(threshold)).any()  # some position has a token above it
        # shifting every location of a position (b_A + a constant) changes no P_k
        model.action.bias.add_(7.0)
        shifted = model(input_ids, inference_mode="standard")
        torch.testing.assert_close(model.ovr_log_probs(shifted.loc_S, shifted.scale_S).exp(), P, rtol=0, atol=1e-4)


def test_zero_vocabulary_row_gives_a_finite_score(tied_base, input_ids):
    # Qwen2 zeroes the padding embedding, so a tied W_A has a zero row: scale_S = 0 there (absolute threshold 0:
    # the row's loc_S = 0 sits exactly on it)
    model = CausalQwenForCausalLM.from_base(tied_base, ovr_threshold_init=0.0, ovr_relative_threshold=False)
    assert torch.count_nonzero(model.action.weight[0]) == 0
    with torch.no_grad():
        out = model(input_ids)
    log_P = model.ovr_log_probs(out.loc_S, out.scale_S)
    assert torch.isfinite(out.logits).all()
    assert torch.allclose(log_P[..., 0].exp(), torch.tensor(0.5))  # loc = threshold: P = ½
    loss = model(input_ids, labels=input_ids).loss
    assert torch.isfinite(loss)
    # below the threshold the degenerate law is a step: P = 0 exactly (log P = −inf), never NaN; `accept` never
    # draws a token with P = 0, `accept_once` keeps it as a fallback draw: log r_0 + log(1 − A), finite
    model = CausalQwenForCausalLM.from_base(tied_base, ovr_threshold_init=16.0, ovr_distribution="accept")
    with torch.no_grad():
        out = model(input_ids)
    log_P = model.ovr_log_probs(out.loc_S, out.scale_S)
    assert not torch.isnan(out.logits).any() and torch.all(out.logits[..., 0] == -math.inf)
    assert torch.all(log_P[..., 0] == -math.inf) and torch.isfinite(out.logits[..., 1:]).all()
    loss = model(input_ids, labels=input_ids).loss
    assert torch.isfinite(loss)
    model.config.ovr_distribution = "accept_once"
    with torch.no_grad():
        out = model(input_ids)
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("relative,threshold", [(True, -4.0), (False, 0.0)])
def test_loss_matches_float64_bce_reference(tied_base, input_ids, relative, threshold):
    # the OvR loss alone (no auxiliary cross-entropy); relative thresholds compare with log softmax(loc_S)
    model = CausalQwenForCausalLM.from_base(tied_base, ovr_threshold_init=threshold, softmax_loss_weight=0.0,
                                            ovr_trains_location=True, ovr_relative_threshold=relative,
                                            ovr_candidates=None)
    with torch.no_grad():
        model.action.weight[0].normal_(std=0.05)  # no degenerate row: the reference divides by scale_S
    labels = input_ids.clone()
    labels[0, :3] = -100  # a prompt that carries no target
    out = model(input_ids, labels=labels)
    with torch.no_grad():
        _, _, log_p = _reference_forward(model, input_ids, "standard", 1.0)
        p = log_p.exp()
        targets = labels[:, 1:]
        p = p[:, :-1][targets != -100]
        onehot = F.one_hot(targets[targets != -100], TINY_VOCAB).double()
        expected = -(onehot * p.log() + (1 - onehot) * (1 - p).log()).sum(-1).mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    out.loss.backward()
    assert model.action.weight.grad is not None and model.model.embed_tokens.weight.grad is None
    # the loss is the same in every inference mode: the scoring options (as generate() would pass them) do not apply
    with torch.no_grad():
        again = model(input_ids, labels=labels, use_cache=True, inference_mode="sampling", causal_temperature=2.0,
                      noise_sharing="sequence")
    assert again.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)


def test_loss_under_autocast_multiplies_in_its_dtype(tied_base, input_ids):
    """Under bfloat16 autocast (TRL's default on accelerators) the products with W_A run in bfloat16, as lm_head's
    would, and the rest in float32: the loss and the gradients are the float32 ones at bfloat16's precision."""
    model = CausalQwenForCausalLM.from_base(tied_base)
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(input_ids, labels=input_ids)
    low.loss.backward()
    assert low.loss.dtype == torch.float32 and low.loss.item() != out.loss.item()
    assert low.loss.item() == pytest.approx(out.loss.item(), rel=4e-3)
    for name, g in grads.items():
        got = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(got, g, rtol=5e-2, atol=5e-2 * g.abs().max().item(), msg=name)


def test_logits_to_keep_scores_only_kept_positions(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base).eval()
    with torch.no_grad():
        full = model(input_ids)
        last = model(input_ids, logits_to_keep=1)
    assert last.loc_S.shape == (2, 1, TINY_VOCAB) and last.scale_U.shape == (2, 1, TINY_HIDDEN)
    torch.testing.assert_close(last.logits, full.logits[:, -1:])


def test_verify_initialization_reports_a_faithful_copy(tiny_base, input_ids):
    base = Qwen2ForCausalLM.from_pretrained(tiny_base)
    # absolute threshold 0: a padding row (loc_S = 0) then has P = ½, not 0
    model = CausalQwenForCausalLM.from_base(base, ovr_threshold_init=0.0, ovr_relative_threshold=False)
    report = model.verify_initialization(input_ids)
    assert report["feature_diff"] == 0.0
    assert report["loc_U_vs_z"] < 1e-6
    assert report["logits_diff"] < 1e-6 and abs(report["kl_to_base"]) < 1e-6
    assert report["scale_U_mean"] == pytest.approx(model.config.gamma_init, rel=1e-6) and report["scale_U_std"] < 1e-6
    assert 0 < report["ovr_prob_min"] <= report["ovr_prob_mean"] <= report["ovr_prob_max"] < 1
    # against a separately loaded base the comparison is real, not trivially shared
    separate = model.verify_initialization(input_ids, base_model=Qwen2ForCausalLM.from_pretrained(tiny_base))
    assert separate["feature_diff"] < 1e-6 and separate["logits_diff"] < 1e-6


def test_from_base_keeps_no_second_copy_of_an_untied_output_layer(tmp_path, input_ids):
    """An untied base's lm_head beside a "full" W_A copy is only referenced weakly: once the base is released it
    is freed, and verify_initialization reads the output layer back from the base's checkpoint (the README's first
    lines on an untied base: from_base by name, then verify) instead of keeping V×H alive."""
    folder = save_tiny_qwen2(tmp_path / "untied", tie_word_embeddings=False)
    base = Qwen2ForCausalLM.from_pretrained(folder)
    lm_head = weakref.ref(base.lm_head)
    model = CausalQwenForCausalLM.from_base(base)
    del base
    gc.collect()
    assert lm_head() is None
    reference = Qwen2ForCausalLM.from_pretrained(folder)  # the base's own logits, loaded apart
    report = model.verify_initialization(input_ids)
    assert report == model.verify_initialization(input_ids, base_model=reference) and report["logits_diff"] < 1e-6
    by_name = CausalQwenForCausalLM.from_base(str(folder))
    gc.collect()
    assert by_name.verify_initialization(input_ids)["logits_diff"] < 1e-6
    with torch.no_grad():  # the comparison is real: heads moved off the base's layer are reported
        by_name.action.weight.add_(1.0)
    assert by_name.verify_initialization(input_ids)["logits_diff"] > 0.1
    # a base whose checkpoint is gone: the caller is asked for it
    import shutil

    moved = CausalQwenForCausalLM.from_base(str(shutil.copytree(folder, tmp_path / "moved")))
    shutil.rmtree(tmp_path / "moved")
    with pytest.raises(ValueError, match="pass base_model=<the base causal LM>"):
        moved.verify_initialization(input_ids)
    # a tied base (or W_A bound to the base's layer) costs nothing extra: the reference stays
    tied = CausalQwenForCausalLM.from_base(save_tiny_qwen2(tmp_path / "tied"))
    assert tied.verify_initialization(input_ids)["logits_diff"] < 1e-6


def test_an_untied_base_loads_without_a_report_of_its_output_layer(tmp_path, caplog):
    """The backbone of an untied checkpoint loads through AutoModel; its lm_head is left on purpose and transformers'
    load report does not call it UNEXPECTED; other tensors of a checkpoint that is not the backbone's still do."""
    import logging

    folder = save_tiny_qwen2(tmp_path / "untied", tie_word_embeddings=False)
    CausalQwenForCausalLM.from_base(str(folder)).save_pretrained(tmp_path / "adapter")
    with caplog.at_level(logging.WARNING):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")
    assert "UNEXPECTED" not in caplog.text and "lm_head" not in caplog.text
    from transformers import Qwen2Model
    assert "_keys_to_ignore_on_load_unexpected" not in Qwen2Model.__dict__  # the class as it was


def test_from_base_refuses_a_checkpoint_without_its_output_layer(tmp_path):
    """An untied config whose checkpoint holds no lm_head (a saved backbone, as embedding models ship): the output
    layer would be random, and W_A a copy of it."""
    from safetensors.torch import load_file, save_file

    folder = save_tiny_qwen2(tmp_path / "untied", tie_word_embeddings=False)
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("lm_head.")}, folder / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights.*lm_head\.weight.*the causal LM checkpoint itself"):
        CausalQwenForCausalLM.from_base(str(folder))


def test_compatible_greedy_generation_equals_base(tiny_base, input_ids):
    base = Qwen2ForCausalLM.from_pretrained(tiny_base).eval()
    model = CausalQwenForCausalLM.from_base(tiny_base).eval()
    expected = base.generate(input_ids[:1], max_new_tokens=8, do_sample=False)
    got = model.generate(input_ids[:1], max_new_tokens=8, do_sample=False, inference_mode="compatible")
    assert torch.equal(got, expected)


def test_bad_modes_and_temperatures(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base)
    with pytest.raises(ValueError, match="compatible, standard, sampling, causal"):
        model(input_ids, inference_mode="greedy")
    with pytest.raises(ValueError, match="causal_temperature"):
        model(input_ids, causal_temperature=-1.0)
    with pytest.raises(ValueError, match="inference_mode"):
        CausalQwenConfig(inference_mode="nope")
    with pytest.raises(TypeError, match="unknown CausalQwenConfig field"):
        CausalQwenForCausalLM.from_base(tied_base, gamma=3.0)


def test_labels_outside_vocabulary_raise(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base)
    labels = input_ids.clone()
    labels[0, 4] = TINY_VOCAB + 5
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
        model(input_ids, labels=labels)


def test_what_is_not_a_causal_lm_is_refused(tmp_path):
    """A backbone without its output layer, or an object that is no model: the error says what to pass (other
    architectures: tests/test_architectures.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="LlamaModel, a model without a language-model output layer: pass the base's"):
        CausalQwenForCausalLM.from_base(LlamaForCausalLM.from_pretrained(tmp_path).model)
    with pytest.raises(TypeError, match="a loaded causal LM .a transformers \\*ForCausalLM., got dict"):
        CausalQwenForCausalLM.from_base({})


def test_ovr_loss_without_location_gradient(tied_base, input_ids):
    # ovr_trains_location=False: the locations learn from the softmax term alone, the scales from the OvR loss alone
    def grads(**config):
        model = CausalQwenForCausalLM.from_base(tied_base, gamma_init=1.0, b_noise_init=0.1, ovr_threshold_init=0.5,
                                                **config)
        model(input_ids, labels=input_ids).loss.backward()
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
                if p.requires_grad}

    routed = grads(ovr_trains_location=False)
    softmax_only = grads(objective="softmax")
    ovr_only = grads(softmax_loss_weight=0.0)
    for name in ("abduction.loc.weight", "abduction.loc.bias", "action.weight", "action.bias"):
        torch.testing.assert_close(routed[name], softmax_only[name], rtol=1e-5, atol=1e-7, msg=name)
    for name in ("abduction.scale.weight", "abduction.scale.bias", "action.b_noise"):
        torch.testing.assert_close(routed[name], ovr_only[name], rtol=1e-5, atol=1e-7, msg=name)
        assert routed[name].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compatible_mode_runs_no_scale_path(tiny_base, input_ids, dtype):
    """`compatible` scores with loc_S alone: W_scale is never multiplied (scale_U and scale_S are None), loc_S is the
    base's logits exactly with fresh heads, and the OvR modes still get both scales."""
    base = Qwen2ForCausalLM.from_pretrained(tiny_base, dtype=dtype).eval()
    model = CausalQwenForCausalLM.from_base(base).eval()
    calls = []
    model.abduction.scale.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    with torch.no_grad():
        out = model(input_ids, inference_mode="compatible")
        expected = base(input_ids).logits
        assert calls == [] and out.scale_U is None and out.scale_S is None
        assert torch.equal(out.loc_S, expected) and torch.equal(out.logits, out.loc_S)
        for mode in ("standard", "causal", "sampling"):
            scored = model(input_ids, inference_mode=mode)
            assert scored.scale_U.shape == (*input_ids.shape, TINY_HIDDEN)
            assert scored.scale_S.shape == (*input_ids.shape, TINY_VOCAB)
            torch.testing.assert_close(scored.loc_U, out.loc_U, rtol=0, atol=0)
        assert len(calls) == 3
        heads = model.causal_heads(model.model(input_ids).last_hidden_state, "compatible")
        assert heads[1] is None and heads[3] is None and torch.equal(heads[2], out.loc_S)
