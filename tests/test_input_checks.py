"""What callers hand over is checked where it enters, the same way at every entry point (library, trainer, recipes):
numbers and tensors as the dtype they are computed in, choices against the allowed ones, paths that do not exist,
data that cannot be read. Every error names the field, the value and what is expected."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.distill import CausalDistillConfig
from causalqwen_adapter.evaluation import evaluate, score_hidden_states
from causalqwen_adapter.numeric import NumericCollator
from causalqwen_adapter.trainer import CausalSFTConfig

from conftest import PAIRS

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM = 5  # the <NUM> id of the tiny numeric models


def _recipe(name: str):
    """The module of the subcommand `name` (causalqwen_adapter/cli/)."""
    return importlib.import_module(f"causalqwen_adapter.cli.{name}")


def _held_out(tmp_path) -> Path:
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"text": p + c}) + "\n" for p, c in PAIRS))
    return data


def _evaluation_arguments(recipe, models, data, out, **overrides):
    return recipe.EvaluationArguments(model_name_or_path=[str(m) for m in models], dataset_name=str(data),
                                      output_dir=str(out), dtype="float32", **overrides)


# --------------------------------------------------------------------------------------- silent non-finite results


@pytest.mark.parametrize("temperature", [math.nan, -1.0, math.inf])
def test_evaluation_refuses_a_temperature_that_is_not_finite_and_non_negative(sft_base, tmp_path, temperature):
    model = CausalQwenForCausalLM.from_base(sft_base)
    batch = {"input_ids": torch.tensor([[3, 4, 5, 6]])}
    message = "causal_temperature must be a finite number >= 0"
    with pytest.raises(ValueError, match=message):
        evaluate(model, [batch], ["standard"], causal_temperature=temperature)
    with pytest.raises(ValueError, match=message):  # the library's lower entry point too
        next(score_hidden_states(model, torch.randn(3, 32), torch.tensor([1, 2, 3]), ["standard"],
                                 causal_temperature=temperature))
    recipe = _recipe("evaluate")
    with pytest.raises(ValueError, match=message):
        recipe.run(_evaluation_arguments(recipe, [sft_base], _held_out(tmp_path), tmp_path / "eval",
                                          causal_temperature=temperature))
    assert not (tmp_path / "eval").exists()  # no metrics written


def test_numbers_are_checked_in_the_dtype_they_are_computed_in(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"causal_temperature must be a finite number >= 0 in float32 .*got 1e\+39"):
        model(input_ids, causal_temperature=1e39)  # finite in Python, inf in the heads' float32
    with pytest.raises(ValueError, match=r"causal_temperature must be a finite number >= 0 in float32"):
        model.generate(input_ids, max_new_tokens=2, causal_temperature=1e39)
    with pytest.raises(ValueError, match=r"ovr_threshold_init must be a finite number in float32"):
        CausalQwenForCausalLM.from_base(tied_base, ovr_threshold_init=-1e39)
    half = CausalQwenForCausalLM.from_base(tied_base, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"causal_temperature must be a finite number >= 0 in float16 .*got 100000"):
        half(input_ids, causal_temperature=1e5)
    noise = torch.zeros(*input_ids.shape, 32, dtype=torch.float64)
    noise[1, 2, 3] = 1e39
    with pytest.raises(ValueError, match=r"causal_noise holds 1e\+39 at \[1, 2, 3\], which is inf in float32"):
        model(input_ids, inference_mode="sampling", causal_noise=noise)
    noise[1, 2, 3] = math.nan
    with pytest.raises(ValueError, match=r"causal_noise holds nan at \[1, 2, 3\]"):
        model(input_ids, inference_mode="sampling", causal_noise=noise)

    numeric = CausalQwenForCausalLM.from_base(tied_base, numeric=True, num_token_id=NUM)
    ids = torch.tensor([[3, NUM, 9, NUM]])
    values = torch.tensor([[0.0, 2.0, 0.0, 1e39]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"numeric_values holds 1e\+39 at \[0, 3\], which is inf in float32"):
        numeric(ids, numeric_values=values)
    with pytest.raises(ValueError, match=r"numeric_values holds 1e\+39 at \[0, 3\], which is inf in float32"):
        numeric.generate(ids, numeric_values=values, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"example 0 of the batch: numeric_values holds 1e\+39 at \[3\]"):
        NumericCollator(lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows])})(
            [{"input_ids": ids[0].tolist(), "numeric_values": values[0].tolist()}])
    values[0, 3] = 7.0
    assert torch.isfinite(numeric(ids, numeric_values=values).logits).all()  # float64 values that fit are fine


def test_a_value_off_num_is_refused_by_forward_generate_and_the_collator(tied_base):
    model = CausalQwenForCausalLM.from_base(tied_base, numeric=True, num_token_id=NUM)
    ids = torch.tensor([[3, NUM, 9, 11]])
    values = torch.tensor([[0.0, 2.5, 4.0, 0.0]])  # 4.0 sits at token 9, not at a <NUM>
    message = r"numeric_values holds 4.0 at \[0, 2\], where the token is 9, not <NUM> \(5\)"
    with pytest.raises(ValueError, match=message):
        model(ids, numeric_values=values)
    with pytest.raises(ValueError, match=message):
        model(ids, numeric_values=values, labels=ids)
    with pytest.raises(ValueError, match=message):
        model.generate(ids, numeric_values=values, max_new_tokens=2)
    collator = NumericCollator(lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows])},
                               num_token_id=NUM)
    with pytest.raises(ValueError, match=r"example 1 of the batch: numeric_values holds 4.0 at \[2\]"):
        collator([{"input_ids": ids[0].tolist(), "numeric_values": [0.0, 2.5, 0.0, 0.0]},
                  {"input_ids": ids[0].tolist(), "numeric_values": values[0].tolist()}])
    with pytest.raises(ValueError, match="numeric_values need the input as input_ids"):
        model(inputs_embeds=model.model.embed_tokens(ids), numeric_values=values)
    values[0, 2] = 0.0
    with torch.no_grad():  # the same values: forward's first step is generate's first step
        forward = model(ids, numeric_values=values).logits[:, -1].argmax(-1)
        generated = model.generate(ids, numeric_values=values, max_new_tokens=1, do_sample=False)[:, -1]
    assert torch.equal(forward, generated)


@pytest.mark.parametrize("config_class", [CausalSFTConfig, CausalDistillConfig])
@pytest.mark.parametrize("field, value, message", [
    ("threshold_lr_ratio", -1.0, "threshold_lr_ratio must be a finite number >= 0, got -1.0"),
    ("location_lr_ratio", math.nan, "location_lr_ratio must be a finite number >= 0, got nan"),
    ("learning_rate", -1e-4, "learning_rate must be a finite number >= 0, got -0.0001"),
    ("softmax_loss_weight", -1.0, "softmax_loss_weight must be a finite number >= 0, got -1.0"),
    ("numeric_loss_weight", math.inf, "numeric_loss_weight must be a finite number >= 0, got inf"),
    ("gamma_init", 0.0, "gamma_init must be a finite number > 0, got 0.0"),
    ("causal_size", 64.5, r"causal_size must be a positive integer, got 64.5 \(float\)"),
    ("objective", "sofmax", "objective='sofmax': choose one of ovr, softmax"),
])
def test_trainer_arguments_are_checked_up_front(tmp_path, config_class, field, value, message):
    with pytest.raises(ValueError, match=message):
        config_class(str(tmp_path), report_to="none", use_cpu=True, **{field: value})


def test_distill_tail_weight_is_checked_up_front(tmp_path):
    with pytest.raises(ValueError, match="distill_tail_weight must be a finite number >= 0, got nan"):
        CausalDistillConfig(str(tmp_path), report_to="none", use_cpu=True, distill_tail_weight=math.nan)


def test_extraction_refuses_a_teacher_whose_weights_hold_nan(sft_base, tmp_path):
    from causalqwen_adapter.features import extract_features

    teacher = Qwen2ForCausalLM.from_pretrained(sft_base)
    with torch.no_grad():
        teacher.model.layers[1].mlp.down_proj.weight[3, 5] = math.nan
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="hold NaN or infinite values: its weights are corrupt.*Nothing was written"):
        extract_features(teacher, ["the cat sat on the mat", "hello"], tmp_path / "features", top_k=2,
                         tokenizer=AutoTokenizer.from_pretrained(sft_base))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no store, no staging folder left


def test_collator_refuses_a_numeric_values_row_shorter_than_its_tokens():
    collator = NumericCollator(lambda rows: {"input_ids": torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(r["input_ids"]) for r in rows], batch_first=True)})
    rows = [{"input_ids": [1, 2, 3], "numeric_values": [0.0, 0.0, 0.0]},
            {"input_ids": [4, 5, 6], "numeric_values": [0.0, 0.0]}]
    with pytest.raises(ValueError, match="example 1 of the batch has 2 numeric_values for 3 input_ids"):
        collator(rows)
    rows[1]["numeric_values"] = [0.0, 0.0, 0.0, 1.0]  # longer: truncated with input_ids, as TRL truncates them
    assert collator(rows)["numeric_values"].shape == (2, 3)


def test_an_unknown_ovr_distribution_set_after_loading_is_refused(tied_base, input_ids, tmp_path):
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(tmp_path / "adapter")
    model = CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")
    model.config.ovr_distribution = "accept_twice"
    message = "ovr_distribution='accept_twice': choose one of accept, accept_once, normalize"
    with pytest.raises(ValueError, match=message):
        model(input_ids, inference_mode="standard")
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids, max_new_tokens=2, inference_mode="causal")
    with pytest.raises(ValueError, match=message):
        evaluate(model, [{"input_ids": input_ids}], ["standard"])
    model(input_ids, inference_mode="compatible")  # the one mode that does not read it


# --------------------------------------------------------------------------------------- unclear errors


def test_a_missing_adapter_folder_is_named(sft_base, tmp_path, capsys):
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(FileNotFoundError, match=f"adapter '{missing}' was not found: no folder"):
        CausalQwenForCausalLM.from_pretrained(missing)
    with pytest.raises(SystemExit) as exit_info:
        _recipe("generate").main([str(missing), "--prompt", "hello", "--device", "cpu"])
    assert exit_info.value.code == 2 and f"--model_name_or_path '{missing}' was not found" in capsys.readouterr().err
    recipe = _recipe("evaluate")
    with pytest.raises(FileNotFoundError, match=f"--model_name_or_path '{missing}' was not found: no folder"):
        recipe.run(_evaluation_arguments(recipe, [sft_base, missing], _held_out(tmp_path), tmp_path / "eval"))


def test_wrong_types_name_the_field_the_value_and_what_is_expected(tied_base, input_ids):
    for field, value, message in [
        ("gamma_init", "abc", r"gamma_init must be a finite number > 0, got 'abc' \(str\)"),
        ("causal_size", 64.5, r"causal_size must be a positive integer, got 64.5 \(float\)"),
        ("causal_temperature", "2", r"causal_temperature must be a finite number >= 0, got '2' \(str\)"),
        ("action_lora_rank", True, r"action_lora_rank must be a positive integer, got True \(bool\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            CausalQwenForCausalLM.from_base(tied_base, **{field: value})
    model = CausalQwenForCausalLM.from_base(tied_base)
    with pytest.raises(ValueError, match=r"causal_temperature must be a finite number >= 0, got '2' \(str\)"):
        model(input_ids, causal_temperature="2")
    batch, length = input_ids.shape
    for shape in [(32,), (batch + 1, length, 32), (batch, length, 31), (batch, length + 1, 32)]:
        with pytest.raises(ValueError, match=rf"causal_noise has shape {re.escape(str(shape))}, the scored positions "
                                             rf"need \({batch}, {length}, 32\)"):
            model(input_ids, inference_mode="sampling", causal_noise=torch.zeros(shape))
    shared = torch.zeros(batch, 1, 32)  # one ε per sequence is a shape that fits
    assert model(input_ids, inference_mode="sampling", causal_noise=shared).logits.shape[:2] == (batch, length)

    numeric = CausalQwenForCausalLM.from_base(tied_base, numeric=True, num_token_id=NUM)
    message = r"numeric_values must be a torch.Tensor \(one value per token, 0 where the token is not <NUM>\), got a list"
    with pytest.raises(ValueError, match=message):
        numeric(input_ids, numeric_values=[[0.0] * length] * batch)
    with pytest.raises(ValueError, match=message):
        numeric.generate(input_ids, numeric_values=[[0.0] * length] * batch, max_new_tokens=2)


def test_empty_data_files_are_named_by_every_recipe(sft_base, tmp_path):
    from trl import ModelConfig, ScriptArguments

    from causalqwen_adapter.data import load_text_dataset

    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    message = r"empty.jsonl is empty \(0 bytes\): no rows to read"
    with pytest.raises(ValueError, match=message):
        load_text_dataset(str(empty))
    recipe = _recipe("evaluate")
    with pytest.raises(ValueError, match=message):
        recipe.run(_evaluation_arguments(recipe, [sft_base], empty, tmp_path / "eval"))
    sft = _recipe("train")
    with pytest.raises(ValueError, match=message):
        sft.run(ScriptArguments(dataset_name=str(empty)),
                 CausalSFTConfig(str(tmp_path / "out"), report_to="none", use_cpu=True),
                 ModelConfig(model_name_or_path=str(sft_base)))
    extract = _recipe("extract_features")
    with pytest.raises(ValueError, match=message):
        extract.run(extract.ExtractArguments(model_name_or_path=str(sft_base), dataset_name=str(empty),
                                              output_dir=str(tmp_path / "features"), device="cpu"))
    assert not (tmp_path / "eval").exists() and not (tmp_path / "features").exists()



@pytest.mark.parametrize("name, content", [("header.csv", "text\n"), ("empty.json", "[]\n"), ("blank.jsonl", "\n" * 5000),
                                           ("none.parquet", None)])
def test_data_files_of_no_rows_are_named_by_every_recipe(sft_base, tmp_path, name, content):
    """Not datasets' 'Instruction "train" corresponds to no data', which names neither the file nor the cause."""
    from trl import ModelConfig, ScriptArguments

    from causalqwen_adapter.data import load_text_dataset

    data = tmp_path / name
    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": pa.array([], pa.string())}), data)
    else:
        data.write_text(content)
    message = rf"{re.escape(str(data))} holds no rows"
    with pytest.raises(ValueError, match=message):
        load_text_dataset(str(data))
    recipe = _recipe("evaluate")
    with pytest.raises(ValueError, match=message):
        recipe.run(_evaluation_arguments(recipe, [sft_base], data, tmp_path / "eval"))
    with pytest.raises(ValueError, match=message):
        _recipe("train").run(ScriptArguments(dataset_name=str(data)),
                             CausalSFTConfig(str(tmp_path / "out"), report_to="none", use_cpu=True),
                             ModelConfig(model_name_or_path=str(sft_base)))
    assert not (tmp_path / "eval").exists() and not (tmp_path / "out").exists()

