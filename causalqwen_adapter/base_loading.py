"""The base of an adapter: which bases are supported, finding one (a folder or a Hub id), checking it against the
adapter, and loading its backbone (and output layer, where the heads use it), its generation config and a backbone
LoRA the adapter carries.

Shipped as remote code: imports only the standard library, torch, transformers, safetensors and huggingface_hub.
"""

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING
from transformers.utils import cached_file

from .adapter_folder import ADAPTER_WEIGHTS_NAME, LORA_FOLDER, LORA_WEIGHTS_NAME, non_finite_tensors
from .configuration_causalqwen import CausalQwenConfig
from .sharding import is_partitioned, whole_shape

# Hub/loading kwargs transformers' Auto classes hand to `from_pretrained`; they address the adapter repo.
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")


def check_config_overrides(overrides: dict) -> None:
    fields = set(CausalQwenConfig.__dataclass_fields__) - {"text_config", "base_model_name_or_path", "base_model_revision"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown CausalQwenConfig field(s) {unknown}; valid fields: {sorted(fields)}")


def reject_unknown(kwargs: dict, allowed: tuple, where: str) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {unknown}")


SUPPORTED_BASES = ("decoder-only causal LMs that transformers' AutoModelForCausalLM loads, with an output layer that "
                   "is one [vocab × hidden] linear map of the final hidden state (Qwen2, Qwen3, Llama, Mistral, "
                   "Gemma 3 text, Phi-3, ...)")
# Config fields of bases whose logits are not lm_head(z), and the value at which they are: the heads start from a copy
# of the output layer, so loc_S would not be the base's logits.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": (None, "soft-caps its logits, cap·tanh(logits/cap)"),  # Gemma 2, VaultGemma
    "logits_soft_cap": (None, "soft-caps its logits, cap·tanh(logits/cap)"),  # RecurrentGemma
    "logit_scale": (1.0, "multiplies its logits by it"),  # Cohere
    "logits_scaling": (1.0, "scales its logits (or final hidden state) by it"),  # Granite, MiniCPM3, HyperCLOVA X
    "lm_head_multiplier": (1.0, "multiplies its logits by it"),  # Falcon-H1
    "output_multiplier": (1.0, "multiplies its logits by it"),
}
# Model types whose transformers forward never reads the field (MPT's config keeps `logit_scale` from its original
# code; transformers' MptForCausalLM returns lm_head(z) whatever it holds). check_logits_are_output_layer still runs.
LOGIT_TRANSFORMS_UNUSED = {"logit_scale": ("mpt",)}


