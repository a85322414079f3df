"""On the real demo base (built by `make test-real`; skipped when absent)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM

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
