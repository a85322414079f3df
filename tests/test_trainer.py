"""CausalSFTTrainer and `causalqwen train` (causalqwen_adapter/cli/train.py, recipes/sft_ovr.py) on a tiny random Qwen2 with a tiny word-level tokenizer.

The references are plain: the model's own forward with `labels` (the naive, materialised OvR loss), one big batch
for gradient accumulation, an uninterrupted run for resuming, a single process for DDP.
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
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM, TrainerCallback

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.tokenization_causalqwen import TOKENIZER_CONFIG
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer
from causalqwen_adapter.training import (
    calibrate_threshold_on_features,
    freeze_unreachable_parameters,
    unreachable_parameters,
)

from conftest import PAIRS, free_port, modes_not_plain
from conftest import TOKENIZER_BASE_VOCAB as VOCAB

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "recipes" / "sft_ovr.py"


# --------------------------------------------------------------------------------------- fixtures


def _args(output_dir, **overrides) -> CausalSFTConfig:
    values = dict(
        bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_pin_memory=False, per_device_train_batch_size=2, learning_rate=1e-2, seed=0,
    )
    values.update(overrides)
    return CausalSFTConfig(str(output_dir), **values)


def _prompt_completion(n=len(PAIRS)) -> Dataset:
    return Dataset.from_dict({"prompt": [p for p, _ in PAIRS[:n]], "completion": [c for _, c in PAIRS[:n]]})


def _heads(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.adapter_state_dict().items()}


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


class _GradCapture(TrainerCallback):
    """Gradients of the trainable tensors once accumulation is complete, before the optimizer step."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def full_run(sft_base, tmp_path_factory):
    """Six steps with checkpoints every three: the reference for resuming and saving."""
    out = tmp_path_factory.mktemp("full-run")
    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(out, max_steps=6, save_strategy="steps", save_steps=3),
        train_dataset=_prompt_completion(),
    )
    trainer.train()
    return trainer, out


# --------------------------------------------------------------------------------------- loss


HEAD_PARAMS = {"abduction.loc.weight", "abduction.loc.bias", "abduction.scale.weight", "abduction.scale.bias",
               "action.bias", "action.b_noise"}


@pytest.mark.parametrize(
    "heads, trained",
    [
        ({}, HEAD_PARAMS | {"action.weight"}),
        ({"learnable_threshold": True}, HEAD_PARAMS | {"action.weight", "ovr.threshold"}),
        ({"action_weight": "tied"}, HEAD_PARAMS),
        ({"action_weight": "lora", "action_lora_rank": 4}, HEAD_PARAMS | {"action.lora_A", "action.lora_B"}),
    ],
    ids=["full", "learnable-threshold", "tied", "lora"],
)
def test_compute_loss_matches_naive_forward(sft_base, tmp_path, heads, trained):
    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, per_device_train_batch_size=4, **heads), train_dataset=_prompt_completion()
    )
    model = trainer.model
    batch = next(iter(trainer.get_train_dataloader()))
    # completion-only masks and right padding are what is being checked
    assert (batch["labels"][batch["attention_mask"] == 1] == -100).any()
    assert (batch["attention_mask"] == 0).any()
    if "lora" in heads.get("action_weight", ""):
        with torch.no_grad():  # B starts at 0; a non-zero B·A makes the check see the low-rank path
            model.action.lora_B.normal_(std=0.01)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == trained
    params = [p for p in model.parameters() if p.requires_grad]

    loss = trainer.compute_loss(model, batch)
    grads = torch.autograd.grad(loss, params)
    reference = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    reference_grads = torch.autograd.grad(reference, params)

    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("micro_batch, accumulation", [(1, 4), (2, 2)])
def test_gradient_accumulation_matches_one_big_batch(sft_base, tmp_path, micro_batch, accumulation):
    data = _prompt_completion(4)  # completions of 2 to 5 tokens: micro-batches hold different target counts

    def grads_and_loss(name, **overrides):
        capture = _GradCapture()
        # Scales of the order of the logits: at the default 1e-5 the OvR gradients amplify the ulps by which padding
        # changes z (different batch compositions) by 1e5, which is conditioning, not accumulation.
        trainer = CausalSFTTrainer(
            str(sft_base), args=_args(tmp_path / name, max_steps=1, max_grad_norm=0.0, gamma_init=1.0,
                                      b_noise_init=0.1, **overrides),
            train_dataset=data, callbacks=[capture],
        )
        trainer.train()
        return capture.grads, _losses(trainer)[1]

    big, big_loss = grads_and_loss("big", per_device_train_batch_size=4, gradient_accumulation_steps=1)
    acc, acc_loss = grads_and_loss(
        "accumulated", per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation
    )
    assert big.keys() == acc.keys() and len(big) == 7
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-5, atol=1e-7, msg=name)
    assert acc_loss == pytest.approx(big_loss, rel=1e-5)


