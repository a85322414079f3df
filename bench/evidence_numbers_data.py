"""bench/evidence_numbers.py, its data: VADER's human sentiment ratings read from the vaderSentiment sdist, and the
frozen base's final hidden states (and, for the digits arms, its answer states) per text, cached and resumable."""

import dataclasses
import hashlib
import io
import math
import os
import sys
import tarfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_digits as digits  # noqa: E402

GROUND_TRUTH_SUFFIX = "_GroundTruth.txt"
INNER_ARCHIVE = "hutto_ICWSM_2014.tar.gz"
PROMPT = 'Text: "{text}"\nSentiment of the text, from -4 (very negative) to 4 (very positive):'


# --- data -------------------------------------------------------------------------------------------------------


def parse_ground_truth(source: str, content: str) -> list[dict]:
    """Rows of one `*_GroundTruth.txt`: `id<TAB>mean rating<TAB>text`. A missing or non-finite rating is refused,
    naming the file, line and id (a NaN target would silently turn every loss into NaN)."""
    rows = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t", 2)
        where = f"{source} line {number} (id {fields[0].strip()!r})"
        if len(fields) < 3 or not fields[1].strip():
            raise ValueError(f"{where}: no rating; each line must read id<TAB>rating<TAB>text")
        try:
            rating = float(fields[1])
        except ValueError:
            raise ValueError(f"{where}: rating {fields[1]!r} is not a number") from None
        if not math.isfinite(rating):
            raise ValueError(f"{where}: rating {fields[1]!r} is not a finite number")
        rows.append({"source": source, "id": fields[0].strip(), "rating": rating, "text": fields[2].strip()})
    return rows


def read_vader_ratings(path) -> list[dict]:
    """Every `*_GroundTruth.txt` row of a tar: the vaderSentiment sdist (read through its nested
    `hutto_ICWSM_2014.tar.gz`) or that inner archive itself. Sorted by (file, line order)."""
    return _read_tar(tarfile.open(path, "r:*"))


def _read_tar(archive: tarfile.TarFile) -> list[dict]:
    rows = []
    with archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            if not member.isfile():
                continue
            if member.name.endswith(INNER_ARCHIVE):
                rows += _read_tar(tarfile.open(fileobj=io.BytesIO(archive.extractfile(member).read()), mode="r:*"))
            elif member.name.endswith(GROUND_TRUTH_SUFFIX):
                name = Path(member.name).name
                rows += parse_ground_truth(name, archive.extractfile(member).read().decode("utf-8"))
    if not rows:
        raise ValueError(f"no *{GROUND_TRUTH_SUFFIX} file in the archive: pass the vaderSentiment sdist or {INNER_ARCHIVE}")
    return rows


# --- features ---------------------------------------------------------------------------------------------------


def feature_cache_path(cache: Path, base: str, answers: bool = False) -> Path:
    key = hashlib.sha256(f"{Path(base).resolve()}\n{PROMPT}".encode()).hexdigest()[:12]
    return cache / f"vader-{'answers' if answers else 'z'}-{key}.pt"


def extract_features(base: str, rows: list[dict], texts: int, cache: Path, batch_size: int = 16,
                     answers: bool = False) -> dict:
    """z at the last prompt token for the first `texts` rows of a fixed permutation (seed 0) of all rows; resumes a
    partial cache (saved after every batch), so a long extraction can be stopped and continued. With `answers`, also
    the states the digits arm reads (evidence_digits.answer_states; z is their first) and the base's output rows of
    the answer tokens, in a cache of their own. Without `answers`, z is read from (and grown in) the answer states'
    cache when it exists and no cache of z alone does: z is their first state."""
    path = feature_cache_path(cache, base, answers)
    if not answers and not path.exists() and feature_cache_path(cache, base, True).exists():
        path = feature_cache_path(cache, base, True)  # z is the answer states' first: the digits arms' cache serves
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    store = torch.load(path, weights_only=False) if path.exists() else {
        "prompt": PROMPT, "base": str(base), "keys": [], "z": [], "rating": [], "seconds": 0.0}
    if len(store["keys"]) >= texts:
        return store
    answers = answers or "states" in store  # a cache of answer states grows as one, whoever resumes it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.padding_side = "left"  # the last position is every row's prompt end; RoPE sees relative positions only
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if answers:
        tree = digits.answer_tree(tokenizer, PROMPT.format(text=""))
        store.setdefault("tree", dataclasses.asdict(tree))
        store.setdefault("rows", digits.output_rows(model, tree))
        store.setdefault("states", torch.empty(0, len(tree.nodes), model.config.hidden_size))
        store.setdefault("rest_lse", torch.empty(0, len(tree.nodes)))
    todo = [rows[i] for i in order[len(store["keys"]) : texts]]
    path.parent.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(todo), batch_size * 4):
        # sort a window by length so a batch pads little; the store keeps the permutation's order
        window = todo[start : start + batch_size * 4]
        prompts = [PROMPT.format(text=r["text"]) for r in window]
        lengths = [len(tokenizer(p).input_ids) for p in prompts]
        by_length = sorted(range(len(window)), key=lengths.__getitem__)
        z = torch.empty(len(window), model.config.hidden_size)
        if answers:
            states = torch.empty(len(window), len(tree.nodes), model.config.hidden_size)
            rest_lse = torch.empty(len(window), len(tree.nodes))
        began = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, len(window), batch_size):
                idx = by_length[b : b + batch_size]
                enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True)
                if answers:
                    out = digits.answer_states(model, tree, enc.input_ids, enc.attention_mask, tokenizer.pad_token_id)
                    states[idx], rest_lse[idx] = out["states"], out["rest_lse"]
                    z[idx] = out["states"][:, 0]
                else:
                    z[idx] = model.get_decoder()(**enc).last_hidden_state[:, -1].float()
        store["seconds"] += time.perf_counter() - began
        store["keys"] += [f"{r['source']}:{r['id']}" for r in window]
        store["rating"] += [r["rating"] for r in window]
        store["z"] = torch.cat([torch.as_tensor(store["z"]).reshape(-1, z.shape[1]), z])
        if answers:
            store["states"] = torch.cat([store["states"], states])
            store["rest_lse"] = torch.cat([store["rest_lse"], rest_lse])
        tmp = path.with_suffix(".tmp")
        torch.save(store, tmp)
        os.replace(tmp, path)
        print(f"  extracted {len(store['keys'])}/{texts} texts, {store['seconds'] / len(store['keys']):.2f} s/text",
              flush=True)
    return store


def answer_features(store: dict, texts: int) -> "digits.AnswerFeatures":
    """The digits arm's inputs from a store extracted with `answers`."""
    return digits.AnswerFeatures(store["states"][:texts], store["rest_lse"][:texts], store["rows"],
                                 digits.AnswerTree(**store["tree"]))