def test_evaluate_recipe_refuses_a_zero_batch_size_and_ids_beyond_the_vocabulary(sft_base, tmp_path):
    recipe = _recipe("evaluate")
    data = _held_out(tmp_path)
    with pytest.raises(ValueError, match=r"per_device_eval_batch_size must be a positive integer, got 0"):
        recipe.run(_evaluation_arguments(recipe, [sft_base], data, tmp_path / "eval", per_device_eval_batch_size=0))
    tokenized = tmp_path / "ids.jsonl"
    tokenized.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n" + json.dumps({"input_ids": [5, 900, 7]}) + "\n")
    with pytest.raises(ValueError, match=r"input_ids of row 1 holds token id 900 at position 1, outside the model's "
                                         r"vocabulary \[0, 128\)"):
        recipe.run(_evaluation_arguments(recipe, [sft_base], tokenized, tmp_path / "eval"))
    assert not (tmp_path / "eval").exists()


def test_an_adapter_given_as_a_base_says_how_to_load_an_adapter(sft_base, tmp_path):
    from causalqwen_adapter.features import extract_features

    adapter = tmp_path / "adapter"
    CausalQwenForCausalLM.from_base(sft_base).save_pretrained(adapter)
    message = rf"'{adapter}' is a CausalQwen adapter, not a base.*CausalQwenForCausalLM.from_pretrained\('{adapter}'\)"
    with pytest.raises(ValueError, match="base_model " + message):
        CausalQwenForCausalLM.from_pretrained(adapter, base_model=str(adapter))
    with pytest.raises(ValueError, match="base " + message):
        CausalQwenForCausalLM.from_base(str(adapter))
    with pytest.raises(ValueError, match="teacher " + message):
        extract_features(str(adapter), ["the cat sat"], tmp_path / "features", top_k=2)


