"""`causalqwen train` (causalqwen_adapter/cli/train.py, recipes/sft_ovr.py) on a tiny random Qwen2 with a tiny
word-level tokenizer.

Each data set format, the help, TRL's model flags, the README's command as written, and two processes under
`accelerate launch` against one process accumulating the same micro-batches.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import PAIRS, REPO_ROOT, free_port
from trainer_helpers import _heads

RECIPE = REPO_ROOT / "recipes" / "sft_ovr.py"


def _load_recipe():
    from causalqwen_adapter.cli import train

    return train


def _write_data(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"prompt-completion": folder / "pc.jsonl", "messages": folder / "messages.json", "text": folder / "text.parquet"}
    with open(paths["prompt-completion"], "w") as f:
        for prompt, completion in PAIRS:
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    messages = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c.strip()}]} for p, c in PAIRS]
    paths["messages"].write_text(json.dumps(messages))
    Dataset.from_dict({"text": [p + c for p, c in PAIRS]}).to_parquet(str(paths["text"]))
    return paths


@pytest.mark.parametrize("data_format", ["prompt-completion", "messages", "text"])
def test_recipe_trains_on_each_dataset_format(sft_base, tmp_path, data_format):
    recipe = _load_recipe()
    data = _write_data(tmp_path / "data")[data_format]
    parsed = recipe.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
        "--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none", "--bf16", "false",
        "--use_cpu", "true", "--logging_steps", "1", "--disable_tqdm", "true", "--dataloader_pin_memory", "false",
    ])
    trainer = recipe.run(*parsed)

    example = trainer.train_dataset[0]
    labels, ids = example["labels"], example["input_ids"]
    if data_format == "prompt-completion":  # the loss sees the completion only
        assert labels[0] == -100 and labels[-1] == ids[-1]
    else:
        assert labels == ids
    if data_format == "messages":
        assert ids[0] == trainer.processing_class.convert_tokens_to_ids("<|im_start|>")
    assert "target_prob" in trainer.state.log_history[0]
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == trainer.model.adapter_keys()
    card = (tmp_path / "out" / "README.md").read_text()
    assert data.name in card and str(data.parent) not in card  # named, without the local path


def test_recipe_help_describes_head_options_from_the_config():
    help_text = " ".join(_load_recipe().make_parser().format_help().split())
    from causalqwen_adapter.training.arguments import config_field_help

    for name in ("gamma_init", "ovr_threshold_init", "ovr_distribution", "objective"):
        assert " ".join(config_field_help(name).split()[:8]) in help_text, name
    assert "{accept,accept_once,normalize}" in help_text


def test_recipe_takes_trls_model_flags(sft_base, tmp_path):
    """The model flags are TRL's `ModelConfig`: LoRA through `get_peft_config`; quantization is refused up front."""
    recipe = _load_recipe()
    data = _write_data(tmp_path / "data")["text"]
    common = ["--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--max_steps", "1",
              "--per_device_train_batch_size", "2", "--report_to", "none", "--use_cpu", "true",
              "--disable_tqdm", "true", "--dataloader_pin_memory", "false"]
    trainer = recipe.run(*recipe.make_parser().parse_args_and_config(args=[
        *common, "--output_dir", str(tmp_path / "lora"), "--use_peft", "--lora_r", "4",
        "--lora_target_modules", "q_proj", "v_proj"]))
    trained = {n for n, p in trainer.model.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in trained)
    assert (tmp_path / "lora" / "lora" / "adapter_model.safetensors").is_file()

    out = tmp_path / "quantized"
    with pytest.raises(ValueError, match="load_in_4bit/--load_in_8bit are not supported"):
        recipe.run(*recipe.make_parser().parse_args_and_config(args=[*common, "--output_dir", str(out),
                                                                      "--load_in_4bit"]))
    assert not out.exists()
    # Liger would find nothing to patch in a CausalQwen model and only log it: refused, before anything is loaded
    with pytest.raises(ValueError, match="use_liger_kernel is not supported"):
        recipe.run(*recipe.make_parser().parse_args_and_config(args=[*common, "--output_dir", str(out),
                                                                      "--use_liger_kernel", "true"]))
    assert not out.exists()


def test_recipe_under_accelerate_launch_two_processes(sft_base, tmp_path):
    """Two CPU processes (gloo DDP), 2 examples each per step, equal one process accumulating those 2 micro-batches."""
    data = _write_data(tmp_path / "data")["prompt-completion"]
    common = [
        "--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--max_steps", "2",
        "--per_device_train_batch_size", "2", "--report_to", "none", "--bf16", "false", "--use_cpu", "true",
        "--logging_steps", "1", "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--learning_rate", "1e-2",
    ]
    out = tmp_path / "ddp"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
    ]
    # Own session, so that a timeout takes the workers down with the launcher.
    proc = subprocess.Popen(
        [*launch, str(RECIPE), *common, "--output_dir", str(out)], env=env, cwd=REPO_ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"accelerate launch timed out:\n{stdout[-3000:]}\n{stderr[-5000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    digests = dict(re.findall(r"rank (\d)/2: adapter sha256 ([0-9a-f]{64})", stdout))
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"], stdout[-2000:]

    recipe = _load_recipe()
    reference = recipe.run(*recipe.make_parser().parse_args_and_config(
        args=[*common, "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "single")]
    ))
    saved = load_file(out / "model.safetensors")
    assert set(saved) == reference.model.adapter_keys()
    for key, value in _heads(reference.model).items():
        # Adam divides by √v: float rounding of the all-reduce shows up at 1e-6 relative in the smallest updates
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-5, msg=key)
    loaded = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    assert set(loaded.adapter_state_dict()) == set(saved)


def test_readme_training_command_runs_as_written(sft_base, tmp_path, device):
    """The README's flags only (model, data, output, steps, batch, length): on a CPU-only machine no --bf16/--use_cpu
    is needed; on a CUDA device the same command trains there, in bf16 mixed precision where the device supports it.
    (The cpu run on a CUDA machine says --use_cpu, which is what a CPU-only machine gets without it.)"""
    recipe = _load_recipe()
    data = _write_data(tmp_path / "data")["text"]
    flags = ["--use_cpu", "true"] if device.type == "cpu" and torch.cuda.is_available() else []
    trainer = recipe.run(*recipe.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", str(sft_base), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--max_length", "160", "--report_to", "none",
        *flags,
    ]))
    assert trainer.state.global_step == 2 and trainer.args.device.type == device.type
    assert next(trainer.model.parameters()).device.type == device.type
    assert trainer.args.bf16 == (device.type == "cuda" and torch.cuda.is_bf16_supported())
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    assert (tmp_path / "out" / "model.safetensors").is_file()