def check_supported_base(base_config, name) -> None:
    """Refuse, from its config alone, a base the heads cannot start from exactly: not a decoder-only causal LM, or
    logits that are not its output layer applied to its final hidden state."""
    model_type = getattr(base_config, "model_type", None) or type(base_config).__name__
    architectures = ", ".join(getattr(base_config, "architectures", None) or [])
    what = f"{name} is a {model_type!r} checkpoint" + (f" ({architectures})" if architectures else "")
    if getattr(base_config, "is_encoder_decoder", False):
        raise ValueError(f"{what}, an encoder-decoder model: CausalQwen heads attach to {SUPPORTED_BASES}")
    # A composite model's text lives in a sub-config (text_config, decoder, ...); a sub-config of another kind (MPT's
    # attn_config) is part of a plain decoder's configuration.
    if getattr(base_config, "sub_configs", None) and base_config.get_text_config(decoder=True) is not base_config:
        raise ValueError(
            f"{what}, a composite model (vision-language or other multimodal, with sub-configs "
            f"{sorted(base_config.sub_configs)}): CausalQwen heads attach to {SUPPORTED_BASES}. Pass a text-only "
            "checkpoint of its language model"
        )
    # Encoder families (BERT, RoBERTa, ...) declare is_decoder and default it to False; decoder-only LMs do not.
    if getattr(base_config, "is_decoder", None) is False:
        raise ValueError(f"{what}, an encoder (bidirectional attention): CausalQwen heads attach to {SUPPORTED_BASES}")
    if type(base_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{what}, which AutoModelForCausalLM does not load: CausalQwen heads attach to {SUPPORTED_BASES}")
    for field, (neutral, effect) in LOGIT_TRANSFORMS.items():
        value = getattr(base_config, field, None)
        if model_type in LOGIT_TRANSFORMS_UNUSED.get(field, ()):
            continue
        if value is not None and value != neutral:
            raise ValueError(
                f"{what} has {field}={value}: its forward {effect}, so its logits are not its output layer applied to "
                f"the final hidden state and fresh heads could not start at the base's logits (loc_S = W_A z). "
                f"CausalQwen heads attach to {SUPPORTED_BASES}"
            )


def base_is_tied(base_config) -> bool:
    """Whether the base's output layer is its input embedding."""
    return bool(getattr(base_config, "tie_word_embeddings", False))


def causal_lm_parts(base, name) -> tuple[nn.Module, nn.Linear]:
    """(backbone, output layer) of a loaded causal LM: the module at its `base_model_prefix` (whose last hidden state
    is z) and the [V × H] linear layer its logits come from, W_A's initial value."""
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"{name}: expected a transformers causal LM (a *ForCausalLM), got {type(base).__name__}")
    check_supported_base(base.config, name)
    backbone, lm_head = base.base_model, base.get_output_embeddings()
    if backbone is base or lm_head is None:
        raise TypeError(
            f"{name} is a {type(base).__name__}, a model without a language-model output layer: pass the base's causal "
            "LM (AutoModelForCausalLM.from_pretrained, a *ForCausalLM), or its folder or Hub id"
        )
    shape = (base.config.vocab_size, base.config.hidden_size)
    weight, bias = getattr(lm_head, "weight", None), getattr(lm_head, "bias", None)
    if not isinstance(lm_head, nn.Linear) or not isinstance(weight, torch.Tensor) or whole_shape(weight) != shape:
        raise ValueError(
            f"{name} ({type(base).__name__}): its output layer is a {type(lm_head).__name__} with weight "
            f"{None if weight is None else whole_shape(weight)}, not one [vocab × hidden] = {list(shape)} linear map: "
            f"W_A cannot copy it. CausalQwen heads attach to {SUPPORTED_BASES}"
        )
    if bias is not None and whole_shape(bias) != shape[:1]:
        raise ValueError(f"{name}: its output layer's bias has shape {whole_shape(bias)}, not [{shape[0]}]")
    return backbone, lm_head


