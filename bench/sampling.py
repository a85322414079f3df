"""Benchmark: is text sampled at temperature 1 coherent? The base model judges the samples of each model.

For each of --prompts prompts (the first 48 tokens of windows of held-out standard-library modules), every model
samples --new-tokens tokens at generation temperature 1 (`do_sample=True`, no top-k/top-p); the base model then
scores each continuation, and the table gives the mean NLL per token (nats) it assigns to them. A model whose
samples the base finds as likely as its own samples has a ratio of 1.0 to the base's row. The fraction of distinct
2-grams per continuation shows whether a low NLL comes from repetition.

    python bench/sampling.py --base build/demo-base --adapters build/bench-heads/default --modes standard sampling

Adapters are scored in each mode of --modes (the OvR modes sample from the config's `ovr_distribution`).
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from causalqwen_adapter import CausalQwenForCausalLM  # noqa: E402
from causalqwen_adapter.configuration_causalqwen import OVR_DISTRIBUTIONS  # noqa: E402

from heads_recipe import HELD_OUT_MODULES, windows  # noqa: E402


@torch.no_grad()
def base_nll(base, prompt, continuation) -> float:
    ids = torch.cat([prompt, continuation])[None]
    logits = base(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.nn.functional.cross_entropy(logits, continuation).item()


def sample(model, prompt, new_tokens, seed, temperature=1.0, **kwargs):
    torch.manual_seed(seed)
    out = model.generate(prompt[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                         temperature=temperature, top_k=0, top_p=1.0, **kwargs)
    return out[0, len(prompt):]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--adapters", nargs="*", default=[])
    parser.add_argument("--modes", nargs="+", default=["standard", "sampling"])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-base", action="store_true", help="only the adapters (the base row is still scored)")
    parser.add_argument("--ovr-distribution", choices=list(OVR_DISTRIBUTIONS),
                        help="the OvR modes' next-token distribution for every adapter (default: each adapter's config)")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16).eval()
    prompts = windows(tokenizer, HELD_OUT_MODULES, args.prompt_tokens, args.prompts)
    runs = {"base": lambda p, seed: sample(base, p, args.new_tokens, seed)}
    if args.skip_base:
        runs = {}
    for folder in args.adapters:
        model = CausalQwenForCausalLM.from_pretrained(folder, base_model=base, dtype=torch.bfloat16).eval()
        if args.ovr_distribution:
            model.config.ovr_distribution = args.ovr_distribution
        for mode in args.modes:
            runs[f"{Path(folder).name} {mode}"] = (
                lambda p, seed, model=model, mode=mode: sample(model, p, args.new_tokens, seed, inference_mode=mode))
    results = {}
    for name, run in runs.items():
        samples = [(p, run(p, seed)) for seed, p in enumerate(prompts)]
        nll = sum(base_nll(base, p, c) for p, c in samples) / len(samples)
        # distinct 2-grams per continuation: a sampler can please the judge by repeating itself
        distinct = sum(len(set(zip(c.tolist(), c[1:].tolist()))) / max(len(c) - 1, 1) for _, c in samples) / len(samples)
        results[name] = (nll, distinct)
        print(f"{name}: base NLL of its samples {nll:.3f} nats/token, distinct 2-grams {distinct:.3f}", flush=True)
    print("\n| model | base's NLL of the samples (nats/token) | × base's own | distinct 2-grams |\n|---|---:|---:|---:|")
    for name, (nll, distinct) in results.items():
        ratio = f"{nll / results['base'][0]:.2f}" if "base" in results else "–"
        print(f"| {name} | {nll:.3f} | {ratio} | {distinct:.3f} |")

if __name__ == "__main__":
    main()
