"""Benchmark: offline distillation (docs/design.md, Offline distillation) on the demo base — throughput, and what the top-K loss learns.

Texts are the standard-library docstrings of `recipes/demo.py`, shuffled, the first --train-texts for training and
the last --heldout-texts held out, truncated to --max-length tokens. Measured in one run:

- stage 1, `extract_features`: tokens/s of the frozen bf16 base writing z + top-K;
- stage 2, `CausalDistillTrainer`: training tokens/s, against `CausalSFTTrainer` (the OvR loss through the frozen
  backbone) on the same texts and heads in the same process: the ratio is what skipping the transformer buys;
- on the held-out tokens, before and after distillation (once per --tail-weights value): the evaluation harness
  with the base's greedy token as the target (agreement of each mode's argmax with the teacher, ΣP, calibration),
  and `eval_top1_match` (the base's top-1 ranked first among its K); and the fit to the teacher, the distillation
  loss's top-K term (Σ_{k∈K} (P_k − p_teacher,k)², over the stored K and over the top 10).

    python bench/distill.py --base build/demo-base
"""

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen2ForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from causalqwen_adapter import CausalQwenForCausalLM  # noqa: E402
from causalqwen_adapter.distill import CausalDistillConfig, CausalDistillTrainer  # noqa: E402
from causalqwen_adapter.evaluation import EvaluationAccumulator, markdown_table, score_hidden_states  # noqa: E402
from causalqwen_adapter.features import extract_features, load_features  # noqa: E402
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer  # noqa: E402

from demo import stdlib_docstrings  # noqa: E402


