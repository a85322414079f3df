"""Benchmark: which recipe makes the causal heads learn? An ablation on cached backbone features.

Training and held-out text are different modules of Python's standard library (a real corpus nobody here wrote,
present on every machine). The frozen demo base runs once over both in bf16; its final hidden states z and the next
tokens are cached under build/bench-heads/. Each configuration then:

1. attaches fresh heads (`CausalQwenForCausalLM.from_base` with the configuration's head fields);
2. trains them with the model's own loss, `model.heads_loss(z, targets)` — exactly what `forward(labels=...)`
   computes after the backbone — with AdamW, the trainer's per-role learning rates and its linear decay, for
   --steps steps of --batch-tokens targets;
3. is evaluated on the held-out tokens with `causalqwen_adapter.evaluation`, at init and after training, in the
   compatible mode (the softmax over loc_S) and the OvR modes.

    python bench/heads_recipe.py --base build/demo-base --steps 200 --batch-tokens 640 --configs default softmax
    python bench/heads_recipe.py --configs default softmax --saved    # re-evaluate the adapters --save wrote

Prints one markdown table (config, stage, mode, metrics); the base's own row is `compatible` at init. The OvR modes
are scored under each of --distributions (the config's `ovr_distribution`: the accepted proposal, or P/ΣP).
"""

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.comparison.training import optimizer_for  # noqa: F401 (time_to_quality.py imports it here)
from causalqwen_adapter.configuration_causalqwen import OVR_DISTRIBUTIONS
from causalqwen_adapter.evaluation import EvaluationAccumulator, confidence_table, markdown_table, score_hidden_states
from causalqwen_adapter.training import calibrate_threshold_on_features

TRAIN_MODULES = [
    "argparse", "configparser", "tokenize", "inspect", "typing", "dis", "ast", "dataclasses", "enum", "functools",
    "subprocess", "threading", "zipfile", "tarfile", "smtplib", "ftplib", "pydoc", "difflib", "textwrap", "calendar",
    "fractions", "string", "csv", "heapq", "bisect", "statistics", "random", "datetime", "logging/__init__",
    "http/client", "email/message", "json/decoder", "unittest/case", "asyncio/base_events", "collections/__init__",
]
HELD_OUT_MODULES = ["copy", "tempfile", "pathlib", "shutil", "glob", "fnmatch", "contextlib", "weakref", "abc", "operator"]

# Each configuration: head fields for from_base, the learning rate and the per-role ratios of the trainer.
CONFIGS = {
    "seeds": dict(heads=dict(ovr_candidates=None, gamma_init=10.0, b_noise_init=0.1, ovr_threshold_init=0.0,
                             softmax_loss_weight=0.0, ovr_trains_location=True),
                  learning_rate=1e-4, location_lr_ratio=1.0, threshold_lr_ratio=1.0),
    "default": dict(heads=dict(), learning_rate=None),  # the package's defaults, whatever they are
    # the OvR loss over the whole vocabulary from γ₀ = 1e-5 (the default before ovr_candidates)
    "vocabulary": dict(heads=dict(ovr_candidates=None), learning_rate=None),
    "softmax": dict(heads=dict(objective="softmax"), learning_rate=None),
    "ovr_location": dict(heads=dict(ovr_candidates=None, ovr_trains_location=True), learning_rate=None),
    # thresholds compared with loc_S itself (the default before relative thresholds), calibrated on data
    "absolute_thresholds": dict(heads=dict(ovr_candidates=None, ovr_relative_threshold=False), learning_rate=None),
    # per-token thresholds, learned fast (0.1): under the accepted-proposal distribution they gate, they do not rank
    "learned_thresholds": dict(heads=dict(ovr_candidates=None, learnable_threshold=True), learning_rate=None,
                               threshold_lr_ratio=1000.0),
    # the OvR loss over the top-16 of loc_S and the target (ovr_candidates), from a scale where P_k is graded
    "candidates": dict(heads=dict(ovr_candidates=16, gamma_init=0.005, b_noise_init=1e-6), learning_rate=None),
    # the same from a larger scale, the scale path 10× faster
    "candidates_fast_scale": dict(heads=dict(ovr_candidates=16, gamma_init=0.03, b_noise_init=1e-6), learning_rate=None,
                                  scale_lr_ratio=10.0),
    # the same loss from the vocabulary loss's initial scale
    "candidates_default_scale": dict(heads=dict(ovr_candidates=16, gamma_init=1e-5, b_noise_init=1e-6),
                                     learning_rate=None),
    # candidates with an exogenous noise at the scale of U's (0.01: the package's default): does it make `causal` and
    # `sampling` differ from `standard`?
    "noise_0.01": dict(heads=dict(ovr_candidates=16, gamma_init=0.005, b_noise_init=0.01), learning_rate=None),
    "noise_0.05": dict(heads=dict(ovr_candidates=16, gamma_init=0.005, b_noise_init=0.05), learning_rate=None),
    # the vocabulary loss with the scale path 30× faster: does the scale learn when it can move?
    "fast_scale": dict(heads=dict(ovr_candidates=None), learning_rate=None, scale_lr_ratio=30.0),
}


