"""Benchmark: one training step of `causalqwen compare`'s arms on the real heads, and the scoring of a run's rows.

A step is what `comparison.training.train_arm` does per batch: `arm_loss` on 16 rows (two targets each, 32
positions), backward, gradient clipping, the fused AdamW step; the heads come from `FreshHeads(base)`, the optimizer
from `optimizer_for(..., fused=True)`. Features are random (the cost depends on the shapes only). Each arm runs
`--steps` steps after one warm-up step (which allocates the optimizer's state); the figures are the median per step
of process CPU time and of wall time, and the scoring of `--score-rows` rows (`arm_scores`) once.

To compare two versions of the package on a shared machine, alternate them and read the ratios:

    PYTHONPATH=/path/to/before python bench/compare_step.py --base build/demo-base --threads 1
    PYTHONPATH=/path/to/after  python bench/compare_step.py --base build/demo-base --threads 1

Prints one JSON line.
"""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from causalqwen_adapter.classification import LabelSet
from causalqwen_adapter.comparison.arms import arm_loss
from causalqwen_adapter.comparison.metrics import arm_scores
from causalqwen_adapter.comparison.training import FreshHeads, RecipeRates, optimizer_for


def timed(fn):
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--arms", nargs="+", default=["softmax", "ovr_candidates", "ovr_alone"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--score-rows", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    H = base.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    labels = LabelSet([f" l{k}" for k in range(6)], list(range(1000, 1006)))
    heads, rates, out = FreshHeads(base), RecipeRates(), {}
    for arm in args.arms:
        model = heads(arm)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = optimizer_for(model, 1e-3, rates.location_lr_ratio, rates.threshold_lr_ratio, fused=True)
        model.train()

        def step():
            z = torch.randn(32, H, generator=generator)
            targets = torch.tensor(labels.token_ids)[torch.randint(0, 6, (32,), generator=generator)]
            loss = arm_loss(model, arm, z, targets)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, rates.max_grad_norm)
            optimizer.step()

        step()  # warm-up: the optimizer's state
        cpu, wall = zip(*(timed(step) for _ in range(args.steps)))
        model.eval()
        z = torch.randn(args.score_rows, H, generator=generator)
        score_cpu, score_wall = timed(lambda: arm_scores(model, arm, z, labels))
        out[arm] = {"step_cpu_s": round(statistics.median(cpu), 3), "step_wall_s": round(statistics.median(wall), 3),
                    "score_cpu_s": round(score_cpu, 2), "score_wall_s": round(score_wall, 2)}
        print(arm, out[arm], flush=True)
    import causalqwen_adapter
    print(json.dumps({"package": causalqwen_adapter.__file__, "threads": args.threads, "steps": args.steps,
                      "score_rows": args.score_rows, "arms": out}))


if __name__ == "__main__":
    main()
