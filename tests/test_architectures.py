"""Causal heads on every supported base architecture, each against the base model itself: Llama (tied, like SmolLM2),
Mistral (sliding window), Qwen3, Gemma 3 text (sliding-window and global layers: a hybrid cache) and Phi-3, as tiny
random checkpoints; and the bases the heads refuse (an encoder, an encoder-decoder, a multimodal model, logits that
are not the output layer's)."""

import json
import textwrap

import pytest
import torch
from datasets import Dataset
from test_adapter_io import _run_isolated
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlavaConfig,
    MistralConfig,
    MptConfig,
    MptForCausalLM,
    Phi3Config,
    Qwen3Config,
    T5Config,
    T5ForConditionalGeneration,
)

from causalqwen_adapter import CausalQwenConfig, CausalQwenForCausalLM
from causalqwen_adapter.features import extract_features
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

from conftest import PAIRS, tiny_tokenizer

VOCAB = 160
LAYOUT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=None)
# Prompts longer than the sliding windows (4), so that generation runs past them with the KV cache.
CONFIGS = {
    "llama": lambda: LlamaConfig(**LAYOUT, tie_word_embeddings=True),  # SmolLM2's layout
    "mistral": lambda: MistralConfig(**LAYOUT, sliding_window=4, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**LAYOUT, head_dim=8, tie_word_embeddings=False),
    "gemma3_text": lambda: Gemma3TextConfig(
        **LAYOUT, head_dim=8, sliding_window=4, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "phi3": lambda: Phi3Config(**LAYOUT, tie_word_embeddings=False),
}
ARCHITECTURES = list(CONFIGS)
TIED = ["llama", "gemma3_text"]
MODES = ["compatible", "standard", "sampling", "causal"]


def _save_base(folder, config):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    if not config.tie_word_embeddings:  # an output layer of its own, so that a mix-up with the embedding shows
        with torch.no_grad():
            base.get_output_embeddings().weight.normal_(std=0.05)
    base.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)  # for the trainer; its ids fit every vocabulary here
    return folder


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    return {name: _save_base(root / name, make()) for name, make in CONFIGS.items()}