# --------------------------------------------------------------------------------------- logging


def test_logs_ovr_metrics_in_training_and_evaluation(sft_base, tmp_path):
    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, max_steps=2, learning_rate=0.0, gamma_init=4.0, ovr_threshold_init=0.0,
                                  ovr_relative_threshold=False, ovr_candidates=0),
        train_dataset=_prompt_completion(), eval_dataset=_prompt_completion(3),
    )
    trainer.train()
    assert trainer.model.config.ovr_candidates is None  # 0: the loss over the whole vocabulary
    first = trainer.state.log_history[0]
    for key in ("loss", "target_prob", "ovr_prob_sum", "units_mean_loc", "units_mean_scale", "num_tokens"):
        assert key in first, key
    # fresh heads: scale_U = softplus(b_scale) = gamma_init everywhere, and every P_k is near ½
    assert first["units_mean_scale"] == pytest.approx(4.0, rel=1e-5)
    assert 0 < first["target_prob"] < 1
    assert first["ovr_prob_sum"] == pytest.approx(VOCAB / 2, rel=0.1)
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_target_prob", "eval_ovr_prob_sum", "eval_units_mean_loc"} <= set(metrics)
    assert metrics["eval_units_mean_scale"] == pytest.approx(4.0, rel=1e-5)
    # the default loss, over 16 candidates and the target: Σ P over the 16 or 17 tokens it scores, each near ½
    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path / "candidates", max_steps=1, learning_rate=0.0, gamma_init=4.0,
                                  ovr_threshold_init=0.0, ovr_relative_threshold=False),
        train_dataset=_prompt_completion(),
    )
    trainer.train()
    first = trainer.state.log_history[0]
    assert "ovr_prob_sum" not in first and 16 * 0.4 < first["candidate_prob_sum"] < 17 * 0.6


@pytest.mark.parametrize("ovr_candidates", [16, 0])
def test_warns_once_when_every_ovr_probability_is_one_half(sft_base, tmp_path, caplog, ovr_candidates):
    """A scale far above the locations' spread (here from the start, as a too-fast scale path gets there) puts every
    P_k at ½: one warning naming the rates; heads at the default scale train without it."""
    from causalqwen_adapter.training import mixins

    def run(name, **heads):
        trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path / name, max_steps=2, learning_rate=1e-4,
                                                             ovr_candidates=ovr_candidates, **heads),
                                   train_dataset=_prompt_completion())
        with caplog.at_level("WARNING", logger=mixins.__name__):
            trainer.train()
        return trainer, [r for r in caplog.records if "Every OvR probability is ½" in r.getMessage()]

    trainer, warnings = run("saturated", gamma_init=1e4, b_noise_init=1e-6)
    assert [abs(h["target_prob"] - 0.5) < 1e-3 for h in trainer.state.log_history if "target_prob" in h] == [True] * 2
    assert len(warnings) == 1 and "learning_rate" in warnings[0].getMessage()
    caplog.clear()
    trainer, warnings = run("default")
    assert warnings == [] and abs(trainer.state.log_history[0]["target_prob"] - 0.5) > 0.01


# --------------------------------------------------------------------------------------- checkpoints


def test_resume_from_checkpoint_continues_exactly(sft_base, tmp_path, full_run):
    full, full_dir = full_run
    resumed = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, max_steps=6, save_strategy="steps", save_steps=3),
        train_dataset=_prompt_completion(),
    )
    resumed.train(resume_from_checkpoint=str(full_dir / "checkpoint-3"))

    expected, got = _losses(full), _losses(resumed)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # steps 1-3 come from the checkpoint's trainer_state.json
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]
    final, reference = _heads(resumed.model), _heads(full.model)
    for key in reference:
        torch.testing.assert_close(final[key], reference[key], rtol=0, atol=0, msg=key)


