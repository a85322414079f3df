"""The adapter's model card (causalqwen_adapter/model_card.py): its metadata, snippet and training record, what it
says of fresh heads on a local base, and that writing it never fails a save.
"""

import json
import shutil
import sys

import huggingface_hub
import huggingface_hub._upload_pipeline
import pytest
import torch

import causalqwen_adapter.model_card as model_card
from causalqwen_adapter import CausalQwenForCausalLM

from fake_hub import BASE_ID, _card


def test_card_metadata_snippet_and_training_record(trained, tmp_path):
    trained.save_pretrained(tmp_path / "my-adapter")
    text = (tmp_path / "my-adapter" / "README.md").read_text()
    meta, body = _card(text)
    assert meta["base_model"] == BASE_ID and meta["base_model_relation"] == "adapter"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"causalqwen", "ovr", "cauchy"} <= set(meta["tags"])
    assert meta["license"] == "apache-2.0"  # carried from the base's card (in the Hub cache)
    assert meta["datasets"] == ["someone/tiny-corpus"]
    assert body.startswith("\n# my-adapter\n")
    assert 'AutoModelForCausalLM.from_pretrained("my-adapter", trust_remote_code=True)' in body
    assert 'AutoTokenizer.from_pretrained("my-adapter", trust_remote_code=True)' in body  # the base's, by pointer
    for mode in ("compatible", "standard", "sampling", "causal"):
        assert f"| `{mode}` |" in body
    assert "| learning_rate | 0.0002 |" in body and "| train_loss | 1.23457 |" in body
    weights = tmp_path / "my-adapter" / "model.safetensors"
    parameters = sum(v.numel() for v in trained.adapter_state_dict().values())
    assert f"| adapter tensors | {parameters:,} parameters (float32), `model.safetensors` " in body
    assert f"({weights.stat().st_size:,} bytes) |" in body
    assert f"- torch {torch.__version__}" in body and f"- huggingface_hub {huggingface_hub.__version__}" in body
    trained.save_pretrained(tmp_path / "my-adapter")
    assert (tmp_path / "my-adapter" / "README.md").read_text() == text  # deterministic: no dates, no paths


def test_card_of_fresh_heads_on_a_local_base(tied_base, tmp_path):
    base = tmp_path / "local-base"
    shutil.copytree(tied_base, base)
    (base / "README.md").write_text("---\nlicense: mit\n---\n# a local base\n")
    CausalQwenForCausalLM.from_base(base).save_pretrained(tmp_path / "adapter")
    meta, body = _card((tmp_path / "adapter" / "README.md").read_text())
    assert "base_model" not in meta and "base_model_relation" not in meta  # the Hub accepts Hub ids only
    assert meta["license"] == "mit" and "datasets" not in meta
    assert 'AutoTokenizer.from_pretrained("adapter", trust_remote_code=True)' in body and "## Training" not in body
    # the card reads the head fields from the config it is saved with
    assert "| OvR threshold | -0.6931 (fixed), relative: compared with log softmax(loc_S) |" in body and "| initial scale γ₀ / `b_noise` | 0.005 / 0.01 |" in body
    assert ("| training loss | OvR over each position's 16 most likely tokens and the target + 1.0 × the softmax "
            "cross-entropy of loc_S |") in body
    # the default acceptance (accept_once), the vocabulary's size, what it is for and what it needs
    assert "(`ovr_distribution=\"accept_once\"`)" in body and "replaced once by a fresh draw" in body
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    assert f"scores `S` over the {vocab}-entry vocabulary" in body
    assert "## Intended use and limitations" in body and "they tie an ordinary softmax head" in body
    url = model_card._project_url()  # the package's metadata has none yet: the card names it without a dead link
    assert "Requires `transformers>=5.20,<5.25`" in body
    assert ("Made with `causalqwen-adapter`" if url is None else f"[causalqwen-adapter]({url})") in body
    assert model_card.LOCAL_BASE_NOTE in body
    for choice, text in (("normalize", "(`ovr_distribution=\"normalize\"`) the returned `logits` are `log P_k`"),
                         ("accept", "(`ovr_distribution=\"accept\"`) the returned `logits` are `loc_S + log P_k`")):
        CausalQwenForCausalLM.from_base(base, ovr_distribution=choice, gamma_init=0.5).save_pretrained(tmp_path / choice)
        _, body = _card((tmp_path / choice / "README.md").read_text())
        assert text in body and "0.5 / 0.01" in body


def test_a_local_data_file_is_never_card_metadata(trained, tmp_path):
    """A training file's name (`data/train.jsonl` reads as a repo id) stays in the training record, out of the
    `datasets:` metadata the Hub links to dataset repos."""
    trained.training_summary = {**trained.training_summary, "datasets": ["data/train.jsonl", "someone/tiny-corpus"]}
    trained.save_pretrained(tmp_path / "a")
    meta, body = _card((tmp_path / "a" / "README.md").read_text())
    assert meta["datasets"] == ["someone/tiny-corpus"] and "`data/train.jsonl`" in body


@pytest.mark.parametrize("problem", ["no template", "no jinja2", "render error"])
def test_the_card_never_fails_a_save(tied_base, tmp_path, monkeypatch, caplog, problem):
    fresh = CausalQwenForCausalLM.from_base(tied_base)
    fresh.save_pretrained(tmp_path / "first")
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "first")
    if problem == "no template":  # what a model loaded as remote code sees: transformers copies only .py files
        monkeypatch.setattr(model_card, "TEMPLATE_NAME", "absent.md.j2")
    elif problem == "no jinja2":  # huggingface_hub renders with jinja2 but does not depend on it
        monkeypatch.setitem(sys.modules, "jinja2", None)
    else:
        monkeypatch.setattr(model_card, "_safetensors_summary", lambda path: 1 / 0)

    fresh.save_pretrained(tmp_path / "fresh")
    assert (tmp_path / "fresh" / "config.json").exists() and not (tmp_path / "fresh" / "README.md").exists()
    assert "saved without a model card" in caplog.text

    loaded.save_pretrained(tmp_path / "again")
    card = (tmp_path / "again" / "README.md")
    if problem == "render error":
        assert not card.exists()
    else:  # keeps the card it was loaded with, naming its new folder
        first = (tmp_path / "first" / "README.md").read_text()
        assert card.read_text() == model_card.retarget_model_card(first, "again")


def test_card_written_before_the_weights_counts_the_model(trained, tmp_path):
    """The trainer writes the card into output_dir at each checkpoint, before output_dir holds any weights."""
    (tmp_path / "output").mkdir()
    model_card.write_model_card(trained, tmp_path / "output")
    _, body = _card((tmp_path / "output" / "README.md").read_text())
    parameters = sum(v.numel() for v in trained.adapter_state_dict().values())
    assert f"| adapter tensors | {parameters:,} parameters (float32) |" in body
    assert body.startswith("\n# output\n") and "| train_loss | 1.23457 |" in body


def test_retarget_model_card_changes_only_the_names():
    text = ('---\ntags: [x]\n---\n\n# run-3\n\nAutoModelForCausalLM.from_pretrained("run-3", trust_remote_code=True)\n'
            'AutoTokenizer.from_pretrained("run-3")\n')
    out = model_card.retarget_model_card(text, "user/run-3")
    assert out == text.replace("# run-3", "# user/run-3").replace('"run-3", trust', '"user/run-3", trust')
    assert model_card.retarget_model_card("# a card of someone else\n", "user/x") == "# a card of someone else\n"
