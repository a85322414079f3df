"""Benchmark: does the numeric path (docs/design.md, Numbers) learn on the real demo base? Two small tasks, end to end.

- `--task words`: "The word seven means the number 7." for 1..20 spelled out; the value is in the text, so the
  regression head can read it from z (tests the head and its loss);
- `--task copy`: "Remember the number X. The number was X." with X uniform in 1..100; the second X must come from
  the first, which reaches the backbone only as φ(X)·d added to a <NUM> embedding (tests the input direction d).

Fresh
numeric heads (`action_weight="tied"`) start at the data's Cauchy(median, IQR/2); the numeric head (d, w, b, s) and
the scale path of the abduction network train, with `CausalSFTTrainer` (OvR loss + Cauchy NLL; the OvR loss now also moves the scale path). Reported on
held-out sentences, before and after: the median absolute error of loc_Y at the answer, against the constant
median predictor, and the mean NLL.

    python bench/numeric.py --base build/demo-base
"""

import argparse
import random
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from causalqwen_adapter.numeric import add_num_token, encode_with_numbers
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

WORDS = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen twenty").split()


# The numeric head, and the scale path of U: scale_Y = |w|·scale_U' + exp(s) grows with any readout w while
# scale_U stays at γ₀ = 10, so the head can only use z once scale_U may shrink.
TRAINED = ("numeric.", "abduction.scale.")


def sentence(task: str, rng: random.Random) -> str:
    if task == "words":
        x = rng.randint(1, 20)
        return f"The word {WORDS[x - 1]} means the number {x}."
    return "Remember the number {x}. The number was {x}.".format(x=rng.randint(1, 100))


def evaluate(model, rows, num_id):
    """Median |loc_Y − y| and mean NLL at each sentence's last <NUM> (the answer)."""
    errors, nlls = [], []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            values = torch.tensor([row["numeric_values"]])
            answer = max(i for i, t in enumerate(row["input_ids"]) if t == num_id)
            out = model(ids[:, :answer], numeric_values=values[:, :answer], inference_mode="standard",
                        logits_to_keep=1)
            y = values[0, answer].item()
            loc, scale = out.loc_Y[0, -1].item(), out.scale_Y[0, -1].item()
            errors.append(abs(loc - y))
            nlls.append(torch.log(torch.tensor(torch.pi * scale)).item() + torch.log1p(torch.tensor(((y - loc) / scale) ** 2)).item())
    return statistics.median(errors), statistics.fmean(nlls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--task", choices=("words", "copy"), default="words")
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args()

    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    num_id = 151665
    add_num_token(tokenizer, num_id)
    texts = [sentence(args.task, rng) for _ in range(args.train + args.heldout)]
    rows = [encode_with_numbers(tokenizer, t, num_id) for t in texts]
    train, heldout = Dataset.from_list(rows[: args.train]), rows[args.train :]

    with tempfile.TemporaryDirectory() as out:
        config = CausalSFTConfig(
            out, numeric=True, num_token_id=num_id, action_weight="tied", max_steps=args.steps,
            per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate, lr_scheduler_type="constant",
            logging_steps=max(1, args.steps // 6), report_to="none", save_strategy="no", use_cpu=True,
            dataloader_pin_memory=False, disable_tqdm=True, seed=0,
        )
        trainer = CausalSFTTrainer(args.base, args=config, train_dataset=train, processing_class=tokenizer)
        model = trainer.model
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith(TRAINED))
        trainer.create_optimizer()  # the optimizer takes what requires grad now
        median = model.numeric.bias.item()
        baseline = statistics.median(abs(r["numeric_values"][max(i for i, t in enumerate(r["input_ids"]) if t == num_id)]
                                         - median) for r in heldout)
        model.eval()
        before = evaluate(model, heldout, num_id)
        model.train()
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        model.eval()
        after = evaluate(model, heldout, num_id)

    print(f"\ntask {args.task}: demo base, {args.train} training / {args.heldout} held-out sentences, {args.steps} steps of "
          f"{args.batch_size}, lr {args.learning_rate}, {torch.get_num_threads()} threads, {seconds / args.steps:.2f} s/step")
    for entry in trainer.state.log_history:
        if "numeric_nll" in entry:
            print(f"  step {entry['step']:>4}: numeric_nll {entry['numeric_nll']:.3f}")
    print(f"held-out median |loc_Y − y|: constant median predictor {baseline:.2f}, fresh head {before[0]:.2f}, "
          f"trained {after[0]:.2f}")
    print(f"held-out mean Cauchy NLL:    fresh head {before[1]:.3f}, trained {after[1]:.3f}")


if __name__ == "__main__":
    main()
