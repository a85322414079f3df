"""The comparison `causalqwen compare` runs on cached features: per seed a stratified train/validation/test split of
the rows, optional label flips (training and validation labels, as noisy as each other; the test labels stay clean)
and optional held-out classes (unknown in training, present at test); every arm trained at every rate of one grid,
each seed's rate chosen on its own validation split by the arm's own rule; the test metrics at the chosen rates."""

import contextlib
import math
import multiprocessing
import signal
import time
from dataclasses import dataclass, field

import torch

from ..classification import LabelSet, macro_f1
from .arms import check_arms
from .metrics import accuracies, arm_scores, noise_metrics, open_set, own_rule, p_top_spread
from .splits import inject_noise, known_classes, split_rows
from .stats import choose_rate
from .training import FreshHeads, RecipeRates, train_arm

NOISE_METRICS = ("accuracy", "macro_f1", "ece")
UNKNOWN_METRICS = ("auroc", "fpr_at_95_tpr", "open_set_macro_f1")


@dataclass
class Protocol:
    arms: list[str] = field(default_factory=lambda: ["ovr_candidates", "ovr_alone", "softmax"])
    baseline: str = "softmax"
    lrs: list[float] = field(default_factory=lambda: [1e-4, 1e-3, 1e-2])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    noise: tuple[str, float] = ("none", 0.0)
    unknown_fraction: float = 0.0
    steps: int | None = None  # None: one epoch of the training rows
    batch_rows: int = 16
    fractions: dict = field(default_factory=lambda: {"train": 0.6, "validation": 0.2, "test": 0.2})
    alpha: float = 0.05


def check_protocol(protocol: Protocol, num_classes: int | None = None) -> None:
    """Everything that would stop the comparison, before any training: an unknown arm, fewer than two seeds, a grid
    without rates; with `num_classes`, fewer than two classes or a held-out fraction that leaves fewer than two known
    classes or none unknown."""
    check_arms(protocol.arms)
    if protocol.baseline not in protocol.arms:
        raise ValueError(f"the baseline {protocol.baseline!r} is not among the arms {protocol.arms}: add it to --arms")
    if len(protocol.arms) < 2:
        raise ValueError(f"--arms {protocol.arms}: a comparison needs the baseline and at least one other arm")
    if len(set(protocol.seeds)) < 2 or len(set(protocol.seeds)) != len(protocol.seeds):
        raise ValueError(f"--seeds {protocol.seeds}: a paired comparison needs two different seeds or more (with one "
                         "there is no standard error); pass e.g. --seeds 0 1 2 3 4")
    if not protocol.lrs or any(not lr > 0 for lr in protocol.lrs):
        raise ValueError(f"--lrs {protocol.lrs}: give one or more positive learning rates")
    if not 0 <= protocol.unknown_fraction < 1:
        raise ValueError(f"--unknown_fraction {protocol.unknown_fraction}: the fraction of classes held out must be in "
                         "[0, 1)")
    if num_classes is None:
        return
    if num_classes < 2:
        raise ValueError(f"the rows hold {num_classes} class(es): a comparison needs two or more; add rows of other "
                         "classes")
    if protocol.unknown_fraction:
        held = round(protocol.unknown_fraction * num_classes)
        if held < 1 or num_classes - held < 2:
            raise ValueError(f"--unknown_fraction {protocol.unknown_fraction} of {num_classes} classes holds out "
                             f"{held} and leaves {num_classes - held} known: choose a fraction that holds out at least "
                             "one class and leaves at least two known (or add classes)")


@dataclass
class SeedData:
    known: list[int]  # the classes known in training (indices of the full label set)
    labels: LabelSet  # the known classes' label set
    features: dict  # z, and z_label at the known labels' positions
    train_rows: torch.Tensor
    train_labels: list[int]  # by row, indices of `labels` (noisy on the training rows)
    val_rows: list[int]  # validation rows of known classes
    val_target: torch.Tensor  # their labels (as noisy as training's)
    test_rows: list[int]  # every test row (unknown classes too)


def seed_data(features: dict, labels: LabelSet, protocol: Protocol, seed: int) -> SeedData:
    """What the seed draws: the split, the known classes and the label flips."""
    clean = features["label"]
    parts = split_rows(clean, seed, protocol.fractions)
    K = len(labels.labels)
    known = list(range(K))
    if protocol.unknown_fraction:
        known = known_classes(known, (K - round(protocol.unknown_fraction * K)) / K, seed)
    index = {k: i for i, k in enumerate(known)}
    run_labels = LabelSet([labels.labels[k] for k in known], [labels.token_ids[k] for k in known])
    y = clean.tolist()
    train_rows = [n for n in parts["train"] if y[n] in index]
    val_rows = [n for n in parts["validation"] if y[n] in index]
    train_labels = [index.get(v, 0) for v in y]
    val_target = [index[y[n]] for n in val_rows]
    kind, rate = protocol.noise
    if rate:
        noisy = inject_noise([train_labels[n] for n in train_rows], len(known), rate, kind, seed)[0]
        for n, v in zip(train_rows, noisy):
            train_labels[n] = v
        val_target = inject_noise(val_target, len(known), rate, kind, seed + 1000)[0]
    view = {"z": features["z"], "z_label": features["z_label"][:, known] if len(known) < K else features["z_label"]}
    return SeedData(known, run_labels, view, torch.tensor(train_rows), train_labels, val_rows,
                    torch.tensor(val_target), parts["test"])