def windows(tokenizer, modules, length, limit):
    lib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for name in modules:
        path = lib / f"{name}.py"
        if not path.exists():
            continue
        ids = tokenizer(path.read_text(encoding="utf-8")).input_ids
        rows += [ids[s : s + length] for s in range(0, len(ids) - length, length)]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[:limit]
    return torch.tensor([rows[i] for i in order])


def cached_features(base, tokenizer, name, modules, length, limit, cache: Path):
    dtype = "" if base.dtype == torch.bfloat16 else f"-{str(base.dtype).removeprefix('torch.')}"
    path = cache / f"{name}-{length}-{limit}{dtype}.pt"
    if path.exists():
        return torch.load(path)
    ids = windows(tokenizer, modules, length, limit)
    zs = []
    with torch.no_grad():
        for i in range(0, len(ids), 8):
            zs.append(base.model(ids[i : i + 8]).last_hidden_state[:, :-1].float())
    data = {"z": torch.cat(zs).reshape(-1, base.config.hidden_size), "targets": ids[:, 1:].reshape(-1)}
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


def evaluate_heads(model, z, targets, modes, distributions=("accept_once",), chunk=256):
    """{mode: metrics} on cached features; OvR modes once per `ovr_distribution` in `distributions`
    (keyed "standard (normalize)" for every distribution but the first)."""
    kinds = [(mode, None) for mode in modes if mode == "compatible"]
    kinds += [(mode, d) for d in distributions for mode in modes if mode != "compatible"]
    name = {(m, d): m if d in (None, distributions[0]) else f"{m} ({d})" for m, d in kinds}
    accumulators = {kind: EvaluationAccumulator(kind[0]) for kind in kinds}
    saved = model.config.ovr_distribution
    for distribution in dict.fromkeys(d for _, d in kinds):
        model.config.ovr_distribution = distribution or saved
        for scored in score_hidden_states(model, z, targets, [m for m, d in kinds if d == distribution],
                                          chunk_size=chunk):
            accumulators[scored.mode, distribution].add(scored)
    model.config.ovr_distribution = saved
    return {name[kind]: acc.compute() for kind, acc in accumulators.items()}


@torch.no_grad()
def scale_quantiles(model, z, limit=4096):
    """The mean over components of scale_U per held-out position: its 5 / 50 / 95 % quantiles (does the scale move
    from one position to the next?)."""
    scale = model.abduction(z[:limit].to(model.action.bias.dtype))[1].float().mean(-1)
    q = torch.quantile(scale, torch.tensor([0.05, 0.5, 0.95]))
    noise = torch.quantile(model.action.b_noise.detach().float().abs(), torch.tensor([0.05, 0.5, 0.95]))
    return ("scale_U (mean over components) 5/50/95 %: " + " / ".join(f"{v:.3g}" for v in q.tolist())
            + "; |b_noise| (components) 5/50/95 %: " + " / ".join(f"{v:.3g}" for v in noise.tolist()))