@pytest.mark.parametrize("mode", ["compatible", "standard", "causal"])
def test_assisted_decoding_takes_the_per_call_mode(tied_base, input_ids, mode):
    assistant = Qwen2ForCausalLM.from_pretrained(tied_base).eval()
    model = CausalQwenForCausalLM.from_base(tied_base, inference_mode="sampling").eval()
    with torch.no_grad():
        model.ovr.threshold.fill_(math.log(0.9))  # the OvR modes then decide otherwise than the compatible one
        prompt = input_ids[:1]
        plain = model.generate(prompt, max_new_tokens=6, do_sample=False, inference_mode=mode)
        assisted = model.generate(prompt, max_new_tokens=6, do_sample=False, inference_mode=mode,
                                  assistant_model=assistant)
    assert torch.equal(assisted, plain)
    numeric = CausalQwenForCausalLM.from_base(tied_base, numeric=True, num_token_id=NUM)
    with pytest.raises(ValueError, match="numeric models generate without assistant_model"):
        numeric.generate(prompt, max_new_tokens=2, assistant_model=assistant)


def test_an_empty_prompt_is_refused(sft_base, tmp_path, capsys):
    model = CausalQwenForCausalLM.from_base(sft_base)
    with pytest.raises(ValueError, match=r"the prompt has no tokens \(input_ids of shape \(1, 0\)\)"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(SystemExit) as exit_info:
        _recipe("generate").main([str(tmp_path / "adapter"), "--prompt", "", "--no-chat", "--device", "cpu"])
    assert exit_info.value.code == 2 and "--prompt is empty" in capsys.readouterr().err


@pytest.mark.parametrize("reference", ["../outside/evil.Model", "ABSOLUTE", "other/repo--modeling_causalqwen.Model"])
def test_push_refuses_an_auto_map_outside_the_folder_before_any_network_call(tied_base, tmp_path, capsys,
                                                                            monkeypatch, reference):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.py").write_text("from .helper import x\n")  # whose import is not there either
    if reference == "ABSOLUTE":
        reference = f"{outside / 'evil'}.Model"
    folder = tmp_path / "adapter"
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"]["AutoModel"] = reference
    (folder / "config.json").write_text(json.dumps(config))
    recipe = _recipe("push")
    monkeypatch.setattr(recipe, "upload_adapter_folder", lambda *a, **k: pytest.fail("uploaded"))
    with pytest.raises(SystemExit) as exit_info:
        recipe.main([str(folder), "user/tiny", "--token", "hf_test"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"auto_map names {reference!r} for AutoModel: the remote code must be a module of the folder itself" in err


def test_the_siblings_check_the_same_way(tied_base, sft_base, tmp_path):
    from datasets import Dataset

    from causalqwen_adapter.numeric import encode_with_numbers
    from causalqwen_adapter.trainer import CausalSFTTrainer

    # fresh heads' init values in the heads' own dtype
    with pytest.raises(ValueError, match=r"gamma_init must be a finite number in float16 .*got 100000"):
        CausalQwenForCausalLM.from_base(tied_base, dtype=torch.float16, gamma_init=1e5)

    class Words:  # the smallest tokenizer encode_with_numbers needs
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [7] * len(text.split())}

    with pytest.raises(ValueError, match="'1e39' at character 6 does not fit a float32, the dtype <NUM> values are"):
        encode_with_numbers(Words(), "costs 1e39 now", NUM)
    # the trainer's pre-tokenized input ids, beside in-vocabulary labels
    args = CausalSFTConfig(str(tmp_path / "out"), report_to="none", use_cpu=True, save_strategy="no",
                           disable_tqdm=True)
    data = Dataset.from_dict({"input_ids": [[3, 4, 5], [3, 900, 5]], "labels": [[3, 4, 5], [3, 4, 5]]})
    with pytest.raises(ValueError, match=r"train example 1 has input id 900, outside the model's vocabulary \[0, 128\)"):
        CausalSFTTrainer(str(sft_base), args=args, train_dataset=data)
    with pytest.raises(ValueError, match=r"loss_chunk_size must be a positive integer, got 0.5 \(float\)"):
        CausalSFTConfig(str(tmp_path / "out"), report_to="none", use_cpu=True, loss_chunk_size=0.5)
    # a numeric trainer's data: one value per token, 0 off <NUM>, checked before training and naming the example
    rows = {"input_ids": [[3, NUM, 9], [3, NUM, 9]], "numeric_values": [[0.0, 2.0, 0.0], [0.0, 2.0, 1.5]]}
    with pytest.raises(ValueError, match=r"train example 1 has the value 1.5 at a token that is not <NUM> \(9\)"):
        CausalSFTTrainer(str(sft_base), args=CausalSFTConfig(str(tmp_path / "num"), report_to="none", use_cpu=True,
                                                             numeric=True, num_token_id=NUM, save_strategy="no"),
                         train_dataset=Dataset.from_dict(rows))
    rows["numeric_values"][1] = [0.0, 2.0]
    with pytest.raises(ValueError, match="train example 1 has 2 numeric_values for 3 input_ids"):
        CausalSFTTrainer(str(sft_base), args=CausalSFTConfig(str(tmp_path / "num"), report_to="none", use_cpu=True,
                                                             numeric=True, num_token_id=NUM, save_strategy="no"),
                         train_dataset=Dataset.from_dict(rows))