def test_checkpoints_hold_only_adapter_tensors(full_run):
    full, full_dir = full_run
    checkpoint = full_dir / "checkpoint-3"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "config.json"):
        assert (checkpoint / name).is_file(), name
    assert set(load_file(checkpoint / "model.safetensors")) == full.model.adapter_keys()
    # TRL writes its generic card into output_dir at every checkpoint; only the adapter's own card may be there
    for readme in (full_dir / "README.md", checkpoint / "README.md"):
        assert not readme.exists() or "It has been trained using [TRL]" not in readme.read_text()


def test_save_model_writes_a_loadable_adapter(sft_base, tmp_path, full_run):
    full, _ = full_run
    folder = tmp_path / "adapter"
    full.save_model(str(folder))

    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_causalqwen.py", "configuration_causalqwen.py"} <= files
    assert "adapter_config.json" not in files
    card = (folder / "README.md").read_text()  # the adapter's card, with the run the trainer recorded
    assert "It has been trained using [TRL]" not in card
    assert "learning_rate" in card and "target_prob" in card
    assert "tokenizer.json" not in files  # the tokenizer is the base's: tokenizer_config.json only points at it
    assert json.loads((folder / "tokenizer_config.json").read_text()) == TOKENIZER_CONFIG
    assert set(load_file(folder / "model.safetensors")) == full.model.adapter_keys()
    assert json.loads((folder / "config.json").read_text())["base_model_name_or_path"] == str(sft_base)

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32)
    trained = _heads(full.model)
    for key, value in loaded.adapter_state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)

    # an adapter path continues training from those heads, with the base's tokenizer
    again = CausalSFTTrainer(str(folder), args=_args(tmp_path / "again"), train_dataset=_prompt_completion())
    assert isinstance(again.model, CausalQwenForCausalLM)
    assert again.processing_class.eos_token == "<|endoftext|>"
    for key, value in _heads(again.model).items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)


def test_model_argument_forms(sft_base, tmp_path):
    fresh = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, causal_size=16, gamma_init=3.0, b_noise_init=0.5, learnable_threshold=True),
        train_dataset=_prompt_completion(),
    ).model
    assert fresh.config.causal_size == 16 and fresh.config.gamma_init == 3.0
    assert torch.all(fresh.action.b_noise == 0.5) and isinstance(fresh.ovr.threshold, torch.nn.Parameter)
    assert fresh.action.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in fresh.model.parameters())

    base = Qwen2ForCausalLM.from_pretrained(str(sft_base))
    from_object = CausalSFTTrainer(base, args=_args(tmp_path), train_dataset=_prompt_completion()).model
    assert isinstance(from_object, CausalQwenForCausalLM)
    torch.testing.assert_close(from_object.action.weight, base.get_output_embeddings().weight)

    with pytest.raises(TypeError, match="CausalQwenForCausalLM"):
        CausalSFTTrainer(torch.nn.Linear(2, 2), args=_args(tmp_path), train_dataset=_prompt_completion())
    with pytest.raises(ValueError, match="peft_config"):
        CausalSFTTrainer(str(sft_base), args=_args(tmp_path, freeze_backbone=False), train_dataset=_prompt_completion())


# --------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "data, max_length",
    [
        # the only label is at position 0, which no position predicts
        (Dataset.from_dict({"input_ids": [[5, 16, 31, 2]], "labels": [[5, -100, -100, -100]]}), None),
        # completions truncated away: TRL drops the fully masked examples and nothing is left
        (Dataset.from_dict({"prompt": ["what is two plus two is four"], "completion": [" four"]}), 3),
    ],
    ids=["only-position-0", "truncated-away"],
)
def test_dataset_without_targets_fails_before_training(sft_base, tmp_path, data, max_length):
    with pytest.raises(ValueError, match="no trainable target token"):
        CausalSFTTrainer(str(sft_base), args=_args(tmp_path, max_length=max_length), train_dataset=data)


def test_label_outside_vocabulary_fails_before_training(sft_base, tmp_path):
    data = Dataset.from_dict({"input_ids": [[5, 16, 31, 2], [5, 16, 31, 2]], "labels": [[5, 16, 31, 2], [5, 16, 500, 2]]})
    with pytest.raises(ValueError, match=r"example 1 has label 500, outside the model's vocabulary \[0, 128\)"):
        CausalSFTTrainer(str(sft_base), args=_args(tmp_path), train_dataset=data)