def main() -> None:
    from causalqwen_adapter.trainer import CausalSFTConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--configs", nargs="+", default=["seeds", "default", "softmax"], choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-tokens", type=int, default=640, help="targets per step (4 rows × 160 tokens)")
    parser.add_argument("--length", type=int, default=161, help="tokens per window (160 targets)")
    parser.add_argument("--train-windows", type=int, default=800)
    parser.add_argument("--held-out-windows", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["compatible", "standard", "causal"])
    parser.add_argument("--cache", default="build/bench-heads")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="the order of the training batches and the heads' init")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the base's dtype for the cached features (float32: about 5× faster on CPUs without "
                             "bfloat16 instructions)")
    parser.add_argument("--no-init", action="store_true", help="skip the evaluation of each configuration at init")
    parser.add_argument("--save", action="store_true", help="save each trained adapter under <cache>/<config>")
    parser.add_argument("--saved", action="store_true",
                        help="evaluate the adapters --save wrote under <cache>/<config> instead of training")
    parser.add_argument("--distributions", nargs="+", default=["accept_once", "accept", "normalize"], choices=list(OVR_DISTRIBUTIONS),
                        help="the OvR modes' next-token distributions to score (config ovr_distribution)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=getattr(torch, args.dtype)).eval()
    start = time.perf_counter()
    train = cached_features(base, tokenizer, "train", TRAIN_MODULES, args.length, args.train_windows, Path(args.cache))
    held = cached_features(base, tokenizer, "held", HELD_OUT_MODULES, args.length, args.held_out_windows, Path(args.cache))
    print(f"features: {len(train['targets'])} training and {len(held['targets'])} held-out tokens "
          f"({time.perf_counter() - start:.0f}s)", flush=True)
    trainer_defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)

    results = {}

    def evaluate(model):
        return evaluate_heads(model, held["z"], held["targets"], args.modes, args.distributions)

    if args.saved:
        for name in args.configs:
            model = CausalQwenForCausalLM.from_pretrained(Path(args.cache) / name, dtype=torch.float32)
            results[f"{name} (saved)"] = evaluate(model)
            print(markdown_table({f"{name} (saved)": results[f"{name} (saved)"]}), flush=True)
        print("\n" + markdown_table(results))
        return
    for name in args.configs:
        spec = CONFIGS[name]
        torch.manual_seed(args.seed)
        base_f32 = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
        model = CausalQwenForCausalLM.from_base(base_f32, **spec["heads"])
        if "ovr_threshold_init" not in spec["heads"] and not model.config.ovr_relative_threshold:  # as the trainer
            threshold = calibrate_threshold_on_features(model, train["z"][:1024])
            print(f"  {name}: threshold calibrated to {threshold:.3f}", flush=True)
        learning_rate = spec["learning_rate"] or trainer_defaults.learning_rate
        ratios = (spec.get("location_lr_ratio", trainer_defaults.location_lr_ratio),
                  spec.get("threshold_lr_ratio", trainer_defaults.threshold_lr_ratio))
        if not args.no_init:
            results[f"{name} init"] = evaluate(model)
            print(markdown_table({f"{name} init": results[f"{name} init"]}), flush=True)
        optimizer = optimizer_for(model, learning_rate, *ratios, fused=True,
                                  scale_lr_ratio=spec.get("scale_lr_ratio", 1.0))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / max(args.steps, 1))
        order = torch.randperm(len(train["targets"]), generator=torch.Generator().manual_seed(args.seed))
        model.train()
        start = time.perf_counter()
        for step in range(args.steps):
            rows = order[(step * args.batch_tokens + torch.arange(args.batch_tokens)) % len(order)]
            loss = model.heads_loss(train["z"][rows], train["targets"][rows]).loss
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"{name}: loss {loss.item()} at step {step + 1}")
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            schedule.step()
            if (step + 1) % max(1, args.steps // 8) == 0:
                print(f"  {name} step {step + 1}: loss {loss.item():.4g} ({time.perf_counter() - start:.0f}s)", flush=True)
        model.eval()
        results[f"{name} after {args.steps}"] = evaluate(model)
        print(f"  {name}: {scale_quantiles(model, held['z'])}", flush=True)
        print(markdown_table({f"{name} after {args.steps}": results[f"{name} after {args.steps}"]}), flush=True)
        if args.save:
            model.save_pretrained(Path(args.cache) / name)
        print(f"  {name}: lr {learning_rate:g}, ratios location {ratios[0]:g} threshold {ratios[1]:g}, heads "
              f"{spec['heads'] or 'package defaults'}; {time.perf_counter() - start:.0f}s of training", flush=True)
        del model, base_f32
    print("\n" + markdown_table(results))
    print("\n" + confidence_table(results))


if __name__ == "__main__":
    main()
