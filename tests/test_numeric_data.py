"""The numeric data helpers (causalqwen_adapter/numeric.py): <NUM> in the tokenizer, numbers read from text as a
person reads them and written back in the precision they are held in, the statistics the head starts from, the
collator's alignment of values with tokens, and missing values named by example and position.

References: readings written by hand, and a character-level tokenizer whose round trip shows what the numbers did.
"""

import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from causalqwen_adapter.numeric import (
    NUM_TOKEN,
    NumericCollator,
    add_num_token,
    decode_with_numbers,
    encode_with_numbers,
    numeric_statistics,
)


def test_encode_decode_and_num_token(sft_base):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    num_id = len(tokenizer)
    with pytest.raises(ValueError, match=f"{NUM_TOKEN} would get id {num_id} in this tokenizer, but the model's"):
        add_num_token(tokenizer, num_id + 1)
    assert len(tokenizer) == num_id  # nothing changed
    add_num_token(tokenizer, num_id)
    assert tokenizer.convert_tokens_to_ids(NUM_TOKEN) == num_id and len(tokenizer) == num_id + 1
    add_num_token(tokenizer, num_id)  # idempotent

    encoded = encode_with_numbers(tokenizer, "the cat sat on 3 mats and -2.5e3 dogs ran .5", num_id)
    ids, values = encoded["input_ids"], encoded["numeric_values"]
    assert len(ids) == len(values)
    assert [v for i, v in zip(ids, values) if i == num_id] == [3.0, -2500.0, 0.5]
    assert all(v == 0.0 for i, v in zip(ids, values) if i != num_id)
    assert decode_with_numbers(tokenizer, ids, values, num_id) == tokenizer.decode(
        encode_with_numbers(tokenizer, "the cat sat on", num_id)["input_ids"]) + "3" + tokenizer.decode(
        encode_with_numbers(tokenizer, " mats and ", num_id)["input_ids"]) + "-2500" + tokenizer.decode(
        encode_with_numbers(tokenizer, " dogs ran ", num_id)["input_ids"]) + "0.5"


def test_num_token_on_a_reserved_placeholder_row_or_a_taken_id(sft_base):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    size = len(tokenizer)
    tokenizer.add_tokens(["[PAD999]"])  # how GGUF-built tokenizers name reserved rows
    add_num_token(tokenizer, size)  # used by id, nothing added
    assert len(tokenizer) == size + 1 and NUM_TOKEN not in tokenizer.get_vocab()
    with pytest.raises(ValueError, match="is the tokenizer's token 'the', not a free row"):
        add_num_token(tokenizer, tokenizer.convert_tokens_to_ids("the"))


