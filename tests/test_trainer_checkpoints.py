"""CausalSFTTrainer's checkpoints and saves on a tiny random Qwen2 with a tiny word-level tokenizer.

The reference for resuming is an uninterrupted run: a resumed run continues it exactly; checkpoints and saves hold
only the adapter's tensors and load back as they were trained, backbone LoRA included.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.tokenization_causalqwen import TOKENIZER_CONFIG
from causalqwen_adapter.trainer import CausalSFTTrainer

from conftest import modes_not_plain
from trainer_helpers import _args, _heads, _losses, _prompt_completion


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
