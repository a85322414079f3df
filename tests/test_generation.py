"""generate() in every inference mode (docs/design.md, Inference modes): exactness, the cache, sampling noise, options."""

import gc
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList, Qwen2ForCausalLM
from transformers.generation.streamers import BaseStreamer

from causalqwen_adapter import (
    CausalQwenForCausalLM,
    dispatch,
    heads,
    kernels,
    modeling_causalqwen,
)
from causalqwen_adapter.cauchy import (
    cauchy_linear,
    cauchy_linear_blocked,
    ovr_decision_scores,
    ovr_log_prob,
    ovr_standardize,
)

from conftest import TINY_VOCAB, decision_scores_float64

DETERMINISTIC = ["compatible", "standard", "causal"]


@pytest.fixture
def padded_batch():
    ids = torch.randint(1, TINY_VOCAB - 1, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :3] = 0  # left padding, as generation wants it
    mask[1, :3] = 0
    ids[2, :1] = 0
    mask[2, :1] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _trained_like(base_path, **config):
    """Heads away from init, so that OvR modes pick different tokens from the base (and B ≠ 0 for a "lora" W_A)."""
    model = CausalQwenForCausalLM.from_base(base_path, **config).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        model.abduction.scale.weight.normal_(std=0.2)
        model.action.b_noise.uniform_(0.0, 2.0)
        if model.config.action_weight == "lora":
            model.action.lora_B.normal_(std=0.02)
    return model


def test_compatible_greedy_equals_base_with_padding(tiny_base, padded_batch):
    base = Qwen2ForCausalLM.from_pretrained(tiny_base).eval()
    model = CausalQwenForCausalLM.from_base(tiny_base).eval()
    expected = base.generate(**padded_batch, max_new_tokens=10, do_sample=False)
    got = model.generate(**padded_batch, max_new_tokens=10, do_sample=False, inference_mode="compatible")
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", DETERMINISTIC)
def test_cache_gives_the_same_tokens_as_no_cache(tied_base, padded_batch, mode):
    model = _trained_like(tied_base)
    with_cache = model.generate(**padded_batch, max_new_tokens=10, do_sample=False, inference_mode=mode)
    without = model.generate(**padded_batch, max_new_tokens=10, do_sample=False, inference_mode=mode, use_cache=False)
    assert torch.equal(with_cache, without)


