"""Numeric-aware heads (docs/design.md, Numbers): <NUM> values in, the Cauchy regression head out, its loss, generation with
fed-back values, the data helpers and CausalSFTTrainer on numeric data.

References: the formulas of docs/design.md, Numeric mode, written out in float64, the backbone run on hand-built input embeddings, and a
teacher-forced forward pass for the generated values.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenConfig, CausalQwenForCausalLM
from causalqwen_adapter.cauchy import cauchy_interval, cauchy_nll, cauchy_quantile, ovr_loss, signed_log1p
from causalqwen_adapter.numeric import (
    NUM_TOKEN,
    NumericCollator,
    add_num_token,
    decode_with_numbers,
    encode_with_numbers,
    numeric_statistics,
)
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

from conftest import TINY_VOCAB, save_tiny_qwen2, tiny_qwen2_config

NUM = TINY_VOCAB - 8  # an id the tiny tests use as <NUM>
REPO_ROOT = Path(__file__).resolve().parents[1]


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


def test_formulas_match_float64():
    v = torch.tensor([-1e6, -2.5, -1e-3, 0.0, 1e-3, 2.5, 1e6], dtype=torch.float64)
    torch.testing.assert_close(signed_log1p(v), torch.tensor([math.copysign(math.log(1 + abs(x)), x) for x in v.tolist()],
                                                             dtype=torch.float64))
    y, loc, scale = torch.tensor([1.0, -4.0, 100.0]), torch.tensor([0.5, 2.0, -3.0]), torch.tensor([0.1, 3.0, 50.0])
    want = [math.log(math.pi * s) + math.log(1 + ((a - b) / s) ** 2) for a, b, s in zip(y.tolist(), loc.tolist(), scale.tolist())]
    torch.testing.assert_close(cauchy_nll(y, loc, scale), torch.tensor(want))


def test_the_cauchy_nll_of_a_far_target_is_finite_in_float32():
    """One target of 1e20 (z² overflows float32 past ≈ 1.8e19): the NLL and its gradients stay finite and match the
    float64 formula, from z = 0 through |z| = 1 (where the two forms meet) to 1e30."""
    targets = [0.0, 0.3, 1.0 - 1e-6, 1.0, 1.0 + 1e-6, 7.0, -2e3, 1e10, -1e20, 1e30]
    y = torch.tensor(targets, requires_grad=True)
    loc, scale = torch.zeros(len(targets), requires_grad=True), torch.full((len(targets),), 1.0, requires_grad=True)
    nll = cauchy_nll(y, loc, scale)
    want = [math.log(math.pi) + math.log1p(t * t) if abs(t) < 1e150 else 0.0 for t in targets]
    torch.testing.assert_close(nll.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    nll.sum().backward()
    for grad in (y.grad, loc.grad, scale.grad):
        assert torch.isfinite(grad).all()
    torch.testing.assert_close(y.grad.double(), torch.tensor([2 * t / (1 + t * t) for t in targets], dtype=torch.float64),
                               rtol=1e-5, atol=1e-12)


def naive_cauchy_cdf(x, loc, scale):
    return 0.5 + math.atan((x - loc) / scale) / math.pi


def naive_truncated_cauchy_quantile(loc, scale, p, low, high):
    """Bisection in float64 on (F(x) − F(low)) / (F(high) − F(low))."""
    f_low, f_high = naive_cauchy_cdf(low, loc, scale), naive_cauchy_cdf(high, loc, scale)
    lo, hi = low, high
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (naive_cauchy_cdf(mid, loc, scale) - f_low) / (f_high - f_low) < p else (lo, mid)
    return (lo + hi) / 2


def test_cauchy_quantiles_and_intervals_invert_the_cdf():
    # inside the range, at its edges, beyond it; narrow and wide laws
    loc = torch.tensor([0.3, -3.9, 3.5, 6.0, -5.0, 1.0], dtype=torch.float64)
    scale = torch.tensor([0.5, 1.0, 3.0, 2.0, 0.7, 40.0], dtype=torch.float64)
    for p in (0.025, 0.1, 0.5, 0.8, 0.975):
        plain = cauchy_quantile(loc, scale, p)
        assert all(naive_cauchy_cdf(q, a, s) == pytest.approx(p, abs=1e-12)
                   for q, a, s in zip(plain.tolist(), loc.tolist(), scale.tolist()))
        truncated = cauchy_quantile(loc, scale, p, support=(-4.0, 4.0))
        assert truncated.dtype == torch.float64 and ((truncated >= -4) & (truncated <= 4)).all()
        want = [naive_truncated_cauchy_quantile(a, s, p, -4.0, 4.0) for a, s in zip(loc.tolist(), scale.tolist())]
        torch.testing.assert_close(truncated, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-9)
    lower, upper = cauchy_interval(loc, scale, 0.9, support=(-4.0, 4.0))  # holds 90 % of the truncated law
    for lo, hi, a, s in zip(lower.tolist(), upper.tolist(), loc.tolist(), scale.tolist()):
        mass = (naive_cauchy_cdf(hi, a, s) - naive_cauchy_cdf(lo, a, s)) / (
            naive_cauchy_cdf(4.0, a, s) - naive_cauchy_cdf(-4.0, a, s))
        assert mass == pytest.approx(0.9, abs=1e-9)
    torch.testing.assert_close(cauchy_interval(loc, scale, 0.5)[1], cauchy_quantile(loc, scale, 0.75))


def test_cauchy_quantile_far_outside_the_range_and_in_low_precision():
    # 56 000 scales beyond the range the truncated density is ∝ 1/(60 − x)², whose median m solves
    # 1/(60 − m) = (1/56 + 1/64)/2
    got = cauchy_quantile(torch.tensor([60.0], dtype=torch.float64), torch.tensor([1e-3], dtype=torch.float64), 0.5,
                          support=(-4.0, 4.0))
    assert got.item() == pytest.approx(60 - 2 / (1 / 56 + 1 / 64), abs=1e-6)
    half = cauchy_quantile(torch.tensor([0.5], dtype=torch.bfloat16), torch.tensor([2.0], dtype=torch.bfloat16), 0.9)
    assert half.dtype == torch.float32 and half.item() == pytest.approx(0.5 + 2 * math.tan(0.4 * math.pi), rel=1e-6)


def test_cauchy_quantile_refuses_bad_levels_and_ranges():
    loc, scale = torch.zeros(2), torch.ones(2)
    for p in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="quantile level"):
            cauchy_quantile(loc, scale, p)
    with pytest.raises(ValueError, match="interval's level"):
        cauchy_interval(loc, scale, 1.0)
    with pytest.raises(ValueError, match="low < high"):
        cauchy_quantile(loc, scale, 0.5, support=(4.0, -4.0))


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


# --------------------------------------------------------------------------------------- generation


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


# --------------------------------------------------------------------------------------- data helpers


def test_encode_decode_and_num_token(sft_base):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    num_id = len(tokenizer)
    with pytest.raises(ValueError, match=f"{NUM_TOKEN} would get id {num_id} in this tokenizer, but the model's"):
        add_num_token(tokenizer, num_id + 1)
    assert len(tokenizer) == num_id  # nothing changed
    add_num_token(tokenizer, num_id)
    assert tokenizer.convert_tokens_to_ids(NUM_TOKEN) == num_id and len(tokenizer) == num_id + 1
    add_num_token(tokenizer, num_id)  # idempotent

    encoded = encode_with_numbers(tokenizer, "the cat sat on 3 mats and -2.5e3 dogs ran .5", num_id)
    ids, values = encoded["input_ids"], encoded["numeric_values"]
    assert len(ids) == len(values)
    assert [v for i, v in zip(ids, values) if i == num_id] == [3.0, -2500.0, 0.5]
    assert all(v == 0.0 for i, v in zip(ids, values) if i != num_id)
    assert decode_with_numbers(tokenizer, ids, values, num_id) == tokenizer.decode(
        encode_with_numbers(tokenizer, "the cat sat on", num_id)["input_ids"]) + "3" + tokenizer.decode(
        encode_with_numbers(tokenizer, " mats and ", num_id)["input_ids"]) + "-2500" + tokenizer.decode(
        encode_with_numbers(tokenizer, " dogs ran ", num_id)["input_ids"]) + "0.5"


class Chars:
    """A character-level tokenizer: decode(encode(piece)) is the piece, so a round trip shows what the numbers did."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


