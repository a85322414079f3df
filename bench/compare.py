"""Benchmark: how long `causalqwen compare` takes after feature extraction, on 2,000 rows × 5 seeds (issue 51's target:
≤ 15 min on 2 CPU cores).

The training and scoring cost depends on the shapes (V × H of the base, the rows per split, the steps) and not on the
feature values, so the features here are random rows of the base's hidden size: what is timed is
`causalqwen_adapter.comparison.runs.run_comparison`, the code the subcommand runs, on the real base's heads. With
`--full` every run of the protocol runs (arms × rates × seeds); without it, `--sample` runs of each arm (seed 0, the
grid's middle rate), and the total is extrapolated as Σ_arm (mean seconds of its runs) × rates × seeds + the one build
of its fresh heads — every run of an arm has the same shapes and steps.

    python bench/compare.py --base build/demo-base --threads 2               # a sample, extrapolated
    python bench/compare.py --base build/demo-base --threads 2 --full        # the whole 45 runs
    python bench/compare.py --base build/demo-base --threads 1 --num_proc 2 --full   # 2 runs at once

Prints one JSON line: the per-run seconds and the (extrapolated) total, wall and (sampled runs) process CPU time: on a
machine shared with other jobs the wall time measures the sharing; the CPU time of one thread is what the run costs.
"""

import argparse
import json
import math
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from causalqwen_adapter.classification import LabelSet
from causalqwen_adapter.comparison import runs as runs_module
from causalqwen_adapter.comparison.runs import Protocol, run_comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--arms", nargs="+", default=Protocol().arms)
    parser.add_argument("--lrs", nargs="+", type=float, default=Protocol().lrs)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="run every run of the protocol instead of a sample")
    parser.add_argument("--num_proc", type=int, default=1, help="with --full: processes training runs at once, "
                        "--threads each (`causalqwen compare --num_proc`)")
    parser.add_argument("--sample", type=int, default=1, help="runs timed per arm without --full")
    parser.add_argument("--steps", type=int, default=0,
                        help="without --full: train the sampled runs this many steps and scale their training time "
                             "to the protocol's (one epoch); 0: the protocol's steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    H, V = base.config.hidden_size, base.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    features = {"z": torch.randn(args.rows, H, generator=generator),
                "z_label": torch.randn(args.rows, args.classes, H, generator=generator),
                "label": torch.arange(args.rows) % args.classes}
    labels = LabelSet([f" l{k}" for k in range(args.classes)], list(range(1000, 1000 + args.classes)))
    seeds = list(range(args.seeds))
    protocol = Protocol(arms=args.arms, lrs=args.lrs, seeds=seeds)
    start = time.perf_counter()
    if args.full:
        out = run_comparison(base, features, labels, base.config.eos_token_id or 0, protocol, num_proc=args.num_proc,
                             threads=args.threads)
        total = time.perf_counter() - start
        by_arm = {arm: [r["seconds"] for r in out["runs"] if r["arm"] == arm] for arm in args.arms}
    else:
        by_arm, cpu, build = {}, {}, {}
        middle = [args.lrs[len(args.lrs) // 2]]
        for arm in args.arms:  # the baseline needs another arm: time each arm against itself, seeds 0 and 1
            sample = Protocol(arms=[arm, "softmax"] if arm != "softmax" else ["softmax", "ovr_candidates"], lrs=middle,
                              seeds=[0, 1])
            d = runs_module.seed_data(features, labels, sample, 0)
            heads = runs_module.FreshHeads(base)
            c0, t0 = time.process_time(), time.perf_counter()
            heads(arm)  # built once per arm in the protocol: timed once, not scaled with the steps
            build[arm] = (time.perf_counter() - t0, time.process_time() - c0)
            epoch = math.ceil(len(d.train_rows) / sample.batch_rows)
            steps = args.steps or epoch
            for _ in range(args.sample):
                c0, t0 = time.process_time(), time.perf_counter()
                model = runs_module.train_arm(base, arm, d.features, d.train_rows, d.train_labels, d.labels, 0, middle[0], steps,
                                    sample.batch_rows, 0, runs_module.RecipeRates(), heads=heads)
                c1, t1 = time.process_time(), time.perf_counter()
                runs_module.accuracies(model, arm, features["z"][d.val_rows], d.val_target, d.labels)
                runs_module.test_metrics(model, arm, features, d)
                c2, t2 = time.process_time(), time.perf_counter()
                by_arm.setdefault(arm, []).append((t1 - t0) * epoch / steps + t2 - t1)
                cpu.setdefault(arm, []).append((c1 - c0) * epoch / steps + c2 - c1)
                print(f"{arm}: heads built in {build[arm][0]:.1f}s ({build[arm][1]:.1f} CPU-s); training {t1 - t0:.1f}s ({c1 - c0:.1f} CPU-s; {steps} of {epoch} steps), scoring "
                      f"{t2 - t1:.1f}s ({c2 - c1:.1f} CPU-s); a run {by_arm[arm][-1]:.1f}s ({cpu[arm][-1]:.1f} CPU-s)",
                      flush=True)
        total = sum(statistics.fmean(v) * len(args.lrs) * len(seeds) + build[arm][0] for arm, v in by_arm.items())
        cpu_total = sum(statistics.fmean(v) * len(args.lrs) * len(seeds) + build[arm][1] for arm, v in cpu.items())
    print(json.dumps({"base": args.base, "vocab": V, "hidden": H, "rows": args.rows, "seeds": len(seeds),
                      "arms": args.arms, "lrs": args.lrs, "threads": args.threads, "num_proc": args.num_proc, "full": args.full,
                      "seconds_per_run": {arm: [round(s, 1) for s in v] for arm, v in by_arm.items()},
                      "total_minutes": round(total / 60, 1),
                      "total_cpu_minutes": None if args.full else round(cpu_total / 60, 1), "extrapolated": not args.full,
                      "steps_timed": args.steps or "one epoch"}))


if __name__ == "__main__":
    main()
