"""Numeric-aware data (docs/design.md, Numbers): the `<NUM>` token, text ↔ (input_ids, numeric_values), target statistics, and
the collator that carries `numeric_values` through TRL's batches.

A number in the text becomes one `<NUM>` token whose value travels beside it in `numeric_values` (0 at every other
token). `<NUM>` is a reserved row of the base vocabulary (`config.num_token_id`, 151665 for Qwen2), registered in
the tokenizer as a special token without growing the vocabulary.
"""

import math
import re
from collections.abc import Iterable, Sequence

import torch
from transformers.utils import logging

from .heads import check_numeric_values

logger = logging.get_logger(__name__)

NUM_TOKEN = "<NUM>"
# What encode_with_numbers reads as numbers (docs/numbers.md, Which text is a number). Scanned left to right, the
# first alternative that matches at a position wins:
# - kept as text (group `text`): ISO dates 2024-01-15, clock times 9:30 / 09:30:15, dotted runs of three parts or
#   more (versions 1.2.3, addresses 192.168.0.1) and digit runs with a leading zero (007, 02139), whose spelling a
#   value cannot give back;
# - a number (group `number`): "42", "3.5", ".5", "6.02e23", standard thousands grouping "1,234,567.5" (groups of
#   exactly three digits after a first group that does not start with 0: "0,125" is 0 and 125, a list, never 125),
#   with a sign only where it cannot be a hyphen or a dash: not after a letter, a digit, "_",
#   ".", a closing bracket or "%", so "10-20" is 10 and 20, "COVID-19" is 19, "x=-5" and "(-5" are -5.
NUMBER_PATTERN = re.compile(
    r"(?P<text>\d{4}-\d{2}-\d{2}(?!\d)|\d{1,2}:\d{2}(?::\d{2})?(?![\d:])|\d+(?:\.\d+){2,}|0\d+)"
    r"|(?P<number>(?:(?<![\w.)\]}%])[-+])?"
    r"(?:(?:[1-9]\d{0,2}(?:,\d{3})+(?!\d|,\d)|\d+)(?:\.\d+)?|(?<![\d.])\.\d+)(?:[eE][-+]?\d+)?)"
)

# The same for text written with decimal commas (`decimal_comma=True`; docs/numbers.md), as most of Europe writes:
# "3,5" and "0,125" are 3.5 and 0.125, and so is "2,500" (2.5: such text groups thousands with dots or spaces);
# "." groups thousands in groups of exactly three digits ("1.234.567,5", "1.000"), and is a decimal point
# otherwise ("3.5"); two or more comma groups of three ("1,000,000") can only be thousands grouping. A dotted run of
# three-digit groups is a number here, no longer a version kept as text.
DECIMAL_COMMA_PATTERN = re.compile(
    r"(?P<text>\d{4}-\d{2}-\d{2}(?!\d)|\d{1,2}:\d{2}(?::\d{2})?(?![\d:])"
    r"|(?![1-9]\d{0,2}(?:\.\d{3})+(?!\d|\.\d))\d+(?:\.\d+){2,}|0\d+)"
    r"|(?P<number>(?:(?<![\w.)\]}%])[-+])?"
    r"(?:(?P<commas>[1-9]\d{0,2}(?:,\d{3}){2,}(?!\d|,\d))(?:\.\d+)?|(?P<dots>[1-9]\d{0,2}(?:\.\d{3})+(?!\d|\.\d))(?:,\d+)?"
    r"|\d+(?:[.,]\d+)?|(?<![\d.])\.\d+)(?:[eE][-+]?\d+)?)"
)


def _value(match: re.Match, decimal_comma: bool) -> float:
    """The value of a `number` match: grouping separators dropped, a decimal comma read as a point."""
    number = match.group("number")
    if not decimal_comma or match.group("commas"):
        return float(number.replace(",", ""))
    if match.group("dots"):
        number = number.replace(".", "")
    return float(number.replace(",", "."))