@torch.no_grad()
def check_logits_are_output_layer(base, backbone, lm_head, name) -> None:
    """Run the base once on a few tokens and check that its logits are its output layer applied to its backbone's
    last hidden state: what the heads copy. Catches what no config field names (a scale, a cap or a norm after the
    output layer in the base's forward). Skipped where the weights are not here (meta, a ZeRO-3 partition)."""
    weight = lm_head.weight
    if weight.device.type == "meta" or is_partitioned(weight):
        return
    seen = {}

    def keep(module, args, output):
        seen["z"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    embeddings = backbone.get_input_embeddings().weight
    ids = torch.arange(min(4, base.config.vocab_size), device=embeddings.device)[None]
    hook = backbone.register_forward_hook(keep)
    try:
        logits = base(input_ids=ids, use_cache=False).logits
    finally:
        hook.remove()
    # What W_A copies: the layer's weight and bias as a plain linear map (not the module's own forward)
    expected = torch.nn.functional.linear(seen["z"].to(weight), weight, lm_head.bias).float()
    if not (torch.isfinite(expected).all() and torch.isfinite(logits).all()):
        return  # a base whose weights are not finite: refused where its outputs are read (finite checks)
    tolerance = 4 * torch.finfo(weight.dtype).eps * expected.abs().max().clamp_min(1.0)  # kernels may differ
    if logits.shape != expected.shape or not torch.allclose(logits.float(), expected, rtol=0, atol=tolerance):
        raise ValueError(
            f"{name} ({type(base).__name__}): its logits are not its output layer applied to the final hidden state "
            "(its forward transforms them: a cap, a scale, a norm), so fresh heads could not start at the base's "
            f"logits. CausalQwen heads attach to {SUPPORTED_BASES}"
        )


def base_config_dict(name: str, what: str, revision=None, **hub_kwargs) -> dict:
    """config.json of what is meant as a base, read without running any code (an adapter's `auto_map` would have
    transformers ask whether to run the folder's code): a missing folder is named, and an adapter is refused."""
    check_found(name, what, BASE_HINT)
    config_dict, _ = PreTrainedConfig.get_config_dict(name, revision=revision, **hub_kwargs)
    if config_dict.get("model_type") == CausalQwenConfig.model_type:
        raise ValueError(
            f"{what} {name!r} is a CausalQwen adapter, not a base: pass the base it attaches to (its config "
            f"names {config_dict.get('base_model_name_or_path')!r}). To load the adapter itself, use "
            f"CausalQwenForCausalLM.from_pretrained({name!r}) (or AutoModelForCausalLM.from_pretrained(..., "
            "trust_remote_code=True))"
        )
    return config_dict


def check_base_matches(config: CausalQwenConfig, base_config, base_name) -> None:
    have, want = getattr(base_config, "model_type", None), config.text_config.model_type
    if have != want:
        raise ValueError(
            f"base checkpoint {base_name} is a {have!r} model, the adapter was built on a {want!r} base: "
            "pass the base the adapter was trained on (base_model=...)"
        )
    for field in ("hidden_size", "vocab_size"):
        have, want = getattr(base_config, field), getattr(config.text_config, field)
        if have != want:
            raise ValueError(
                f"base checkpoint {base_name} has {field} {have}, the adapter expects {want}: "
                "pass the base the adapter was trained on (base_model=...)"
            )

def load_backbone(config, base_model, base_model_revision, dtype, device_map, loader_kwargs):
    """(decoder, lm_head or None, name) of the base. The lm_head is loaded only when the adapter uses
    the base's own output weights ("tied"/"lora" action weights on an untied base)."""
    wants_lm_head = config.action_weight != "full" and not base_is_tied(config.text_config)
    if isinstance(base_model, PreTrainedModel):
        name = base_model.config.name_or_path
        if base_model.base_model is not base_model:  # a causal LM: its backbone, and its output layer when used
            backbone, lm_head = causal_lm_parts(base_model, name)
            return backbone, lm_head if wants_lm_head else None, name
        if not wants_lm_head:  # already the backbone (AutoModel)
            check_supported_base(base_model.config, name)
            return base_model, None, name
    if base_model is not None and not isinstance(base_model, (str, os.PathLike)):
        raise TypeError(
            f"base_model must be a Hub id, a folder or a loaded causal LM (a *ForCausalLM"
            f"{'' if wants_lm_head else ', or its backbone'}), got {type(base_model).__name__}"
        )
    name = str(base_model) if base_model is not None else config.base_model_name_or_path
    revision = base_model_revision if base_model is not None else config.base_model_revision
    if not name:
        raise ValueError("the adapter's config names no base (base_model_name_or_path is empty): pass base_model=...")
    what = "base_model" if base_model is not None else "the adapter's base"
    name = base_reference(name, what)
    hub = {k: v for k, v in loader_kwargs.items() if k in HUB_KWARGS}
    base_config_dict(name, what, revision, **hub)  # a missing folder or an adapter: refused before any code runs
    base_config = AutoConfig.from_pretrained(name, revision=revision, **hub)
    check_supported_base(base_config, name)
    check_base_matches(config, base_config, name)
    kwargs = dict(config=base_config, revision=revision, dtype=dtype, device_map=device_map, **loader_kwargs)
    if wants_lm_head:
        return (*causal_lm_parts(AutoModelForCausalLM.from_pretrained(name, **kwargs), name), name)
    with output_layer_expected(base_config):
        backbone, info = AutoModel.from_pretrained(name, output_loading_info=True, **kwargs)
    if info["missing_keys"]:  # the checkpoint is not this backbone's: never run on freshly initialised weights
        raise ValueError(
            f"{name}: AutoModel built a {type(backbone).__name__} whose weights {sorted(info['missing_keys'])[:5]} "
            "are not in the checkpoint: pass a base whose backbone AutoModel loads (base_model=...)"
        )
    return backbone, None, name


@contextmanager
def output_layer_expected(base_config):
    """While the backbone of a causal LM checkpoint loads through AutoModel: its output layer's tensors are left
    unloaded on purpose (the heads copy or bind it), so transformers' load report does not list them as UNEXPECTED.
    The backbone class's own ignore list, extended for this load only."""
    backbone_class = MODEL_MAPPING[type(base_config)] if type(base_config) in MODEL_MAPPING else None
    if backbone_class is None:
        yield
        return
    before = backbone_class.__dict__.get("_keys_to_ignore_on_load_unexpected", _UNSET)
    backbone_class._keys_to_ignore_on_load_unexpected = [*(backbone_class._keys_to_ignore_on_load_unexpected or []),
                                                         r"^lm_head\."]
    try:
        yield
    finally:
        if before is _UNSET:
            del backbone_class._keys_to_ignore_on_load_unexpected
        else:
            backbone_class._keys_to_ignore_on_load_unexpected = before


_UNSET = object()


def read_output_layer(name: str, revision: str | None = None, **hub_kwargs) -> tuple | None:
    """(weight, bias or None) of the base checkpoint `name`'s output layer (`lm_head`), read from its safetensors
    alone (the sharded index followed), or None where the checkpoint stores none (a tied base) or is not safetensors."""
    options = dict(revision=revision, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    index = cached_file(name, "model.safetensors.index.json", **options)
    if index is not None:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = {weight_map.get(f"lm_head.{part}") for part in ("weight", "bias")} - {None}
    else:
        files = {ADAPTER_WEIGHTS_NAME}
    tensors = {}
    for file in files:
        path = cached_file(name, file, **options)
        if path is None:
            return None
        with safe_open(path, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in ("lm_head.weight", "lm_head.bias") if k in f.keys()})
    if "lm_head.weight" not in tensors:
        return None
    return tensors["lm_head.weight"], tensors.get("lm_head.bias")


def load_backbone_lora(backbone, adapter: str, hub_kwargs: dict) -> None:
    """Re-apply the backbone LoRA an adapter carries in lora/ (transformers' PEFT integration)."""
    files = [cached_file(adapter, f"{LORA_FOLDER}/{name}", _raise_exceptions_for_missing_entries=False, **hub_kwargs)
             for name in ("adapter_config.json", LORA_WEIGHTS_NAME)]
    if files[0] is None:
        return
    if files[1] is None:
        raise OSError(f"{adapter}/{LORA_FOLDER} has an adapter_config.json but no {LORA_WEIGHTS_NAME}: the backbone "
                      "LoRA cannot be applied. Save the adapter again (or remove lora/ to load the heads alone)")
    bad = non_finite_tensors(files[1])
    if bad:
        raise ValueError(f"{adapter}/{LORA_FOLDER}/{LORA_WEIGHTS_NAME}: {bad[:5]} hold NaN or infinite values, so the "
                         "model would output NaN. Save a healthy adapter again (or remove lora/ to load the heads "
                         "alone)")
    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{adapter} trains the backbone with LoRA (its {LORA_FOLDER}/ folder): pip install peft") from err
    backbone.load_adapter(str(Path(files[0]).parent))

def load_generation_config(adapter, hub_kwargs, backbone):
    for source in (adapter, backbone.config.name_or_path):
        try:
            return GenerationConfig.from_pretrained(source, **(hub_kwargs if source == adapter else {}))
        except OSError:
            continue
    return GenerationConfig.from_model_config(backbone.config)

def base_reference(name: str, what: str) -> str:
    """How an adapter refers to its base: an existing folder by its absolute path (a relative one would resolve
    against whatever directory loads the adapter later), a Hub id as given. A path that exists nowhere is an error
    here rather than a network lookup."""
    if not name or os.path.isdir(name):
        return os.path.abspath(name) if name else name
    check_found(name, what, BASE_HINT)
    return name


# What to pass instead of a path that does not exist (`check_found`).
BASE_HINT = "Pass an existing base folder or a Hub id (base_model=... when loading an adapter)"
ADAPTER_HINT = "Pass the folder save_pretrained wrote, or the adapter's Hub id"
MODEL_HINT = "Pass an existing base or CausalQwen adapter folder, or a Hub id"


def check_found(name: str, what: str, hint: str) -> None:
    """A name meant as a local path must be an existing folder: a Hub id is `name` or `org/name`, anything else
    (`/abs`, `./rel`, `~/x`, `a/b/c`) is a path, which the Hub lookup would answer with "Repo id must be in the
    form ..."."""
    if os.path.isdir(name):
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.isabs(name):
        raise FileNotFoundError(
            f"{what} {name!r} was not found: no folder {os.path.abspath(os.path.expanduser(name))!r}. {hint}."
        )