def test_non_finite_loss_stops_training_naming_the_step(sft_base, tmp_path):
    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                with torch.no_grad():
                    model.abduction.loc.weight[0, 0] = float("nan")

    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, max_steps=5), train_dataset=_prompt_completion(), callbacks=[Poison()]
    )
    with pytest.raises(FloatingPointError, match="training loss is nan at step 3"):
        trainer.train()
    assert trainer.state.global_step == 2


# --------------------------------------------------------------------------------------- LoRA on the backbone


def test_backbone_lora_trains_saves_in_lora_folder_and_resumes(sft_base, tmp_path):
    peft = pytest.importorskip("peft")

    def lora_config():
        return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])

    first = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=_prompt_completion(), peft_config=lora_config(),
    )
    frozen_before = first.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    first.train()
    backbone = first.model.model
    lora = {n: p.detach().clone() for n, p in backbone.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    assert any(n.endswith("lora_B.default.weight") and v.abs().sum() > 0 for n, v in lora.items())  # B starts at 0
    torch.testing.assert_close(backbone.layers[0].self_attn.q_proj.base_layer.weight, frozen_before, rtol=0, atol=0)

    folder = tmp_path / "adapter"
    first.save_model(str(folder))
    assert (folder / "lora" / "adapter_config.json").is_file()
    assert modes_not_plain(folder) == {}  # PEFT's adapter_model.safetensors too (safetensors writes 0600)
    assert not (folder / "adapter_config.json").exists()
    assert set(load_file(folder / "model.safetensors")) == first.model.adapter_keys()
    # from_pretrained re-applies the backbone LoRA by itself
    reloaded = CausalQwenForCausalLM.from_pretrained(folder)
    reloaded_lora = {n: p for n, p in reloaded.model.named_parameters() if "lora_" in n}
    assert set(reloaded_lora) == set(lora)
    for name, value in lora.items():
        torch.testing.assert_close(reloaded_lora[name].detach(), value, rtol=0, atol=0, msg=name)

    resumed = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path / "resumed", max_steps=2), train_dataset=_prompt_completion(),
        peft_config=lora_config(),
    )
    resumed._load_from_checkpoint(str(tmp_path / "run" / "checkpoint-2"))
    for name, param in resumed.model.model.named_parameters():
        if name in lora:
            torch.testing.assert_close(param.detach(), lora[name], rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------------------- recipe


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


def test_evaluation_logs_the_harness_metrics_of_each_mode(sft_base, tmp_path):
    from causalqwen_adapter.evaluation import evaluate

    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, per_device_eval_batch_size=3, eval_inference_modes=["compatible", "causal"]),
        train_dataset=_prompt_completion(), eval_dataset=_prompt_completion(),
    )
    metrics = trainer.evaluate()
    expected = evaluate(trainer.model, list(trainer.get_eval_dataloader()), modes=("compatible", "causal"))
    for mode in ("compatible", "causal"):
        for name in ("top1_accuracy", "nll", "target_prob", "prob_sum_median", "ece_top1", "ece_top10", "num_tokens"):
            assert metrics[f"eval_{mode}_{name}"] == pytest.approx(expected[mode][name], rel=1e-6), (mode, name)
    # every completion token after the causal shift (the collator's labels), nothing else
    assert metrics["eval_causal_num_tokens"] == sum(
        (b["labels"][:, 1:] != -100).sum().item() for b in trainer.get_eval_dataloader()
    ) > 0
    with pytest.raises(ValueError, match="eval_inference_modes has unknown mode"):
        _args(tmp_path, eval_inference_modes=["greedy"])


def test_softmax_objective_is_the_cross_entropy_of_loc_S(sft_base, tmp_path):
    trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, objective="softmax"), train_dataset=_prompt_completion())
    model = trainer.model
    assert model.config.objective == "softmax"
    batch = next(iter(trainer.get_train_dataloader()))
    loss = trainer.compute_loss(model, batch)
    with torch.no_grad():
        loc_S = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], inference_mode="compatible").logits
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    keep = targets != -100
    expected = torch.nn.functional.cross_entropy(loc_S[keep].double(), targets[keep])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert model.abduction.loc.weight.grad.abs().sum() > 0
    assert model.abduction.scale.weight.grad is None or model.abduction.scale.weight.grad.abs().sum() == 0


