"""Numeric heads end to end: CausalSFTTrainer on numeric data (against the model's own loss), `causalqwen train
--numeric`, and `causalqwen generate` writing the generated numbers and their Cauchy intervals.
"""

import json
import re
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.cauchy import cauchy_interval
from causalqwen_adapter.numeric import (
    add_num_token,
    encode_with_numbers,
    numeric_statistics,
)
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

from conftest import REPO_ROOT


def _numeric_data(tokenizer, num_id):
    texts = ["the cat sat on 3 mats", "a dog ran 12 times in the park", "two plus two is 4",
             "hello 7 how are you 2.5", "the sky is 100 blue today", "cats and dogs are 40 friends"]
    return Dataset.from_list([encode_with_numbers(tokenizer, t, num_id) for t in texts])


def test_trainer_starts_from_the_data_and_matches_the_naive_loss(sft_base, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    num_id = len(tokenizer)
    add_num_token(tokenizer, num_id)
    data = _numeric_data(tokenizer, num_id)
    args = CausalSFTConfig(str(tmp_path), numeric=True, num_token_id=num_id, numeric_loss_weight=0.5, max_steps=2,
                           per_device_train_batch_size=3, learning_rate=1e-2, logging_steps=1, report_to="none",
                           save_strategy="no", use_cpu=True, dataloader_pin_memory=False, disable_tqdm=True, seed=0)
    trainer = CausalSFTTrainer(str(sft_base), args=args, train_dataset=data, processing_class=tokenizer)
    model = trainer.model
    targets = [3.0, 12.0, 4.0, 7.0, 2.5, 100.0, 40.0]
    median, scale = numeric_statistics(targets)
    assert model.numeric.bias.item() == pytest.approx(median)
    assert model.numeric.log_scale.exp().item() == pytest.approx(scale, rel=1e-6)

    batch = trainer.data_collator([data[i] for i in range(3)])
    assert batch["numeric_values"].shape == batch["input_ids"].shape
    fused = trainer.compute_loss(model, dict(batch))
    with torch.no_grad():
        naive = model(**batch)  # the model's own forward: materialised OvR + λ NLL
    torch.testing.assert_close(fused.detach(), naive.loss, rtol=1e-5, atol=1e-5)

    direction = model.numeric.direction.detach().clone()
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all("numeric_nll" in h for h in logged)
    assert not torch.equal(model.numeric.direction, direction)  # d trains through the frozen backbone
    assert all(not p.requires_grad for p in model.model.parameters())


def test_trainer_refuses_numeric_heads_without_values_or_with_packing(sft_base, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    num_id = len(tokenizer)
    add_num_token(tokenizer, num_id)
    common = dict(numeric=True, num_token_id=num_id, report_to="none", use_cpu=True, save_strategy="no")
    with pytest.raises(ValueError, match="has no numeric_values column"):
        CausalSFTTrainer(str(sft_base), args=CausalSFTConfig(str(tmp_path), **common),
                         train_dataset=Dataset.from_dict({"text": ["the cat sat on 3 mats"]}), processing_class=tokenizer)
    with pytest.raises(ValueError, match="packing is not supported with numeric heads"):
        CausalSFTTrainer(str(sft_base), args=CausalSFTConfig(str(tmp_path), packing=True, **common),
                         train_dataset=_numeric_data(tokenizer, num_id), processing_class=tokenizer)
    data = _numeric_data(tokenizer, num_id).to_dict()
    data["numeric_values"][2] = [None if v else v for v in data["numeric_values"][2]]  # a null target in row 2
    with pytest.raises(ValueError, match="train example 2 has the numeric value None"):
        CausalSFTTrainer(str(sft_base), args=CausalSFTConfig(str(tmp_path), **common),
                         train_dataset=Dataset.from_dict(data), processing_class=tokenizer)
    adapter = tmp_path / "plain-adapter"
    CausalQwenForCausalLM.from_base(Qwen2ForCausalLM.from_pretrained(sft_base)).save_pretrained(adapter)
    with pytest.raises(ValueError, match="this adapter's heads are not numeric"):
        CausalSFTTrainer(str(adapter), args=CausalSFTConfig(str(tmp_path), **common),
                         train_dataset=_numeric_data(tokenizer, num_id), processing_class=tokenizer)


def test_sft_recipe_with_numeric_heads(sft_base, tmp_path):
    from causalqwen_adapter.cli import train as recipe

    data = tmp_path / "numbers.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the cat sat on 3 mats", "two plus two is 4",
                                                                     "a dog ran 12 times"]))
    parsed = recipe.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
        "--numeric", "--max_steps", "1", "--per_device_train_batch_size", "3", "--report_to", "none",
        "--use_cpu", "true", "--logging_steps", "1", "--disable_tqdm", "true", "--dataloader_pin_memory", "false",
    ])
    trainer = recipe.run(*parsed)
    num_id = trainer.model.config.num_token_id
    assert num_id == len(AutoTokenizer.from_pretrained(sft_base))  # the next free id
    assert sorted(v for row in trainer.train_dataset["numeric_values"] for v in row if v) == [3.0, 4.0, 12.0]
    assert "numeric_nll" in trainer.state.log_history[0]
    assert CausalQwenForCausalLM.from_pretrained(tmp_path / "out").config.numeric
    # training continues from the adapter: the data are read with its base's tokenizer, <NUM> at the adapter's id
    parsed = recipe.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", str(tmp_path / "out"), "--dataset_name", str(data), "--output_dir",
        str(tmp_path / "again"), "--numeric", "--max_steps", "1", "--per_device_train_batch_size", "3",
        "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true", "--dataloader_pin_memory", "false",
    ])
    again = recipe.run(*parsed)
    assert again.model.config.num_token_id == num_id
    assert again.train_dataset["input_ids"] == trainer.train_dataset["input_ids"]


