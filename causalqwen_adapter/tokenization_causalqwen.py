"""The tokenizer of an adapter folder: its base's (docs/design.md, The adapter folder).

An adapter carries no tokenizer files. Its `tokenizer_config.json` only names `CausalQwenTokenizer` in `auto_map`, so
`AutoTokenizer.from_pretrained(adapter, trust_remote_code=True)`, and with it
`pipeline("text-generation", model=adapter, trust_remote_code=True)`, load the tokenizer of the base the adapter's
config names, at its revision, with `<NUM>` registered for a numeric adapter.

Shipped as remote code: imports only the standard library, torch and transformers.
"""

import json
from pathlib import Path

from transformers import AutoTokenizer

from .configuration_causalqwen import CausalQwenConfig
from .numeric import add_num_token

TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
TOKENIZER_REFERENCE = "tokenization_causalqwen.CausalQwenTokenizer"
# what an adapter's tokenizer_config.json holds: the class for both of AutoTokenizer's slots (slow, fast)
TOKENIZER_CONFIG = {"auto_map": {"AutoTokenizer": [TOKENIZER_REFERENCE, TOKENIZER_REFERENCE]}}
# what the Auto classes pass about the adapter repository (its revision, code, files): the base is another repository
ADAPTER_REPO_KWARGS = ("revision", "subfolder", "_commit_hash", "_from_auto", "trust_remote_code", "code_revision")


class CausalQwenTokenizer:
    """Not a tokenizer of its own: `from_pretrained(adapter)` returns the adapter's base's tokenizer."""

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoTokenizer"):
        """Nothing to register: what `from_pretrained` returns is the base's tokenizer class, saved as the base's."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *inputs, base_model=None, base_model_revision=None,
                        **kwargs):
        """The tokenizer of the base the adapter `pretrained_model_name_or_path` names (or of `base_model`, as
        `CausalQwenForCausalLM.from_pretrained` takes it), with `<NUM>` at `config.num_token_id` for a numeric adapter.
        Other keyword arguments go to the base's `AutoTokenizer.from_pretrained`."""
        from .adapter_io import HUB_KWARGS, base_reference  # not at the top: adapter_io imports this module

        adapter_kwargs = {k: kwargs[k] for k in HUB_KWARGS if kwargs.get(k) is not None}
        config = CausalQwenConfig.from_pretrained(pretrained_model_name_or_path, **adapter_kwargs)
        name = base_model if base_model is not None else config.base_model_name_or_path
        if not name:
            raise ValueError(f"{pretrained_model_name_or_path}'s config names no base (base_model_name_or_path is "
                             "empty): pass base_model=... or load the base's tokenizer itself")
        # a base named by a folder of the machine that saved the adapter, missing here: said as the model says it
        name = base_reference(str(name), "base_model" if base_model is not None else "the adapter's base")
        revision = base_model_revision if base_model is not None else config.base_model_revision
        base_kwargs = {k: v for k, v in kwargs.items() if k not in ADAPTER_REPO_KWARGS}
        tokenizer = AutoTokenizer.from_pretrained(name, *inputs, revision=revision, **base_kwargs)
        if config.numeric:
            add_num_token(tokenizer, config.num_token_id)
        return tokenizer


def is_adapter_tokenizer_config(path: Path) -> bool:
    """Whether `path` is the `tokenizer_config.json` an adapter save writes (a user's own tokenizer is kept)."""
    try:
        auto_map = json.loads(Path(path).read_text()).get("auto_map") or {}
        return TOKENIZER_REFERENCE in (auto_map.get("AutoTokenizer") or [])
    except (OSError, ValueError, AttributeError, TypeError):
        return False


__all__ = ["CausalQwenTokenizer", "TOKENIZER_CONFIG", "TOKENIZER_CONFIG_NAME", "is_adapter_tokenizer_config"]
