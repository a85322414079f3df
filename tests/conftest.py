"""Shared fixtures: tiny random Qwen2 checkpoints saved to disk, and the real demo base when built."""

import os
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_BASE = Path(os.environ.get("CAUSALQWEN_DEMO_BASE", REPO_ROOT / "build" / "demo-base"))

TINY_VOCAB = 128
TINY_HIDDEN = 32


def tiny_qwen2_config(**overrides) -> Qwen2Config:
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=TINY_VOCAB - 1,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def save_tiny_qwen2(folder: Path, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**overrides)).eval()
    if not model.config.tie_word_embeddings:
        # untied: give lm_head values of its own so a mix-up with the embedding would show
        with torch.no_grad():
            model.lm_head.weight.normal_(std=0.05)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=["tied", "untied"])
def tiny_base(request, tmp_path_factory) -> Path:
    tied = request.param == "tied"
    return save_tiny_qwen2(tmp_path_factory.mktemp(f"tiny-base-{request.param}"), tie_word_embeddings=tied)


@pytest.fixture(scope="session")
def tied_base(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-base"), tie_word_embeddings=True)


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(1, TINY_VOCAB - 1, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def demo_base() -> Path:
    if not (DEMO_BASE / "config.json").exists():
        pytest.skip(f"real demo base not built at {DEMO_BASE}: run `make test-real`")
    return DEMO_BASE
