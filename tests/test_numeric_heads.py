"""Numeric-aware heads (docs/design.md, Numbers): <NUM> values in, the Cauchy regression head out, its loss,
generation with fed-back values, the saved adapter and its card.

References: the formulas of docs/design.md, Numeric mode, written out in float64, the backbone run on hand-built
input embeddings, and a teacher-forced forward pass for the generated values.
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from causalqwen_adapter import CausalQwenConfig, CausalQwenForCausalLM
from causalqwen_adapter.cauchy import ovr_loss

from conftest import TINY_VOCAB, save_tiny_qwen2, tiny_qwen2_config

NUM = TINY_VOCAB - 8  # an id the tiny tests use as <NUM>


@pytest.fixture(scope="module")
def numeric_base(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("numeric-base"), seed=5, pad_token_id=None)


@pytest.fixture
def model(numeric_base):
    torch.manual_seed(0)
    model = CausalQwenForCausalLM.from_base(numeric_base, numeric=True, num_token_id=NUM).eval()
    with torch.no_grad():  # move the regression head off its init so every term shows
        model.numeric.weight.normal_(std=0.3)
        model.numeric.bias.fill_(1.5)
        model.numeric.log_scale.fill_(-0.7)
    return model


IDS = torch.tensor([[3, NUM, 9, 11, NUM, 4, NUM], [NUM, 5, 6, NUM, 8, 2, 7]])
VALUES = torch.where(IDS == NUM, torch.tensor([[0.0, 12.5, 0, 0, -3.0, 0, 1e4], [7.0, 0, 0, 0.25, 0, 0, 0]]), 0.0)


def test_zero_values_change_nothing(numeric_base, model):
    plain = CausalQwenForCausalLM.from_base(numeric_base).eval()
    ids = torch.tensor([[3, 9, 11, 4, 20]])
    with torch.no_grad():
        without = model(ids)
        with_zeros = model(ids, numeric_values=torch.zeros(ids.shape))
        reference = plain(ids)
    assert torch.equal(with_zeros.logits, without.logits) and torch.equal(without.logits, reference.logits)
    assert torch.equal(with_zeros.loc_Y, without.loc_Y)


def test_numbers_enter_as_phi_times_the_unit_direction(model):
    d = model.numeric.direction.detach()
    assert d.norm().item() == pytest.approx(1.0, abs=1e-6)
    embeds = model.model.embed_tokens(IDS).detach().double()
    embeds = embeds + torch.sign(VALUES.double()).unsqueeze(-1) * torch.log1p(VALUES.double().abs()).unsqueeze(-1) * d.double()
    with torch.no_grad():
        got = model(IDS, numeric_values=VALUES)
        want = model(inputs_embeds=embeds.float())
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["standard", "causal", "sampling"])
def test_regression_head_is_the_cauchy_law_of_the_fused_individual(model, mode):
    torch.manual_seed(3)
    with torch.no_grad():
        out = model(IDS, numeric_values=VALUES, inference_mode=mode, causal_temperature=0.7)
    loc_U, scale_U = out.loc_U.double(), out.scale_U.double()
    b_noise = model.action.b_noise.double()
    if mode == "standard":
        scale_U = scale_U + 0.7 * b_noise.abs()
    elif mode == "sampling":
        loc_U = loc_U + 0.7 * b_noise.abs() * out.causal_noise.double()
    w = model.numeric.weight.double()
    torch.testing.assert_close(out.loc_Y.double(), loc_U @ w + model.numeric.bias.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.scale_Y.double(), scale_U @ w.abs() + model.numeric.log_scale.double().exp(),
                               rtol=1e-5, atol=1e-5)


def test_loss_is_ovr_plus_lambda_times_the_nll_of_num_targets(numeric_base, model):
    model.config.numeric_loss_weight = 0.5
    model.config.softmax_loss_weight = 0.0  # the OvR loss alone beside the NLL (the CE term has its own test)
    model.config.ovr_candidates = None  # over the vocabulary, as the reference writes it
    labels = IDS.clone()
    labels[0, 1] = -100  # a masked <NUM> target does not count
    loss = model(IDS, numeric_values=VALUES, labels=labels).loss
    with torch.no_grad():  # the reference scores: the standard-mode forward, training fusion
        out = model(IDS, numeric_values=VALUES, inference_mode="standard", causal_temperature=1.0)
    targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    loc_S = out.loc_S.double()
    if model.config.ovr_relative_threshold:  # thresholds compared with log softmax(loc_S)
        loc_S = torch.log_softmax(loc_S, -1)
    ovr = ovr_loss(loc_S, out.scale_S.double(), model.ovr.threshold, targets)
    is_number = targets == NUM
    y = torch.cat([VALUES[:, 1:], torch.zeros(2, 1)], 1)[is_number].double()
    loc_U, scale_U = out.loc_U[is_number].double(), out.scale_U[is_number].double() + model.action.b_noise.double().abs()
    w = model.numeric.weight.double()
    loc_Y = loc_U @ w + model.numeric.bias.double()
    scale_Y = scale_U @ w.abs() + model.numeric.log_scale.double().exp()
    nll = (torch.log(math.pi * scale_Y) + torch.log1p(((y - loc_Y) / scale_Y) ** 2)).sum()
    assert is_number.sum() == 3
    torch.testing.assert_close(loss.double(), ovr.double() + 0.5 * nll / (targets != -100).sum(), rtol=1e-5, atol=1e-5)
    loss.backward()
    assert model.numeric.direction.grad.abs().sum() > 0 and model.numeric.weight.grad.abs().sum() > 0


def test_bad_numeric_inputs(numeric_base, model):
    plain = CausalQwenForCausalLM.from_base(numeric_base)
    with pytest.raises(ValueError, match="this model has numeric=False"):
        plain(IDS, numeric_values=VALUES)
    with pytest.raises(ValueError, match=r"numeric_values has shape \(2, 6\), the input tokens \(2, 7\)"):
        model(IDS, numeric_values=VALUES[:, :6])
    with pytest.raises(ValueError, match="<NUM> targets but no numeric_values"):
        model(IDS, labels=IDS)
    with pytest.raises(ValueError, match="numeric=True needs num_token_id"):
        CausalQwenConfig(text_config=tiny_qwen2_config(), numeric=True)
    with pytest.raises(ValueError, match=r"num_token_id=128 is outside the vocabulary \[0, 128\)"):
        CausalQwenConfig(text_config=tiny_qwen2_config(), numeric=True, num_token_id=TINY_VOCAB)
    with pytest.raises(ValueError, match="numeric_loss_weight must be a finite number >= 0, got -1"):
        CausalQwenConfig(text_config=tiny_qwen2_config(), numeric=True, num_token_id=NUM, numeric_loss_weight=-1)
    qwen = CausalQwenConfig(text_config=tiny_qwen2_config(vocab_size=151936), numeric=True)
    assert qwen.num_token_id == 151665


def test_compatible_mode_keeps_the_scale_the_numeric_head_reads(model):
    # compatible skips the scale path where nothing reads it; a numeric model's scale_Y reads scale_U (unfused, as in
    # causal mode)
    with torch.no_grad():
        compatible = model(IDS, numeric_values=VALUES, inference_mode="compatible")
        causal = model(IDS, numeric_values=VALUES, inference_mode="causal")
    assert compatible.scale_S is None
    for field in ("loc_U", "scale_U", "loc_Y", "scale_Y"):
        torch.testing.assert_close(getattr(compatible, field), getattr(causal, field), rtol=0, atol=0, msg=field)


def _force_numbers(model):
    with torch.no_grad():
        model.action.bias[NUM] = 40.0  # <NUM> wins every step in compatible mode


def test_generated_numbers_are_loc_y_and_are_fed_back(model):
    _force_numbers(model)
    prompt, values = IDS[:1, :4], VALUES[:1, :4]
    out = model.generate(prompt, numeric_values=values, max_new_tokens=3, do_sample=False,
                         inference_mode="compatible", return_dict_in_generate=True)
    seq, got, scales = out.sequences, out.numeric_values, out.numeric_scales
    assert (seq[0, 4:] == NUM).all()
    assert torch.equal(got[:, :4], values)
    assert scales.shape == seq.shape and torch.equal(scales[:, :4], torch.zeros_like(values))  # given, not predicted
    # teacher forcing: each generated value is loc_Y of the previous position given all earlier values, its scale
    # that position's scale_Y
    for p in range(4, seq.shape[1]):
        with torch.no_grad():
            step = model(seq[:, :p], numeric_values=got[:, :p], inference_mode="compatible")
        torch.testing.assert_close(got[0, p], step.loc_Y[0, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scales[0, p], step.scale_Y[0, -1], rtol=1e-5, atol=1e-5)
        assert scales[0, p] > 0
    no_cache = model.generate(prompt, numeric_values=values, max_new_tokens=3, do_sample=False, use_cache=False,
                              inference_mode="compatible", return_dict_in_generate=True)
    assert torch.equal(no_cache.sequences, seq)
    torch.testing.assert_close(no_cache.numeric_values, got, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(no_cache.numeric_scales, scales, rtol=1e-5, atol=1e-5)
    # several samples per prompt: the values are expanded with the sequences
    multi = model.generate(prompt, numeric_values=values, max_new_tokens=2, do_sample=True, num_return_sequences=2,
                           inference_mode="compatible", return_dict_in_generate=True)
    assert multi.numeric_values.shape == multi.sequences.shape == multi.numeric_scales.shape == (2, 6)
    assert torch.equal(multi.numeric_values[:, :4], values.expand(2, -1))
    assert (multi.numeric_scales[:, 4:][multi.sequences[:, 4:] == NUM] > 0).all()
    assert (multi.numeric_scales[multi.sequences != NUM] == 0).all()
    # without return_dict: the usual tensor; without numeric_values: zeros for the prompt
    plain = model.generate(prompt, max_new_tokens=2, do_sample=False, inference_mode="compatible")
    assert isinstance(plain, torch.Tensor) and plain.shape == (1, 6)


def test_generation_refuses_beams_and_misaligned_values(model):
    with pytest.raises(ValueError, match="num_beams=1"):
        model.generate(IDS[:1], max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match=r"numeric_values has shape \(1, 3\), input_ids \(1, 7\)"):
        model.generate(IDS[:1], numeric_values=VALUES[:1, :3], max_new_tokens=2)


def test_adapter_round_trip_and_remote_code(model, tmp_path):
    _force_numbers(model)
    model.save_pretrained(tmp_path / "adapter")
    options = dict(numeric_values=VALUES[:1, :4], max_new_tokens=2, do_sample=False, inference_mode="compatible",
                   return_dict_in_generate=True)
    want = model.generate(IDS[:1, :4], **options)
    for loaded in (CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter"),
                   AutoModelForCausalLM.from_pretrained(tmp_path / "adapter", trust_remote_code=True)):
        assert loaded.config.numeric and loaded.config.num_token_id == NUM
        assert loaded.numeric.bias.dtype == torch.float32
        with torch.no_grad():
            a, b = model(IDS, numeric_values=VALUES), loaded(IDS, numeric_values=VALUES)
        assert torch.equal(a.loc_Y, b.loc_Y) and torch.equal(a.logits, b.logits)
        got = loaded.generate(IDS[:1, :4], **options)  # generated numbers with their scales, the remote code too
        assert torch.equal(got.sequences, want.sequences) and (got.sequences[0, 4:] == NUM).all()
        torch.testing.assert_close(got.numeric_values, want.numeric_values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.numeric_scales, want.numeric_scales, rtol=1e-5, atol=1e-5)
        assert (got.numeric_scales[0, 4:] > 0).all() and (got.numeric_scales[0, :4] == 0).all()


def test_model_card_says_the_adapter_is_numeric(model, tmp_path):
    model.save_pretrained(tmp_path / "adapter")
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert f"`<NUM>` (id {NUM})" in card and "numeric_values" in card and "numeric_scales" in card
    CausalQwenForCausalLM.from_base(model.config.base_model_name_or_path).save_pretrained(tmp_path / "plain")
    assert "<NUM>" not in (tmp_path / "plain" / "README.md").read_text()