def test_an_adapter_keeps_its_loss_and_distribution_options_unless_asked(sft_base, tmp_path):
    adapter = tmp_path / "softmax-adapter"
    CausalQwenForCausalLM.from_base(sft_base, objective="softmax", softmax_loss_weight=0.5,
                                    ovr_distribution="normalize").save_pretrained(adapter)
    kept = CausalSFTTrainer(str(adapter), args=_args(tmp_path / "a"), train_dataset=_prompt_completion()).model.config
    assert (kept.objective, kept.softmax_loss_weight, kept.ovr_distribution) == ("softmax", 0.5, "normalize")
    args = _args(tmp_path / "b", objective="ovr", ovr_distribution="accept", ovr_candidates=8)
    changed = CausalSFTTrainer(str(adapter), args=args, train_dataset=_prompt_completion()).model.config
    assert (changed.objective, changed.ovr_distribution, changed.ovr_candidates) == ("ovr", "accept", 8)
    assert kept.ovr_candidates == 16
    args = _args(tmp_path / "b0", objective="ovr", ovr_candidates=0)  # 0: the loss over the whole vocabulary
    assert CausalSFTTrainer(str(adapter), args=args, train_dataset=_prompt_completion()).model.config.ovr_candidates is None
    with pytest.raises(ValueError, match="ovr_distribution='sample': choose one of accept, accept_once, normalize"):
        CausalSFTTrainer(str(adapter), args=_args(tmp_path / "c", ovr_distribution="sample"),
                         train_dataset=_prompt_completion())
    # the threshold's reference is part of what the adapter's thresholds mean: fresh heads only
    same = CausalSFTTrainer(str(adapter), args=_args(tmp_path / "d", ovr_relative_threshold=True),
                            train_dataset=_prompt_completion()).model.config
    assert same.ovr_relative_threshold
    with pytest.raises(ValueError, match="ovr_relative_threshold=False but this adapter's thresholds were trained"):
        CausalSFTTrainer(str(adapter), args=_args(tmp_path / "e", ovr_relative_threshold=False),
                         train_dataset=_prompt_completion())
    assert not (tmp_path / "e").exists()


def test_learning_rates_by_role(sft_base, tmp_path):
    args = _args(tmp_path, learning_rate=1e-2, location_lr_ratio=1e-3, threshold_lr_ratio=0.5, learnable_threshold=True)
    trainer = CausalSFTTrainer(str(sft_base), args=args, train_dataset=_prompt_completion())
    optimizer = trainer.create_optimizer()
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    expected = {
        "abduction.loc.weight": 1e-5, "abduction.loc.bias": 1e-5, "action.weight": 1e-5,
        "abduction.scale.weight": 1e-2, "abduction.scale.bias": 1e-2, "action.b_noise": 1e-2,
        "action.bias": 1e-5, "ovr.threshold": 5e-3,
    }
    named = dict(trainer.model.named_parameters())
    assert {n for n, p in named.items() if p.requires_grad} == set(expected)
    for name, lr in expected.items():
        assert lr_of[id(named[name])] == pytest.approx(lr), name
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)  # what the Trainer logs as learning_rate
    trainer.train()  # the scheduler runs on these groups
    assert trainer.state.global_step > 0


def test_fresh_threshold_is_calibrated_on_data_unless_given(sft_base, tmp_path):
    # relative thresholds (the default) start at log ½ by design: nothing to calibrate
    relative = CausalSFTTrainer(str(sft_base), args=_args(tmp_path), train_dataset=_prompt_completion()).model
    assert relative.config.ovr_relative_threshold and relative.ovr.threshold.item() == pytest.approx(math.log(0.5))
    with pytest.raises(ValueError, match="chooses an absolute threshold"):
        calibrate_threshold_on_features(relative, torch.zeros(4, relative.config.hidden_size))
    # absolute thresholds are calibrated on the first training rows
    trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, ovr_relative_threshold=False),
                               train_dataset=_prompt_completion())
    model = trainer.model
    threshold = model.config.ovr_threshold_init
    assert torch.equal(model.ovr.threshold, torch.tensor(threshold))
    # naive reference: the agreement of every candidate threshold, on the same positions
    batches = list(trainer._calibration_batches())
    with torch.no_grad():
        z = torch.cat([
            model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state[
                torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[:, 1:] != -100]
            for b in batches
        ]).double()
        loc_S = z @ model.action.weight.double().T + model.action.bias.double()
        gamma, noise = model.config.gamma_init, model.config.b_noise_init  # uniform scale_U' = γ₀ + |b_noise|
        scale_S = (gamma + abs(noise)) * model.action.weight.double().abs().sum(-1)

        def agreement(c):
            return (((loc_S - c) / scale_S).argmax(-1) == loc_S.argmax(-1)).double().mean().item()

        candidates = torch.quantile(loc_S.max(-1).values, torch.linspace(0, 0.95, 20, dtype=torch.float64)).tolist()
    assert agreement(threshold) == pytest.approx(max(agreement(c) for c in candidates))
    assert agreement(threshold) >= agreement(0.0)
    given = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, ovr_threshold_init=-1.5, ovr_relative_threshold=False),
                             train_dataset=_prompt_completion())
    assert given.model.config.ovr_threshold_init == -1.5 and given.model.ovr.threshold.item() == -1.5


