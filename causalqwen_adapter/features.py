"""Stage 1 of offline distillation (docs/design.md, Offline distillation): the teacher's features, extracted once.

`extract_features` runs the frozen teacher (the base) over a corpus and stores, for every real token, the final hidden
state z and the teacher's top-K next-token ids and softmax probabilities, as a `datasets` folder
(`Dataset.save_to_disk` layout, memory-mapped when read back) plus `causalqwen_features.json` naming the teacher
and the sha256 of every shard. `load_features` reads a store back (checking the shards), and
`check_feature_dataset` checks one against the model that will train on it.

Under `accelerate launch` / `torchrun` (a torch.distributed process group is up) every process runs the teacher on
every world-size-th sequence, on its own device, and the first process merges their rows, in corpus order, into the
one store.
"""

import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow.compute as pc
import torch
import torch.distributed as dist
from datasets import Dataset, Features, IterableDataset, Sequence, Value, concatenate_datasets, load_from_disk
from datasets.arrow_writer import ArrowWriter
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging

from .adapter_folder import check_can_write, make_staging, replace_folder, save_failed
from .adapter_io import (
    all_finite,
    base_config_dict,
    causal_lm_parts,
    check_logits_are_output_layer,
    check_supported_base,
    stale_save_folders,
)
from .configuration_causalqwen import check_number
from .devices import resolve_device
from .modeling_causalqwen import CausalQwenForCausalLM

logger = logging.get_logger(__name__)

FEATURES_CONFIG_NAME = "causalqwen_features.json"
FEATURE_COLUMNS = ("hidden_state", "topk_ids", "topk_probs")
_FEATURE_DTYPES = ("float32", "float16")


