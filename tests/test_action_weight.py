"""Compact action weights (config `action_weight`): "full", "tied" (the base's own tensor), "lora"."""

import pytest
import torch
from safetensors import safe_open
from test_adapter_io import REMOTE_SCRIPT, _run_isolated
from transformers import Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM

from conftest import TINY_HIDDEN, TINY_VOCAB

HEAD_KEYS = {"abduction.loc.weight", "abduction.loc.bias", "abduction.scale.weight", "abduction.scale.bias",
             "action.bias", "action.b_noise"}
SAVED = {"full": HEAD_KEYS | {"action.weight"}, "tied": HEAD_KEYS,
         "lora": HEAD_KEYS | {"action.lora_A", "action.lora_B"}}


def _base_output_weight(model):
    return model.model.embed_tokens.weight if model.config.text_config.tie_word_embeddings else model.lm_head.weight


@pytest.mark.parametrize("action_weight", ["full", "tied", "lora"])
def test_loc_S_equals_base_logits_at_init(tiny_base, input_ids, action_weight):
    base = Qwen2ForCausalLM.from_pretrained(tiny_base).eval()
    model = CausalQwenForCausalLM.from_base(tiny_base, action_weight=action_weight).eval()
    with torch.no_grad():
        diff = (model(input_ids, inference_mode="compatible").loc_S - base(input_ids).logits).abs().max()
    assert diff.item() <= 1e-5


@pytest.mark.parametrize("action_weight", ["tied", "lora"])
def test_round_trip_saves_only_the_compact_tensors(tiny_base, tmp_path, input_ids, action_weight):
    model = CausalQwenForCausalLM.from_base(tiny_base, action_weight=action_weight, action_lora_rank=4)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(tmp_path / "adapter")
    with safe_open(tmp_path / "adapter" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == SAVED[action_weight]
        if action_weight == "lora":
            assert f.get_slice("action.lora_B").get_shape() == [TINY_VOCAB, 4]
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")
    # the base's output weights are used in place: no vocabulary-sized copy for "tied"
    if action_weight == "tied":
        assert loaded.action.effective_weight().data_ptr() == _base_output_weight(loaded).data_ptr()
    model.eval()
    with torch.no_grad():
        a, b = model(input_ids), loaded(input_ids)
    for key in ("logits", "loc_S", "scale_S"):
        assert torch.equal(a[key], b[key]), key

    torch.save(input_ids, tmp_path / "ids.pt")
    proc = _run_isolated(REMOTE_SCRIPT, tmp_path / "adapter", tmp_path / "ids.pt", tmp_path / "out.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "out.pt")["lm"]["loc_S"], a["loc_S"])


@pytest.mark.parametrize("action_weight", ["tied", "lora"])
def test_trains_without_touching_the_base(tied_base, input_ids, action_weight):
    model = CausalQwenForCausalLM.from_base(tied_base, action_weight=action_weight)
    base_weight = _base_output_weight(model).detach().clone()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(input_ids, labels=input_ids).loss
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0]
    assert torch.equal(_base_output_weight(model), base_weight)
    if action_weight == "lora":
        assert model.action.lora_B.abs().sum() > 0  # the low-rank update moved W_A
        torch.testing.assert_close(model.action.effective_weight(),
                                   base_weight + model.action.lora_B @ model.action.lora_A)


def test_compact_weights_need_causal_size_equal_hidden(tied_base):
    with pytest.raises(ValueError, match=f"causal_size must equal the hidden size {TINY_HIDDEN}"):
        CausalQwenForCausalLM.from_base(tied_base, action_weight="tied", causal_size=8)
    with pytest.raises(ValueError, match="choose one of full, tied, lora"):
        CausalQwenForCausalLM.from_base(tied_base, action_weight="shared")