def test_ovr_greedy_is_argmax_of_P(tied_base, padded_batch):
    model = _trained_like(tied_base)
    out = model.generate(**padded_batch, max_new_tokens=1, do_sample=False, inference_mode="standard",
                         output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        full = model(**padded_batch, inference_mode="standard")
    p_last = full.logits[:, -1].exp()
    assert torch.equal(out.sequences[:, -1], p_last.argmax(-1))


def test_sampling_is_reproducible_with_a_seed(tied_base, padded_batch):
    model = _trained_like(tied_base)

    def draw(seed, **kw):
        torch.manual_seed(seed)
        return model.generate(**padded_batch, max_new_tokens=12, do_sample=True, top_k=20, top_p=0.9,
                              inference_mode="sampling", causal_temperature=1.5, **kw)

    assert torch.equal(draw(0), draw(0))
    assert not torch.equal(draw(0), draw(1))
    assert torch.equal(draw(0, noise_sharing="sequence"), draw(0, noise_sharing="sequence"))


@pytest.mark.parametrize("sharing", ["step", "sequence"])
def test_sampling_noise_per_step_or_per_sequence(tied_base, padded_batch, sharing):
    model = _trained_like(tied_base)
    seen = []
    model.register_forward_hook(lambda module, args, output: seen.append(output.causal_noise))
    model.generate(**padded_batch, max_new_tokens=5, do_sample=False, inference_mode="sampling", noise_sharing=sharing)
    assert len(seen) == 5
    if sharing == "sequence":
        assert seen[0].shape == (3, 1, model.config.causal_size)
        assert all(torch.equal(n, seen[0]) for n in seen)
    else:
        # one ε per scored position: generate scores only the last one (logits_to_keep=1)
        assert all(n.shape == (3, 1, model.config.causal_size) for n in seen)
        assert not torch.equal(seen[1], seen[2])


def test_sampling_noise_shifts_loc_by_T_b_noise_eps(tied_base, input_ids):
    model = _trained_like(tied_base)
    eps = torch.randn(2, 1, model.config.causal_size)
    with torch.no_grad():
        out = model(input_ids, inference_mode="sampling", causal_temperature=0.7, causal_noise=eps)
        causal = model(input_ids, inference_mode="causal")
    shifted = causal.loc_U + 0.7 * model.action.b_noise.abs() * eps
    expected = shifted @ model.action.weight.T + model.action.bias
    torch.testing.assert_close(out.loc_S, expected)
    torch.testing.assert_close(out.scale_S, causal.scale_S)


class CollectingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_eos_and_stopping(tied_base, input_ids):
    model = _trained_like(tied_base)
    streamer = CollectingStreamer()
    out = model.generate(input_ids[:1], max_new_tokens=6, do_sample=False, inference_mode="standard", streamer=streamer)
    assert streamer.ended and sum(streamer.chunks[1:], []) == out[0, input_ids.shape[1]:].tolist()
    first = out[0, input_ids.shape[1]].item()
    stopped = model.generate(input_ids[:1], max_new_tokens=6, do_sample=False, inference_mode="standard",
                             eos_token_id=first)
    assert stopped.shape[1] == input_ids.shape[1] + 1


def test_bad_options(tied_base, input_ids):
    model = _trained_like(tied_base)
    with pytest.raises(ValueError, match="choose one of compatible, standard, sampling, causal"):
        model.generate(input_ids, max_new_tokens=2, inference_mode="beam")
    with pytest.raises(ValueError, match="causal_temperature must be a finite number >= 0"):
        model.generate(input_ids, max_new_tokens=2, inference_mode="standard", causal_temperature=-0.5)
    with pytest.raises(ValueError, match="noise_sharing"):
        model.generate(input_ids, max_new_tokens=2, inference_mode="sampling", noise_sharing="batch")
    with pytest.warns(UserWarning, match="'causal' ignores causal_temperature"):
        model.generate(input_ids, max_new_tokens=2, inference_mode="causal", causal_temperature=2.0)
    with pytest.warns(UserWarning, match="'standard' ignores noise_sharing"):
        model.generate(input_ids, max_new_tokens=2, inference_mode="standard", noise_sharing="sequence")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a valid call stays quiet
        model.generate(input_ids, max_new_tokens=2, inference_mode="sampling", causal_temperature=0.5)


@pytest.mark.parametrize("mode", ["standard", "causal", "sampling"])
def test_decoding_holds_no_vocabulary_sized_tensor_besides_the_weights(tied_base, padded_batch, mode):
    model = _trained_like(tied_base)  # a "full" adapter: W_A is its own [V, C] parameter beside the embedding
    shape = tuple(model.action.weight.shape)

    def vocabulary_sized():  # every live tensor of W_A's shape in this process
        # real tensors only: fake ones (torch.compile's, cached by other tests' compiled graphs) have no data
        return {o.data_ptr() for o in gc.get_objects()
                if type(o) in (torch.Tensor, torch.nn.Parameter) and tuple(o.shape) == shape}

    gc.collect()  # other tests' models, left in reference cycles, are not this test's business
    before = vocabulary_sized()
    strays = []

    class ScanMemory(LogitsProcessor):  # runs between decode steps, with the model's state as decoding leaves it
        def __call__(self, ids, scores):
            strays.extend(vocabulary_sized() - before)
            return scores

    model.generate(**padded_batch, max_new_tokens=3, do_sample=False, inference_mode=mode,
                   logits_processor=LogitsProcessorList([ScanMemory()]))
    assert strays == []  # e.g. no cached |W_A|
    vocabulary_sized_parameters = {name for name, p in model.named_parameters() if tuple(p.shape) == shape}
    assert vocabulary_sized_parameters == {"action.weight", "model.embed_tokens.weight"}
    assert not [name for name, b in model.named_buffers() if tuple(b.shape) == shape]


def test_blocked_kernel_matches_float64_reference():
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 24), torch.randn(300)
    loc_U, scale_U = torch.randn(2, 5, 24), torch.rand(2, 5, 24)
    w64 = weight.double()
    want_loc = torch.einsum("vc,blc->blv", w64, loc_U.double()) + bias.double()
    want_scale = torch.einsum("vc,blc->blv", w64.abs(), scale_U.double())
    for block_rows in (64, 300, 4096):  # a partial last block, one exact block, a block larger than V
        for b, expected_loc in ((bias, want_loc), (None, want_loc - bias.double())):
            loc_S, scale_S = cauchy_linear_blocked(loc_U, scale_U, weight, b, block_rows=block_rows)
            assert loc_S.shape == scale_S.shape == (2, 5, 300)
            torch.testing.assert_close(loc_S.double(), expected_loc, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(scale_S.double(), want_scale, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the model's heads take that path without gradient, and give the same scores
        model_weight = weight.clone()
        got = cauchy_linear_blocked(loc_U, scale_U, model_weight, bias)
        model_weight.mul_(2.0)  # nothing is cached: a changed W_A is read as it is now
        again = cauchy_linear_blocked(loc_U, scale_U, model_weight, bias)
    torch.testing.assert_close(again[1], 2 * got[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the products in autocast's dtype, as F.linear's would be
        loc_S, scale_S = cauchy_linear_blocked(loc_U, scale_U, weight, bias, block_rows=64)
        expected = cauchy_linear(loc_U, scale_U, weight, bias)
    assert loc_S.dtype == scale_S.dtype == expected[0].dtype == torch.bfloat16
    torch.testing.assert_close(loc_S.double(), want_loc, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(scale_S.double(), want_scale, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("rows", [1, 4])
def test_fused_kernel_matches_float64_reference(rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 24), torch.randn(300)
    loc_U, scale_U = torch.randn(rows, 1, 24), torch.rand(rows, 1, 24)
    fused = kernels.compiled.cauchy_linear(loc_U, scale_U, weight, bias)
    assert not kernels.compiled._fused_matvec.given_up, "torch.compile is unavailable here"
    expected = cauchy_linear(loc_U.double(), scale_U.double(), weight.double(), bias.double())
    for got, want in zip(fused, expected):
        assert got.shape == (rows, 1, 300)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("distribution, relative", [("accept_once", True), ("accept", True), ("normalize", True),
                                                    ("accept_once", False)])
def test_compiled_decision_scores_match_float64_reference(distribution, relative):
    torch.manual_seed(0)
    loc_S, scale_S = torch.randn(2, 3, 1000) * 3, torch.rand(2, 3, 1000) + 0.1
    threshold = torch.randn(1000) - (8.0 if relative else 0.0)  # near log-probabilities under relative thresholds
    want = decision_scores_float64(loc_S, scale_S, threshold, relative, distribution)
    eager = ovr_decision_scores(loc_S, scale_S, threshold, relative, distribution)
    compiled = kernels.compiled.CompiledKernel(ovr_decision_scores)(loc_S, scale_S, threshold, relative, distribution)
    assert compiled is not None, "torch.compile is unavailable here"
    log_r = torch.log_softmax(loc_S, -1)  # the evaluation passes log P_k it already has
    log_P = ovr_log_prob(ovr_standardize(log_r if relative else loc_S, scale_S, threshold))
    given = ovr_decision_scores(loc_S, scale_S, threshold, relative, distribution, log_P=log_P)
    # the logits decide through their differences within a row: compare them up to a constant per row
    for got in (eager, compiled, given):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close((got - got[..., :1]).double(), want - want[..., :1], rtol=1e-5, atol=1e-5)


def test_generation_with_compiled_kernels_matches_eager(tied_base, padded_batch, monkeypatch):
    """The installed package's compiled kernels (what the operators run where C does not) decode as the eager torch
    code does."""
    model = _trained_like(tied_base)
    runs = {}
    monkeypatch.setattr(heads, "_FUSED_MIN_NUMEL", 0)  # the tiny model takes the operators too
    monkeypatch.setattr(kernels.compiled, "FUSED_MAX_ROWS", 2)  # batch 3: the blocked head beside the compiled scores
    monkeypatch.setattr(kernels.cpu, "c_cauchy_linear_applies", lambda *args: False)  # as on a CPU without the C ones
    monkeypatch.setattr(kernels.cpu, "c_ovr_scores_applies", lambda *args: False)
    calls = {"cauchy_linear": 0, "ovr_scores": 0}
    for name in calls:
        def counted(*args, _name=name, _kernel=getattr(kernels.compiled, name)):
            calls[_name] += 1
            return _kernel(*args)
        monkeypatch.setattr(kernels.compiled, name, counted)
    for compiled in (False, True):
        monkeypatch.setattr(heads, "_FUSED_DECODE", compiled)
        for batch in (1, 2, 3):  # the fused head at one and two rows, then the blocked one
            inputs = {k: v[:batch] for k, v in padded_batch.items()}
            runs[compiled, batch] = model.generate(**inputs, max_new_tokens=4, do_sample=False, output_scores=True,
                                                   return_dict_in_generate=True, inference_mode="standard")
    # 4 steps at batch 1 and 2 through the compiled head, every step of the three batches through the scores
    assert calls == {"cauchy_linear": 8, "ovr_scores": 12}, calls
    assert not (kernels.compiled._fused_matvec.given_up or kernels.compiled._decision_scores.given_up)
    for batch in (1, 2, 3):
        eager, compiled = runs[False, batch], runs[True, batch]
        assert torch.equal(compiled.sequences, eager.sequences)
        for got, want in zip(compiled.scores, eager.scores):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("action_weight", ["full", "tied", "lora"])
def test_generation_through_the_cpu_kernel_matches_matmuls(tied_base, padded_batch, monkeypatch, action_weight, dtype):
    """A bf16 or float32 model decodes through the causalqwen::cauchy_linear operator of kernels/cpu.py at 1 to 3 rows,
    whichever tensor holds W_A (its own, the base's, the base's + B·A), and scores through causalqwen::ovr_scores;
    the tokens are those of the two blocked matmuls and the eager scores (CAUSALQWEN_FUSED_DECODE=0), the scores
    within the dtype's rounding."""
    if not kernels.cpu.available(dtype):
        pytest.skip(f"no C kernel for {dtype} on this machine (x86-64 with AVX-512, AVX512-BF16 for bf16, c++, ninja)")
    model = _trained_like(tied_base, action_weight=action_weight, action_lora_rank=4).to(dtype)
    calls = {"cauchy_linear": [], "ovr_scores": []}

    def counted(name, *args):
        out = dispatch.run_operator(name, *args)
        calls[name].append(out is not None)
        return out

    monkeypatch.setattr(heads, "_FUSED_MIN_NUMEL", 0)
    monkeypatch.setattr(heads, "run_operator", counted)
    monkeypatch.setattr(modeling_causalqwen, "run_operator", counted)
    runs = {}
    for kernel in (False, True):
        monkeypatch.setattr(heads, "_FUSED_DECODE", kernel)
        for batch in (1, 3):
            inputs = {k: v[:batch] for k, v in padded_batch.items()}
            runs[kernel, batch] = model.generate(**inputs, max_new_tokens=4, do_sample=False, output_scores=True,
                                                 return_dict_in_generate=True, inference_mode="causal")
    for ran in calls.values():  # every step of the kernel runs went through both, none of the others
        assert ran and all(ran)
    for batch in (1, 3):
        matmuls, kernel = runs[False, batch], runs[True, batch]
        assert torch.equal(kernel.sequences, matmuls.sequences)
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
        for got, want in zip(kernel.scores, matmuls.scores):
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


# --------------------------------------------------------------------------------------- recipes/generate.py


@pytest.mark.parametrize("spelling", [("--no-chat", "--mode", "--max-new-tokens"),
                                      ("--no_chat", "--inference_mode", "--max_new_tokens")])
def test_generate_recipe_streams_the_greedy_answer(sft_base, tmp_path, spelling):
    """Compatible mode with fresh heads: what the recipe prints is the base's own greedy continuation. Its options
    read under their dashed names and generate()'s keywords alike."""
    base = Qwen2ForCausalLM.from_pretrained(sft_base).eval()
    CausalQwenForCausalLM.from_base(base).save_pretrained(tmp_path / "adapter")
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    prompt = "the cat sat on"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = tokenizer.decode(base.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:],
                                skip_special_tokens=True)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "generate.py"
    no_chat, mode, max_new_tokens = spelling
    env = {**os.environ, "PYTHONPATH": str(recipe.parents[1])}  # the recipe beside this checkout's package
    proc = subprocess.run([sys.executable, str(recipe), str(tmp_path / "adapter"), "--prompt", prompt, no_chat,
                           mode, "compatible", max_new_tokens, "5"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == expected.strip()
