"""What the heads say behind the hypothesis's classification verdicts (exploratory, after the run; not a claim).

The pre-registered hypothesis (docs/evidence.md) compared the ECE of `ovr_candidates`' P_top with the softmax's
maximum probability on the clean TREC and tweets cells. This script re-trains chosen runs of that family exactly as
bench/evidence_preregistered.py did (same features, split, seed and rate: each run's test metrics must equal the
recorded ones, or it stops), then reads what the ECE summarises: the mean confidence against the accuracy (over- or
under-confident), a reliability table, and the OvR heads' own outputs (`evidence.head_outputs`: the median P_k of the
label picked, the share of prompts where no label passes ½, the median Σ_k P_k, the median scale_S of the pick).
It changes no verdict and chooses nothing.

    OMP_NUM_THREADS=1 python bench/hypothesis_heads.py --results bench/results/preregistered-hypothesis.json \
        --seeds 0 --out bench/results/hypothesis-heads.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import evidence_preregistered as driver  # noqa: E402
import evidence_protocol as protocol  # noqa: E402

from causalqwen_adapter.comparison.metrics import arm_scores, link_probs, own_rule  # noqa: E402

import evidence  # noqa: E402

CELLS = ("trec 0", "tweets 0")
ARMS = ("ovr_candidates", "softmax")


def reliability(confidence: torch.Tensor, correct: torch.Tensor, bins: int = 5) -> list[dict]:
    """Per equal-width confidence bin: rows, mean confidence, accuracy."""
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (confidence > lo) & (confidence <= hi) if lo > 0 else (confidence <= hi)
        if inside.any():
            out.append({"bin": [round(lo.item(), 2), round(hi.item(), 2)], "rows": int(inside.sum()),
                        "confidence": confidence[inside].mean().item(),
                        "accuracy": correct[inside].double().mean().item()})
    return out


def read_heads(model, arm: str, test: dict, labels) -> dict:
    scores = arm_scores(model, arm, test["z"], labels)
    pred, confidence = scores.decide(own_rule(model))
    if own_rule(model) == "ovr":  # as noise_metrics reads it: F(max_k x_k) in float64
        confidence = link_probs(arm, scores.x.max(-1).values)
    confidence, correct = confidence.double(), pred == test["label"]
    out = {"accuracy": correct.double().mean().item(), "mean_confidence": confidence.mean().item(),
           "reliability": reliability(confidence, correct)}
    heads = evidence.head_outputs(model, arm, test["z"], labels)
    if heads is not None:
        out["heads"] = heads
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="bench/results/preregistered-hypothesis.json")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--data", default="/work/data")
    parser.add_argument("--cache", default="build/evidence")
    parser.add_argument("--out", default="bench/results/hypothesis-heads.json")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from causalqwen_adapter.classification import label_set
    from causalqwen_adapter.trainer import CausalSFTConfig

    from evidence_data import task

    family = protocol.FAMILY
    runs = driver.load(Path(args.results), family)
    chosen = protocol.chosen_runs(runs, {**family, "cells": list(CELLS), "arms": list(ARMS)})
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    torch.set_num_threads(1)
    out = []
    for cell in CELLS:
        name = protocol.parse_cell(cell)[0]
        data = task(name, Path(args.data))
        labels = label_set(tokenizer, data["labels"], base.config.vocab_size)
        features = {**driver.pool_features(args, base, data, labels, tokenizer), "labels": labels}
        for arm in ARMS:
            for seed in args.seeds:
                recorded = chosen[cell, arm][seed]
                captured = {}

                def train(*a, **k):
                    captured["model"] = evidence.train_arm(*a, **k)
                    return captured["model"]

                again = driver.run_one(cell, arm, recorded["lr"], seed, features, base, tokenizer.eos_token_id,
                                       defaults, family, train=train)
                if again["test"] != recorded["test"]:
                    sys.exit(f"{cell} {arm} seed {seed}: the re-trained run's test metrics {again['test']} are not the "
                             f"recorded {recorded['test']}: not the same run")
                row = {"cell": cell, "arm": arm, "seed": seed, "lr": recorded["lr"], "ece": recorded["test"]["ece"],
                       **read_heads(captured["model"], arm, features["test"], labels)}
                out.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