# (text, the numbers read, the text decode_with_numbers gives back): written by hand, the reading a person gives them
NUMBER_CASES = [
    ("10-20", [10, 20], "10-20"),  # a range: the dash is no sign
    ("pages 10 - 20", [10, 20], "pages 10 - 20"),
    ("2024-01-15", [], "2024-01-15"),  # a date stays text (its zero padding would be lost)
    ("on 2024-01-15 at 09:30", [], "on 2024-01-15 at 09:30"),
    ("1,000", [1000], "1000"),  # thousands grouping: one number
    ("1,234,567.5 units", [1234567.5], "1234567.5 units"),
    ("-1,000 and +2", [-1000, 2], "-1000 and 2"),
    ("1,2,3", [1, 2, 3], "1,2,3"),  # not groups of three: a list
    ("12,34", [12, 34], "12,34"),
    ("x=-5, (-3.5) [-2]", [-5, -3.5, -2], "x=-5, (-3.5) [-2]"),  # signs after =, brackets
    ("-7 at the start", [-7], "-7 at the start"),
    ("it was -4 degrees", [-4], "it was -4 degrees"),
    ("COVID-19 and e-5", [19, 5], "COVID-19 and e-5"),  # hyphens after letters
    ("5%-10% and (2)-1", [5, 10, 2, 1], "5%-10% and (2)-1"),
    ("1+2", [1, 2], "1+2"),
    ("costs 3.", [3], "costs 3."),  # the sentence's full stop stays text
    ("3.50 and .5 and 6.02e23 and 5e-3", [3.5, 0.5, 6.02e23, 5e-3], "3.5 and 0.5 and 6.02e+23 and 0.005"),
    ("version 1.2.3 at 192.168.0.1", [], "version 1.2.3 at 192.168.0.1"),
    ("zip 02139, 0 and 0.25", [0, 0.25], "zip 02139, 0 and 0.25"),  # a leading zero: a code, not a quantity
    ("12345678901", [12345678901], "12345678901"),  # written whole, not 1.23457e+10
]


