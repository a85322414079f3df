"""Benchmark: decoding tokens/s of every inference mode vs the base model, on the demo base (or any --base folder, loaded
as its own class) in bf16 (--dtype float32: in float32).

Same prompts, greedy (sampling mode draws its ε but picks argmax), exactly --new-tokens new tokens
(min_new_tokens), KV cache on, one untimed warm-up per variant (it also triggers the one-off
compilation of the decode kernels; "standard (eager)" runs without them, as CAUSALQWEN_FUSED_DECODE=0 does and as
an adapter folder's remote code does without the package).
Variants run interleaved, --repeats rounds; tokens/s are medians, ratios to the base are per round,
reported as median (min–max) (bench/stats.py). Targets: every mode ≥ 1.0×.

Two rates per variant: end to end (prompt + --new-tokens steps, what a user waits for) and decode
only, (new_tokens − 1)·batch / (T(new_tokens) − T(1)), which removes the prefill. The split matters
at batch > 1: the base `Qwen2ForCausalLM` feeds lm_head the non-contiguous slice
`hidden_states[:, -1:, :]` at prefill, and bf16 `F.linear` on such a 3-D input takes PyTorch's slow
CPU `bmm` path (it copies the weight once per row; pytorch/pytorch#151934), seconds per call here.

    python bench/decode.py --base build/demo-base --batch 1 8 --new-tokens 64 --repeats 3
    python bench/decode.py --base build/gemma3-270m --batch 1 --variants base compatible

On a machine other jobs share, `--clock cpu` times each run by this process's CPU time (`time.process_time`, all its
threads) instead of the wall clock: waiting for a core no longer counts, so the ratios measure the work each variant
does (the tokens/s are then per CPU-second, not what a user waits for).
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from causalqwen_adapter import CausalQwenForCausalLM, heads

from stats import round_ratios, spread

PROMPTS = [
    "def binary_search(xs, target):",
    "Write a haiku about the sea.",
    "import os\nimport sys\n\n",
    "The three laws of thermodynamics are",
    "class Stack:\n    def __init__(self):",
    "SELECT name, COUNT(*) FROM users",
    "Once upon a time, in a small village,",
    "# Compute the nth prime number\n",
]


VARIANTS = ["base", "compatible", "standard", "standard (eager)", "causal", "sampling"]


def prompts(batch_size: int) -> list[str]:
    """`batch_size` prompts, PROMPTS repeated as needed."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]


def run_variant(base, model, variant: str, batch, new_tokens: int):
    """Exactly `new_tokens` greedy tokens of `variant`: the base, or the heads in a mode ("(eager)": no decode kernels)."""
    generate_kwargs = dict(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if variant == "base":
        return base.generate(**generate_kwargs)
    mode, _, eager = variant.partition(" ")
    heads._FUSED_DECODE = eager != "(eager)"
    try:
        return model.generate(**generate_kwargs, inference_mode=mode)
    finally:
        heads._FUSED_DECODE = True


def measure(base, model, tokenizer, batch_size: int, new_tokens: int, repeats: int, variants=VARIANTS,
            synchronize=lambda: None, clock=time.perf_counter) -> dict[str, dict]:
    """Per variant: end-to-end and decode-only tokens/s (medians over the rounds) and the per-round times of both, the
    variants interleaved, one untimed warm-up each. `synchronize` waits for the device (torch.cuda.synchronize);
    `clock` reads the time (the wall clock, or `time.process_time`)."""
    device = next(model.parameters()).device
    batch = tokenizer(prompts(batch_size), return_tensors="pt", padding=True).to(device)
    full = {v: [] for v in variants}
    prefill = {v: [] for v in variants}

    def timed(v, n):
        synchronize()
        start = clock()
        out = run_variant(base, model, v, batch, n)
        synchronize()
        assert out.shape[1] == batch.input_ids.shape[1] + n
        return clock() - start

    with torch.inference_mode():
        for v in variants:
            timed(v, new_tokens)  # warm-up
        for _ in range(repeats):
            for v in variants:
                full[v].append(timed(v, new_tokens))
                prefill[v].append(timed(v, 1))
    results = {}
    for v in variants:
        # per round: the decode-only time is that round's full run minus its one-token run
        decode_times = [f - p for f, p in zip(full[v], prefill[v])]
        results[v] = {
            "end_to_end": batch_size * new_tokens / statistics.median(full[v]),
            "decode": batch_size * (new_tokens - 1) / statistics.median(decode_times),
            "full_times": full[v],
            "decode_times": decode_times,
        }
    return results


HEADER = f"{'batch':>5}  {'variant':<24}{'end-to-end tok/s':>17}  {'× base':<17}{'decode tok/s':>12}  {'× base':<17}"


def print_rows(batch_size: int, results: dict[str, dict]) -> None:
    """One line per variant: its rates and their ratios to the base's, median (min–max) of the rounds."""
    base = results["base"]
    for v, r in results.items():
        print(
            f"{batch_size:>5}  {v:<24}{r['end_to_end']:>17.2f}  {spread(round_ratios(base['full_times'], r['full_times'])):<17}"
            f"{r['decode']:>12.2f}  {spread(round_ratios(base['decode_times'], r['decode_times'])):<17}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="base and heads")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS, help="the base is always timed")
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                        help="wall: what a user waits for; cpu: this process's CPU time, for a shared machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = ["base"] + [v for v in args.variants if v != "base"]

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    tokenizer.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=getattr(torch, args.dtype)).eval()
    model = CausalQwenForCausalLM.from_base(base).eval()

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"{args.base} ({type(base).__name__}) {args.dtype}, {args.new_tokens} new tokens, {args.threads} threads, {args.repeats} interleaved "
          f"rounds, {args.clock} clock: median tokens/s, and the speed as a multiple of the base's, median (min–max) of "
          "the rounds")
    print(HEADER)
    for batch_size in args.batch:
        print_rows(batch_size, measure(base, model, tokenizer, batch_size, args.new_tokens, args.repeats, variants,
                                       clock=clock))


if __name__ == "__main__":
    main()
