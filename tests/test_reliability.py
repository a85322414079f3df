"""Nothing lost, nothing silent: non-finite settings and inputs, corrupt files, batches with nothing to learn."""

import math

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.adapter_io import all_finite
from causalqwen_adapter.numeric import NumericCollator, encode_with_numbers
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

from conftest import modes_not_plain


@pytest.mark.parametrize("field", ["ovr_threshold_init", "causal_temperature", "gamma_init", "b_noise_init"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_settings_are_refused(tied_base, field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        CausalQwenForCausalLM.from_base(tied_base, **{field: value})


def test_non_finite_temperature_per_call_is_refused(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base)
    for value in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="causal_temperature must be a finite number >= 0"):
            model(input_ids, causal_temperature=value)
        with pytest.raises(ValueError, match="causal_temperature must be a finite number >= 0"):
            model.generate(input_ids, max_new_tokens=2, causal_temperature=value)


def test_non_finite_numbers_are_refused_where_they_enter(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base, numeric=True, num_token_id=5)
    values = torch.zeros(input_ids.shape)
    values[0, 3] = math.inf
    with pytest.raises(ValueError, match="numeric_values holds inf"):
        model(input_ids, numeric_values=values)
    values[0, 3] = math.nan
    with pytest.raises(ValueError, match="numeric_values holds nan"):
        model.generate(input_ids, numeric_values=values, max_new_tokens=2)

    class Words:  # the smallest tokenizer encode_with_numbers needs
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [7] * len(text.split())}

    assert encode_with_numbers(Words(), "costs 12 now", 5)["numeric_values"] == [0.0, 12.0, 0.0]
    with pytest.raises(ValueError, match="'1e400' at character 6 does not fit a float64"):
        encode_with_numbers(Words(), "costs 1e400 now", 5)
    collator = NumericCollator(lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows])})
    with pytest.raises(ValueError, match=r"example 0 of the batch: numeric_values holds inf at \[1\]"):
        collator([{"input_ids": [1, 5], "numeric_values": [0.0, math.inf]}])


def test_adapter_with_non_finite_tensors_does_not_load(tied_base, tmp_path):
    model = CausalQwenForCausalLM.from_base(tied_base)
    model.save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "model.safetensors"
    tensors = load_file(weights)
    tensors["action.b_noise"][2] = math.nan
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"\['action.b_noise'\] hold NaN or infinite values"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_agrees_with_isfinite(dtype):
    tensor = torch.randn(37, 11).to(dtype)
    assert all_finite(tensor) and all_finite(tensor[:0]) and all_finite(torch.arange(5))
    for value in (math.nan, math.inf, -math.inf):
        for index in ((0, 0), (36, 10), (20, 3)):
            bad = tensor.clone()
            bad[index] = value
            assert all_finite(bad) == bool(torch.isfinite(bad).all()) is False


