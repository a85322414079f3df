"""The adapter folder on the Hub: its model card (README.md).

The card is rendered from one Jinja template, `model_card/adapter_card.md.j2` at the top of the project
(`adapter_card.md.j2` next to this file is a link to it, shipped as package data), with huggingface_hub's
`ModelCard`. `save_pretrained` writes it; `push_to_hub` and `causalqwen push` upload the folder through the
installed package's `hub.py`, which is never remote code.

Shipped as remote code next to modeling_causalqwen.py (transformers copies relatively imported files), so:
the standard library and huggingface_hub only, jinja2 through huggingface_hub; never this package by name.
Transformers copies only `.py` files, so a model loaded as remote code has no template: it keeps the card of
the adapter it was loaded from instead (see `write_model_card`).

Training record. The trainer sets `model.training_summary` before saving, a dict with any of
    "hyperparameters": {"learning_rate": 1e-4, ...}   rendered as a table
    "metrics":         {"train_loss": 2.31, ...}       final metrics, rendered as a table
    "datasets":        ["user/dataset", ...]           listed, and Hub ids go to the card's `datasets` metadata
    "tags":            ["trl", "sft"]                  extra metadata tags
The card is where the record lives: it is not saved elsewhere, and a model loaded back has no `training_summary`.
"""

import importlib.metadata
import logging
import math
import os
import re
from pathlib import Path

from huggingface_hub import (
    ModelCard,
    ModelCardData,
    hf_hub_download,
    metadata_load,
    try_to_load_from_cache,
)
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import safe_open

logger = logging.getLogger(__name__)

TEMPLATE_NAME = "adapter_card.md.j2"
CARD_NAME = "README.md"
WEIGHTS_NAME = "model.safetensors"
TAGS = ["causalqwen", "ovr", "cauchy"]  # and the base's model type
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
# Framework versions named in the card; the package itself only when it is installed.
_VERSIONED = ("causalqwen-adapter", "torch", "transformers", "huggingface_hub", "safetensors")
# Said of an adapter whose base is a local folder (the card of a folder never pushed: a push names a Hub id instead,
# `hub.point_at_hub_base`, which removes this note by its exact text).
LOCAL_BASE_NOTE = ("The base is named by the absolute path of a local folder on the machine that saved it: elsewhere, "
                   "pass `base_model=` (a folder or Hub id of the same base) to `from_pretrained`.")
# A local data file named in the training record is never a Hub dataset id, wherever the card is rendered.
_DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".gz", ".zst")


# --------------------------------------------------------------------------------------- rendering


class CardUnavailable(RuntimeError):
    """No card can be rendered here: no template next to this file (remote code), or no jinja2."""


def write_model_card(model, folder, model_id: str | None = None) -> Path | None:
    """Write `folder/README.md` for `model`; `model_id` is the repo id or folder name the load snippet uses.

    Never raises: a card that cannot be rendered must not lose a trained adapter. Without the template
    (remote code) or jinja2 it keeps the card of the adapter the model was loaded from, else writes none.
    """
    folder = Path(folder)
    model_id = model_id or _target_name(folder)
    try:
        weights = None
        if not (folder / WEIGHTS_NAME).is_file():  # a trainer's output_dir between checkpoints: count the model's
            weights = _tensors_summary(model.adapter_state_dict())
        text = render_model_card(folder, model.config.to_dict(), model_id=model_id,
                                 training_summary=getattr(model, "training_summary", None), weights=weights)
    except CardUnavailable as err:
        text = _card_loaded_with(model)
        if text is None:
            logger.warning(f"adapter saved without a model card: {err}")
            return None
        text = retarget_model_card(text, model_id)
        logger.warning(
            f"{err}; kept the model card of {model.name_or_path} (save with the causalqwen-adapter package and jinja2 "
            "installed to render a fresh one)"
        )
    except Exception as err:  # a card is documentation: never fail the save for it
        logger.warning(f"adapter saved without a model card, rendering it failed: {err!r}")
        return None
    path = folder / CARD_NAME
    path.write_text(text, encoding="utf-8")
    return path


def _unique(items: list) -> list:
    return list(dict.fromkeys(items))