def extract_features(
    teacher,
    dataset,
    output_dir,
    *,
    tokenizer=None,
    top_k: int = 32,
    max_length: int = 1024,
    batch_size: int = 8,
    text_field: str = "text",
    feature_dtype: str = "float32",
    dtype="auto",
    revision: str | None = None,
    overwrite: bool = False,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> Dataset:
    """Run the frozen teacher over `dataset` and write its features to `output_dir`; returns the stored dataset.

    Args:
        teacher: the base as a loaded causal LM (a `*ForCausalLM` of any architecture `from_base` takes) or its
            folder / Hub id (loaded in `dtype`, at `revision`).
        dataset: a `datasets.Dataset` / `IterableDataset` with a `text_field` column (tokenized here, truncated to
            `max_length`) or an `input_ids` column, or a list of strings.
        tokenizer: defaults to the teacher's.
        top_k: how many of the teacher's most probable next tokens to keep per position.
        feature_dtype: "float32" (exact) or "float16" (half the disk; z is checked to fit) for the stored z.
        overwrite: replace an existing `output_dir`; otherwise an existing non-empty folder is an error.
        device: where the teacher runs (`devices.resolve_device`: "auto", "cpu", "cuda", "cuda:1", ...; under a
            launcher a bare type is each process's own device). None: a teacher object already off the CPU stays
            where it is, otherwise "auto" (the accelerator when there is one). A teacher object is moved there.
        progress: show a progress bar of the teacher pass (the first process's share of the sequences).

    One row per real (non-padding) token, in corpus order: `hidden_state` [H], `topk_ids` [K] (the teacher's top-1
    first), `topk_probs` [K]. The folder appears complete or not at all.
    """
    if feature_dtype not in _FEATURE_DTYPES:
        raise ValueError(f"feature_dtype must be one of {', '.join(_FEATURE_DTYPES)}, got {feature_dtype!r}")
    for name, value in (("max_length", max_length), ("batch_size", batch_size)):
        check_number(name, value, minimum=1, integer=True)
    target = Path(output_dir)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} is a file, not a folder: the features are a folder, and extract_features "
                              "never replaces a file (overwrite replaces only a feature store). Choose another "
                              "output_dir")
    # what the folder holds, but for the hidden folders killed extractions staging inside it left (staging_place)
    held = set(target.iterdir()) - set(stale_save_folders(target)) if target.is_dir() else set()
    if held and not overwrite:
        raise FileExistsError(f"{target} already exists: pass overwrite=True (--overwrite) or choose another folder")

    if target.is_dir() and ((target / "config.json").is_file() or (target / "model.safetensors").is_file()):
        raise FileExistsError(f"{target} holds a model checkpoint: feature extraction never writes over (or, with "
                              "overwrite, deletes) a model folder. Choose another output_dir")
    if held and not (target / FEATURES_CONFIG_NAME).is_file():
        raise FileExistsError(f"{target} is not a feature store (no {FEATURES_CONFIG_NAME}): overwrite replaces only a "
                              "folder extract_features wrote. Choose another output_dir")
    check_can_write(target, "the features")  # before the teacher pass, not after it
    if device is None and isinstance(teacher, torch.nn.Module) and next(teacher.parameters()).device.type != "cpu":
        device = next(teacher.parameters()).device
    device = resolve_device(device)  # before loading: a wrong device fails at once
    teacher = _load_teacher(teacher, dtype, revision).to(device)
    vocab = teacher.config.vocab_size
    if not isinstance(top_k, int) or not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be an integer in [1, {vocab}] (the teacher's vocabulary), got {top_k!r}")
    rank, world = _process_group()
    sequences = _token_sequences(dataset, tokenizer, text_field, max_length, teacher.name_or_path, revision,
                                 rank=rank, world=world)

    hidden = teacher.config.hidden_size
    features = Features({
        "hidden_state": Sequence(Value(feature_dtype), length=hidden),
        "topk_ids": Sequence(Value("int32"), length=top_k),
        "topk_probs": Sequence(Value("float32"), length=top_k),
    })
    staging = None
    if rank == 0:
        staging = make_staging(target, "the features")  # beside the target, or inside it (staging_place)
    try:
        staging = Path(_broadcast(str(staging) if staging else None))
        lengths, error = [], None
        try:  # this process's rows; its sequence lengths let the first process put every row back in corpus order
            total = _share(dataset, rank, world)
            bar = _progress_bar(total) if progress and rank == 0 else None
            try:
                _write_rows(teacher, sequences, batch_size, top_k, features, staging / f"rows-{rank}.arrow", lengths,
                            bar)
            finally:
                if bar is not None:
                    bar.close()
        except Exception as exc:  # reported to every process, so that none waits for rows that will not come
            error = exc
        results = _gather((None if error is None else f"{type(error).__name__}: {error}", lengths))
        failed = [(r, message) for r, (message, _) in enumerate(results) if message is not None]
        if isinstance(error, OSError):  # writing the rows into the hidden staging folder: named by the target
            raise save_failed(error, target, "the features") from error
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"feature extraction failed in process {failed[0][0]}: {failed[0][1]}")
        lengths_by_rank = [rank_lengths for _, rank_lengths in results]
        num_tokens = sum(map(sum, lengths_by_rank))
        if num_tokens == 0:
            raise ValueError("the dataset holds no token to extract features from (empty dataset or empty texts)")
        message = None
        if rank == 0:
            try:
                _write_store(staging, target, lengths_by_rank, {
                    "teacher_name_or_path": _same_place(teacher.name_or_path),  # a folder by its absolute path
                    "teacher_revision": revision,
                    "hidden_size": hidden,
                    "vocab_size": vocab,
                    "top_k": top_k,
                    "max_length": max_length,
                    "num_tokens": num_tokens,
                    "num_sequences": sum(n > 0 for rank_lengths in lengths_by_rank for n in rank_lengths),
                    "feature_dtype": feature_dtype,
                    "teacher_dtype": str(teacher.dtype).removeprefix("torch."),
                })
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                _broadcast(message)
        elif (message := _broadcast(None)) is not None:
            raise RuntimeError(f"feature extraction failed in process 0 while writing {target}: {message}")
    finally:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
    logger.info(f"Stored teacher features of {num_tokens} tokens in {target}")
    return load_features(target)


def _share(dataset, rank: int, world: int) -> int | None:
    """How many sequences process `rank` of `world` reads (round robin), when the dataset's length is known."""
    try:
        n = len(dataset)
    except TypeError:  # an IterableDataset
        return None
    return len(range(rank, n, world))


def _progress_bar(total: int | None):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="teacher pass", unit="seq")