def find_numbers(text: str, *, decimal_comma: bool = False) -> list[tuple[int, int, float]]:
    """(start, end, value) of each number `encode_with_numbers` reads in `text` (NUMBER_PATTERN, or
    DECIMAL_COMMA_PATTERN for text written with decimal commas): the spans it replaces by `<NUM>`, the value each
    carries."""
    found = []
    for match in (DECIMAL_COMMA_PATTERN if decimal_comma else NUMBER_PATTERN).finditer(text):
        if match.group("number") is None:
            continue  # a date, a time, a version: stays text
        value = _value(match, decimal_comma)
        if not math.isfinite(value):  # "1e400" parses as inf, which would turn every score into NaN
            raise ValueError(f"the number {match.group()!r} at character {match.start()} does not fit a float64: "
                             "rewrite it (or scale the data) so every value is finite")
        if abs(value) > torch.finfo(torch.float32).max:  # finite here, inf where φ(v) is computed
            raise ValueError(f"the number {match.group()!r} at character {match.start()} does not fit a float32, "
                             "the dtype <NUM> values are computed in: rewrite it (or scale the data)")
        found.append((match.start(), match.end(), value))
    return found


def format_number(value: float, float32: bool = False) -> str:
    """`value` in the shortest decimal that reads back as the same float64 (float32: the same float32), positional
    from 1e-4 to 1e16 ("1234567.5", "2500", "0.5"), scientific beyond ("6.02e+23")."""
    import numpy as np

    x = np.float32(value) if float32 else np.float64(value)
    if x == 0:
        return "0"
    if 1e-4 <= abs(x) < 1e16:
        return np.format_float_positional(x, unique=True, trim="-")
    return np.format_float_scientific(x, unique=True, trim="-")


def default_num_token_id(tokenizer, vocab_size: int, name: str) -> int:
    """The row `<NUM>` takes when none is given: the tokenizer's next id, `len(tokenizer)`, an embedding row the
    tokenizer never produces (151665, the first of Qwen2's 271 reserved rows). A base whose tokenizer already uses
    every row has none to give: refused with what to do, since the heads never grow or change the base."""
    next_id = len(tokenizer)
    if next_id < vocab_size:
        return next_id
    raise ValueError(
        f"numeric heads need an embedding row the tokenizer never produces, for {NUM_TOKEN}: {name}'s tokenizer has "
        f"{next_id:,} tokens for its {vocab_size:,}-row embedding, so no row is free. Pass --num_token_id <the id of "
        "a token this tokenizer never produces, e.g. an unused reserved special token>, or give the base a row "
        "first: tokenizer.add_special_tokens({'additional_special_tokens': ['<NUM>']}), "
        "base.resize_token_embeddings(len(tokenizer)), save both to a new folder and train from that folder. "
        "The heads never resize or modify a base"
    )


def add_num_token(tokenizer, num_token_id: int) -> None:
    """Register `<NUM>` as a special token of `tokenizer` at `num_token_id` (the model's `config.num_token_id`).

    The tokenizer gives a new special token the next free id, `len(tokenizer)`; for Qwen2 tokenizers that is 151665,
    the first reserved row of the 151936-row embedding, which is where `<NUM>` must land. Anything else is an error
    (nothing is changed then): the id would not be the row the model reads.
    """
    if NUM_TOKEN in tokenizer.get_vocab():
        have = tokenizer.convert_tokens_to_ids(NUM_TOKEN)
        if have != num_token_id:
            raise ValueError(f"the tokenizer already maps {NUM_TOKEN} to {have}, the model expects {num_token_id}")
        return
    if num_token_id < len(tokenizer):
        taken = tokenizer.convert_ids_to_tokens(num_token_id)
        if re.fullmatch(r"\[PAD\d+\]", taken or ""):
            # Tokenizers converted from GGUF name every reserved row "[PAD<id>]": that row is unused, so it serves
            # as <NUM> by id (encode_with_numbers / decode_with_numbers), without a string of its own.
            logger.warning(f"the tokenizer names the reserved row {num_token_id} {taken!r}: <NUM> is used by id there")
            return
        raise ValueError(f"id {num_token_id} is the tokenizer's token {taken!r}, not a free row: <NUM> needs an unused id")
    if len(tokenizer) != num_token_id:
        raise ValueError(
            f"{NUM_TOKEN} would get id {len(tokenizer)} in this tokenizer, but the model's num_token_id is "
            f"{num_token_id}: build the heads with num_token_id={len(tokenizer)} (an unused row of the embedding), "
            "or use the tokenizer of the base they were built for"
        )
    tokenizer.add_special_tokens({"extra_special_tokens": [NUM_TOKEN]}, replace_extra_special_tokens=False)
    if tokenizer.convert_tokens_to_ids(NUM_TOKEN) != num_token_id:  # defensive: tokenizers differ in how they add
        raise RuntimeError(f"{NUM_TOKEN} was registered at {tokenizer.convert_tokens_to_ids(NUM_TOKEN)}, not {num_token_id}")