@pytest.mark.parametrize("text, numbers, decoded", NUMBER_CASES)
def test_numbers_are_read_as_a_person_reads_them(text, numbers, decoded):
    num_id = 0x10FFFF + 1  # beyond every character
    encoded = encode_with_numbers(Chars(), text, num_id)
    ids, values = encoded["input_ids"], encoded["numeric_values"]
    assert [v for i, v in zip(ids, values) if i == num_id] == [float(n) for n in numbers]
    assert decode_with_numbers(Chars(), ids, values, num_id) == decoded


def _shortest_float32(v: float) -> str:
    """The fewest significant digits that read back as the same float32 (values between 1e-4 and 1e16)."""
    return next(t for t in (f"{v:.{p}f}".rstrip("0").rstrip(".") if abs(v) >= 1 else f"{v:.{p}g}" for p in range(1, 12))
                if torch.tensor(float(t), dtype=torch.float32) == torch.tensor(v, dtype=torch.float32))

def test_generated_values_are_written_in_the_precision_they_are_held_in():
    num_id = 0x10FFFF + 1
    ids = [num_id, ord(" "), num_id, ord(" "), num_id, ord(" "), num_id]
    values = torch.tensor([3.3, 1234567.5, -41.87, 2.5e-7], dtype=torch.float32)
    padded = torch.zeros(len(ids))
    padded[[0, 2, 4, 6]] = values
    # float32's 3.3 is 3.2999999523...: written as the float32 it is, not as that float64
    assert decode_with_numbers(Chars(), ids, padded, num_id) == "3.3 1234567.5 -41.87 2.5e-07"
    assert decode_with_numbers(Chars(), ids, padded.double(), num_id).startswith("3.299999952316284 ")
    assert decode_with_numbers(Chars(), ids, padded, num_id, number_format="{:.2f}") == "3.30 1234567.50 -41.87 0.00"


def test_numeric_statistics_are_the_median_and_half_the_iqr():
    values = torch.tensor([1.0, 2.0, 4.0, 8.0, 100.0, -50.0])
    median, scale = numeric_statistics(values)
    q1, q3 = torch.quantile(values.double(), 0.25).item(), torch.quantile(values.double(), 0.75).item()
    assert median == pytest.approx(3.0) and scale == pytest.approx((q3 - q1) / 2)
    assert numeric_statistics([5.0, 5.0, 5.0]) == (5.0, pytest.approx(5e-3))
    with pytest.raises(ValueError, match="no numeric target"):
        numeric_statistics([])
    with pytest.raises(ValueError, match="values must be finite"):
        numeric_statistics([1.0, float("nan")])


