"""Text datasets as the subcommands read them: a `datasets` name or a local file, in any format TRL's SFT reads.

Formats (TRL's): `text` (language modeling), `prompt` + `completion` (scored on the completion only) and chat
`messages`; conversational rows go through the tokenizer's chat template (`trl.data_utils.maybe_apply_chat_template`).
"""

from pathlib import Path

import torch

from .configuration_causalqwen import check_number

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
FORMATS = ("text", "prompt/completion", "messages")


def check_data_source(name: str, what: str = "dataset_name") -> None:
    """Refuse, before anything loads, a data source that cannot be read, saying what to give instead: a local path
    (a name with a data file's suffix, or one written as a path: `./x`, `/x`, `~/x`, `a/b/c`) that does not exist, a
    file of another type or empty, a folder holding no data file `datasets` reads. Any other name is a `datasets`
    name, left to the Hub lookup."""
    path = Path(name).expanduser()
    formats = ", ".join(_FILE_BUILDERS)
    if path.is_file():
        if path.suffix not in _FILE_BUILDERS:
            raise ValueError(f"{what} {name!r}: unsupported data file type {path.suffix!r}; use one of {formats}")
        size = path.stat().st_size
        if size == 0 or (size < 4096 and not path.read_bytes().strip()):
            # datasets would raise a bare StopIteration while guessing the columns
            raise ValueError(f"{name} is empty ({size} bytes): no rows to read. Give a file with one "
                             "example per line (.jsonl) or a table with a header")
    elif path.is_dir():
        from datasets.data_files import EmptyDatasetError, get_data_patterns

        try:  # how load_dataset finds a folder's files; it would fail the same way, naming neither flag nor fix
            get_data_patterns(str(path))
        except EmptyDatasetError:
            raise ValueError(f"{what} {name!r} is a folder holding no data file datasets can read: give a {formats} "
                             "file, or a folder of such files") from None
    elif path.exists():
        raise ValueError(f"{what} {name!r} is neither a file nor a folder: give a {formats} file or a folder of them")
    elif path.suffix in _FILE_BUILDERS or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"{what} {name!r} was not found: no file or folder {str(path.absolute())!r}. Give an "
                                f"existing {formats} file or folder, or the name of a dataset on the Hub")


def load_text_dataset(name: str, config: str | None = None, streaming: bool = False):
    """A `DatasetDict`: a local .jsonl/.json/.parquet/.csv file (one split, `train`) or a `datasets` name/folder,
    first checked by `check_data_source`."""
    from datasets import load_dataset

    check_data_source(name)
    path = Path(name).expanduser()
    if path.is_file():
        builder = _FILE_BUILDERS[path.suffix]
        no_rows = (f"{name} holds no rows (a header alone, an empty list, blank lines): give it one example per line "
                   "(.jsonl), a list of objects (.json) or rows under the header (.csv)")
        if builder == "parquet":  # datasets fails on a parquet file of no rows with Arrow's "BatchSize must be > 0"
            import pyarrow.parquet as pq

            if pq.ParquetFile(path).metadata.num_rows == 0:
                raise ValueError(no_rows)
        try:
            return load_dataset(builder, data_files=str(path), streaming=streaming)
        except ValueError as err:
            if "corresponds to no data" in str(err):  # datasets' words, which name neither the file nor the cause
                raise ValueError(no_rows) from None
            raise
    return load_dataset(name, name=config, streaming=streaming)


def check_text_dataset(dataset, split: str = "train") -> None:
    """Refuse, with what to do, a dataset none of the formats can read: no rows, no text column, non-text values."""
    columns = list(getattr(dataset, "column_names", None) or [])
    if not columns:
        return  # streaming datasets may not know their columns; TRL checks rows as they come
    if "input_ids" in columns:
        return  # already tokenized
    if "messages" not in columns and "text" not in columns and not {"prompt", "completion"} <= set(columns):
        raise ValueError(
            f"the {split} dataset has columns {columns}, none of the formats: give it a `text` column, `prompt` and "
            "`completion` columns, or chat `messages` (rename yours with dataset.rename_column)"
        )
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError(f"the {split} dataset has no rows: nothing to train or evaluate on")
    column = "messages" if "messages" in columns else "text" if "text" in columns else "completion"
    if column == "messages" or not hasattr(dataset, "with_format"):
        return
    # From the Arrow column, without reading the texts into Python: its type, then its missing values.
    import pyarrow as pa
    import pyarrow.compute as pc

    values = dataset.with_format("arrow").data.column(column)
    conversational = pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
    text = pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
    bad = None
    if not (text or conversational):
        bad = 0
    elif values.null_count:
        bad = pc.index(pc.is_null(values), True).as_py()
    if bad is not None:
        value = dataset[bad][column]
        raise ValueError(
            f"the {split} dataset's `{column}` in row {bad} is {value!r} ({type(value).__name__}), not text: "
            "drop or fix such rows (dataset.filter(lambda r: isinstance(r[...], str)))"
        )


def tokenize_for_evaluation(dataset, tokenizer, max_length: int | None = None) -> list[dict[str, list[int]]]:
    """Rows of `input_ids` and `labels` (−100 on prompts), truncated to `max_length` tokens, as SFT would score them."""
    from trl.data_utils import maybe_apply_chat_template

    check_text_dataset(dataset, "evaluation")
    rows = []
    for example in dataset:
        if "input_ids" in example:
            ids = list(example["input_ids"])
            labels = list(example.get("labels") or ids)
        else:
            example = maybe_apply_chat_template({k: v for k, v in example.items() if k in ("text", "prompt", "completion", "messages")}, tokenizer)
            if "text" in example:
                ids = tokenizer(example["text"], add_special_tokens=False).input_ids
                labels = list(ids)
            else:
                prompt = tokenizer(example["prompt"], add_special_tokens=False).input_ids
                completion = tokenizer(example["completion"], add_special_tokens=False).input_ids
                ids = prompt + completion
                labels = [-100] * len(prompt) + completion
        if max_length is not None:
            ids, labels = ids[:max_length], labels[:max_length]
        if len(ids) > 1:
            rows.append({"input_ids": ids, "labels": labels})
    if not rows:
        raise ValueError("no evaluation row has two tokens or more: nothing to score")
    return rows


def batches(rows: list[dict], batch_size: int, pad_token_id: int = 0):
    """Right-padded tensors of `input_ids`, `labels` (−100 at padding) and `attention_mask`, `batch_size` rows each."""
    check_number("batch_size", batch_size, minimum=1, integer=True)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(r["input_ids"]) for r in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, r in enumerate(chunk):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            mask[i, :n] = 1
        yield {"input_ids": ids, "labels": labels, "attention_mask": mask}


__all__ = ["FORMATS", "batches", "check_text_dataset", "load_text_dataset", "tokenize_for_evaluation"]