def test_metrics(model, arm: str, features: dict, data: SeedData) -> dict[str, float]:
    """Accuracy, macro-F1 and ECE of the own rule (and the rest of `noise_metrics`) on the test rows of known classes;
    with held-out classes, the open-set scores of the arm's declared rejection score (max_k P_k for the OvR arms,
    the energy score for the others)."""
    index = {k: i for i, k in enumerate(data.known)}
    y = features["label"].tolist()
    rows = [n for n in data.test_rows if y[n] in index]
    target = torch.tensor([index[y[n]] for n in rows])
    scores = arm_scores(model, arm, features["z"][rows], data.labels)
    out = noise_metrics(model, arm, None, target, data.labels, scores=scores)
    out["macro_f1"] = macro_f1(scores.decide(own_rule(model))[0], target)
    if own_rule(model) == "ovr":  # reported under the table: a flat P_top is an uncalibrated probability
        out.update(p_top_spread(arm, scores))
    if len(data.known) < len(set(y)):
        score = "ovr_max_prob" if model.config.objective == "ovr" else "energy"
        sets = open_set(model, arm, features["z"][data.test_rows], features["label"][data.test_rows], data.known,
                        features["z"][data.val_rows], features["label"][data.val_rows], data.labels)
        out.update(sets[score])
        out["rejection_score"] = score
    return out


def check_seed_data(data: SeedData, seed: int, features: dict, unknown: bool) -> None:
    """Each seed's split must leave training and validation rows, test rows of known classes and, with held-out
    classes, test rows of unknown ones: refused before any training, with what to change."""
    y = features["label"].tolist()
    known = set(data.known)
    problems = []
    if len(data.train_rows) == 0 or not data.val_rows:
        problems.append("no training or no validation rows of the known classes")
    if not any(y[n] in known for n in data.test_rows):
        problems.append("no test rows of the known classes")
    if unknown and all(y[n] in known for n in data.test_rows):
        problems.append("no test rows of a held-out class")
    if problems:
        raise ValueError(f"seed {seed}: the split leaves {' and '.join(problems)}: add rows (a few per class at "
                         "least) or hold out a smaller --unknown_fraction")


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def run_comparison(base, features: dict, labels: LabelSet, eos: int, protocol: Protocol, *, rates=RecipeRates(),
                   log=print, on_run=None, done: dict | None = None, num_proc: int = 1, threads: int = 1) -> dict:
    """Every (arm, seed, rate) run, arms outermost (an arm's fresh heads are built once per process, `FreshHeads`);
    returns {runs: [{arm, seed, lr, validation, test, seconds}], per_seed: {arm: {seed: test metrics at the chosen
    rate}}, chosen: {arm: {seed: lr}}}. `on_run(run)` after each run trained; `done`: runs of this comparison already
    finished, by (arm, seed, lr) (`progress.RunLog`), taken as they are instead of trained again. ``num_proc`` > 1:
    that many forked processes of ``threads`` torch threads each train the runs (`parallel_runs`); each run is
    seeded by itself, so the results are the one-process results whatever process trains it (within the rounding of
    another thread count's products)."""
    check_protocol(protocol, len(labels.labels))
    data = {seed: seed_data(features, labels, protocol, seed) for seed in protocol.seeds}
    for seed, d in data.items():
        check_seed_data(d, seed, features, bool(protocol.unknown_fraction))
    planned = [(arm, seed, lr) for arm in protocol.arms for seed in protocol.seeds for lr in protocol.lrs]
    finished = {key: done[key] for key in planned if key in (done or {})}
    todo = [key for key in planned if key not in finished]
    if finished:
        log(f"{len(finished)} of {len(planned)} runs finished earlier: training the other {len(todo)}")
    for count, run in enumerate(finished.values(), 1):
        log(_progress_line(count, len(planned), run, "finished earlier"))
    context = _RunContext(base, features, data, eos, protocol, rates)
    trained_seconds = 0.0
    runs = parallel_runs(context, todo, num_proc, threads) if num_proc > 1 else (context.train(k) for k in todo)
    with contextlib.closing(runs):  # an error here stops the processes at once
        for count, run in enumerate(runs, 1):
            finished[(run["arm"], run["seed"], run["lr"])] = run
            trained_seconds += run["seconds"]
            if on_run is not None:
                on_run(run)
            left = trained_seconds / count * (len(todo) - count) / max(1, min(num_proc, len(todo) - count))
            log(_progress_line(len(finished), len(planned), run, f"{run['seconds']:.0f}s"
                               + (f"; about {_duration(left)} left" if left else "")))
    per_seed, chosen = {}, {}
    for arm in protocol.arms:
        for seed in protocol.seeds:
            by_lr = {lr: finished[(arm, seed, lr)] for lr in protocol.lrs}
            lr = choose_rate({lr: run["validation"] for lr, run in by_lr.items()})
            chosen.setdefault(arm, {})[seed] = lr
            per_seed.setdefault(arm, {})[seed] = by_lr[lr]["test"]
    return {"runs": [finished[key] for key in planned], "per_seed": per_seed, "chosen": chosen,
            "known": {seed: [labels.labels[k] for k in d.known] for seed, d in data.items()}}


