"""Seeded, stratified splits and label noise: what a seed draws in a comparison (the bench's and `causalqwen
compare`'s alike)."""

import random
from collections import defaultdict

import torch

NOISE_KINDS = ("uniform", "class")


def stratified_split(rows: list[dict], key: str, fractions: dict[str, float], seed: int = 0) -> dict[str, list[dict]]:
    """Rows split per class in the given fractions (the last split takes the rest), shuffled with `seed`."""
    by_class = defaultdict(list)
    for row in rows:
        by_class[row[key]].append(row)
    rng = random.Random(seed)
    splits = {name: [] for name in fractions}
    for label in sorted(by_class):
        members = by_class[label]
        rng.shuffle(members)
        start = 0
        for i, (name, fraction) in enumerate(fractions.items()):
            end = len(members) if i == len(fractions) - 1 else start + round(fraction * len(members))
            splits[name] += members[start:end]
            start = end
    for name in splits:
        rng.shuffle(splits[name])
    return splits


def split_rows(labels: torch.Tensor, seed: int, fractions: dict[str, float]) -> dict[str, list[int]]:
    """{split: sorted row indices} of rows with class `labels`, stratified by class in `fractions`, drawn with
    `seed`."""
    rows = [{"row": n, "label": y} for n, y in enumerate(labels.tolist())]
    return {name: sorted(r["row"] for r in part) for name, part in stratified_split(rows, "label", fractions, seed).items()}


def inject_noise(labels: list[int], num_classes: int, rate: float, kind: str, seed: int) -> tuple[list[int], list[bool]]:
    """(noisy labels, flipped) with exactly round(rate·n) labels flipped, chosen with `seed`. `uniform`: each flipped
    label becomes one of the other classes at random; `class`: class k becomes class (k + 1) mod K (a class-dependent
    flip, the same wrong class for every example of a class)."""
    if kind not in NOISE_KINDS:
        raise ValueError(f"noise kind {kind!r}: choose one of {', '.join(NOISE_KINDS)}")
    if not 0 <= rate < 1:
        raise ValueError(f"noise rate must be in [0, 1), got {rate}")
    if num_classes < 2:
        raise ValueError(f"label noise needs two classes or more, got {num_classes}")
    rng = random.Random(seed)
    flipped = set(rng.sample(range(len(labels)), round(rate * len(labels))))
    noisy = []
    for i, y in enumerate(labels):
        if i not in flipped:
            noisy.append(y)
        elif kind == "uniform":
            noisy.append(rng.choice([k for k in range(num_classes) if k != y]))
        else:
            noisy.append((y + 1) % num_classes)
    return noisy, [i in flipped for i in range(len(labels))]


def parse_noise(spec: str) -> tuple[str, float]:
    """("none", 0.0) for `0`, else (kind, rate) of `KIND:RATE`; anything else refused with the form to write."""
    if spec in ("0", "none"):
        return "none", 0.0
    kind, _, rate = spec.partition(":")
    try:
        value = float(rate)
    except ValueError:
        value = None
    if kind not in NOISE_KINDS or value is None or not 0 <= value < 1:
        raise ValueError(f"noise setting {spec!r}: write 0 or KIND:RATE with KIND one of {', '.join(NOISE_KINDS)} and "
                         "RATE in [0, 1), e.g. uniform:0.2 or class:0.4")
    return ("none", 0.0) if value == 0 else (kind, value)


def known_classes(present: list[int], fraction: float, seed: int) -> list[int]:
    """The classes known in training at `seed`: round(fraction × len(present)) of `present`, drawn with the seed."""
    order = torch.randperm(len(present), generator=torch.Generator().manual_seed(seed))
    return sorted(torch.tensor(present)[order[: round(fraction * len(present))]].tolist())
