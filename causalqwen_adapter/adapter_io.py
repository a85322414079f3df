"""Adapter I/O: finding and loading the base, checking an adapter against its config, and installing a saved folder
atomically (docs/design.md, The adapter folder). The model's `from_base`, `save_pretrained` and `from_pretrained`
call these.

Shipped as remote code: imports only the standard library, torch, transformers and safetensors.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig, Qwen2ForCausalLM, Qwen2Model
from transformers.utils import cached_file

from .configuration_causalqwen import CausalQwenConfig

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


def check_is_qwen2(base_config, name) -> None:
    if getattr(base_config, "model_type", None) != "qwen2":
        raise ValueError(
            f"{name} is a {getattr(base_config, 'model_type', type(base_config).__name__)!r} checkpoint, not Qwen2: "
            "CausalQwen heads attach to Qwen2-architecture bases (Qwen2, Qwen2.5, Qwen2.5-Coder, ...)"
        )


def check_base_matches(config: CausalQwenConfig, base_config, base_name) -> None:
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
    wants_lm_head = config.action_weight != "full" and not config.text_config.tie_word_embeddings
    if isinstance(base_model, Qwen2ForCausalLM):
        return base_model.model, base_model.lm_head if wants_lm_head else None, base_model.config.name_or_path
    if isinstance(base_model, Qwen2Model) and not wants_lm_head:
        return base_model, None, base_model.config.name_or_path
    if base_model is not None and not isinstance(base_model, (str, os.PathLike)):
        raise TypeError(
            f"base_model must be a Hub id, a folder or a loaded Qwen2ForCausalLM{'' if wants_lm_head else '/Qwen2Model'}, "
            f"got {type(base_model).__name__}"
        )
    name = str(base_model) if base_model is not None else config.base_model_name_or_path
    revision = base_model_revision if base_model is not None else config.base_model_revision
    if not name:
        raise ValueError("the adapter's config names no base (base_model_name_or_path is empty): pass base_model=...")
    name = base_reference(name, "base_model" if base_model is not None else "the adapter's base")
    hub = {k: v for k, v in loader_kwargs.items() if k in HUB_KWARGS}
    base_config = AutoConfig.from_pretrained(name, revision=revision, **hub)
    check_is_qwen2(base_config, name)
    check_base_matches(config, base_config, name)
    loader = Qwen2ForCausalLM if wants_lm_head else Qwen2Model
    loaded = loader.from_pretrained(
        name, config=base_config, revision=revision, dtype=dtype, device_map=device_map, **loader_kwargs
    )
    if wants_lm_head:
        return loaded.model, loaded.lm_head, name
    return loaded, None, name


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
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700; the folder gets a plain mkdir's mode
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
    # A Hub id is `name` or `org/name`; anything else is meant as a path.
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.isabs(name):
        raise FileNotFoundError(
            f"{what} {name!r} was not found: no folder {os.path.abspath(os.path.expanduser(name))!r}. Pass an "
            "existing Qwen2 folder or a Hub id (base_model=... when loading an adapter)."
        )
    return name


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_not_foreign(target: Path) -> None:
    """Never write over a folder that is not an adapter's: a base checkpoint, a dataset, another model."""
    config = target / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = "unreadable"
        if model_type != CausalQwenConfig.model_type:
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


__all__ = [
    "ADAPTER_WEIGHTS_NAME", "BASE_PREFIXES", "HUB_KWARGS", "LORA_FOLDER", "base_reference", "check_base_matches", "check_config_overrides", "check_is_qwen2", "check_keys", "check_not_foreign", "install_folder", "load_backbone", "load_backbone_lora", "load_generation_config", "reject_unknown",
]