@pytest.mark.parametrize("truncation_mode, padding_free", [("keep_start", False), ("keep_end", False), ("keep_start", True)])
def test_collator_keeps_values_aligned_with_tokens(truncation_mode, padding_free):
    def inner(examples):  # like TRL's: input_ids already truncated, padded right or concatenated
        rows = [torch.tensor(e["input_ids"]) for e in examples]
        if padding_free:
            return {"input_ids": torch.cat(rows)[None]}
        width = max(map(len, rows))
        return {"input_ids": torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=-1) for r in rows])}

    full = [[1, 2, 3, 4], [5, 6]]
    values = [[0.0, 2.5, 0.0, 9.0], [7.0, 0.0]]
    kept = [ids[:3] if truncation_mode == "keep_start" else ids[-3:] for ids in full[:1]] + [full[1]]
    examples = [{"input_ids": k, "numeric_values": v} for k, v in zip(kept, values)]
    batch = NumericCollator(inner, truncation_mode=truncation_mode, padding_free=padding_free)(examples)
    lookup = {i: v for ids, vals in zip(full, values) for i, v in zip(ids, vals)}
    expected = batch["input_ids"].clone().float().apply_(lambda i: lookup.get(int(i), 0.0))
    assert torch.equal(batch["numeric_values"], expected)


# --------------------------------------------------------------------------------------- training


def _numeric_data(tokenizer, num_id):
    texts = ["the cat sat on 3 mats", "a dog ran 12 times in the park", "two plus two is 4",
             "hello 7 how are you 2.5", "the sky is 100 blue today", "cats and dogs are 40 friends"]
    return Dataset.from_list([encode_with_numbers(tokenizer, t, num_id) for t in texts])


def test_trainer_starts_from_the_data_and_matches_the_naive_loss(sft_base, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    num_id = len(tokenizer)
    add_num_token(tokenizer, num_id)
    data = _numeric_data(tokenizer, num_id)
    args = CausalSFTConfig(str(tmp_path), numeric=True, num_token_id=num_id, numeric_loss_weight=0.5, max_steps=2,
                           per_device_train_batch_size=3, learning_rate=1e-2, logging_steps=1, report_to="none",
                           save_strategy="no", use_cpu=True, dataloader_pin_memory=False, disable_tqdm=True, seed=0)
    trainer = CausalSFTTrainer(str(sft_base), args=args, train_dataset=data, processing_class=tokenizer)
    model = trainer.model
    targets = [3.0, 12.0, 4.0, 7.0, 2.5, 100.0, 40.0]
    median, scale = numeric_statistics(targets)
    assert model.numeric.bias.item() == pytest.approx(median)
    assert model.numeric.log_scale.exp().item() == pytest.approx(scale, rel=1e-6)

    batch = trainer.data_collator([data[i] for i in range(3)])
    assert batch["numeric_values"].shape == batch["input_ids"].shape
    fused = trainer.compute_loss(model, dict(batch))
    with torch.no_grad():
        naive = model(**batch)  # the model's own forward: materialised OvR + λ NLL
    torch.testing.assert_close(fused.detach(), naive.loss, rtol=1e-5, atol=1e-5)

    direction = model.numeric.direction.detach().clone()
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all("numeric_nll" in h for h in logged)
    assert not torch.equal(model.numeric.direction, direction)  # d trains through the frozen backbone
    assert all(not p.requires_grad for p in model.model.parameters())


def test_trainer_refuses_numeric_heads_without_values_or_with_packing(sft_base, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    num_id = len(tokenizer)
    add_num_token(tokenizer, num_id)
    common = dict(numeric=True, num_token_id=num_id, report_to="none", use_cpu=True, save_strategy="no")
    with pytest.raises(ValueError, match="has no numeric_values column"):
        CausalSFTTrainer(str(sft_base), args=CausalSFTConfig(str(tmp_path), **common),
                         train_dataset=Dataset.from_dict({"text": ["the cat sat on 3 mats"]}), processing_class=tokenizer)
    with pytest.raises(ValueError, match="packing is not supported with numeric heads"):
        CausalSFTTrainer(str(sft_base), args=CausalSFTConfig(str(tmp_path), packing=True, **common),
                         train_dataset=_numeric_data(tokenizer, num_id), processing_class=tokenizer)
    data = _numeric_data(tokenizer, num_id).to_dict()
    data["numeric_values"][2] = [None if v else v for v in data["numeric_values"][2]]  # a null target in row 2
    with pytest.raises(ValueError, match="train example 2 has the numeric value None"):
        CausalSFTTrainer(str(sft_base), args=CausalSFTConfig(str(tmp_path), **common),
                         train_dataset=Dataset.from_dict(data), processing_class=tokenizer)
    adapter = tmp_path / "plain-adapter"
    CausalQwenForCausalLM.from_base(Qwen2ForCausalLM.from_pretrained(sft_base)).save_pretrained(adapter)
    with pytest.raises(ValueError, match="this adapter's heads are not numeric"):
        CausalSFTTrainer(str(adapter), args=CausalSFTConfig(str(tmp_path), **common),
                         train_dataset=_numeric_data(tokenizer, num_id), processing_class=tokenizer)


def test_sft_recipe_with_numeric_heads(sft_base, tmp_path):
    from causalqwen_adapter.cli import train as recipe

    data = tmp_path / "numbers.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the cat sat on 3 mats", "two plus two is 4",
                                                                     "a dog ran 12 times"]))
    parsed = recipe.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
        "--numeric", "--max_steps", "1", "--per_device_train_batch_size", "3", "--report_to", "none",
        "--use_cpu", "true", "--logging_steps", "1", "--disable_tqdm", "true", "--dataloader_pin_memory", "false",
    ])
    trainer = recipe.run(*parsed)
    num_id = trainer.model.config.num_token_id
    assert num_id == len(AutoTokenizer.from_pretrained(sft_base))  # the next free id
    assert sorted(v for row in trainer.train_dataset["numeric_values"] for v in row if v) == [3.0, 4.0, 12.0]
    assert "numeric_nll" in trainer.state.log_history[0]
    assert CausalQwenForCausalLM.from_pretrained(tmp_path / "out").config.numeric
    # training continues from the adapter: the data are read with its base's tokenizer, <NUM> at the adapter's id
    parsed = recipe.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", str(tmp_path / "out"), "--dataset_name", str(data), "--output_dir",
        str(tmp_path / "again"), "--numeric", "--max_steps", "1", "--per_device_train_batch_size", "3",
        "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true", "--dataloader_pin_memory", "false",
    ])
    again = recipe.run(*parsed)
    assert again.model.config.num_token_id == num_id
    assert again.train_dataset["input_ids"] == trainer.train_dataset["input_ids"]