def _progress_line(index: int, total: int, run: dict, took: str) -> str:
    return (f"[{index}/{total}] {run['arm']} seed {run['seed']} lr {run['lr']:g}: validation {run['validation']:.4f}, "
            f"test accuracy {run['test']['accuracy']:.4f} ({took})")


@dataclass
class _RunContext:
    """What a run needs, shared by the processes that train runs (inherited by fork, never pickled)."""

    base: object
    features: dict
    data: dict
    eos: int
    protocol: Protocol
    rates: RecipeRates
    heads: FreshHeads | None = None

    def train(self, key: tuple) -> dict:
        arm, seed, lr = key
        if self.heads is None:
            self.heads = FreshHeads(self.base)
        d, protocol, start = self.data[seed], self.protocol, time.perf_counter()
        steps = protocol.steps or math.ceil(len(d.train_rows) / protocol.batch_rows)
        model = train_arm(self.base, arm, d.features, d.train_rows, d.train_labels, d.labels, self.eos, lr, steps,
                          protocol.batch_rows, seed, self.rates, heads=self.heads)
        validation = accuracies(model, arm, self.features["z"][d.val_rows], d.val_target, d.labels)
        validation = validation["ovr" if "ovr" in validation else "softmax"]
        return {"arm": arm, "seed": seed, "lr": lr, "steps": steps, "validation": validation,
                "test": test_metrics(model, arm, self.features, d), "seconds": time.perf_counter() - start}


def check_num_proc(num_proc: int, threads: int = 1, device: torch.device | str = "cpu") -> None:
    """--num_proc forks; a forked process runs one torch thread (GNU OpenMP, torch's CPU threads, does not survive a
    fork with more: the processes hang) and no accelerator (a CUDA context does not survive a fork either)."""
    device = torch.device(device)
    if num_proc > 1 and device.type != "cpu":
        raise ValueError(f"--num_proc {num_proc} with --device {device}: forked processes cannot share the "
                         f"{device.type} device's context; on it one process trains the runs one after another: "
                         "pass --num_proc 1 (or --device cpu to train runs in parallel processes on the CPU)")
    if num_proc > 1 and "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError(f"--num_proc {num_proc} forks processes, which this platform cannot: pass --num_proc 1")
    if num_proc > 1 and threads > 1:
        raise ValueError(f"--threads {threads} with --num_proc {num_proc}: each forked process runs one torch thread "
                         "(torch's OpenMP threads do not survive a fork): pass --threads 1, or --num_proc 1 for "
                         f"{threads} threads in one process")


_CONTEXT: _RunContext | None = None  # the forked processes' context (set by the parent before it forks them)


def _start_worker(threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops every process
    torch.set_num_threads(threads)


def _train_in_worker(key: tuple) -> dict:
    return _CONTEXT.train(key)


def parallel_runs(context: _RunContext, keys: list, num_proc: int, threads: int = 1):
    """Yields the runs of ``keys`` as ``num_proc`` forked processes of ``threads`` torch threads each finish them
    (the base, the features and the splits inherited, not copied: each process holds its own heads, optimizer state
    and gradients, about four copies of W_A). A run that fails, Ctrl-C, or the caller closing the generator stops
    every process at once (the runs under way are lost; those yielded before are the caller's to keep: `RunLog`)
    and the error is raised."""
    global _CONTEXT
    check_num_proc(num_proc, threads, next(context.base.parameters()).device)
    _CONTEXT = context
    try:
        with multiprocessing.get_context("fork").Pool(min(num_proc, max(1, len(keys))), initializer=_start_worker,
                                                      initargs=(threads,)) as pool:  # its exit terminates them
            yield from pool.imap_unordered(_train_in_worker, keys, chunksize=1)
    finally:
        _CONTEXT = None