def encode_with_numbers(tokenizer, text: str, num_token_id: int, *, add_special_tokens: bool = False,
                        decimal_comma: bool = False) -> dict:
    """Tokenize `text` with every number replaced by one `<NUM>` token carrying its value.

    Returns `{"input_ids": [...], "numeric_values": [...]}` of equal length, values 0.0 off `<NUM>`. The text between
    numbers is tokenized piece by piece (a number's surrounding spaces stay with the text). Which text is a number:
    NUMBER_PATTERN ("10-20" is 10 and 20, "1,000" is 1000, dates, times and versions stay text; "3,5" is 3 and 5).
    `decimal_comma=True` reads text written with decimal commas ("3,5" is 3.5, "1.000" is 1000:
    DECIMAL_COMMA_PATTERN).
    """
    input_ids: list[int] = []
    values: list[float] = []
    if add_special_tokens:
        input_ids += tokenizer.build_inputs_with_special_tokens([])
        values += [0.0] * len(input_ids)
    position = 0
    for start, end, value in find_numbers(text, decimal_comma=decimal_comma):
        piece = tokenizer(text[position:start], add_special_tokens=False)["input_ids"]
        input_ids += [*piece, num_token_id]
        values += [0.0] * len(piece) + [value]
        position = end
    piece = tokenizer(text[position:], add_special_tokens=False)["input_ids"]
    input_ids += piece
    values += [0.0] * len(piece)
    return {"input_ids": input_ids, "numeric_values": values}


def decode_with_numbers(tokenizer, input_ids: Sequence[int], numeric_values: Sequence[float], num_token_id: int,
                        *, skip_special_tokens: bool = True, number_format: str | None = None) -> str:
    """The text of `input_ids` with each `<NUM>` written as its value (e.g. from `generate(...).numeric_values`).

    By default a value is written in the shortest decimal that reads back as the same number, in the precision it
    is held in (float32 for a float32 tensor such as generate's, float64 for Python floats): the numbers of
    encoded text come back as written, up to spelling ("1,000" -> "1000", "3.50" -> "3.5", ".5" -> "0.5").
    `number_format` (e.g. "{:.3g}") writes them another way."""
    ids = [int(i) for i in input_ids]
    float32 = torch.is_tensor(numeric_values) and numeric_values.dtype != torch.float64
    values = [float(v) for v in numeric_values]
    if len(ids) != len(values):
        raise ValueError(f"{len(ids)} tokens but {len(values)} numeric values: pass one value per token")
    pieces, start = [], 0
    for i, token in enumerate(ids):
        if token == num_token_id:
            pieces.append(tokenizer.decode(ids[start:i], skip_special_tokens=skip_special_tokens))
            pieces.append(format_number(values[i], float32) if number_format is None else number_format.format(values[i]))
            start = i + 1
    pieces.append(tokenizer.decode(ids[start:], skip_special_tokens=skip_special_tokens))
    return "".join(pieces)


def numeric_statistics(values: Iterable[float] | torch.Tensor) -> tuple[float, float]:
    """(median, IQR/2) of the numeric targets: the Cauchy location and scale estimates the regression head starts
    from (mean and standard deviation do not exist for a Cauchy law).

    An IQR of 0 (most targets equal) would give a zero scale; it is floored at 1e-3·max(1, |median|).
    """
    values = torch.as_tensor(list(values) if not torch.is_tensor(values) else values, dtype=torch.float64).flatten()
    if values.numel() == 0:
        raise ValueError(f"no numeric target to estimate the regression head from: the data holds no {NUM_TOKEN} value")
    if not torch.isfinite(values).all():
        raise ValueError(f"the numeric targets hold {values[~torch.isfinite(values)][0].item()}: values must be finite")
    median = values.quantile(0.5).item()
    q1, q3 = values.quantile(0.25).item(), values.quantile(0.75).item()
    return median, max((q3 - q1) / 2, 1e-3 * max(1.0, abs(median)))


