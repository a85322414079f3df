"""What an adapter folder holds is checked before it is used: a backbone LoRA (lora/) never saved, loaded or pushed
holding NaN or half; weights whose header does not fit config.json, or that cannot be read, refused by name."""

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


@pytest.mark.parametrize("causal_size", [2**34, 8])
def test_a_config_that_does_not_fit_the_weights_is_refused_from_the_header(tied_base, tmp_path, monkeypatch, causal_size):
    """causal_size edited in config.json: refused from the file's header, before the base loads or a head is built."""
    import json

    import causalqwen_adapter.adapter_io as adapter_io

    folder = tmp_path / "adapter"
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["causal_size"] = causal_size
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(adapter_io, "load_backbone", lambda *a, **k: pytest.fail("the base was loaded"))
    with pytest.raises(ValueError, match=rf"config.json expects .*causal_size {causal_size}.*do not belong together"):
        CausalQwenForCausalLM.from_pretrained(folder)


def test_an_unreadable_adapter_file_says_so(tied_base, tmp_path, monkeypatch):
    """A file of mode 0600 owned by another user (os.access answers as for that user; the tests run as root)."""
    import os

    folder = tmp_path / "adapter"
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(folder)
    weights = str(folder / "model.safetensors")
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == weights else access(path, mode))
    with pytest.raises(PermissionError, match="permission denied .*chmod a\\+r"):
        CausalQwenForCausalLM.from_pretrained(folder)


def test_push_of_a_folder_a_save_was_killed_in_names_where_the_old_files_are(tied_base, tmp_path):
    from conftest import kill_save_mid_swap

    folder = tmp_path / "old"
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(folder)
    kill_save_mid_swap(tied_base, folder)
    with pytest.raises(ValueError, match=r"interrupted while swapping.*\.old\.[a-z0-9_]{8}\.old.*move them back"):
        adapter_files(folder)


def test_push_refuses_weights_that_do_not_fit_their_config(tied_base, tmp_path):
    """The loader's header check, before any request: a repo pushed so could not be loaded by anyone."""
    import json

    folder = tmp_path / "adapter"
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["causal_size"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json expects .*do not belong together"):
        adapter_files(folder)