class Chars:
    """A character-level tokenizer: decode(encode(piece)) is the piece, so a round trip shows what the numbers did."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


# (text, the numbers read, the text decode_with_numbers gives back): written by hand, the reading a person gives them
NUMBER_CASES = [
    ("10-20", [10, 20], "10-20"),  # a range: the dash is no sign
    ("pages 10 - 20", [10, 20], "pages 10 - 20"),
    ("2024-01-15", [], "2024-01-15"),  # a date stays text (its zero padding would be lost)
    ("on 2024-01-15 at 09:30", [], "on 2024-01-15 at 09:30"),
    ("1,000", [1000], "1000"),  # thousands grouping: one number
    ("1,234,567.5 units", [1234567.5], "1234567.5 units"),
    ("-1,000 and +2", [-1000, 2], "-1000 and 2"),
    ("1,2,3", [1, 2, 3], "1,2,3"),  # not groups of three: a list
    ("12,34", [12, 34], "12,34"),
    ("x=-5, (-3.5) [-2]", [-5, -3.5, -2], "x=-5, (-3.5) [-2]"),  # signs after =, brackets
    ("-7 at the start", [-7], "-7 at the start"),
    ("it was -4 degrees", [-4], "it was -4 degrees"),
    ("COVID-19 and e-5", [19, 5], "COVID-19 and e-5"),  # hyphens after letters
    ("5%-10% and (2)-1", [5, 10, 2, 1], "5%-10% and (2)-1"),
    ("1+2", [1, 2], "1+2"),
    ("costs 3.", [3], "costs 3."),  # the sentence's full stop stays text
    ("3.50 and .5 and 6.02e23 and 5e-3", [3.5, 0.5, 6.02e23, 5e-3], "3.5 and 0.5 and 6.02e+23 and 0.005"),
    ("version 1.2.3 at 192.168.0.1", [], "version 1.2.3 at 192.168.0.1"),
    ("zip 02139, 0 and 0.25", [0, 0.25], "zip 02139, 0 and 0.25"),  # a leading zero: a code, not a quantity
    ("12345678901", [12345678901], "12345678901"),  # written whole, not 1.23457e+10
]


@pytest.mark.parametrize("text, numbers, decoded", NUMBER_CASES)
def test_numbers_are_read_as_a_person_reads_them(text, numbers, decoded):
    num_id = 0x10FFFF + 1  # beyond every character
    encoded = encode_with_numbers(Chars(), text, num_id)
    ids, values = encoded["input_ids"], encoded["numeric_values"]
    assert [v for i, v in zip(ids, values) if i == num_id] == [float(n) for n in numbers]
    assert decode_with_numbers(Chars(), ids, values, num_id) == decoded


def test_generated_values_are_written_in_the_precision_they_are_held_in():
    num_id = 0x10FFFF + 1
    ids = [num_id, ord(" "), num_id, ord(" "), num_id, ord(" "), num_id]
    values = torch.tensor([3.3, 1234567.5, -41.87, 2.5e-7], dtype=torch.float32)
    padded = torch.zeros(len(ids))
    padded[[0, 2, 4, 6]] = values
    # float32's 3.3 is 3.2999999523...: written as the float32 it is, not as that float64
    assert decode_with_numbers(Chars(), ids, padded, num_id) == "3.3 1234567.5 -41.87 2.5e-07"
    assert decode_with_numbers(Chars(), ids, padded.double(), num_id).startswith("3.299999952316284 ")
    assert decode_with_numbers(Chars(), ids, padded, num_id, number_format="{:.2f}") == "3.30 1234567.50 -41.87 0.00"


def test_numeric_statistics_are_the_median_and_half_the_iqr():
    values = torch.tensor([1.0, 2.0, 4.0, 8.0, 100.0, -50.0])
    median, scale = numeric_statistics(values)
    q1, q3 = torch.quantile(values.double(), 0.25).item(), torch.quantile(values.double(), 0.75).item()
    assert median == pytest.approx(3.0) and scale == pytest.approx((q3 - q1) / 2)
    assert numeric_statistics([5.0, 5.0, 5.0]) == (5.0, pytest.approx(5e-3))
    with pytest.raises(ValueError, match="no numeric target"):
        numeric_statistics([])
    with pytest.raises(ValueError, match="values must be finite"):
        numeric_statistics([1.0, float("nan")])


@pytest.mark.parametrize("truncation_mode, padding_free", [("keep_start", False), ("keep_end", False), ("keep_start", True)])
def test_collator_keeps_values_aligned_with_tokens(truncation_mode, padding_free):
    def inner(examples):  # like TRL's: input_ids already truncated, padded right or concatenated
        rows = [torch.tensor(e["input_ids"]) for e in examples]
        if padding_free:
            return {"input_ids": torch.cat(rows)[None]}
        width = max(map(len, rows))
        return {"input_ids": torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=-1) for r in rows])}

    full = [[1, 2, 3, 4], [5, 6]]
    values = [[0.0, 2.5, 0.0, 9.0], [7.0, 0.0]]
    kept = [ids[:3] if truncation_mode == "keep_start" else ids[-3:] for ids in full[:1]] + [full[1]]
    examples = [{"input_ids": k, "numeric_values": v} for k, v in zip(kept, values)]
    batch = NumericCollator(inner, truncation_mode=truncation_mode, padding_free=padding_free)(examples)
    lookup = {i: v for ids, vals in zip(full, values) for i, v in zip(ids, vals)}
    expected = batch["input_ids"].clone().float().apply_(lambda i: lookup.get(int(i), 0.0))
    assert torch.equal(batch["numeric_values"], expected)


@pytest.mark.parametrize("rows, message", [
    ([[0.0, 2.0], [0.0, None, 1.0]], r"train example 1 has the numeric value None at position 1: every value must be "
                                     r"a finite number \(a missing value reads as null\)"),
    ([[0.0, 2.0], None], r"train example 1 has no numeric_values \(null\)"),
    ([[0.0, 2.0], [0.0], [math.nan, 0.0]], r"train example 2 has the numeric value nan at position 0"),
    ([[0.0, 2.0], [math.inf]], r"train example 1 has the numeric value inf at position 0"),
])
def test_missing_numeric_values_are_named_by_example_and_position(rows, message):
    from causalqwen_adapter.numeric import check_numeric_values_present

    with pytest.raises(ValueError, match=message):
        check_numeric_values_present(Dataset.from_dict({"input_ids": [[1] * len(r or [0]) for r in rows],
                                                        "numeric_values": rows}))
    check_numeric_values_present(Dataset.from_dict({"numeric_values": [[0.0, 2.5], [], [1e30]]}))  # all present