def check_numeric_values_present(dataset, split: str = "train") -> None:
    """Refuse, naming the example and the position, a `numeric_values` row that is missing (null) or holds a missing
    or non-finite value: Arrow reads a JSON null as a missing value, which becomes NaN in the targets' statistics
    and in the loss. Map-style `datasets.Dataset`s only (a streaming one is checked batch by batch by the
    collator)."""
    from datasets import Dataset

    if not isinstance(dataset, Dataset) or "numeric_values" not in dataset.column_names:
        return
    import pyarrow.compute as pc

    rows = dataset.with_format("arrow").data.column("numeric_values")
    flat = pc.list_flatten(rows)
    bad = pc.fill_null(pc.invert(pc.is_finite(flat)), True) if len(flat) else flat
    row = pc.index(pc.is_null(rows), True).as_py()
    if row < 0 and len(flat) and pc.any(bad).as_py():
        row = pc.list_parent_indices(rows)[pc.index(bad, True).as_py()].as_py()
    if row < 0:
        return
    values = dataset[row]["numeric_values"]
    if values is None:
        raise ValueError(f"{split} example {row} has no numeric_values (null): give one value per token, 0 where the "
                         f"token is not {NUM_TOKEN} (encode_with_numbers lines them up), or drop the example")
    position = next(i for i, v in enumerate(values) if v is None or not math.isfinite(v))
    raise ValueError(f"{split} example {row} has the numeric value {values[position]} at position {position}: every "
                     f"value must be a finite number (a missing value reads as null); fix or drop the example")


class NumericCollator:
    """Wraps a TRL collator: `numeric_values` follow `input_ids` through truncation, padding (0) and padding-free
    concatenation, so batch["numeric_values"] lines up with batch["input_ids"] position by position.

    Each example's values are checked as the model reads them (`heads.check_numeric_values`): one per token (at least
    as many as the possibly truncated `input_ids`), finite in float32 and, given `num_token_id`, 0 off `<NUM>`."""

    def __init__(self, collator, *, truncation_mode: str = "keep_start", padding_free: bool = False,
                 num_token_id: int | None = None):
        self.collator = collator
        self.truncation_mode = truncation_mode
        self.padding_free = padding_free
        self.num_token_id = num_token_id

    def __call__(self, examples: list[dict]) -> dict:
        if any("numeric_values" not in example for example in examples):
            raise ValueError("a numeric model trains on examples with numeric_values beside input_ids (build them with "
                             "encode_with_numbers, of the numeric module)")
        rows = [self._values(i, example) for i, example in enumerate(examples)]
        batch = self.collator([{k: v for k, v in example.items() if k != "numeric_values"} for example in examples])
        if self.padding_free:
            rows = [torch.cat(rows)]
        width = batch["input_ids"].shape[1]
        padded = torch.zeros(len(rows), width, dtype=torch.float32)
        for i, row in enumerate(rows):
            padded[i, : len(row)] = row[:width]
        batch["numeric_values"] = padded
        return batch

    def _values(self, i: int, example: dict) -> torch.Tensor:
        """Example i's values for its (possibly truncated) input_ids, checked."""
        ids = torch.as_tensor(example["input_ids"])
        try:
            values = torch.as_tensor(example["numeric_values"], dtype=torch.float64).flatten()
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"example {i} of the batch: numeric_values must be a list of numbers, one per token "
                             f"({err})") from None
        n = len(ids)  # TRL truncates input_ids and labels, not our column
        if len(values) < n:
            raise ValueError(f"example {i} of the batch has {len(values)} numeric_values for {n} input_ids: pass one "
                             "value per token (0 where the token is not <NUM>; encode_with_numbers lines them up)")
        values = values[:n] if self.truncation_mode == "keep_start" else values[len(values) - n :]
        try:
            return check_numeric_values(values, ids.shape, "the input_ids", ids, self.num_token_id)
        except ValueError as err:
            raise ValueError(f"example {i} of the batch: {err}") from None


__all__ = [
    "DECIMAL_COMMA_PATTERN", "NUM_TOKEN", "NUMBER_PATTERN", "NumericCollator", "add_num_token", "check_numeric_values_present",
    "decode_with_numbers", "encode_with_numbers", "find_numbers", "format_number", "numeric_statistics",
]
