"""Causal heads on real checkpoints beyond the demo base, each against the base model itself: SmolLM2-135M-Instruct (Llama,
tied, vocabulary 49,152), Gemma 3 270M (sliding-window and global layers, head_dim 256, vocabulary 262,144) and
Qwen2.5-Coder-1.5B-Instruct (Qwen2 at three times the demo base's size: 28 layers, hidden 1,536), built by `make test-real`
(recipes/prepare_demo_base.py --base ...); each skipped while its folder is absent."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.data import batches, tokenize_for_evaluation
from causalqwen_adapter.evaluation import evaluate
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

from conftest import REPO_ROOT

pytestmark = pytest.mark.real

# where `make test-real` builds them; CAUSALQWEN_REAL_BASES points elsewhere (a folder holding one folder per base)
REAL_BASES = Path(os.environ.get("CAUSALQWEN_REAL_BASES", REPO_ROOT / "build"))
BASES = {"smollm2-135m": "LlamaForCausalLM", "gemma3-270m": "Gemma3ForCausalLM",
         "qwen2.5-coder-1.5b": "Qwen2ForCausalLM"}
PROMPTS = ["def quicksort(xs):", "The capital of France is"]
HELD_OUT_ROWS = 24  # held-out documents scored (up to 160 tokens each): enough tokens for top-1 to move by < 0.1%


def _demo_recipe():
    """recipes/demo.py: its text set (standard-library docstrings, held-out modules apart) is the one trained on here."""
    spec = importlib.util.spec_from_file_location("demo_recipe", REPO_ROOT / "recipes" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=list(BASES))
def real_base(request) -> Path:
    path = REAL_BASES / request.param
    if not (path / "config.json").exists():
        pytest.skip(f"real base {request.param} not built at {path}: run `make test-real` "
                    f"(or recipes/prepare_demo_base.py {path} --base {request.param})")
    return path


def _tokenizer(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return tokenizer


def _real_text(count: int) -> list[str]:
    demo = _demo_recipe()
    texts = [t for t in demo.stdlib_docstrings(limit=10_000) if t.split(".")[0] in demo.HELD_OUT_MODULES]
    return texts[:count]


def test_loc_S_equals_base_logits_on_real_text(real_base):
    tokenizer = _tokenizer(real_base)
    base = AutoModelForCausalLM.from_pretrained(real_base, dtype=torch.float32).eval()
    assert type(base).__name__ == BASES[real_base.name]
    model = CausalQwenForCausalLM.from_base(base).eval()
    batch = tokenizer(_real_text(3), return_tensors="pt", padding=True, truncation=True, max_length=96)
    with torch.no_grad():
        loc_S = model(**batch, inference_mode="compatible").loc_S
        logits = base(**batch).logits
    mask = batch.attention_mask.bool()
    loc_S, logits = loc_S[mask], logits[mask]
    # the figures bench/results/real-architectures.md records (`pytest -s`)
    print(f"\n{real_base.name}: {len(logits)} positions, max |loc_S - logits| {(loc_S - logits).abs().max().item():.3g}"
          f" (max |logits| {logits.abs().max().item():.3g})")
    assert loc_S.shape == logits.shape and logits.shape[-1] == base.config.vocab_size
    # fp32: W_A z and lm_head(z) are the same dot products, summed in possibly different orders
    assert (loc_S - logits).abs().max().item() <= 1e-4 * logits.abs().max().item()
    assert torch.equal(loc_S.argmax(-1), logits.argmax(-1))
    with torch.no_grad():
        checks = model.verify_initialization(batch.input_ids, batch.attention_mask, base_model=base)
    assert checks["feature_diff"] == 0 and checks["logits_diff"] <= 1e-6


def test_compatible_greedy_equals_base_greedy_for_32_tokens(real_base):
    tokenizer = _tokenizer(real_base)
    base = AutoModelForCausalLM.from_pretrained(real_base, dtype=torch.bfloat16).eval()
    model = CausalQwenForCausalLM.from_base(base).eval()
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    # min_new_tokens: an early end-of-text would leave fewer than 32 tokens to compare
    options = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    expected = base.generate(**batch, **options)
    got = model.generate(**batch, **options, inference_mode="compatible")
    print(f"\n{real_base.name}: {tokenizer.batch_decode(expected[:, batch.input_ids.shape[1]:])}")
    assert expected.shape[1] == batch.input_ids.shape[1] + 32
    assert torch.equal(got, expected)


def test_twenty_training_steps_keep_the_base_held_out_top1(real_base, tmp_path):
    """The default recipe (recipes/sft_ovr.py's defaults, as recipes/demo.py trains) for 20 steps on docstrings of the
    standard library; scored on docstrings of modules it never saw, against the base's own next-token top-1."""
    demo = _demo_recipe()
    tokenizer = _tokenizer(real_base)
    texts = [t for t in demo.stdlib_docstrings() if t.split(".")[0] not in demo.HELD_OUT_MODULES]
    args = CausalSFTConfig(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=2, max_length=128,
                           save_strategy="no", report_to="none", seed=0, disable_tqdm=True)
    trainer = CausalSFTTrainer(str(real_base), args=args, train_dataset=Dataset.from_dict({"text": texts}).shuffle(seed=0),
                               processing_class=tokenizer)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses)))

    held_out = Dataset.from_dict({"text": _real_text(HELD_OUT_ROWS)})
    rows = tokenize_for_evaluation(held_out, tokenizer, max_length=160)
    pad = tokenizer.pad_token_id or 0
    base = AutoModelForCausalLM.from_pretrained(real_base, dtype=torch.float32).eval()  # the trainer's dtype
    with torch.no_grad():
        want = evaluate(base, batches(rows, 4, pad))["softmax"]
        got = evaluate(trainer.model.eval(), batches(rows, 4, pad), ("compatible",))["compatible"]
    print(f"\n{real_base.name}: loss {losses[0]:.3f} -> {losses[-1]:.3f}; held-out {want['num_tokens']} tokens, top-1 "
          f"base {want['top1_accuracy']:.4f} trained {got['top1_accuracy']:.4f}, NLL base {want['nll']:.4f} "
          f"trained {got['nll']:.4f}")
    assert got["num_tokens"] == want["num_tokens"] > 1000
    assert got["top1_accuracy"] >= want["top1_accuracy"], (got, want)