def test_sft_recipe_with_numeric_heads_names_a_row_without_text(sft_base, tmp_path):
    from causalqwen_adapter.cli import train as recipe

    data = tmp_path / "numbers.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the cat sat on 3 mats", None, "a dog ran 12 times"]))
    parsed = recipe.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
        "--numeric", "--max_steps", "1", "--report_to", "none", "--use_cpu", "true"])
    with pytest.raises(ValueError, match=r"the train dataset's `text` in row 1 is None \(NoneType\), not text"):
        recipe.run(*parsed)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rows, message", [
    ([[0.0, 2.0], [0.0, None, 1.0]], r"train example 1 has the numeric value None at position 1: every value must be "
                                     r"a finite number \(a missing value reads as null\)"),
    ([[0.0, 2.0], None], r"train example 1 has no numeric_values \(null\)"),
    ([[0.0, 2.0], [0.0], [math.nan, 0.0]], r"train example 2 has the numeric value nan at position 0"),
    ([[0.0, 2.0], [math.inf]], r"train example 1 has the numeric value inf at position 0"),
])
def test_missing_numeric_values_are_named_by_example_and_position(rows, message):
    from causalqwen_adapter.numeric import check_numeric_values_present

    with pytest.raises(ValueError, match=message):
        check_numeric_values_present(Dataset.from_dict({"input_ids": [[1] * len(r or [0]) for r in rows],
                                                        "numeric_values": rows}))
    check_numeric_values_present(Dataset.from_dict({"numeric_values": [[0.0, 2.5], [], [1e30]]}))  # all present