def test_all_finite_is_not_fooled_by_a_sum_that_overflows():
    # bfloat16 is summed first: finite values near the largest bf16 overflow that sum, and min and max settle it
    huge = torch.full((64,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    assert not torch.isfinite(huge.sum()) and all_finite(huge) and all_finite(torch.cat([huge, -huge]))
    for value in (math.inf, -math.inf, math.nan):
        bad = torch.cat([huge, -huge, torch.tensor([value], dtype=torch.bfloat16)])
        assert not all_finite(bad)


def test_a_batch_with_nothing_to_learn_contributes_nothing(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base)
    labels = torch.full_like(input_ids, -100)
    for n in (None, 0):
        out = model(input_ids, labels=labels, num_items_in_batch=n)
        assert out.loss.item() == 0.0
        out.loss.backward()
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_training_goes_on_past_a_batch_without_targets(sft_base, tmp_path):
    # one-token rows have no target after the causal shift; batches of one row make some batches empty
    data = Dataset.from_dict({"text": ["", "the cat sat on the mat", "", "two plus two is four"]})
    args = CausalSFTConfig(str(tmp_path), max_steps=4, per_device_train_batch_size=1, report_to="none",
                           use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)
    trainer = CausalSFTTrainer(str(sft_base), args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 4
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_saving_over_a_folder_that_is_not_an_adapter_is_refused(tied_base, tmp_path):
    import shutil

    base_copy = tmp_path / "base"
    shutil.copytree(tied_base, base_copy)
    before = {p.name: p.read_bytes() for p in base_copy.iterdir()}
    model = CausalQwenForCausalLM.from_base(base_copy)
    with pytest.raises(FileExistsError, match="holds a 'qwen2' checkpoint"):
        model.save_pretrained(base_copy)
    (base_copy / "config.json").unlink()  # weights without a config: still not ours
    before.pop("config.json")
    with pytest.raises(FileExistsError, match="holds model weights that are not an adapter's"):
        model.save_pretrained(base_copy)
    assert {p.name: p.read_bytes() for p in base_copy.iterdir()} == before


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_folder_and_its_files_have_plain_modes(tied_base, tmp_path, umask):
    """mkdtemp's staging folder is 0700 and safetensors 0.8 writes 0600: another user (a server, a container's user)
    must read an adapter whose folder looks readable, as a plain mkdir and open() would have made it."""
    import os

    model = CausalQwenForCausalLM.from_base(tied_base)
    previous = os.umask(umask)
    try:
        model.save_pretrained(tmp_path / "adapter")
        model.save_pretrained(tmp_path / "adapter")  # into an existing folder: the replaced files too
        assert (tmp_path / "adapter" / "model.safetensors").is_file()
        assert modes_not_plain(tmp_path / "adapter") == {}
    finally:
        os.umask(previous)


def test_dot_names_the_saved_folder(tied_base, tmp_path, monkeypatch):
    import os

    model = CausalQwenForCausalLM.from_base(tied_base)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    model.save_pretrained(".")
    card = (tmp_path / "here" / "README.md").read_text()
    assert 'from_pretrained("here"' in card and ".tmp" not in card
    assert os.path.isfile(tmp_path / "here" / "config.json")


def test_a_local_base_is_stored_by_absolute_path_and_a_missing_one_is_named(tied_base, tmp_path, monkeypatch):
    import json
    import shutil

    shutil.copytree(tied_base, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    model = CausalQwenForCausalLM.from_base("base")
    assert model.config.base_model_name_or_path == str(tmp_path / "base")
    model.save_pretrained("adapter")
    assert json.loads((tmp_path / "adapter" / "config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    assert "absolute path of a local folder" in (tmp_path / "adapter" / "README.md").read_text()
    monkeypatch.chdir(tmp_path / "adapter")  # loads from anywhere
    CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match=r"base './nowhere' was not found: no folder '.*/adapter/nowhere'"):
        CausalQwenForCausalLM.from_base("./nowhere")
    with pytest.raises(FileNotFoundError, match="base_model '/no/such/base' was not found"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter", base_model="/no/such/base")


@pytest.mark.parametrize("mode", ["compatible", "standard"])
def test_generate_from_inputs_embeds_like_the_base(tiny_base, mode):
    from transformers import Qwen2ForCausalLM

    base = Qwen2ForCausalLM.from_pretrained(tiny_base).eval()
    model = CausalQwenForCausalLM.from_base(tiny_base).eval()
    ids = torch.randint(1, 120, (2, 6), generator=torch.Generator().manual_seed(3))
    embeds = base.get_input_embeddings()(ids)
    with torch.no_grad():
        from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False, inference_mode=mode)
        from_ids = model.generate(ids, max_new_tokens=5, do_sample=False, inference_mode=mode)[:, ids.shape[1]:]
    assert torch.equal(from_embeds, from_ids)  # generate() returns only the new tokens for an embeddings prompt
    if mode == "compatible":
        assert torch.equal(from_embeds, base.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False))


def test_feature_extraction_never_replaces_a_model_or_foreign_folder(sft_base, tmp_path):
    import shutil

    from causalqwen_adapter.features import extract_features

    teacher = tmp_path / "teacher"
    shutil.copytree(sft_base, teacher)
    before = sorted(p.name for p in teacher.iterdir())
    data = Dataset.from_dict({"text": ["the cat sat on the mat"]})
    with pytest.raises(FileExistsError, match="holds a model checkpoint"):
        extract_features(str(teacher), data, teacher, top_k=2, overwrite=True)
    assert sorted(p.name for p in teacher.iterdir()) == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not a feature store"):
        extract_features(str(teacher), data, tmp_path / "mine", top_k=2, overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match=r"token id 500 is outside the teacher's vocabulary \[0, 128\)"):
        extract_features(str(teacher), Dataset.from_dict({"input_ids": [[1, 2, 500]]}), tmp_path / "f", top_k=2)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("rows, message", [
    ({"body": ["some text"]}, r"has columns \['body'\], none of the formats"),
    ({"text": ["fine", None]}, r"`text` in row 1 is None \(NoneType\), not text"),
    ({"text": [3]}, r"`text` in row 0 is 3 \(int\), not text"),
    ({"text": []}, "has no rows"),
])
def test_unusable_datasets_are_refused_up_front(sft_base, tmp_path, rows, message):
    args = CausalSFTConfig(str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    data = Dataset.from_dict(rows) if rows.get("text") != [] else Dataset.from_dict({"text": []}).cast_column(
        "text", __import__("datasets").Value("string"))
    with pytest.raises(ValueError, match=message):
        CausalSFTTrainer(str(sft_base), args=args, train_dataset=data)


def test_a_trainer_refuses_an_output_dir_holding_a_model(sft_base, tmp_path):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(sft_base, base)
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    args = CausalSFTConfig(str(base), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    with pytest.raises(FileExistsError, match="holds a 'qwen2' checkpoint"):
        CausalSFTTrainer(str(base), args=args, train_dataset=Dataset.from_dict({"text": ["the cat sat"]}))
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before


def test_a_corrupted_feature_shard_is_refused(sft_base, tmp_path):
    from causalqwen_adapter.features import extract_features, load_features

    store = tmp_path / "features"
    extract_features(str(sft_base), Dataset.from_dict({"text": ["the cat sat on the mat"] * 3}), store, top_k=2)
    assert len(load_features(store)) > 0
    shard = next(store.glob("*.arrow"))
    data = bytearray(shard.read_bytes())
    data[-200:-100] = bytes(range(100))  # random bytes inside the table
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="its bytes changed since extract_features wrote it"):
        load_features(store)


# (text, the numbers by default, the numbers with decimal_comma=True): by hand, as a reader of each convention reads them
DECIMAL_COMMA_CASES = [
    ("3,5", [3, 5], [3.5]),  # by default a list; a decimal comma when the text is written so
    ("costs 0,125 and 12,34", [0, 125, 12, 34], [0.125, 12.34]),  # a thousands group never follows a lone 0
    ("0.125 and 0.125.000", [0.125], [0.125]),  # nor a dotted one: 0.125 is a decimal, 0.125.000 a version either way
    ("x=-3,5 (-0,5)", [-3, 5, 0, 5], [-3.5, -0.5]),  # by default -3, 5, -0 and 5
    ("2,500 kg", [2500], [2.5]),
    ("1,000", [1000], [1]),
    ("1,000,000 and 1,234,567.5", [1000000, 1234567.5], [1000000, 1234567.5]),  # only grouping can have two
    ("1.000 and 1.234.567,5", [1, 5], [1000, 1234567.5]),  # by default 1.234.567 is a version, kept as text
    ("3.5 and 3.14 and .5", [3.5, 3.14, 0.5], [3.5, 3.14, 0.5]),
    ("1, 2, 3", [1, 2, 3], [1, 2, 3]),
    ("version 1.2.3 at 192.168.0.1 on 2024-01-15 09:30, zip 02139", [], []),
    ("6,5e3", [6, 5e3], [6.5e3]),
]


@pytest.mark.parametrize("text, default, decimal_comma", DECIMAL_COMMA_CASES)
def test_decimal_commas_are_read_only_when_asked_and_then_as_written(text, default, decimal_comma):
    from test_numeric_data import Chars

    from causalqwen_adapter.numeric import decode_with_numbers, find_numbers

    num_id = 0x10FFFF + 1  # beyond every character
    for option, expected in ((False, default), (True, decimal_comma)):
        assert [v for *_, v in find_numbers(text, decimal_comma=option)] == [float(n) for n in expected], option
        encoded = encode_with_numbers(Chars(), text, num_id, decimal_comma=option)
        ids, values = encoded["input_ids"], encoded["numeric_values"]
        assert [v for i, v in zip(ids, values) if i == num_id] == [float(n) for n in expected]
        # the text around the numbers is kept whole: only the numbers' spans became <NUM>
        spans = find_numbers(text, decimal_comma=option)
        kept = "".join(text[a:b] for a, b in zip([0] + [e for _, e, _ in spans], [s for s, _, _ in spans] + [len(text)]))
        assert decode_with_numbers(Chars(), ids, values, num_id, number_format="") == kept


def test_train_and_generate_take_the_decimal_comma_option(sft_base, tmp_path):
    from datasets import DatasetDict

    from causalqwen_adapter.cli import generate, train

    common = ["--model_name_or_path", str(sft_base), "--dataset_name", "d.jsonl", "--output_dir", str(tmp_path / "o"),
              "--numeric", "--use_cpu"]
    for flags, value in (([], [3.0, 5.0]), (["--numeric_decimal_comma"], [3.5])):
        script_args, training_args, model_args = train.make_parser().parse(common + flags)
        data = DatasetDict({"train": Dataset.from_dict({"text": ["costs 3,5 euro"]})})
        data, _ = train.numeric_data(data, model_args, training_args)
        row = data["train"][0]
        assert [v for i, v in zip(row["input_ids"], row["numeric_values"]) if i == training_args.num_token_id] == value
    assert generate.parse_args(["--model_name_or_path", "a", "--prompt", "p", "--decimal_comma"]).decimal_comma
    assert not generate.parse_args(["--model_name_or_path", "a", "--prompt", "p"]).decimal_comma