def test_eval_loss_is_the_mean_over_target_tokens(sft_base, tmp_path):
    # completions of different lengths, one row per batch, and a row with nothing to score
    data = Dataset.from_dict({"text": ["hello", "the cat sat on the mat", "", "two plus two is four"]})
    trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, per_device_eval_batch_size=1),
                               train_dataset=data, eval_dataset=data)
    metrics = trainer.evaluate()
    total = count = 0.0
    for batch in trainer.get_eval_dataloader():
        with torch.no_grad():
            loss = trainer.model(**batch).loss.item()
        n = (batch["labels"][:, 1:] != -100).sum().item()
        total, count = total + loss * n, count + n
    assert count > 0
    assert metrics["eval_loss"] == pytest.approx(total / count, rel=1e-5)


def test_precision_and_pinning_follow_the_device(tmp_path):
    args = CausalSFTConfig(str(tmp_path), report_to="none")
    assert args.bf16 == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert args.dataloader_pin_memory == torch.cuda.is_available()
    assert CausalSFTConfig(str(tmp_path), report_to="none", bf16=False, dataloader_pin_memory=False).bf16 is False


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



SCALE_PATH = ["abduction.scale.bias", "abduction.scale.weight", "action.b_noise"]
LOCATION_PATH = ["abduction.loc.bias", "abduction.loc.weight", "action.bias", "action.weight"]
NUM = 100  # <NUM> of the numeric configurations: a row of the tiny vocabulary