def test_sft_recipe_with_numeric_heads_names_a_row_without_text(sft_base, tmp_path):
    from causalqwen_adapter.cli import train as recipe

    data = tmp_path / "numbers.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the cat sat on 3 mats", None, "a dog ran 12 times"]))
    parsed = recipe.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
        "--numeric", "--max_steps", "1", "--report_to", "none", "--use_cpu", "true"])
    with pytest.raises(ValueError, match=r"the train dataset's `text` in row 1 is None \(NoneType\), not text"):
        recipe.run(*parsed)
    assert not (tmp_path / "out").exists()


def _shortest_float32(v: float) -> str:
    """The fewest significant digits that read back as the same float32 (values between 1e-4 and 1e16)."""
    return next(t for t in (f"{v:.{p}f}".rstrip("0").rstrip(".") if abs(v) >= 1 else f"{v:.{p}g}" for p in range(1, 12))
                if torch.tensor(float(t), dtype=torch.float32) == torch.tensor(v, dtype=torch.float32))


def test_generate_recipe_writes_generated_numbers(sft_base, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    num_id = len(tokenizer)
    model = CausalQwenForCausalLM.from_base(str(sft_base), numeric=True, num_token_id=num_id).eval()
    with torch.no_grad():
        model.action.bias[num_id] = 40.0  # every generated token is <NUM>
        model.numeric.bias.fill_(42.0)
    model.save_pretrained(tmp_path / "adapter")
    cli = [sys.executable, "-m", "causalqwen_adapter.cli", "generate"]  # run in the checkout: its package
    proc = subprocess.run([*cli, str(tmp_path / "adapter"),
                           "--prompt", "the cat sat on 3", "--no-chat", "--mode", "compatible", "--max-new-tokens", "2"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    add_num_token(tokenizer, num_id)
    encoded = encode_with_numbers(tokenizer, "the cat sat on 3", num_id)
    out = model.generate(torch.tensor([encoded["input_ids"]]), numeric_values=torch.tensor([encoded["numeric_values"]]),
                         max_new_tokens=2, do_sample=False, inference_mode="compatible", return_dict_in_generate=True)
    n = len(encoded["input_ids"])
    values = out.numeric_values[0, n:]
    assert proc.stdout.strip() == "".join(_shortest_float32(v) for v in values.tolist())
    assert all(abs(v - 42.0) < 5 for v in values.tolist())
    # with --interval: a line per generated number, its Cauchy interval on the range given
    proc = subprocess.run([*cli, "--model_name_or_path", str(tmp_path / "adapter"),
                           "--prompt", "the cat sat on 3", "--no_chat", "--inference_mode", "compatible",
                           "--max_new_tokens", "2", "--interval", "0.9", "--value_range", "0", "45"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lower, upper = cauchy_interval(values, out.numeric_scales[0, n:], 0.9, support=(0.0, 45.0))
    assert proc.stdout.strip().splitlines() == ["".join(_shortest_float32(v) for v in values.tolist())] + [
        f"number {i}: {v:g}, 90 % interval [{lo:g}, {hi:g}]"
        for i, (v, lo, hi) in enumerate(zip(values.tolist(), lower.tolist(), upper.tolist()), 1)]
    assert (upper <= 45).all() and (lower < values).all() and (values < upper).all()


@pytest.mark.parametrize("extra, message", [
    (["--interval", "1.5"], r"--interval is the interval's level, in \(0, 1\)"),
    (["--interval", "nan"], "--interval must be a finite number"),
    (["--value-range", "0", "4"], "give --interval LEVEL with it"),
    (["--interval", "0.9", "--value-range", "4", "-4"], "LOW < HIGH, got 4 -4"),
])
def test_generate_recipe_refuses_bad_interval_options(sft_base, tmp_path, capsys, monkeypatch, extra, message):
    from causalqwen_adapter.cli import generate as recipe

    CausalQwenForCausalLM.from_base(str(sft_base)).save_pretrained(tmp_path / "plain")
    loaded = []  # every refusal comes before the model loads
    monkeypatch.setattr(recipe.CausalQwenForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit) as exit_info:
        recipe.main([str(tmp_path / "plain"), "--prompt", "hi", "--no-chat", "--device", "cpu", *extra])
    assert exit_info.value.code == 2 and re.search(message, capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_info:  # a plain adapter has no numbers to give intervals of
        recipe.main([str(tmp_path / "plain"), "--prompt", "hi", "--no-chat", "--device", "cpu", "--interval", "0.9"])
    assert exit_info.value.code == 2 and "is not one" in capsys.readouterr().err and not loaded