def render_model_card(folder, config: dict, *, model_id: str, training_summary: dict | None = None,
                      weights: dict | None = None) -> str:
    """The card text for the adapter folder `folder` with `config.json`'s dict.

    Sizes come from `folder/model.safetensors`, or from `weights` ({"bytes": None, "parameters", "dtypes"}) when
    the folder has none yet. Raises `CardUnavailable` without the template or jinja2.
    """
    from .configuration_causalqwen import TRANSFORMERS_SUPPORTED  # remote code too; imported late (it imports torch)

    folder = Path(folder)
    template = _template_path()
    text_config = config.get("text_config") or {}
    base_name = config.get("base_model_name_or_path") or ""
    base_revision = config.get("base_model_revision")
    base_model = base_name if is_hub_id(base_name) else None
    training = _training_section(training_summary)

    hub_datasets = [d for d in training["datasets"] if is_hub_id(d) and not d.lower().endswith(_DATA_FILE_SUFFIXES)
                    ] if training else []
    base_card = _base_card_metadata(base_name, base_revision)
    card_data = ModelCardData(
        base_model=base_model,
        base_model_relation="adapter" if base_model else None,  # the Hub needs base_model for a relation
        library_name="transformers",
        pipeline_tag="text-generation",
        license=base_card.get("license"),
        license_name=base_card.get("license_name"),
        license_link=base_card.get("license_link"),
        datasets=hub_datasets or None,
        tags=_unique(TAGS + [text_config.get("model_type") or "qwen2"] + (training_summary or {}).get("tags", [])),
    )
    weights = weights or _safetensors_summary(folder / WEIGHTS_NAME)
    lora = folder / "lora"
    lora_bytes = sum(p.stat().st_size for p in lora.rglob("*") if p.is_file()) if lora.is_dir() else None
    try:
        card = ModelCard.from_template(
            card_data,
            template_path=str(template),
            model_id=model_id,
            base_name=base_name,
            base_model=base_model,
            base_revision=base_revision,
            config=config,  # the head fields, as saved in config.json
            text_config=text_config,
            weights_bytes=f"{weights['bytes']:,}" if weights["bytes"] is not None else None,
            weights_size=_human_bytes(weights["bytes"]) if weights["bytes"] is not None else None,
            parameters=f"{weights['parameters']:,}",
            weights_dtypes=", ".join(weights["dtypes"]),
            lora_bytes=lora_bytes,
            lora_size=_human_bytes(lora_bytes) if lora_bytes is not None else None,
            local_base_note=LOCAL_BASE_NOTE,
            transformers_range=TRANSFORMERS_SUPPORTED,  # what the modeling code checks at load
            project_url=_project_url(),
            training=training,
            versions=_framework_versions(),
        )
    except ImportError as err:  # huggingface_hub renders templates with jinja2, not one of its dependencies
        raise CardUnavailable(f"cannot render the model card template: {err}") from err
    return str(card).rstrip("\n") + "\n"


def retarget_model_card(text: str, model_id: str) -> str:
    """The card with its title and load snippet naming `model_id` (a pushed folder becomes its repo id)."""
    found = re.search(r'AutoModelForCausalLM\.from_pretrained\("([^"]*)", trust_remote_code=True\)', text)
    if found is None or found.group(1) == model_id:
        return text  # not one of our cards, or already right
    old = found.group(1)
    snippet = 'from_pretrained("{}", trust_remote_code=True)'
    text = text.replace(snippet.format(old), snippet.format(model_id))
    return re.sub(rf"^# {re.escape(old)}$", lambda _: f"# {model_id}", text, count=1, flags=re.MULTILINE)


def card_with_base(text: str, old: str, new: str) -> str:
    """The card of an adapter on the base `old` (a local folder or a Hub id), naming the Hub id `new` instead: the
    `base_model` metadata (with `base_model_relation: adapter`), the base's mentions and no local-folder note."""
    card = ModelCard(text)
    card.data.base_model = new
    card.data.base_model_relation = "adapter"
    linked = f"[{new}](https://huggingface.co/{new})"
    body = card.text.replace(" " + LOCAL_BASE_NOTE, "")
    if old:
        body = body.replace(f"[{old}](https://huggingface.co/{old})", linked).replace(f"`{old}`", linked)
    return f"---\n{card.data.to_yaml()}\n---\n{body}"