@pytest.mark.parametrize(
    "loss, heads, frozen",
    [
        ("sft", {}, []),
        ("sft", {"learnable_threshold": True}, []),
        ("sft", {"objective": "softmax", "learnable_threshold": True}, SCALE_PATH + ["ovr.threshold"]),
        ("sft", {"softmax_loss_weight": 0.0}, LOCATION_PATH),
        ("sft", {"softmax_loss_weight": 0.0, "action_weight": "lora", "action_lora_rank": 4},
         ["abduction.loc.bias", "abduction.loc.weight", "action.bias", "action.lora_A", "action.lora_B"]),
        ("sft", {"softmax_loss_weight": 0.0, "ovr_trains_location": True}, []),
        ("sft", {"numeric": True}, []),
        ("sft", {"numeric": True, "objective": "softmax"}, []),  # the numeric NLL reads the scale path
        ("sft", {"numeric": True, "softmax_loss_weight": 0.0}, ["action.bias", "action.weight"]),  # and loc_U
        ("sft", {"numeric": True, "numeric_loss_weight": 0.0}, ["numeric.bias", "numeric.log_scale", "numeric.weight"]),
        ("distill", {}, LOCATION_PATH),
        ("distill", {"ovr_trains_location": True, "learnable_threshold": True}, []),
    ],
    ids=["ovr", "ovr-learnable-threshold", "softmax", "softmax-weight-0", "softmax-weight-0-lora",
         "softmax-weight-0-ovr-trains-location", "numeric", "numeric-softmax", "numeric-softmax-weight-0",
         "numeric-loss-weight-0", "distill", "distill-ovr-trains-location"],
)
def test_frozen_parameters_are_exactly_those_the_loss_never_reaches(tied_base, loss, heads, frozen):
    """With every head parameter trainable, the loss gives the frozen ones no gradient (None or exact zeros) on any
    batch, and every other one a non-zero gradient on a batch that holds a <NUM> target; freezing them leaves the
    loss and the other gradients as they were."""
    if heads.get("numeric"):
        heads = {**heads, "num_token_id": NUM}
    model = CausalQwenForCausalLM.from_base(str(tied_base), gamma_init=0.5, b_noise_init=0.1, **heads)
    with torch.no_grad():
        if model.config.action_weight == "lora":
            model.action.lora_B.normal_(std=0.01)  # B = 0 at init gives A a zero gradient
        if model.config.learnable_threshold:
            model.ovr.threshold.normal_(std=0.5)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, NUM, (2, 9), generator=generator)
    ids[0, 4] = ids[0, 6] = NUM  # the second one's value is a target whose position sees the first one's input
    values = torch.zeros(ids.shape).masked_fill_(ids == NUM, 12.0)
    features = {"hidden_state": torch.randn(6, model.config.hidden_size, generator=generator),
                "topk_ids": torch.randint(0, NUM, (6, 4), generator=generator),
                "topk_probs": torch.rand(6, 4, generator=generator).softmax(-1)}

    def grads(with_number: bool):
        model.zero_grad(set_to_none=True)
        if loss == "distill":
            out = model(**features)
        else:
            batch = ids if with_number else ids.masked_fill(ids == NUM, 7)
            extra = {"numeric_values": values * (batch == NUM)} if model.config.numeric else {}
            out = model(input_ids=batch, labels=batch, **extra)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    assert sorted(unreachable_parameters(model, loss)) == sorted(frozen)
    for with_number in (True, False):
        _, all_grads = grads(with_number)
        for name in frozen:
            assert all_grads[name] is None or not all_grads[name].any(), name
    full_loss, all_grads = grads(True)
    for name, grad in all_grads.items():
        if name not in frozen:
            assert grad is not None and grad.any(), name
    assert sorted(freeze_unreachable_parameters(model, loss)) == sorted(frozen)
    frozen_loss, kept = grads(True)
    assert set(kept) == set(all_grads) - set(frozen)
    torch.testing.assert_close(frozen_loss, full_loss, rtol=1e-6, atol=0)
    for name, grad in kept.items():
        torch.testing.assert_close(grad, all_grads[name], rtol=1e-5, atol=1e-8, msg=name)


def test_ddp_step_matches_one_process_in_every_loss_configuration(sft_base, tmp_path):
    """Two CPU processes (gloo DDP, with the trainer's own find_unused_parameters) for each objective,
    softmax_loss_weight=0 and numeric heads: every step runs, and the heads equal one process accumulating the same
    two micro-batches (tests/ddp_worker.py)."""
    import ddp_worker
    from conftest import run_processes

    names = list(ddp_worker.CONFIGURATIONS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    results = run_processes(
        [([sys.executable, str(REPO_ROOT / "tests" / "ddp_worker.py"), str(sft_base), str(tmp_path), *names],
          {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(2)],
        cwd=REPO_ROOT, timeout=300, what="the DDP processes",
    )
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank}:\n{out[-2000:]}\n{err[-4000:]}"
    for name in names:
        ddp = torch.load(tmp_path / f"{name}.pt")
        single = ddp_worker.build(sft_base, tmp_path / f"{name}-single", name, gradient_accumulation_steps=2)
        single.train()
        reference = ddp_worker.result(single)
        assert ddp["find_unused"] == (name == "numeric"), name
        assert ddp["trainable"] == reference["trainable"], name
        assert sorted(ddp["losses"]) == sorted(reference["losses"]) == [1, 2], name
        for step, loss in reference["losses"].items():
            assert ddp["losses"][step] == pytest.approx(loss, rel=1e-5), (name, step)
        for key, value in reference["heads"].items():
            # Adam divides by √v: float rounding of the all-reduce shows up at 1e-6 relative in the smallest updates
            torch.testing.assert_close(ddp["heads"][key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")


def test_learnable_absolute_thresholds_are_calibrated_in_place(sft_base, tmp_path):
    # one learnable threshold per token: the calibration fills the parameter (a leaf) without recording a graph
    trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, ovr_relative_threshold=False, learnable_threshold=True),
                               train_dataset=_prompt_completion())
    threshold = trainer.model.ovr.threshold
    assert isinstance(threshold, torch.nn.Parameter) and threshold.requires_grad and threshold.grad_fn is None
    assert torch.equal(threshold, torch.full_like(threshold, trainer.model.config.ovr_threshold_init))