@pytest.fixture
def prompt():
    return torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def _base(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _perturbed(model):
    """Heads moved away from their initialisation (B ≠ 0 for a "lora" W_A), so that a load that re-initialises, or
    an OvR mode that ignores the scales, would show."""
    torch.manual_seed(5)
    with torch.no_grad():
        model.abduction.scale.weight.normal_(std=0.2)
        model.abduction.loc.bias.normal_(std=0.01)
        model.action.b_noise.uniform_(0.0, 2.0)
        if model.config.action_weight == "lora":
            model.action.lora_B.normal_(std=0.02)
    return model.eval()


def _outputs(model, ids):
    with torch.no_grad():
        out = model(ids)
    return {k: out[k] for k in ("logits", "loc_U", "scale_U", "loc_S", "scale_S")}


# --------------------------------------------------------------------------------------- each architecture


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fresh_heads_are_the_base(bases, arch, prompt):
    """loc_S is the base's logits, and `compatible` greedy decoding with the KV cache is the base's, token for token,
    past the sliding windows."""
    base = _base(bases[arch])
    model = CausalQwenForCausalLM.from_base(bases[arch]).eval()
    assert type(model.model) is type(base.base_model) and type(model.config.text_config) is type(base.config)
    assert model._no_split_modules == set(base._no_split_modules) and model._no_split_modules
    with torch.no_grad():
        torch.testing.assert_close(model(prompt, inference_mode="compatible").logits, base(prompt).logits)
    report = model.verify_initialization(prompt, base_model=base)
    assert report["feature_diff"] < 1e-6 and report["logits_diff"] < 1e-6, report
    expected = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         inference_mode="compatible")
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_mode_generates_the_same_with_the_kv_cache(bases, arch, prompt):
    """Each inference mode's greedy tokens and scores with the base's own cache (sliding, hybrid) equal those of a
    full recomputation at every step."""
    model = _perturbed(CausalQwenForCausalLM.from_base(bases[arch]))
    for mode in MODES:
        runs = []
        for use_cache in (True, False):
            torch.manual_seed(0)  # the sampling mode's ε, one per sequence
            runs.append(model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                       do_sample=False, inference_mode=mode, use_cache=use_cache, output_scores=True,
                                       return_dict_in_generate=True,
                                       **({"noise_sharing": "sequence"} if mode == "sampling" else {})))
        assert torch.equal(runs[0].sequences, runs[1].sequences), mode
        torch.testing.assert_close(torch.stack(runs[0].scores), torch.stack(runs[1].scores), msg=mode)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_save_and_load_round_trip(bases, arch, prompt, tmp_path):
    model = _perturbed(CausalQwenForCausalLM.from_base(bases[arch]))
    model.save_pretrained(tmp_path / "adapter")
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")
    assert loaded.config.text_config.model_type == arch
    before, after = _outputs(model, prompt), _outputs(loaded, prompt)
    for key in before:
        assert torch.equal(before[key], after[key]), key


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["causalqwen_adapter"] = None  # any import of the package now fails
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    *adapters, ids, out = sys.argv[1:]
    ids, results = torch.load(ids), {}
    for adapter in adapters:
        lm = AutoModelForCausalLM.from_pretrained(adapter, trust_remote_code=True)
        bare = AutoModel.from_pretrained(adapter, trust_remote_code=True)
        assert type(lm).__module__.startswith("transformers_modules"), type(lm).__module__
        with torch.no_grad():
            a, b = lm(ids), bare(ids)
        generated = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                inference_mode="standard")
        results[adapter] = {"lm": {k: a[k] for k in ("logits", "loc_S", "scale_S")}, "model": b.loc_S,
                            "generated": generated, "backbone": type(bare.model).__name__}
    torch.save(results, out)
    """
)


def test_remote_code_loads_every_architecture_without_the_package(bases, prompt, tmp_path):
    """The adapter folders loaded by plain transformers (AutoModelForCausalLM and AutoModel, trust_remote_code) in a
    process where the package cannot be imported: the same scores and the same generated tokens."""
    models, folders = {}, []
    for arch in ARCHITECTURES:
        models[arch] = _perturbed(CausalQwenForCausalLM.from_base(bases[arch]))
        folders.append(tmp_path / arch)
        models[arch].save_pretrained(folders[-1])
    torch.save(prompt, tmp_path / "ids.pt")
    proc = _run_isolated(REMOTE_SCRIPT, *folders, tmp_path / "ids.pt", tmp_path / "out.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    for arch, folder in zip(ARCHITECTURES, folders):
        remote, model = got[str(folder)], models[arch]
        assert remote["backbone"] == type(model.model).__name__
        for key, value in _outputs(model, prompt).items():
            if key in remote["lm"]:
                assert torch.equal(remote["lm"][key], value), (arch, key)
        assert torch.equal(remote["model"], remote["lm"]["loc_S"]), arch
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                  inference_mode="standard")
        assert torch.equal(remote["generated"], expected), arch


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_one_training_step(bases, arch, tmp_path):
    """CausalSFTTrainer from the base's folder: the step's loss is the model's own loss on the batch (the whole
    data set in one batch), the heads move and the backbone does not."""
    data = Dataset.from_dict({"prompt": [p for p, _ in PAIRS], "completion": [c for _, c in PAIRS]})
    args = CausalSFTConfig(str(tmp_path), bf16=False, use_cpu=True, report_to="none", logging_steps=1,
                           save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, max_steps=1,
                           per_device_train_batch_size=len(PAIRS), learning_rate=1e-2, seed=0)
    trainer = CausalSFTTrainer(str(bases[arch]), args=args, train_dataset=data)
    model = trainer.model
    assert type(model.model).__name__ == type(_base(bases[arch]).base_model).__name__
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        expected = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss.item()
    heads = {k: v.clone() for k, v in model.adapter_state_dict().items()}
    backbone = {k: v.clone() for k, v in model.model.state_dict().items()}
    trainer.train()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert loss == [pytest.approx(expected, rel=1e-5)]
    assert any(not torch.equal(v, heads[k]) for k, v in model.adapter_state_dict().items())
    assert all(torch.equal(v, backbone[k]) for k, v in model.model.state_dict().items())


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("action_weight", ["tied", "lora"])
def test_tied_and_lora_action_weights(bases, arch, action_weight, prompt, tmp_path):
    """W_A read from the base's own output layer (the input embedding on a tied base): the base at init, never saved,
    and the same after a round trip."""
    base = _base(bases[arch])
    model = CausalQwenForCausalLM.from_base(bases[arch], action_weight=action_weight, action_lora_rank=4).eval()
    owner = model.model.get_input_embeddings() if arch in TIED else model.lm_head
    assert model.action._base_owner is owner
    if arch in TIED:
        assert "lm_head" not in dict(model.named_children())
    with torch.no_grad():
        torch.testing.assert_close(model(prompt, inference_mode="compatible").logits, base(prompt).logits)
        assert torch.equal(model.action.effective_weight(), base.get_output_embeddings().weight)
    model = _perturbed(model)
    model.save_pretrained(tmp_path / "adapter")
    assert not any(k.startswith("action.weight") for k in model.adapter_state_dict())
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")
    before, after = _outputs(model, prompt), _outputs(loaded, prompt)
    for key in before:
        assert torch.equal(before[key], after[key]), key


@pytest.mark.parametrize("arch", ["gemma3_text", "phi3"])
def test_features_of_any_base(bases, arch, tmp_path):
    """Distillation's teacher is the base of any architecture: the stored z is its final hidden state and the
    stored top-K its softmax, sequence by sequence."""
    sequences = [[5, 9, 17, 3, 44, 60, 2, 8], [7, 8], [100, 101, 102, 103, 104]]
    store = extract_features(str(bases[arch]), Dataset.from_dict({"input_ids": sequences}), tmp_path / "store",
                             top_k=5, batch_size=2, dtype=torch.float32).with_format("torch")
    base = _base(bases[arch])
    rows = iter(store)
    for seq in sequences:
        with torch.no_grad():
            out = base(torch.tensor([seq]), output_hidden_states=True)
        probs, ids = torch.softmax(out.logits[0], -1).topk(5, -1)
        for position in range(len(seq)):
            row = next(rows)
            torch.testing.assert_close(row["hidden_state"], out.hidden_states[-1][0, position])
            assert torch.equal(row["topk_ids"], ids[position].int())
            torch.testing.assert_close(row["topk_probs"], probs[position])


def test_numbers_on_a_scaled_embedding(bases, prompt):
    """Gemma scales its input embedding by √H inside the embedding module: <NUM> values of 0 leave the base's input
    exactly, through the backbone's own embedding."""
    model = CausalQwenForCausalLM.from_base(bases["gemma3_text"], numeric=True, num_token_id=VOCAB - 1).eval()
    prompt = prompt.clone()
    prompt[:, 3] = VOCAB - 1  # a <NUM> token: values count there only
    with torch.no_grad():
        plain = model(prompt)
        zeros = model(prompt, numeric_values=torch.zeros(prompt.shape))
        values = torch.zeros(prompt.shape)
        values[:, 3] = 12.5
        moved = model(prompt, numeric_values=values)
    assert torch.equal(plain.loc_S, zeros.loc_S)
    assert not torch.equal(plain.loc_S[:, 3:], moved.loc_S[:, 3:]) and torch.equal(plain.loc_S[:, :3], moved.loc_S[:, :3])