def _write_rows(teacher, sequences, batch_size, top_k, features, arrow_file: Path, lengths: list, bar=None) -> None:
    """The teacher's rows of `sequences` into one Arrow file; `lengths` receives each sequence's token count (0 for
    an empty one), in order; `bar`, a tqdm bar, advances by one per sequence the teacher has scored."""
    store_dtype = getattr(torch, features["hidden_state"].feature.dtype)

    def counted():
        for seq in sequences:
            lengths.append(len(seq))
            yield seq

    with ArrowWriter(features=features, path=str(arrow_file)) as writer:
        for z, ids, probs in _teacher_rows(teacher, counted(), batch_size, top_k):
            if not (all_finite(z) and all_finite(probs)):  # NaN weights give NaN features, and heads that learn NaN
                raise ValueError(
                    "the teacher's hidden states or next-token probabilities hold NaN or infinite values: its "
                    f"weights are corrupt, or its activations overflow {str(teacher.dtype).removeprefix('torch.')}. "
                    "Nothing was written; check the teacher's weights (or extract with dtype='float32')"
                )
            if store_dtype == torch.float16 and z.abs().max() > torch.finfo(torch.float16).max:
                raise ValueError("a hidden state does not fit in float16: extract with feature_dtype='float32'")
            writer.write_batch({
                "hidden_state": z.to(store_dtype).numpy(),
                "topk_ids": ids.to(torch.int32).numpy(),
                "topk_probs": probs.numpy(),
            })
            if bar is not None:
                bar.update(1)
        if bar is not None:  # the empty sequences, which the teacher skips
            bar.update(len(lengths) - bar.n)
        writer.finalize()


def _merge_and_install(staging: Path, target: Path, lengths_by_rank: list[list[int]], info: dict) -> None:
    """The processes' rows as one store in corpus order (sequence j came from process j mod world), its info and
    shard checksums, then the folder put in place of `target` (`replace_folder`)."""
    world = len(lengths_by_rank)
    parts = [Dataset.from_file(str(staging / f"rows-{r}.arrow")) for r in range(world)]
    merged = parts[0]
    if world > 1:
        firsts = []  # per process: the first row of each of its sequences in the concatenated table
        offset = 0
        for rank_lengths in lengths_by_rank:
            firsts.append(list(itertools.accumulate(rank_lengths, initial=offset)))
            offset = firsts[-1][-1]
        order = []
        for j in range(sum(map(len, lengths_by_rank))):
            r, i = j % world, j // world
            order.extend(range(firsts[r][i], firsts[r][i] + lengths_by_rank[r][i]))
        merged = concatenate_datasets(parts).select(order)
    merged.save_to_disk(str(staging / "store"))
    # sha256 of every Arrow shard: load_features refuses a store whose bytes changed since
    info["shards"] = {f.name: _sha256(f) for f in sorted((staging / "store").glob("*.arrow"))}
    (staging / "store" / FEATURES_CONFIG_NAME).write_text(json.dumps(info, indent=2) + "\n")
    replace_folder(staging / "store", target, FEATURES_CONFIG_NAME)


def _write_store(staging: Path, target: Path, lengths_by_rank: list[list[int]], info: dict) -> None:
    """`_merge_and_install`, a file error raised naming `target` and its cause (never only the hidden staging path)."""
    try:
        _merge_and_install(staging, target, lengths_by_rank, info)
    except OSError as err:
        raise save_failed(err, target, "the features") from err


