"""A backbone LoRA (lora/) is checked like the heads: never saved, loaded or pushed holding NaN, never pushed half."""

import shutil

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.adapter_io import LORA_WEIGHTS_NAME
from causalqwen_adapter.cli.push import adapter_files


@pytest.fixture
def with_lora(tied_base, tmp_path):
    model = CausalQwenForCausalLM.from_base(tied_base)
    model.model.add_adapter(peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    folder = tmp_path / "adapter"
    model.save_pretrained(folder)
    return model, folder


def _lora_parameters(model):
    return [p for name, p in model.model.named_parameters() if "lora_" in name]


def test_a_nan_lora_is_never_saved_over_a_good_one(with_lora):
    model, folder = with_lora
    good = (folder / "lora" / LORA_WEIGHTS_NAME).read_bytes()
    with torch.no_grad():
        _lora_parameters(model)[0][0, 0] = float("nan")
    with pytest.raises(ValueError, match="backbone LoRA tensors .* NaN or infinite.*not saved"):
        model.save_pretrained(folder)
    assert (folder / "lora" / LORA_WEIGHTS_NAME).read_bytes() == good
    assert not list(folder.parent.glob(".adapter.*"))  # no staging folder left behind
    CausalQwenForCausalLM.from_pretrained(folder)  # the folder loads as before


def _poison(folder):
    path = folder / "lora" / LORA_WEIGHTS_NAME
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("inf")
    save_file(tensors, path, metadata={"format": "pt"})
    return name


def test_a_nan_lora_is_refused_at_load_and_push(with_lora, tmp_path):
    _, folder = with_lora
    name = _poison(folder)
    with pytest.raises(ValueError, match=rf"lora/{LORA_WEIGHTS_NAME}: \['{name}'\] hold NaN or infinite"):
        CausalQwenForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match="NaN or infinite values; save a healthy adapter"):
        adapter_files(folder)


def test_a_lora_without_weights_is_refused_at_load_and_push(with_lora):
    _, folder = with_lora
    (folder / "lora" / LORA_WEIGHTS_NAME).unlink()
    with pytest.raises(OSError, match="adapter_config.json but no adapter_model.safetensors"):
        CausalQwenForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"lacks \['adapter_model.safetensors'\]"):
        adapter_files(folder)
    shutil.rmtree(folder / "lora")
    assert "config.json" in adapter_files(folder)  # without lora/ at all it is a plain adapter