def test_numbers_need_a_free_row_outside_qwen2(bases):
    """Only Qwen2's vocabulary is known to keep unused rows; Qwen3's has the same size but uses them."""
    with pytest.raises(ValueError, match="numeric=True needs num_token_id on this 'llama' base: no row of its 160-token"):
        CausalQwenForCausalLM.from_base(bases["llama"], numeric=True)
    qwen3 = Qwen3Config(vocab_size=151936, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2)
    with pytest.raises(ValueError, match="resize the base's embeddings yourself"):
        CausalQwenConfig(text_config=qwen3, numeric=True)
    assert CausalQwenConfig(text_config=qwen3, numeric=True, num_token_id=151935).num_token_id == 151935


def test_the_numeric_recipe_refuses_a_base_whose_tokenizer_fills_its_vocabulary(tmp_path):
    """SmolLM2's case: 49,152 tokens for 49,152 rows, no row to give <NUM>. Refused before anything is written."""
    full = _save_base(tmp_path / "full-vocab", LlamaConfig(**{**LAYOUT, "vocab_size": len(tiny_tokenizer())}))
    from causalqwen_adapter.cli import train as recipe

    data = tmp_path / "numbers.jsonl"
    data.write_text(json.dumps({"text": "the cat sat on 3 mats"}) + "\n")
    out = tmp_path / "out"
    parsed = recipe.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", str(full), "--dataset_name", str(data), "--output_dir", str(out), "--numeric",
        "--max_steps", "1", "--report_to", "none", "--use_cpu", "true",
    ])
    rows = len(tiny_tokenizer())
    with pytest.raises(ValueError, match=f"tokenizer has {rows} tokens for its {rows}-row embedding, so no row is free. "
                                         "Pass --num_token_id"):
        recipe.run(*parsed)
    assert not out.exists()