def test_generate_recipe_writes_generated_numbers(sft_base, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    num_id = len(tokenizer)
    model = CausalQwenForCausalLM.from_base(str(sft_base), numeric=True, num_token_id=num_id).eval()
    with torch.no_grad():
        model.action.bias[num_id] = 40.0  # every generated token is <NUM>
        model.numeric.bias.fill_(42.0)
    model.save_pretrained(tmp_path / "adapter")
    cli = [sys.executable, "-m", "causalqwen_adapter.cli", "generate"]  # run in the checkout: its package
    proc = subprocess.run([*cli, str(tmp_path / "adapter"),
                           "--prompt", "the cat sat on 3", "--no-chat", "--mode", "compatible", "--max-new-tokens", "2"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    add_num_token(tokenizer, num_id)
    encoded = encode_with_numbers(tokenizer, "the cat sat on 3", num_id)
    out = model.generate(torch.tensor([encoded["input_ids"]]), numeric_values=torch.tensor([encoded["numeric_values"]]),
                         max_new_tokens=2, do_sample=False, inference_mode="compatible", return_dict_in_generate=True)
    n = len(encoded["input_ids"])
    values = out.numeric_values[0, n:]
    assert proc.stdout.strip() == "".join(_shortest_float32(v) for v in values.tolist())
    assert all(abs(v - 42.0) < 5 for v in values.tolist())
    # with --interval: a line per generated number, its Cauchy interval on the range given
    proc = subprocess.run([*cli, "--model_name_or_path", str(tmp_path / "adapter"),
                           "--prompt", "the cat sat on 3", "--no_chat", "--inference_mode", "compatible",
                           "--max_new_tokens", "2", "--interval", "0.9", "--value_range", "0", "45"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lower, upper = cauchy_interval(values, out.numeric_scales[0, n:], 0.9, support=(0.0, 45.0))
    assert proc.stdout.strip().splitlines() == ["".join(_shortest_float32(v) for v in values.tolist())] + [
        f"number {i}: {v:g}, 90 % interval [{lo:g}, {hi:g}]"
        for i, (v, lo, hi) in enumerate(zip(values.tolist(), lower.tolist(), upper.tolist()), 1)]
    assert (upper <= 45).all() and (lower < values).all() and (values < upper).all()


@pytest.mark.parametrize("extra, message", [
    (["--interval", "1.5"], r"--interval is the interval's level, in \(0, 1\)"),
    (["--interval", "nan"], "--interval must be a finite number"),
    (["--value-range", "0", "4"], "give --interval LEVEL with it"),
    (["--interval", "0.9", "--value-range", "4", "-4"], "LOW < HIGH, got 4 -4"),
])
def test_generate_recipe_refuses_bad_interval_options(sft_base, tmp_path, capsys, monkeypatch, extra, message):
    from causalqwen_adapter.cli import generate as recipe

    CausalQwenForCausalLM.from_base(str(sft_base)).save_pretrained(tmp_path / "plain")
    loaded = []  # every refusal comes before the model loads
    monkeypatch.setattr(recipe.CausalQwenForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit) as exit_info:
        recipe.main([str(tmp_path / "plain"), "--prompt", "hi", "--no-chat", "--device", "cpu", *extra])
    assert exit_info.value.code == 2 and re.search(message, capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_info:  # a plain adapter has no numbers to give intervals of
        recipe.main([str(tmp_path / "plain"), "--prompt", "hi", "--no-chat", "--device", "cpu", "--interval", "0.9"])
    assert exit_info.value.code == 2 and "is not one" in capsys.readouterr().err and not loaded


def test_model_card_says_the_adapter_is_numeric(model, tmp_path):
    model.save_pretrained(tmp_path / "adapter")
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert f"`<NUM>` (id {NUM})" in card and "numeric_values" in card and "numeric_scales" in card
    CausalQwenForCausalLM.from_base(model.config.base_model_name_or_path).save_pretrained(tmp_path / "plain")
    assert "<NUM>" not in (tmp_path / "plain" / "README.md").read_text()


def test_num_token_on_a_reserved_placeholder_row_or_a_taken_id(sft_base):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    size = len(tokenizer)
    tokenizer.add_tokens(["[PAD999]"])  # how GGUF-built tokenizers name reserved rows
    add_num_token(tokenizer, size)  # used by id, nothing added
    assert len(tokenizer) == size + 1 and NUM_TOKEN not in tokenizer.get_vocab()
    with pytest.raises(ValueError, match="is the tokenizer's token 'the', not a free row"):
        add_num_token(tokenizer, tokenizer.convert_tokens_to_ids("the"))


def test_compatible_mode_keeps_the_scale_the_numeric_head_reads(model):
    # compatible skips the scale path where nothing reads it; a numeric model's scale_Y reads scale_U (unfused, as in
    # causal mode)
    with torch.no_grad():
        compatible = model(IDS, numeric_values=VALUES, inference_mode="compatible")
        causal = model(IDS, numeric_values=VALUES, inference_mode="causal")
    assert compatible.scale_S is None
    for field in ("loc_U", "scale_U", "loc_Y", "scale_Y"):
        torch.testing.assert_close(getattr(compatible, field), getattr(causal, field), rtol=0, atol=0, msg=field)