def _process_group() -> tuple[int, int]:
    """(rank, world size) of the torch.distributed group a launcher started; (0, 1) in a single process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast(value):
    """The first process's `value`, in every process (itself without a process group)."""
    if _process_group()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value) -> list:
    """Every process's `value`, by rank."""
    if _process_group()[1] == 1:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def load_features(path) -> Dataset:
    """A feature folder written by `extract_features`, memory-mapped, formatted as torch tensors; its shards are
    checked against the sha256 sums `extract_features` recorded."""
    path = Path(path)
    check_feature_store(path)
    shards = features_info(path).get("shards")
    if shards is None:
        logger.warning(f"{path} records no shard checksums (written by an older version): its bytes are not verified")
    for name, digest in (shards or {}).items():
        if not (path / name).is_file() or _sha256(path / name) != digest:
            raise ValueError(
                f"{path / name} is missing or its bytes changed since extract_features wrote it (sha256 differs from "
                f"{FEATURES_CONFIG_NAME}): the store is corrupt; extract the features again"
            )
    dataset = load_from_disk(str(path))
    if not isinstance(dataset, Dataset):
        raise ValueError(f"{path} holds a DatasetDict, not the single table extract_features writes")
    return dataset.with_format("torch", columns=list(FEATURE_COLUMNS))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_feature_store(path: Path) -> None:
    """Refuse, naming what to do, a folder that is not a feature store `extract_features` finished writing (checked
    before any model loads; `load_features` then checks its bytes)."""
    path = Path(path)
    if not (path / FEATURES_CONFIG_NAME).is_file():
        # the old store, renamed whole beside the folder or (staged inside it) its files set aside in it
        kept = [p if p.parent == path else p / path.name for p in stale_save_folders(path) if p.suffix == ".old"]
        kept = [p for p in kept if (p / FEATURES_CONFIG_NAME).is_file()]
        if kept and not path.exists():
            raise FileNotFoundError(
                f"{path} does not exist: an extraction replacing it was interrupted. The previous feature store is "
                f"{kept[-1]}: move it back to {path}, or extract the features again."
            )
        if kept:
            raise FileNotFoundError(
                f"{path} holds no {FEATURES_CONFIG_NAME}: an extraction replacing it was interrupted while swapping "
                f"its files. The previous store's {FEATURES_CONFIG_NAME} and the files already replaced are in "
                f"{kept[-1]}: move them back into {path}, or extract the features again."
            )
        found = "no such folder" if not path.exists() else "a file" if not path.is_dir() else \
            f"it holds no {FEATURES_CONFIG_NAME}"
        raise FileNotFoundError(
            f"{path}: {found}, so it is not a feature store written by extract_features: give the folder "
            "`causalqwen extract-features --output_dir` wrote"
        )


def features_info(path) -> dict:
    """The teacher and shapes recorded next to a feature store (`causalqwen_features.json`)."""
    return json.loads((Path(path) / FEATURES_CONFIG_NAME).read_text())


def _load_teacher(teacher, dtype, revision) -> PreTrainedModel:
    """The teacher as a causal LM whose softmax is that of its output layer on z: what the heads are distilled to."""
    if isinstance(teacher, (str, os.PathLike)):
        base_config_dict(str(teacher), "teacher", revision)  # a missing folder or an adapter: refused
        check_supported_base(AutoConfig.from_pretrained(str(teacher), revision=revision), str(teacher))
        teacher = AutoModelForCausalLM.from_pretrained(str(teacher), revision=revision, dtype=dtype)
    elif not isinstance(teacher, PreTrainedModel):
        raise TypeError(f"teacher must be a loaded causal LM (a *ForCausalLM) or its folder / Hub id, got "
                        f"{type(teacher).__name__}")
    backbone, lm_head = causal_lm_parts(teacher, teacher.name_or_path)
    check_logits_are_output_layer(teacher, backbone, lm_head, teacher.name_or_path)
    return teacher.eval()


def _token_sequences(dataset, tokenizer, text_field, max_length, teacher_name, revision, rank=0,
                     world=1) -> Iterator[list[int]]:
    """The token ids of every `world`-th sequence from the `rank`-th, truncated to `max_length`."""
    if isinstance(dataset, (list, tuple)):
        if not all(isinstance(t, str) for t in dataset):
            raise TypeError("a list dataset must hold strings (the texts)")
        rows: Iterable = [{text_field: t} for t in dataset]
        columns = [text_field]
    elif isinstance(dataset, Dataset):
        rows, columns = dataset, dataset.column_names
    elif isinstance(dataset, IterableDataset):
        rows, columns = dataset, dataset.column_names
        if columns is None:  # features unknown until the first example
            first = next(iter(dataset), None)
            columns = list(first) if first is not None else []
    else:
        raise TypeError(f"dataset must be a datasets.Dataset, an IterableDataset or a list of texts, got {type(dataset).__name__}")
    if world > 1:  # round robin, before tokenizing: each process tokenizes only its own texts
        rows = (row for i, row in enumerate(rows) if i % world == rank)
    if "input_ids" in columns:
        return (list(row["input_ids"])[:max_length] for row in rows)
    if text_field not in columns:
        raise ValueError(
            f"the dataset has no {text_field!r} or 'input_ids' column (columns: {columns}): pass text_field=<the "
            "column that holds the texts>"
        )
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(teacher_name, revision=revision)
        if len(tokenizer) < 2:  # transformers builds an empty tokenizer for a folder without tokenizer files
            raise ValueError(f"{teacher_name} has no tokenizer: pass tokenizer=... to tokenize the texts")
    return (tokenizer(row[text_field], truncation=True, max_length=max_length)["input_ids"] for row in rows)


