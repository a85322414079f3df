"""Adapter I/O (docs/design.md, The adapter folder): attaching fresh heads to a base, saving, uploading and loading an
adapter, as `CausalAdapterMixin`; finding and loading the base, checking an adapter against its config, and installing
a saved folder atomically, as the functions it calls.

Shipped as remote code: imports only the standard library, torch, transformers, safetensors and huggingface_hub.
"""

import inspect
import json
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import GENERATION_CONFIG_NAME, cached_file

from .configuration_causalqwen import CausalQwenConfig, check_number
from .model_card import CARD_NAME, write_model_card
from .sharding import gathered, gathered_tensors, is_partitioned, whole_shape
from .tokenization_causalqwen import TOKENIZER_CONFIG, TOKENIZER_CONFIG_NAME, is_adapter_tokenizer_config

ADAPTER_WEIGHTS_NAME = "model.safetensors"
LORA_FOLDER = "lora"
BASE_PREFIXES = ("model.", "lm_head.")  # base tensors: never in an adapter
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


def check_keys(found: set, expected: set, where) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ValueError(
            f"{where} does not hold the adapter tensors this config describes: missing {missing}, unexpected "
            f"{unexpected}. An adapter stores only head tensors; check learnable_threshold/causal_size in config.json."
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
    backbone, info = AutoModel.from_pretrained(name, output_loading_info=True, **kwargs)
    if info["missing_keys"]:  # the checkpoint is not this backbone's: never run on freshly initialised weights
        raise ValueError(
            f"{name}: AutoModel built a {type(backbone).__name__} whose weights {sorted(info['missing_keys'])[:5]} "
            "are not in the checkpoint: pass a base whose backbone AutoModel loads (base_model=...)"
        )
    return backbone, None, name


def load_backbone_lora(backbone, adapter: str, hub_kwargs: dict) -> None:
    """Re-apply the backbone LoRA an adapter carries in lora/ (transformers' PEFT integration)."""
    files = [cached_file(adapter, f"{LORA_FOLDER}/{name}", _raise_exceptions_for_missing_entries=False, **hub_kwargs)
             for name in ("adapter_config.json", "adapter_model.safetensors")]
    if files[0] is None:
        return
    if files[1] is None:
        raise OSError(f"{adapter}/{LORA_FOLDER} has an adapter_config.json but no adapter_model.safetensors")
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


def install_folder(staging: Path, target: Path) -> None:
    """Move a fully written staging folder into place (see save_pretrained for the guarantees).

    Into an existing folder, each file it replaces is first moved aside, `config.json` first (until the new one is
    in, the folder refuses to load) and last back in; if a move fails, everything is moved back as it was.
    """
    give_plain_modes(staging)
    if not target.exists():
        os.rename(staging, target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    done: list[tuple[Path, Path | None]] = []  # (target entry, where its old version went)

    def put_aside(dest: Path) -> None:
        if dest.exists() or dest.is_symlink():
            os.replace(dest, aside / dest.name)
            done.append((dest, aside / dest.name))

    try:
        put_aside(target / "config.json")
        if not (staging / LORA_FOLDER).exists():
            put_aside(target / LORA_FOLDER)  # a stale backbone LoRA must not be re-applied to these heads
        for item in sorted(staging.iterdir(), key=lambda p: p.name == "config.json"):  # config.json last
            dest = target / item.name
            if item.name != "config.json":
                put_aside(dest)
            done.append((dest, None))
            os.replace(item, dest)
    except BaseException:
        for dest, old in reversed(done):  # undo: the new entries out, the old ones back
            if old is None and (dest.exists() or dest.is_symlink()):
                shutil.rmtree(dest) if dest.is_dir() and not dest.is_symlink() else dest.unlink()
            elif old is not None:
                os.replace(old, dest)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def give_plain_modes(folder: Path) -> None:
    """Give a folder we wrote through a staging copy, and everything in it, the modes a plain `mkdir` and `open()`
    would have: `tempfile.mkdtemp` makes its folder 0700 and safetensors (0.8) writes its files 0600, which would hide
    the weights of a folder that looks readable from every other user (a serving process, a container's user)."""
    mask = _umask()
    for path in (folder, *folder.rglob("*")):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def adapter_file_names() -> set[str]:
    """The names a save writes at the top of an adapter folder (docs/design.md, The adapter folder), but for
    `tokenizer_config.json`, which it writes only where no tokenizer of the user's is (`keeps_tokenizer_config`)."""
    modeling = Path(__file__).with_name("modeling_causalqwen.py")
    code = {Path(f).name for f in [modeling, *get_relative_import_files(modeling)]}
    return {"config.json", ADAPTER_WEIGHTS_NAME, GENERATION_CONFIG_NAME, CARD_NAME, LORA_FOLDER, *code}


def keeps_tokenizer_config(target: Path) -> bool:
    """Whether `target` holds a `tokenizer_config.json` that an adapter save did not write (a tokenizer the user
    saved there): the save leaves it, and AutoTokenizer reads that tokenizer instead of the base's."""
    path = target / TOKENIZER_CONFIG_NAME
    return (path.exists() or path.is_symlink()) and not is_adapter_tokenizer_config(path)


def stale_save_folders(target: Path) -> list[Path]:
    """The hidden folders saves into `target` create beside it, named as `tempfile.mkdtemp` names them:
    `.NAME.XXXXXXXX.tmp` (a save's new files) and `.NAME.XXXXXXXX.old` (the files a swap moved out). A save removes
    its own; any left were left by a process killed while saving."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.[a-z0-9_]{{8}}\.(tmp|old)")
    if not target.parent.is_dir():
        return []
    return sorted((p for p in target.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir()
                   and not p.is_symlink()), key=lambda p: p.stat().st_mtime)


def interrupted_swap(target: Path) -> Path | None:
    """The hidden folder holding the previous adapter's `config.json` when a save into `target` was killed while
    swapping files in (config.json goes aside first and comes back last), else None."""
    if (target / "config.json").exists():
        return None
    asides = [p for p in stale_save_folders(target) if p.suffix == ".old" and _is_adapter_config(p / "config.json")]
    return asides[-1] if asides else None


def is_adapter_folder(target: Path) -> bool:
    """Whether saves of ours wrote `target`: it holds a CausalQwen config.json, or a save into it was interrupted."""
    return _is_adapter_config(target / "config.json") or interrupted_swap(target) is not None


def _is_adapter_config(path: Path) -> bool:
    return _model_type(path) == CausalQwenConfig.model_type


def _model_type(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "unreadable"


def check_not_foreign(target: Path, other_names: tuple[str, ...] = ()) -> None:
    """Never write over a file that is not ours: a base checkpoint, a dataset, another model, a user's own files.

    A folder saves of ours wrote (`is_adapter_folder`) is the adapter's: a save replaces its adapter files. In any
    other folder a save only adds files: one of the names it writes (`adapter_file_names()` and `other_names`, the
    trainer's `training_args.bin`) already there is refused, naming them.
    """
    config = target / "config.json"
    if config.is_file() and (model_type := _model_type(config)) != CausalQwenConfig.model_type:
        raise FileExistsError(
            f"{target} holds a {model_type!r} checkpoint (its config.json), not a CausalQwen adapter: saving here "
            "would replace its files. Save the adapter to a folder of its own."
        )
    weights = target / ADAPTER_WEIGHTS_NAME
    if weights.is_file() and not config.is_file():
        try:
            with safe_open(weights, "pt") as f:
                foreign = [k for k in f.keys() if k.startswith(BASE_PREFIXES)]
        except Exception:  # unreadable: not ours to overwrite either
            foreign = ["(unreadable)"]
        if foreign:
            raise FileExistsError(
                f"{weights} holds model weights that are not an adapter's ({foreign[0]}, ...): saving here would "
                "replace them. Save the adapter to a folder of its own."
            )
    if is_adapter_folder(target):
        return
    clash = sorted(n for n in adapter_file_names() | set(other_names) if (target / n).exists() or (target / n).is_symlink())
    if clash:
        raise FileExistsError(
            f"{target} is not an adapter folder (it has no CausalQwen config.json) and holds {clash}: a save would "
            "replace them, and they were not written by a save of this adapter. Move them out of the folder, or "
            "save the adapter to a folder of its own."
        )


__all__ = [
    "ADAPTER_HINT", "ADAPTER_WEIGHTS_NAME", "BASE_HINT", "BASE_PREFIXES", "MODEL_HINT", "HUB_KWARGS", "LORA_FOLDER",
    "SUPPORTED_BASES", "adapter_file_names", "base_config_dict", "base_is_tied", "base_reference", "causal_lm_parts",
    "check_base_matches", "check_config_overrides", "check_found", "check_keys", "check_logits_are_output_layer",
    "check_not_foreign", "check_supported_base", "install_folder", "interrupted_swap", "is_adapter_folder",
    "load_backbone", "load_backbone_lora", "load_generation_config", "reject_unknown", "stale_save_folders",
]


class CausalAdapterMixin:
    """Building, saving and loading a CausalQwen model as an adapter: only the heads' tensors are written, the base is
    referenced by name. Mixed into `CausalQwenModel` ahead of `PreTrainedModel`, whose save/load it replaces."""

    @classmethod
    def _remote_code_files(cls) -> list[str]:
        """The modeling file and every file it imports relatively (configuration, heads, Cauchy math, this file)."""
        modeling = next(c for c in cls.__mro__ if c.__module__.rsplit(".", 1)[-1] == "modeling_causalqwen")
        this = inspect.getfile(modeling)
        return [this] + sorted(set(get_relative_import_files(this)))  # a file two others import is copied once

    # ------------------------------------------------------------------ building

    @classmethod
    def from_base(cls, base, *, revision=None, dtype="auto", device_map=None, **config_overrides):
        """Attach fresh causal heads (seed initialisation) to a base: any decoder-only causal LM that transformers'
        `AutoModelForCausalLM` loads (`SUPPORTED_BASES`). The heads wrap its backbone and copy its output layer.

        `base` is a Hub id, a local folder, or a loaded causal LM (a `*ForCausalLM`). `config_overrides` are
        `CausalQwenConfig` fields (`causal_size`, `gamma_init`, ...); Hub options go to the base loader. A base whose
        logits are not its output layer applied to its final hidden state is refused (`check_supported_base`,
        `check_logits_are_output_layer`): the heads could not start where it is.
        """
        hub_kwargs = {k: config_overrides.pop(k) for k in HUB_KWARGS if k in config_overrides and k != "revision"}
        check_config_overrides(config_overrides)
        if isinstance(base, (str, os.PathLike)):
            base_name = base_reference(str(base), "base")
            base_config_dict(base_name, "base", revision, **hub_kwargs)  # a missing folder or an adapter: refused
            base_config = AutoConfig.from_pretrained(base_name, revision=revision, **hub_kwargs)
            check_supported_base(base_config, base_name)
            base = AutoModelForCausalLM.from_pretrained(base_name, config=base_config, revision=revision, dtype=dtype,
                                                        device_map=device_map, **hub_kwargs)
        elif isinstance(base, PreTrainedModel):
            base_name = base_reference(base.config.name_or_path, "base")
        else:
            raise TypeError(
                f"base must be a Hub id, a local folder or a loaded causal LM (a transformers *ForCausalLM), got "
                f"{type(base).__name__}; CausalQwen heads attach to {SUPPORTED_BASES}"
            )
        backbone, lm_head = causal_lm_parts(base, base_name)
        check_logits_are_output_layer(base, backbone, lm_head, base_name)
        config = cls.config_class(
            base_model_name_or_path=base_name, base_model_revision=revision, text_config=base.config, **config_overrides
        )
        for name in ("gamma_init", "b_noise_init", "ovr_threshold_init"):  # they must fit the heads' dtype (fp16: 65504)
            check_number(name, getattr(config, name), dtype=lm_head.weight.dtype)
        tied = base_is_tied(config.text_config)
        model = cls._assemble(config, backbone, None if tied else lm_head)
        with torch.no_grad():
            model.abduction.reset_parameters(config.gamma_init)
            # a base built partitioned (DeepSpeed ZeRO-3 with zero3_init_flag) is gathered for the copy only: every
            # rank reads the output layer, nothing else of the base
            with gathered(*(p for p in (lm_head.weight, lm_head.bias) if p is not None)):
                weight = lm_head.weight
                if config.causal_size != config.text_config.hidden_size:
                    # W_A = W_base · W_loc⁺ keeps loc_S = W_base z exactly when C > H (W_loc⁺ W_loc = I)
                    # and as the least-squares best when C < H.
                    pinv = torch.linalg.pinv(model.abduction.loc.weight.double())
                    weight = (weight.double() @ pinv).to(weight.dtype)
                model.action.reset_parameters(config.b_noise_init, weight, lm_head.bias)
            if config.numeric:
                model.numeric.reset_parameters()  # median 0, scale 1 until the trainer sees the data
        model.generation_config = base.generation_config
        # For verify_initialization, outside the module tree, never saved. Held strongly only when the model keeps
        # its weight anyway (tied embedding, or W_A bound to it); an untied base's own V×H matrix beside a "full"
        # W_A copy lives only as long as the caller keeps the base.
        shared = tied or config.action_weight != "full"
        model.__dict__["_base_lm_head"] = lm_head if shared else weakref.ref(lm_head)
        return model

    @classmethod
    def _assemble(cls, config, backbone, lm_head=None):
        """Build the model around a loaded backbone; the heads are allocated but not initialised."""
        with torch.device("meta"):  # no wasted initialisation of vocabulary-sized heads
            model = cls(config, backbone=backbone, lm_head=lm_head if config.action_weight != "full" else None)
        # The heads read the final hidden state: on the device of the backbone's last parameter (its final norm), in
        # the dtype of its embeddings (the model's; a norm may be kept in float32).
        anchor = torch.empty(0, dtype=backbone.get_input_embeddings().weight.dtype,
                             device=list(backbone.parameters())[-1].device)
        for name in ("abduction", "action", "ovr", "numeric")[: 4 if config.numeric else 3]:
            head = getattr(model, name).to(dtype=anchor.dtype)
            head.to_empty(device=anchor.device)
            setattr(model, name, head)
        if config.learnable_threshold:  # thresholds stay float32 like the loss math
            model.ovr.float()
        if config.numeric:  # b = a median of the data: bf16 would round it (12345.6 → 12352)
            model.numeric.float()
        model.ovr.reset_parameters()  # a scalar threshold is config, not an adapter tensor: set it here
        return model

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors an adapter folder stores: every persistent tensor outside the backbone."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(BASE_PREFIXES)}

    def gathered_adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """`adapter_state_dict` with whole tensors under sharded training (FSDP2, ZeRO-3): only the adapter's tensors are
        gathered, never the frozen base. A collective: every rank calls it; any rank may then save what it returns."""
        keys = self.adapter_keys()
        return gathered_tensors({k: v for k, v in self.state_dict(keep_vars=True).items() if k in keys})

    def adapter_keys(self) -> set[str]:
        return set(self._adapter_tensors())

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The persistent tensors outside the backbone, as `state_dict(keep_vars=True)` names them, read from the head
        modules alone (the backbone's hundreds of tensors are not walked; the model holds no tensor of its own)."""
        tensors = {}
        for name, module in self.named_children():
            if f"{name}." not in BASE_PREFIXES:
                module.state_dict(destination=tensors, prefix=f"{name}.", keep_vars=True)
        return tensors

    # ------------------------------------------------------------------ saving

    def save_pretrained(self, save_directory, is_main_process=True, state_dict=None, push_to_hub=False, **kwargs):
        """Write the adapter folder of docs/design.md (The adapter folder) atomically: config, adapter tensors, remote code.

        A new folder appears complete or not at all; files in an existing folder are swapped with
        `config.json` last, so an interrupted save leaves a folder that refuses to load, never one
        that loads wrong. Other files in the folder (a trainer's checkpoints) are left untouched.
        Refused before anything is written: tensors that are not finite, and a folder that is not an
        adapter's holding a file of a name the save writes (`check_not_foreign`).
        """
        reject_unknown(kwargs, ("safe_serialization", "max_shard_size", "variant"), "save_pretrained")
        if kwargs.get("safe_serialization") is False or kwargs.get("variant"):
            raise ValueError("adapters are always saved as a single `model.safetensors`: drop safe_serialization/variant")
        if push_to_hub:
            raise NotImplementedError("push_to_hub from save_pretrained is not supported yet: call model.push_to_hub(repo_id)")
        target = Path(os.path.abspath(save_directory))  # "." has a name, the card and the staging folder use it
        if target.exists() and not target.is_dir():
            raise FileExistsError(f"cannot save the adapter to {target}: it is an existing file, not a folder")
        if target.is_dir():
            check_not_foreign(target)
        if not is_main_process:
            return
        if not self.config.base_model_name_or_path:
            raise ValueError(
                "config.base_model_name_or_path is empty, so the adapter could not find its base when loaded: "
                "set model.config.base_model_name_or_path to the base's Hub id or folder"
            )
        tensors = self.adapter_state_dict() if state_dict is None else {
            k: v for k, v in state_dict.items() if not k.startswith(BASE_PREFIXES)
        }
        check_keys(set(tensors), self.adapter_keys(), "the state_dict to save")
        bad = sorted(k for k, v in tensors.items() if not all_finite(v))
        if bad:  # before anything is written: such a folder would refuse to load, and would replace a good one
            raise ValueError(
                f"the adapter tensors {bad} hold NaN or infinite values: the heads diverged, and a folder holding them "
                f"would refuse to load. Nothing was written ({target} is as it was); save heads that are finite (an "
                "earlier checkpoint, or training with a lower learning_rate)."
            )

        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            self._write_adapter_files(staging, tensors, tokenizer_config=not keeps_tokenizer_config(target))
            install_folder(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        # the folder is whole again: what killed saves left beside it is superseded
        for stale in stale_save_folders(target):
            shutil.rmtree(stale, ignore_errors=True)

    def _write_adapter_files(self, folder: Path, tensors: dict, tokenizer_config: bool = True) -> None:
        config = self.config.to_dict()
        config["architectures"] = ["CausalQwenForCausalLM"]
        config["auto_map"] = {
            "AutoConfig": "configuration_causalqwen.CausalQwenConfig",
            "AutoModel": "modeling_causalqwen.CausalQwenModel",
            "AutoModelForCausalLM": "modeling_causalqwen.CausalQwenForCausalLM",
        }
        config["dtype"] = str(self.action.bias.dtype).removeprefix("torch.")
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, folder / ADAPTER_WEIGHTS_NAME,
                  metadata={"format": "pt"})
        for source in self._remote_code_files():
            shutil.copyfile(source, folder / Path(source).name)
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.save_pretrained(folder)
        if tokenizer_config:  # AutoTokenizer.from_pretrained(folder) gives the base's tokenizer (tokenization_causalqwen)
            (folder / TOKENIZER_CONFIG_NAME).write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
        if getattr(self.model, "_hf_peft_config_loaded", False):
            # LoRA on the backbone, in PEFT's format under lora/ (never at the root: transformers
            # would then take the whole folder for a PEFT adapter).
            self.model.save_pretrained(folder / LORA_FOLDER)
        write_model_card(self, folder)  # never fails the save; a trainer records its run in self.training_summary
        # config.json is the commit marker: written last, swapped in last.
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")

    def push_to_hub(self, repo_id, *, private=None, token=None, revision=None, commit_message=None, create_pr=False,
                    base_model_id=None):
        """Upload exactly the adapter folder (what `save_pretrained` writes, card included) to the Hub repo `repo_id`.

        Saves into a temporary folder, creates the repo if needed (`private` applies then), and uploads that folder
        as one commit on `revision` (created from main when missing) or as a pull request (`create_pr`). The pushed
        config and card name the base by its Hub id: `base_model_id` (e.g. "Qwen/Qwen2.5-0.5B-Instruct"), required
        when the model was built on a local folder, which nobody else could load. The repo id, the base and the
        token are checked before anything is written or sent. Returns huggingface_hub's `CommitInfo`.
        """
        try:  # sharing belongs to the installed package: the remote code carries no upload code
            from causalqwen_adapter.hub import push_adapter
        except ImportError:
            raise ImportError(
                "push_to_hub uploads with the causalqwen-adapter package, which is not installed here: install it from "
                "its source (in a clone of the project: pip install .), or save_pretrained the adapter and upload the "
                "folder yourself"
            ) from None
        return push_adapter(self, repo_id, private=private, token=token, revision=revision,
                            commit_message=commit_message, create_pr=create_pr, base_model_id=base_model_id)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, base_model=None, base_model_revision=None,
                        config=None, dtype="auto", device_map=None, trust_remote_code=None, adapter_kwargs=None,
                        code_revision=None, _from_auto=False, _commit_hash=None, **kwargs):
        """Load the base named in the adapter's config (or `base_model`), then the adapter's heads.

        `pretrained_model_name_or_path` is an adapter folder or Hub id (files resolved through
        transformers' `cached_file`, so the Hub cache and `HF_HUB_OFFLINE=1` work). `base_model`
        may be a Hub id, a folder, a loaded causal LM (`*ForCausalLM`) or its backbone. The remaining keyword arguments
        (`attn_implementation`, `low_cpu_mem_usage`, ...) go to the base's `from_pretrained`.

        `trust_remote_code`, `adapter_kwargs`, `code_revision`, `_from_auto` and `_commit_hash` are what transformers'
        Auto classes pass along about the adapter repository (its code, a PEFT adapter inside it, its revision);
        they are taken here so that they do not reach the base's loading, which reads another repository.
        """
        if model_args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes no extra positional arguments, got {model_args}")
        adapter = str(pretrained_model_name_or_path)
        check_found(adapter, "adapter", ADAPTER_HINT)
        hub_kwargs = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
        hub_kwargs = {k: v for k, v in hub_kwargs.items() if v is not None}
        if "torch_dtype" in kwargs:
            dtype = kwargs.pop("torch_dtype")
        if not isinstance(config, cls.config_class):
            if cached_file(adapter, "config.json", _raise_exceptions_for_missing_entries=False, **hub_kwargs) is None:
                aside = interrupted_swap(Path(adapter)) if os.path.isdir(adapter) else None
                if aside is not None:
                    raise OSError(
                        f"{adapter} has no config.json: a save into it was interrupted while swapping its files. The "
                        f"previous adapter's config.json and the files already replaced are in {aside}: move them back "
                        f"into {adapter} to restore that adapter, or save the adapter again (which removes {aside})."
                    )
                raise OSError(
                    f"{adapter} has no config.json: it is not a complete CausalQwen adapter (an interrupted "
                    "save leaves it so). Save it again with save_pretrained."
                )
            config_dict, _ = cls.config_class.get_config_dict(adapter, **hub_kwargs)
            if config_dict.get("model_type") != cls.config_class.model_type:
                raise ValueError(
                    f"{adapter} is a {config_dict.get('model_type')!r} checkpoint, not a CausalQwen adapter: "
                    f"to attach fresh heads to a base use {cls.__name__}.from_base({adapter!r})"
                )
            config = cls.config_class.from_dict(config_dict)
        weights_file = cached_file(adapter, ADAPTER_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        if weights_file is None:
            raise OSError(
                f"{adapter} has no {ADAPTER_WEIGHTS_NAME}: it is not a complete CausalQwen adapter "
                "(was the save interrupted?). Save it again with save_pretrained."
            )

        base_hub_kwargs = {k: v for k, v in hub_kwargs.items() if k not in ("revision", "subfolder")}
        backbone, lm_head, base_name = load_backbone(
            config, base_model, base_model_revision, dtype, device_map, {**base_hub_kwargs, **kwargs}
        )
        check_base_matches(config, backbone.config, base_name)
        config.text_config = backbone.config
        if base_model is not None and isinstance(base_model, (str, os.PathLike)):
            config.base_model_name_or_path = str(base_model)
            config.base_model_revision = base_model_revision
        model = cls._assemble(config, backbone, lm_head)
        model._load_adapter_weights(weights_file)
        load_backbone_lora(backbone, adapter, hub_kwargs)
        model.generation_config = load_generation_config(adapter, hub_kwargs, backbone)
        model.name_or_path = adapter
        model.eval()
        return model

    def _load_adapter_weights(self, weights_file: str) -> None:
        try:
            tensors = load_file(weights_file)
        except (SafetensorError, OSError, ValueError) as err:
            raise OSError(f"cannot read adapter weights {weights_file}: {err}. The file is corrupt; save the adapter again.") from err
        own = self._adapter_tensors()
        check_keys(set(tensors), set(own), weights_file)
        for key, value in tensors.items():
            if tuple(value.shape) != tuple(own[key].shape):
                raise ValueError(
                    f"{weights_file}: {key} has shape {tuple(value.shape)} but this config expects "
                    f"{tuple(own[key].shape)}; the adapter and its config.json do not belong together"
                )
        bad = sorted(k for k, v in tensors.items() if not all_finite(v))
        if bad:
            raise ValueError(
                f"{weights_file}: {bad} hold NaN or infinite values: the file is corrupt or the heads diverged before "
                "it was saved. Load an earlier checkpoint, or save the adapter again."
            )
        # assign: the tensors read from the file become the parameters, no second copy; head by head, the backbone's
        # modules not walked
        for name, module in self.named_children():
            prefix = f"{name}."
            part = {k.removeprefix(prefix): v.to(dtype=own[k].dtype, device=own[k].device)
                    for k, v in tensors.items() if k.startswith(prefix)}
            if part and prefix not in BASE_PREFIXES:
                module.load_state_dict(part, assign=True)


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or ±inf in a tensor, in one pass and no allocation: min and max propagate NaN, and an infinity is one
    of them (`isfinite(...).all()` would build a boolean copy, 136 MiB for a bf16 W_A, and take 40× longer).

    bfloat16 is first summed: NaN and ±inf propagate through a sum too (inf − inf is NaN), so a finite sum proves every
    value finite, and it reads a bf16 tensor in 0.6× the time of min and max (whose per-element conversion costs more
    than the read). A sum that is not finite (finite values can overflow it only near 3.4e38) is settled by min and
    max."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.dtype == torch.bfloat16 and torch.isfinite(tensor.sum()):
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))
