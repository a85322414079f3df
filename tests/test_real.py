"""On the real demo base (built by `make test-real`; skipped when absent)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM, heads, kernels

pytestmark = pytest.mark.real

PROMPTS = ["def quicksort(xs):", "The capital of France is"]


@pytest.fixture(scope="module")
def real(demo_base):
    tokenizer = AutoTokenizer.from_pretrained(demo_base)
    tokenizer.padding_side = "left"
    base = Qwen2ForCausalLM.from_pretrained(demo_base, dtype=torch.float32).eval()
    model = CausalQwenForCausalLM.from_base(base).eval()
    return tokenizer, base, model


def test_loc_S_equals_base_logits(real):
    tokenizer, base, model = real
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        loc_S = model(**batch, inference_mode="compatible").loc_S
        logits = base(**batch).logits
    mask = batch.attention_mask.bool()
    assert (loc_S[mask] - logits[mask]).abs().max().item() <= 1e-4  # fp32, 896-term dot products


def test_save_and_reload_through_auto_model(real, tmp_path):
    tokenizer, base, model = real
    model.save_pretrained(tmp_path / "adapter")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter", trust_remote_code=True, dtype=torch.float32)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        a, b = model(**batch), reloaded(**batch)
    for key in ("logits", "loc_U", "scale_U", "loc_S", "scale_S"):
        assert torch.equal(a[key], b[key]), key


def test_compatible_greedy_equals_base_greedy(demo_base):
    tokenizer = AutoTokenizer.from_pretrained(demo_base)
    tokenizer.padding_side = "left"
    base = Qwen2ForCausalLM.from_pretrained(demo_base, dtype=torch.bfloat16).eval()
    model = CausalQwenForCausalLM.from_base(base).eval()
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    expected = base.generate(**batch, max_new_tokens=24, do_sample=False)
    got = model.generate(**batch, max_new_tokens=24, do_sample=False, inference_mode="compatible")
    assert torch.equal(got, expected)


def test_pipeline_on_the_adapter_folder_writes_what_the_base_writes(demo_base, tmp_path):
    """`pipeline("text-generation", model=adapter)` (the tokenizer by the adapter's pointer): with fresh heads in the
    compatible mode, the base's own greedy answer, chat template included."""
    from transformers import pipeline

    CausalQwenForCausalLM.from_base(str(demo_base), dtype=torch.float32).save_pretrained(tmp_path / "adapter")
    messages = [{"role": "user", "content": "Name a sorting algorithm."}]
    pipe = pipeline("text-generation", model=str(tmp_path / "adapter"), trust_remote_code=True, dtype=torch.float32)
    got = pipe(messages, max_new_tokens=12, do_sample=False, inference_mode="compatible")[0]["generated_text"]
    want = pipeline("text-generation", model=str(demo_base), dtype=torch.float32)(
        messages, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert got == want


def test_num_token_is_the_first_reserved_row_of_the_real_vocabulary(real):
    from causalqwen_adapter.numeric import NUM_TOKEN, add_num_token, encode_with_numbers

    tokenizer, base, _ = real
    numeric = CausalQwenForCausalLM.from_base(base, numeric=True).eval()
    assert numeric.config.num_token_id == 151665
    # A Hub Qwen2 tokenizer has 151665 entries and gets <NUM> there; the GGUF-built demo tokenizer names the
    # reserved rows "[PAD151665]"...: <NUM> is then used by id, and the vocabulary never grows.
    size = len(tokenizer)
    add_num_token(tokenizer, numeric.config.num_token_id)
    if size == 151665:
        assert tokenizer.convert_tokens_to_ids(NUM_TOKEN) == 151665 and len(tokenizer) == 151666
    else:
        assert tokenizer.convert_ids_to_tokens(151665) == "[PAD151665]" and len(tokenizer) == size
    enc = encode_with_numbers(tokenizer, "x = 42 * 3.5", 151665)
    assert [v for i, v in zip(enc["input_ids"], enc["numeric_values"]) if i == 151665] == [42.0, 3.5]
    batch = tokenizer(PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():  # numbers at 0 leave the base untouched
        got = numeric(**batch, numeric_values=torch.zeros(batch.input_ids.shape), inference_mode="compatible").logits
        want = base(**batch).logits
    assert (got - want).abs().max().item() <= 1e-4


def test_extracted_features_are_the_base_hidden_states(real, tmp_path):
    from causalqwen_adapter.features import extract_features

    tokenizer, base, _ = real
    stored = extract_features(base, PROMPTS, tmp_path / "features", top_k=4, tokenizer=tokenizer)
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        z = base.model(ids).last_hidden_state[0]
        top = torch.softmax(base.lm_head(z), -1).topk(4)
    rows = stored[: ids.shape[1]]
    torch.testing.assert_close(rows["hidden_state"], z, rtol=1e-4, atol=1e-4)
    assert torch.equal(rows["topk_ids"].long(), top.indices)


def test_bf16_decoding_through_the_cpu_kernel(demo_base, monkeypatch):
    """The real W_A (151936 × 896, bf16) through the causalqwen::cauchy_linear operator of kernels/cpu.py: loc_S,
    scale_S within one bf16 rounding of float64, and the same greedy tokens as the two blocked matmuls."""
    if not kernels.cpu.available(torch.bfloat16):
        pytest.skip("needs an x86-64 CPU with AVX512-BF16, c++ and ninja")
    tokenizer = AutoTokenizer.from_pretrained(demo_base)
    tokenizer.padding_side = "left"
    model = CausalQwenForCausalLM.from_base(demo_base, dtype=torch.bfloat16).eval()
    torch.manual_seed(0)
    loc_U, scale_U = torch.randn(5, 896).bfloat16(), torch.rand(5, 896).bfloat16()
    weight, bias = model.action.effective_weight(), model.action.bias
    loc_S, scale_S = torch.ops.causalqwen.cauchy_linear(loc_U, scale_U, weight, bias)
    want_loc = loc_U.double() @ weight.double().T + bias.double()
    want_scale = scale_U.double() @ weight.double().abs().T
    for got, want in ((loc_S, want_loc), (scale_S, want_scale)):
        assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()

    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    runs = {}
    for kernel in (False, True):
        monkeypatch.setattr(heads, "_FUSED_DECODE", kernel)
        runs[kernel] = model.generate(**batch, max_new_tokens=16, do_sample=False, inference_mode="causal")
    assert torch.equal(runs[True], runs[False])