class StepTimer(TrainerCallback):
    def __init__(self):
        self.seconds = []

    def on_step_begin(self, *args, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.seconds.append(time.perf_counter() - self.start)


def against_teacher(model, features, modes=("compatible", "standard")) -> dict:
    """The evaluation harness on stored held-out features, the teacher's top-1 as the target: `top1_accuracy` is the
    agreement of each mode's argmax with the teacher's greedy token; ΣP and the calibrations as for text."""
    rows = load_features(features)[:]
    z, targets = rows["hidden_state"], rows["topk_ids"][:, 0].long()
    accumulators = {mode: EvaluationAccumulator(mode) for mode in modes}
    for scored in score_hidden_states(model, z, targets, modes):
        accumulators[scored.mode].add(scored)
    return {mode: acc.compute() for mode, acc in accumulators.items()}


@torch.no_grad()
def topk_fit(model, features) -> dict[str, float]:
    """How well the heads fit the teacher on stored held-out features: the distillation loss's own top-K term,
    Σ_{k∈K} (P_k − p_teacher,k)² (mean over positions; the tail term off), and the same over the teacher's top 10."""
    rows = load_features(features)[:]
    z, ids, probs = rows["hidden_state"], rows["topk_ids"].long(), rows["topk_probs"]
    tail, model.config.distill_tail_weight = model.config.distill_tail_weight, 0.0
    try:
        fit = {f"top-{ids.shape[1]}": model(hidden_state=z, topk_ids=ids, topk_probs=probs).loss.item(),
               "top-10": model(hidden_state=z, topk_ids=ids[:, :10], topk_probs=probs[:, :10]).loss.item()}
    finally:
        model.config.distill_tail_weight = tail
    return fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--train-texts", type=int, default=60)
    parser.add_argument("--heldout-texts", type=int, default=20)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--sft-steps", type=int, default=4)
    parser.add_argument("--tail-weights", type=float, nargs="+", default=[1.0, 0.0],
                        help="distill_tail_weight of each stage-2 run (the first run gives the throughput figure)")
    parser.add_argument("--gamma-init", type=float, default=None,
                        help="gamma_init of every head this builds (default: each builder's own, 0.005 for the "
                        "fresh-heads row and the SFT reference, 1e-5 for distillation)")
    args = parser.parse_args()
    torch.manual_seed(0)

    texts = stdlib_docstrings()
    random.Random(0).shuffle(texts)
    train_texts, heldout_texts = texts[: args.train_texts], texts[-args.heldout_texts :]
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    work = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    heads = dict(action_weight="tied")
    if args.gamma_init is not None:
        heads["gamma_init"] = args.gamma_init
    common = dict(report_to="none", save_strategy="no", use_cpu=True, dataloader_pin_memory=False, disable_tqdm=True,
                  seed=0, **heads)
    try:
        start = time.perf_counter()
        train = extract_features(base, train_texts, work / "train", top_k=args.top_k, max_length=args.max_length)
        extract_seconds = time.perf_counter() - start
        extract_features(base, heldout_texts, work / "heldout", top_k=args.top_k, max_length=args.max_length)

        fresh = CausalQwenForCausalLM.from_base(base, **heads).float()
        results = {"fresh heads": against_teacher(fresh, work / "heldout")}
        fits = {"fresh heads": topk_fit(fresh, work / "heldout")}
        del fresh

        # Reference: the OvR loss through the frozen backbone, same texts, same heads, float32 heads.
        sft = CausalSFTTrainer(
            args.base,
            args=CausalSFTConfig(str(work / "sft"), max_steps=args.sft_steps + 1, per_device_train_batch_size=4,
                                 max_length=args.max_length, logging_steps=1, **common),
            train_dataset=Dataset.from_dict({"text": train_texts}),
            processing_class=tokenizer,
        )
        timer = StepTimer()
        sft.add_callback(timer)
        sft.train()
        seen = [entry["num_tokens"] for entry in sft.state.log_history if "num_tokens" in entry]
        tokens_per_step = [b - a for a, b in zip([0, *seen], seen)]
        sft_rate = sum(tokens_per_step[1:]) / sum(timer.seconds[1:])  # the first step is warm-up
        del sft

        runs = {}
        for tail_weight in args.tail_weights:
            distill = CausalDistillTrainer(
                args.base,
                args=CausalDistillConfig(str(work / "distill"), num_train_epochs=args.epochs,
                                         learning_rate=args.learning_rate, per_device_train_batch_size=64,
                                         per_device_eval_batch_size=256, eval_strategy="epoch", logging_steps=10**6,
                                         distill_tail_weight=tail_weight, **common),
                train_dataset=work / "train",
                eval_dataset=work / "heldout",
            )
            start = time.perf_counter()
            distill.train()
            seconds = time.perf_counter() - start
            evals = [h for h in distill.state.log_history if "eval_loss" in h]
            runs[tail_weight] = (seconds, evals)
            results[f"distilled, tail weight {tail_weight:g}"] = against_teacher(distill.model, work / "heldout")
            fits[f"distilled, tail weight {tail_weight:g}"] = topk_fit(distill.model, work / "heldout")
            print(markdown_table({f"distilled, tail weight {tail_weight:g}": results[f"distilled, tail weight {tail_weight:g}"]}),
                  flush=True)
            del distill

        print(f"\ndemo base bf16, {len(train)} training tokens ({args.train_texts} texts), "
              f"{len(load_features(work / 'heldout'))} held-out tokens, top-K = {args.top_k}, {torch.get_num_threads()} threads")
        print(f"stage 1 extract_features:            {len(train) / extract_seconds:8.1f} tokens/s")
        print(f"reference CausalSFTTrainer (OvR):     {sft_rate:8.1f} tokens/s (mean over {args.sft_steps} steps after one warm-up)")
        for tail_weight, (seconds, evals) in runs.items():
            rate = args.epochs * len(train) / seconds
            print(f"stage 2 CausalDistillTrainer, tail weight {tail_weight:g}: {rate:8.1f} tokens/s ({args.epochs} epochs, "
                  f"evaluation included) = {rate / sft_rate:.1f}× the SFT reference; held-out eval_loss "
                  f"{evals[0]['eval_loss']:.4f} after epoch 1 → {evals[-1]['eval_loss']:.4f}, eval_top1_match "
                  f"{evals[0]['eval_top1_match']:.3f} → {evals[-1]['eval_top1_match']:.3f}")
        print("\nHeld-out tokens, the teacher's greedy token as target (top1_accuracy = agreement with the teacher):")
        print(markdown_table(results))
        print("\nHeld-out fit to the teacher's probabilities, Σ_k (P_k − p_teacher,k)² per position (standard mode):")
        for name, fit in fits.items():
            print(f"  {name:<28}" + "  ".join(f"{k} {v:.4f}" for k, v in fit.items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