def _project_url() -> str | None:
    """The project's home page as the installed package's metadata gives it (`[project.urls]`), else None: the card
    names the package without a link rather than one to a page that does not exist."""
    try:
        urls = importlib.metadata.metadata("causalqwen-adapter").get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = dict(url.split(", ", 1) for url in urls if ", " in url)
    return found.get("Homepage") or found.get("Repository") or next(iter(found.values()), None)


def _template_path() -> Path:
    path = Path(__file__).with_name(TEMPLATE_NAME)
    if not path.is_file():
        raise CardUnavailable(f"no model card template {TEMPLATE_NAME} next to {Path(__file__).name}")
    return path


def _target_name(folder: Path) -> str:
    """The folder name the load snippet uses. save_pretrained writes into a staging folder that tempfile.mkdtemp
    names `.<target>.<random>.tmp` next to the target; the card must name the target."""
    staged = re.fullmatch(r"\.(.+)\.[^.]+\.tmp", folder.name)
    return staged.group(1) if staged else folder.name


def is_hub_id(name) -> bool:
    """A Hub repo id, not a local folder (the Hub rejects local paths in `base_model` and `datasets`)."""
    if not isinstance(name, str) or not name or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _base_card_metadata(base_name: str, revision: str | None) -> dict:
    """YAML metadata of the base's own card, from its folder or the local Hub cache (never the network)."""
    if not base_name:
        return {}
    if os.path.isdir(base_name):
        path = Path(base_name) / CARD_NAME
    elif is_hub_id(base_name):
        path = try_to_load_from_cache(base_name, CARD_NAME, revision=revision)
    else:
        return {}
    if not isinstance(path, (str, Path)) or not os.path.isfile(path):
        return {}
    try:
        return metadata_load(path) or {}
    except Exception as err:  # a malformed base card only costs the license line
        logger.info(f"could not read the base's model card {path}: {err!r}")
        return {}


def _card_loaded_with(model) -> str | None:
    """README.md of the adapter folder or repo the model was loaded from, if there is one."""
    source = str(getattr(model, "name_or_path", "") or "")
    if not source:
        return None
    if os.path.isfile(os.path.join(source, CARD_NAME)):
        return Path(source, CARD_NAME).read_text(encoding="utf-8")
    if not is_hub_id(source):
        return None
    try:  # the local cache first, then the Hub (honours HF_HUB_OFFLINE)
        path = try_to_load_from_cache(source, CARD_NAME)
        if not isinstance(path, str):
            path = hf_hub_download(source, CARD_NAME)
        return Path(path).read_text(encoding="utf-8")
    except Exception as err:
        logger.info(f"no model card to keep from {source}: {err!r}")
        return None


def _safetensors_summary(path: Path) -> dict:
    """Bytes, parameter count and dtypes of a safetensors file, from its header (safetensors' own reader)."""
    parameters, dtypes = 0, set()
    with safe_open(path, "pt") as f:
        for key in f.keys():
            tensor = f.get_slice(key)
            parameters += math.prod(tensor.get_shape())
            dtypes.add(_SAFETENSORS_DTYPES.get(tensor.get_dtype(), tensor.get_dtype().lower()))
    return {"bytes": path.stat().st_size, "parameters": parameters, "dtypes": sorted(dtypes)}


def _tensors_summary(tensors: dict) -> dict:
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    return {"bytes": None, "parameters": sum(t.numel() for t in tensors.values()), "dtypes": dtypes}


def _training_section(summary: dict | None) -> dict | None:
    if not summary:
        return None
    unknown = sorted(set(summary) - {"hyperparameters", "metrics", "datasets", "tags"})
    if unknown:
        logger.warning(f"training_summary keys {unknown} are not rendered: use hyperparameters, metrics, datasets")
    datasets = summary.get("datasets") or []
    return {
        "hyperparameters": [(k, _format_value(v)) for k, v in (summary.get("hyperparameters") or {}).items()],
        "metrics": [(k, _format_value(v)) for k, v in (summary.get("metrics") or {}).items()],
        "datasets": [datasets] if isinstance(datasets, str) else [str(d) for d in datasets],
    }


def _format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace("|", "\\|").replace("\n", " ")  # one table cell


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _framework_versions() -> list[tuple[str, str]]:
    versions = []
    for name in _VERSIONED:
        try:
            versions.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


__all__ = ["write_model_card", "render_model_card", "retarget_model_card"]
