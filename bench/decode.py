"""Benchmark: decoding tokens/s of every inference mode vs the base model, on the demo base in bf16.

Same prompts, greedy (sampling mode draws its ε but picks argmax), exactly --new-tokens new tokens
(min_new_tokens), KV cache on, one untimed warm-up per variant (it also triggers the one-off
compilation of the fused batch-1 head). Variants run interleaved, --repeats rounds, medians reported
as tokens/s and as ratios to the base in the same run. Targets: compatible ≥ 0.95×, the OvR
modes ≥ 0.80×.

    python bench/decode.py --base build/demo-base --batch 1 8 --new-tokens 64 --repeats 3
"""

import argparse
import statistics
import time

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

import causalqwen_adapter.modeling_causalqwen as modeling
from causalqwen_adapter import CausalQwenForCausalLM

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    tokenizer.padding_side = "left"
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16).eval()
    model = CausalQwenForCausalLM.from_base(base).eval()

    def run(variant, batch):
        generate_kwargs = dict(**batch, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        if variant == "base":
            return base.generate(**generate_kwargs)
        mode, _, fused = variant.partition(" ")
        modeling._FUSED_DECODE = fused != "(two matmuls)"
        return model.generate(**generate_kwargs, inference_mode=mode)

    variants = ["base", "compatible", "standard", "standard (two matmuls)", "causal", "sampling"]
    print(f"demo base bf16, {args.new_tokens} new tokens, {args.threads} threads, medians of {args.repeats}")
    print(f"{'batch':>5}  {'variant':<24}{'tokens/s':>10}{'× base':>8}")
    for batch_size in args.batch:
        batch = tokenizer(PROMPTS[:batch_size], return_tensors="pt", padding=True)
        times = {v: [] for v in variants}
        with torch.inference_mode():
            for v in variants:
                run(v, batch)  # warm-up
            for _ in range(args.repeats):
                for v in variants:
                    start = time.perf_counter()
                    out = run(v, batch)
                    times[v].append(time.perf_counter() - start)
                    assert out.shape[1] == batch.input_ids.shape[1] + args.new_tokens
        rate = {v: batch_size * args.new_tokens / statistics.median(t) for v, t in times.items()}
        for v in variants:
            print(f"{batch_size:>5}  {v:<24}{rate[v]:>10.2f}{rate[v] / rate['base']:>8.2f}")
    modeling._FUSED_DECODE = True


if __name__ == "__main__":
    main()