@torch.inference_mode()
def _teacher_rows(teacher, sequences, batch_size: int, top_k: int, head_rows: int = 512):
    """Per sequence: (z [L, H] float32, top-K ids [L, K], top-K probabilities [L, K] float32)."""
    device = teacher.device
    backbone, lm_head = teacher.base_model, teacher.get_output_embeddings()  # checked by _load_teacher
    batch: list[list[int]] = []

    def run(batch):
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, seq in enumerate(batch):  # right padding: positions 0..L−1 keep their unpadded values
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        vocab = teacher.config.vocab_size
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
            bad = ids[(ids < 0) | (ids >= vocab)][0].item()
            raise ValueError(f"token id {bad} is outside the teacher's vocabulary [0, {vocab}): the input_ids were not "
                             "made by this base's tokenizer")
        z = backbone(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        for i, seq in enumerate(batch):
            zi = z[i, : len(seq)]
            top_ids, top_probs = [], []
            for r in range(0, len(seq), head_rows):  # [rows × V] logits a block at a time
                probs = torch.softmax(lm_head(zi[r : r + head_rows]).float(), dim=-1)
                p, k = probs.topk(top_k, dim=-1)
                top_ids.append(k)
                top_probs.append(p)
            yield zi.float().cpu(), torch.cat(top_ids).cpu(), torch.cat(top_probs).cpu()

    for seq in sequences:
        if len(seq) == 0:
            continue
        batch.append(seq)
        if len(batch) == batch_size:
            yield from run(batch)
            batch = []
    if batch:
        yield from run(batch)


def _same_place(name: str) -> str:
    """A Hub id as it is; a local folder by its absolute path (as adapters store their base)."""
    return os.path.abspath(name) if os.path.isdir(name) else os.path.normpath(name)


def check_feature_dataset(data, model: CausalQwenForCausalLM, split: str) -> Dataset:
    """A feature store checked against the model: columns, z width, top-K ids inside the vocabulary."""
    if isinstance(data, (str, os.PathLike)):
        info = features_info(data) if (Path(data) / FEATURES_CONFIG_NAME).is_file() else {}
        dataset = load_features(data)
        teacher = info.get("teacher_name_or_path")
        base = model.config.base_model_name_or_path
        if teacher and base and _same_place(teacher) != _same_place(base):
            logger.warning(
                f"the {split} features were extracted with {teacher}, the heads attach to {base}: distilled heads "
                "are only right on the base whose hidden states they were trained on"
            )
    elif isinstance(data, Dataset):
        dataset = data
    else:
        raise TypeError(f"the {split} dataset must be a feature folder or a Dataset from load_features, got {type(data).__name__}")
    missing = [c for c in FEATURE_COLUMNS if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"the {split} dataset lacks the feature columns {missing} (it has {dataset.column_names}): build it with "
            "extract_features"
        )
    hidden, vocab = model.config.text_config.hidden_size, model.config.text_config.vocab_size
    width = getattr(dataset.features["hidden_state"], "length", None)
    if width != hidden:
        raise ValueError(
            f"the {split} features hold hidden states of size {width}, the model's base has hidden_size {hidden}: "
            "extract the features with this base"
        )
    ids = pc.list_flatten(dataset.with_format("arrow").data.column("topk_ids"))
    if len(ids):
        bounds = pc.min_max(ids)
        if bounds["min"].as_py() < 0 or bounds["max"].as_py() >= vocab:
            raise ValueError(
                f"the {split} features hold top-K token id {bounds['max'].as_py()} outside the model's vocabulary "
                f"[0, {vocab}): extract the features with this base"
            )
    return dataset.with_format("torch", columns=list(FEATURE_COLUMNS))


__all__ = ["FEATURES_CONFIG_NAME", "check_feature_dataset", "extract_features", "features_info", "load_features"]
