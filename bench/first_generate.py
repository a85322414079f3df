"""Benchmark: how long the first ``generate()`` of a fresh process takes, each inference mode against the base model
(demo base, bf16, batch 1, greedy, --new-tokens tokens).

The OvR modes' decode step runs kernels the base does not: where the C kernels of ``kernels/cpu.py`` run, nothing is
compiled at the first call (their library is built once per machine, into PyTorch's extensions cache, which this bench
warms first); on CPUs without them the installed package's operators run ``torch.compile``d kernels
(``kernels/compiled.py``), whose first call compiles: the variant "standard (compiled kernels)" forces that path to
show its cost. "standard (eager, the remote code's path)" runs no operator, as an adapter folder loaded without the
package does. Each variant runs in its own process with an empty
TorchInductor cache (--warm-inductor: one shared cache, filled by an untimed first round), so the figure is what a
user sees on a fresh machine (or on every run, with a warm cache). Variants interleaved, --repeats rounds; ratios
to the base per round, median (min–max) (bench/stats.py).

    python bench/first_generate.py --base build/demo-base --repeats 3
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from stats import round_ratios, spread

VARIANTS = ["base", "compatible", "standard", "causal", "sampling", "standard (compiled kernels)",
            "standard (eager, the remote code's path)"]


def _child(base: str, variant: str, new_tokens: int) -> dict:
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from causalqwen_adapter import CausalQwenForCausalLM, heads, kernels, modeling_causalqwen

    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    kwargs = {}
    if variant != "base":
        model = CausalQwenForCausalLM.from_base(model).eval()
        kwargs["inference_mode"] = variant.split()[0]
    if variant == "standard (compiled kernels)":  # as on a CPU without the C kernels
        kernels.cpu.c_cauchy_linear_applies = kernels.cpu.c_ovr_scores_applies = lambda *args: False
    if variant.startswith("standard (eager"):  # no causalqwen operator, as without the package
        heads.run_operator = modeling_causalqwen.run_operator = lambda name, *args: None
    input_ids = AutoTokenizer.from_pretrained(base)("The three laws of thermodynamics are", return_tensors="pt").input_ids
    times = []
    for _ in range(2):
        start = time.perf_counter()
        model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
        times.append(time.perf_counter() - start)
    return {"first": times[0], "second": times[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm-inductor", action="store_true", help="one TorchInductor cache for every process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.base, args.child, args.new_tokens)))
        return

    with tempfile.TemporaryDirectory() as shared:
        def run(variant):
            env = dict(os.environ)
            env["TORCHINDUCTOR_CACHE_DIR"] = shared if args.warm_inductor else tempfile.mkdtemp(dir=shared)
            cmd = [sys.executable, __file__, "--base", args.base, "--new-tokens", str(args.new_tokens), "--child", variant]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            return json.loads(out.strip().splitlines()[-1])

        run("standard")  # the C kernels' own one-off build (cached per machine), and a warm page cache
        if args.warm_inductor:
            run("standard (compiled kernels)")
        results = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                results[variant].append(run(variant))

    base_first = [r["first"] for r in results["base"]]
    print(f"first generate() of a process, {args.new_tokens} new tokens, batch 1, bf16, "
          f"{'warm' if args.warm_inductor else 'empty'} TorchInductor cache; seconds median (min–max), × base")
    for variant in VARIANTS:
        first = [r["first"] for r in results[variant]]
        second = [r["second"] for r in results[variant]]
        print(f"  {variant:40s} first {spread(first)} s   second {spread(second)} s   "
              f"first × base {spread(round_ratios(first, base_first))}")


if __name__ == "__main__":
    main()