# --------------------------------------------------------------------------------------- refused


def _save(model, folder):
    model.save_pretrained(folder)
    return folder


def test_an_encoder_is_refused(tmp_path):
    bert = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32))
    folder = _save(bert, tmp_path / "bert")
    for base in (folder, bert):
        with pytest.raises(ValueError, match=r"is a 'bert' checkpoint .*an encoder .bidirectional attention.: "
                                             "CausalQwen heads attach to decoder-only causal LMs"):
            CausalQwenForCausalLM.from_base(base)


def test_an_encoder_decoder_is_refused(tmp_path):
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=1,
                                             num_heads=2, decoder_start_token_id=0))
    with pytest.raises(ValueError, match="is a 't5' checkpoint .*an encoder-decoder model: CausalQwen heads attach"):
        CausalQwenForCausalLM.from_base(_save(t5, tmp_path / "t5"))


def test_a_vision_language_model_is_refused(tmp_path):
    LlavaConfig().save_pretrained(tmp_path / "llava")  # refused from its config: no weight is read
    with pytest.raises(ValueError, match="is a 'llava' checkpoint.*a composite model .vision-language.*text_config"):
        CausalQwenForCausalLM.from_base(tmp_path / "llava")


def test_soft_capped_logits_are_refused(tmp_path, bases):
    layout = {k: v for k, v in LAYOUT.items() if k != "num_hidden_layers"}
    capped = Gemma2ForCausalLM(Gemma2Config(**layout, num_hidden_layers=1, head_dim=8, final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="has final_logit_softcapping=30.0: its forward soft-caps its logits"):
        CausalQwenForCausalLM.from_base(_save(capped, tmp_path / "gemma2"))
    gemma3 = CONFIGS["gemma3_text"]()
    gemma3.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="'gemma3_text' checkpoint .* has final_logit_softcapping=30.0"):
        CausalQwenForCausalLM.from_base(_save(AutoModelForCausalLM.from_config(gemma3), tmp_path / "gemma3"))
    assert CONFIGS["gemma3_text"]().final_logit_softcapping is None  # Gemma 3's default: not capped, accepted above


def test_a_config_field_the_base_never_applies_is_not_refused():
    """transformers' MPT keeps `logit_scale` in its config but never applies it: its logits are lm_head(z)."""
    torch.manual_seed(0)
    mpt = MptForCausalLM(MptConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                                   logit_scale=0.25)).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        loc_S = CausalQwenForCausalLM.from_base(mpt).eval()(ids, inference_mode="compatible").loc_S
        logits = mpt(ids).logits
    torch.testing.assert_close(loc_S, logits, rtol=0, atol=1e-5)


def test_logits_that_are_not_the_output_layer_are_refused(bases):
    """What no config field names: a layer after the output layer, or a forward that changes its result."""
    base = _base(bases["mistral"])
    base.lm_head = nn.Sequential(base.lm_head, nn.LayerNorm(VOCAB))
    with pytest.raises(ValueError, match=r"its output layer is a Sequential with weight None, not one \[vocab × hidden\]"):
        CausalQwenForCausalLM.from_base(base)

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5

    base = _base(bases["mistral"])
    scaled = Scaled(32, VOCAB, bias=False)
    scaled.weight = base.lm_head.weight
    base.lm_head = scaled
    with pytest.raises(ValueError, match="its logits are not its output layer applied to the final hidden state"):
        CausalQwenForCausalLM.from_base(base)


def test_a_base_of_another_architecture_or_vocabulary_is_refused_at_load(bases, tmp_path):
    """Same hidden size, same vocabulary, another architecture: refused before any weight is read."""
    CausalQwenForCausalLM.from_base(bases["mistral"]).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="is a 'qwen3' model, the adapter was built on a 'mistral' base"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter", base_model=bases["qwen3"])
    with pytest.raises(ValueError, match="is a 'qwen3' model, the adapter was built on a 'mistral' base"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter", base_model=_base(bases["qwen3"]))
    other = _save_base(tmp_path / "wide-vocab", MistralConfig(**{**LAYOUT, "vocab_size": 192}, sliding_window=4))
    with pytest.raises(ValueError, match="has vocab_size 192, the adapter expects 160"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter", base_model=other)
