"""Benchmark: time to quality — the steps and wall time the default OvR recipe needs to reach the softmax
baseline's held-out top-1 accuracy, as a ratio to the baseline's own.

Same set-up as `bench/heads_recipe.py` (its cached backbone features, its training loop: `model.heads_loss` on
batches of --batch-tokens targets, AdamW with the trainer's per-role learning rates and linear decay). The two
configurations train side by side, their steps alternating so that the machine's slow moments slow both alike;
every --eval-every steps both are scored on the held-out tokens (not counted in the wall time).

The target is the softmax baseline's top-1 at its last step. The baseline's own time to it is the first evaluation
at which it reaches it (at most --steps); the default recipe's is the first evaluation at which its top-1 — in the
compatible mode, and in the OvR default mode (`standard`) — reaches the same value. Ratios are default / baseline,
in steps and in training wall time; "not reached" when the default recipe never gets there within --steps.
The heads are float32; --autocast runs their losses under bf16 autocast, as a Trainer with bf16=True (TRL's default)
does.

    python bench/time_to_quality.py --base build/demo-base --steps 200 --eval-every 25 [--autocast]
"""

import argparse
import contextlib
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.trainer import CausalSFTConfig

from heads_recipe import CONFIGS, HELD_OUT_MODULES, TRAIN_MODULES, cached_features, evaluate_heads, optimizer_for

CONFIG_NAMES = ("softmax", "default")  # the baseline first
MODES = ("compatible", "standard")


def first_reaching(curve: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """(step, wall seconds) of the first evaluation whose top-1 is at least `target`; None if none is."""
    return next(((step, wall) for step, wall, top1 in curve if top1 >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--batch-tokens", type=int, default=640, help="targets per step (4 rows × 160 tokens)")
    parser.add_argument("--length", type=int, default=161, help="tokens per window (160 targets)")
    parser.add_argument("--train-windows", type=int, default=800)
    parser.add_argument("--held-out-windows", type=int, default=32)
    parser.add_argument("--cache", default="build/bench-heads")
    parser.add_argument("--autocast", action="store_true", help="the losses under bf16 autocast (bf16=True)")
    args = parser.parse_args()
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be positive")

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16).eval()
    train = cached_features(base, tokenizer, "train", TRAIN_MODULES, args.length, args.train_windows, Path(args.cache))
    held = cached_features(base, tokenizer, "held", HELD_OUT_MODULES, args.length, args.held_out_windows, Path(args.cache))
    del base
    defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    ratios = (defaults.location_lr_ratio, defaults.threshold_lr_ratio)

    runs = {}
    for name in CONFIG_NAMES:
        model = CausalQwenForCausalLM.from_base(
            Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32), **CONFIGS[name]["heads"])
        optimizer = optimizer_for(model, defaults.learning_rate, *ratios)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / args.steps)
        runs[name] = dict(model=model, optimizer=optimizer, schedule=schedule, wall=0.0,
                          curves={mode: [] for mode in MODES})

    def evaluate(step):
        for name, run in runs.items():
            run["model"].eval()
            metrics = evaluate_heads(run["model"], held["z"], held["targets"], MODES)
            run["model"].train()
            for mode in MODES:
                run["curves"][mode].append((step, run["wall"], metrics[mode]["top1_accuracy"]))
            print(f"step {step:4d} {name:<8} train {run['wall']:7.1f}s  top-1 "
                  + "  ".join(f"{mode} {metrics[mode]['top1_accuracy']:.4f}" for mode in MODES), flush=True)

    evaluate(0)
    order = torch.randperm(len(train["targets"]), generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        rows = order[(step * args.batch_tokens + torch.arange(args.batch_tokens)) % len(order)]
        for run in runs.values():  # same batch for both, steps alternating
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext():
                loss = run["model"].heads_loss(train["z"][rows], train["targets"][rows]).loss
            run["optimizer"].zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in run["model"].parameters() if p.requires_grad], 1.0)
            run["optimizer"].step()
            run["schedule"].step()
            run["wall"] += time.perf_counter() - start
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1)

    baseline, default = runs["softmax"], runs["default"]
    target = baseline["curves"]["compatible"][-1][2]
    own = first_reaching(baseline["curves"]["compatible"], target)
    print(f"\ntarget: the softmax baseline's held-out top-1 after {args.steps} steps, {target:.4f}; the baseline "
          f"reaches it at step {own[0]} ({own[1]:.1f}s of training)")
    print("| default recipe, mode | top-1 after the last step | steps to target | × baseline (steps) | "
          "× baseline (wall) |\n|---|---|---|---|---|")
    for mode in MODES:
        reached = first_reaching(default["curves"][mode], target)
        final = default["curves"][mode][-1][2]
        if reached is None:
            print(f"| {mode} | {final:.4f} | not reached in {args.steps} | — | — |")
        else:
            print(f"| {mode} | {final:.4f} | {reached[0]} | {reached[0] / max(own[0], 1):.2f}× | "
                  f"{reached[1] / max(own[1], 1e-9):.2f}× |")
    print(f"training wall time per step: default {default['wall'] / args.steps:.2f}s, softmax "
          f"{baseline['wall'] / args.steps:.2f}s ({default['wall'] / baseline['wall']:.2f}×)")


if __name__ == "__main__":
    main()
