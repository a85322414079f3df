"""Benchmark: one training step of CausalSFTTrainer against TRL's plain SFTTrainer, tokens/s.

Same base, same batch (random token ids, full-sequence loss), same trainable scope: the backbone is frozen in both.
CausalSFTTrainer trains the causal heads (abduction + action W_A [V × C], b_A, b_noise) with the chunked OvR loss;
the plain SFTTrainer trains only the output layer with TRL's fused (chunked) cross-entropy. The demo base ties
lm_head to the embedding, so the plain run unties it (an own copy of the weight) so that only the head trains, as
W_A is a copy for the causal heads. Activation checkpointing is off in both (a frozen backbone keeps no
activations). By default the model keeps the base's dtype (bf16 for the demo base) and runs without autocast;
`--dtype float32 --autocast` is TRL's default set-up instead (float32 weights, bf16 autocast).

A step is what the Trainer does per optimizer step: `training_step` (forward, backward, with the trainer's own
`compute_loss` and GA scaling), gradient clipping, `optimizer.step()`, `zero_grad()`. Both trainers live in one
process and their steps alternate, so that other jobs on a shared machine slow both alike; each round times one
step of each (wall and process CPU time), the first round is warm-up, and the ratio is the median over rounds.

    python bench/train_step.py --base build/demo-base --batch-size 2 --seq-len 128
    python bench/train_step.py --base build/demo-base --batch-size 2 --seq-len 128 --dtype float32 --autocast
"""

import argparse
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen2ForCausalLM
from trl import SFTConfig, SFTTrainer

from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

from stats import round_ratios, spread

TARGET_RATIO = 1.0


def build_trainers(base: str, batch_size: int, seq_len: int, dtype: str, autocast: bool):
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = torch.randint(0, len(tokenizer) - 300, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    dataset = Dataset.from_dict({"input_ids": ids.tolist()})  # ordinary tokens; labels = input_ids
    common = dict(
        per_device_train_batch_size=batch_size, max_length=None, bf16=autocast, activation_checkpointing=False,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, learning_rate=1e-5,
        seed=0, use_cpu=not torch.cuda.is_available(),  # bf16 autocast on CPU needs it said
    )

    plain_model = Qwen2ForCausalLM.from_pretrained(base, dtype=dtype)
    with torch.no_grad():
        head = torch.nn.Parameter(plain_model.get_output_embeddings().weight.detach().clone())
    plain_model.lm_head.weight = head  # untied: the embedding stays frozen, the head trains
    plain_model.config.tie_word_embeddings = False
    plain_model.requires_grad_(False)
    plain_model.lm_head.weight.requires_grad_(True)
    plain = SFTTrainer(
        plain_model, args=SFTConfig(tempfile.mkdtemp(), **common), train_dataset=dataset, processing_class=tokenizer
    )
    causal = CausalSFTTrainer(
        Qwen2ForCausalLM.from_pretrained(base, dtype=dtype), args=CausalSFTConfig(tempfile.mkdtemp(), **common),
        train_dataset=dataset, processing_class=tokenizer,
    )
    return {"plain": plain, "causal": causal}


class Stepper:
    """One optimizer step of a trainer on a fixed batch, the way Trainer's loop does it."""

    def __init__(self, trainer, steps: int):
        self.trainer = trainer
        # What Trainer.train does first: accelerate's prepare, which wraps forward in autocast under bf16=True.
        self.model = trainer.accelerator.prepare_model(trainer.model)
        trainer.create_optimizer_and_scheduler(num_training_steps=steps)
        batch = next(iter(trainer.get_train_dataloader()))
        self.batch = trainer._prepare_inputs(batch)
        self.num_items = trainer._get_num_items_in_batch([self.batch], trainer.args.device)
        self.tokens = int(self.batch["attention_mask"].sum())
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.model.train()

    def step(self) -> tuple[float, float]:
        trainer = self.trainer
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.training_step(self.model, dict(self.batch), self.num_items)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), trainer.args.max_grad_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad()
        return time.perf_counter() - wall, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="build/demo-base", help="Qwen2 base folder or Hub id")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of one step each; the first is warm-up")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="model weights dtype")
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast (TrainingArguments.bf16)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the first is warm-up")

    trainers = build_trainers(args.base, args.batch_size, args.seq_len, args.dtype, args.autocast)
    steppers = {name: Stepper(trainer, args.rounds) for name, trainer in trainers.items()}
    times = {name: [] for name in steppers}
    for _ in range(args.rounds):
        for name, stepper in steppers.items():
            times[name].append(stepper.step())
    times = {name: t[1:] for name, t in times.items()}

    tokens = steppers["plain"].tokens
    dtype = next(trainers["plain"].model.parameters()).dtype
    print(f"{tokens} tokens/step (batch {args.batch_size} × {args.seq_len}), backbone frozen, base {args.base}, "
          f"weights {dtype}, autocast {'bf16' if args.autocast else 'off'}, {torch.get_num_threads()} threads")
    for name, label in (("plain", "plain SFTTrainer (output layer)"), ("causal", "CausalSFTTrainer (causal heads)")):
        wall = statistics.median(t[0] for t in times[name])
        cpu = statistics.median(t[1] for t in times[name])
        print(f"{label:34s} {tokens / wall:8.1f} tokens/s   {tokens / cpu:8.1f} tokens/CPU-s   "
              f"steps {[round(t[0], 2) for t in times[name]]} s   trainable {steppers[name].trainable:,}")
    wall_ratios = round_ratios([t[0] for t in times["plain"]], [t[0] for t in times["causal"]])
    cpu_ratios = round_ratios([t[1] for t in times["plain"]], [t[1] for t in times["causal"]])
    print(f"ratio causal / plain tokens/s, median (min–max) over {len(wall_ratios)} rounds: {spread(wall_ratios)}× wall, "
          f"{spread(cpu_ratios)}× CPU time (target ≥ {TARGET_RATIO}×)")


if __name__ == "__main__":
    main()
