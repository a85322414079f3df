"""The model a trainer trains: its `model` argument (a base, an adapter, or a loaded model) as a
`CausalQwenForCausalLM` (`prepare_causal_model`), with the head parameters its configured loss can never reach frozen
(`unreachable_parameters`), and the backbone frozen or with LoRA (`configure_backbone`)."""

import os
from contextlib import contextmanager

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.utils import logging

from ..adapter_io import BASE_PREFIXES, MODEL_HINT, check_found, check_supported_base
from ..modeling_causalqwen import CausalQwenForCausalLM
from .arguments import config_value, head_options
from .mixins import SCALE_PARAMETERS, THRESHOLD_PARAMETERS

logger = logging.get_logger(__name__)


def prepare_causal_model(model, args, loss: str = "sft") -> tuple[CausalQwenForCausalLM, bool]:
    """The trainers' `model` argument as a `CausalQwenForCausalLM`, and whether its heads are fresh: an adapter
    (folder, Hub id or loaded) keeps its heads; a base (folder, Hub id or loaded causal LM) gets fresh heads from the
    config's head fields. The head parameters that `loss` (`"sft"`: `forward(labels=...)`; `"distill"`: the
    distillation loss), as the config sets it, can never reach are frozen (`freeze_unreachable_parameters`)."""
    fresh = False
    if isinstance(model, (str, os.PathLike)):
        model, fresh = _load_model(str(model), args, loss)
    elif isinstance(model, PreTrainedModel) and not isinstance(model, CausalQwenForCausalLM):
        model, fresh = CausalQwenForCausalLM.from_base(model, **head_options(args, loss)), True  # checks the base
    elif not isinstance(model, CausalQwenForCausalLM):
        raise TypeError(
            f"model must be a CausalQwenForCausalLM, a base causal LM (*ForCausalLM), or a path/Hub id of either, got "
            f"{type(model).__name__}"
        )
    if args.learnable_threshold and not model.config.learnable_threshold:
        raise ValueError(
            "learnable_threshold=True but this model's heads have a fixed threshold: it applies to fresh heads "
            "only (pass the base instead of an adapter, or drop the option)"
        )
    relative = getattr(args, "ovr_relative_threshold", None)
    if not fresh and relative is not None and relative != model.config.ovr_relative_threshold:
        raise ValueError(
            f"ovr_relative_threshold={relative} but this adapter's thresholds were trained with "
            f"ovr_relative_threshold={model.config.ovr_relative_threshold}: it applies to fresh heads only (pass the "
            "base instead of an adapter, or drop the option)"
        )
    if args.numeric and not model.config.numeric:
        raise ValueError("numeric=True but this adapter's heads are not numeric: it applies to fresh heads only (pass "
                         "the base instead of an adapter, or drop the option)")
    # The loss is the model's (forward(labels=...)): the trainer's choice goes into its config, saved with it.
    changed = False
    for name in ("objective", "softmax_loss_weight", "ovr_trains_location", "ovr_distribution", "ovr_candidates",
                 "distill_tail_weight"):
        value = getattr(args, name, None)  # distill_tail_weight is the distillation config's only
        if value is not None and config_value(name, value) != getattr(model.config, name):
            setattr(model.config, name, config_value(name, value))
            changed = True
    if changed:
        model.config.__post_init__()  # validates the new values
    freeze_unreachable_parameters(model, loss)
    return model, fresh


# The head parameters by path (names as in `model.named_parameters()`, prefixes).
_ABDUCTION_LOCATION = ("abduction.loc.",)
_ACTION_LOCATION = ("action.weight", "action.bias", "action.lora_A", "action.lora_B")
_NUMERIC_REGRESSION = ("numeric.weight", "numeric.bias", "numeric.log_scale")
_LOSSES = ("sft", "distill")


def unreachable_parameters(model: CausalQwenForCausalLM, loss: str = "sft") -> list[str]:
    """The trainable head parameters that `loss`, as `model.config` sets it, never gives a gradient, whatever the data.

    `"sft"` is `forward(labels=...)` (docs/design.md, Training losses):
    - `objective="softmax"`: the cross-entropy of loc_S alone, so the scale path (W_scale, b_scale, b_noise) and the
      thresholds; the scale path stays when numeric heads train (their NLL reads scale_U + |b_noise|);
    - `softmax_loss_weight=0` without `ovr_trains_location`: the OvR loss stops at the locations, so the location
      path (W_A, b_A, or the LoRA factors of W_A, and W_loc, b_loc); W_loc and b_loc stay when numeric heads train
      (their NLL reads loc_U). The loss would give these exact zeros (and allocate a V × C one for W_A);
    - `numeric_loss_weight=0`: the numeric regression head (w, b, s); the direction d stays (it enters at the input).
    `"distill"` is the distillation loss: the location path without `ovr_trains_location` (the locations stay the
    teacher's), and the numeric head, which it never reads.

    What the data decides is not here: numeric heads get no gradient on a batch without a `<NUM>` target (see
    `CausalSFTConfig.ddp_find_unused_parameters`).
    """
    if loss not in _LOSSES:
        raise ValueError(f"loss={loss!r}: choose one of {', '.join(_LOSSES)}")
    config = model.config
    numeric = config.numeric and (loss == "sft" and config.numeric_loss_weight > 0)
    unreached: tuple[str, ...] = ()
    if loss == "distill":
        if not config.ovr_trains_location:
            unreached += _ABDUCTION_LOCATION + _ACTION_LOCATION
        if config.numeric:
            unreached += ("numeric.",)
    else:
        if config.objective == "softmax":
            unreached += THRESHOLD_PARAMETERS + (() if numeric else SCALE_PARAMETERS)
        elif config.softmax_loss_weight == 0 and not config.ovr_trains_location:
            unreached += _ACTION_LOCATION + (() if numeric else _ABDUCTION_LOCATION)
        if config.numeric and not numeric:
            unreached += _NUMERIC_REGRESSION
    if not unreached:
        return []
    return [name for name, p in model.named_parameters()
            if p.requires_grad and not name.startswith(BASE_PREFIXES) and name.startswith(unreached)]


def freeze_unreachable_parameters(model: CausalQwenForCausalLM, loss: str = "sft") -> list[str]:
    """Freeze `unreachable_parameters(model, loss)`, so that DDP (whose `find_unused_parameters` stays off), FSDP,
    DeepSpeed and the optimizer see only what trains; logs them once (first process). Returns their names."""
    names = unreachable_parameters(model, loss)
    params = dict(model.named_parameters())
    for name in names:
        params[name].requires_grad_(False)
    if names and int(os.environ.get("RANK", "0")) == 0:
        config = model.config
        logger.info(
            f"Frozen, the {loss} loss never reaches them with objective={config.objective!r}, softmax_loss_weight="
            f"{config.softmax_loss_weight}, ovr_trains_location={config.ovr_trains_location}"
            + (f", numeric_loss_weight={config.numeric_loss_weight}" if config.numeric else "")
            + f": {', '.join(names)}"
        )
    return names


def _load_model(name: str, args, loss: str = "sft") -> CausalQwenForCausalLM:
    """An adapter (model_type causalqwen) loads with its heads; a base gets fresh heads from the config."""
    kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    kwargs.pop("trust_remote_code", None)  # the package's own code is used, not the folder's copy
    revision = kwargs.pop("revision", None)
    dtype = kwargs.pop("dtype", "float32")
    if isinstance(dtype, str) and dtype in ("bfloat16", "float16", "float32"):
        dtype = getattr(torch, dtype)
    check_found(name, "model", MODEL_HINT)
    config, _ = PreTrainedConfig.get_config_dict(name, revision=revision)
    model_type = config.get("model_type")
    with base_loading_under_zero3(args):
        if model_type == CausalQwenForCausalLM.config_class.model_type:
            return CausalQwenForCausalLM.from_pretrained(name, revision=revision, dtype=dtype, **kwargs), False
        heads = head_options(args, loss)
        check_supported_base(AutoConfig.from_pretrained(name, revision=revision), name)  # before loading any weights
        base = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=dtype, **kwargs)
        return CausalQwenForCausalLM.from_base(base, revision=revision, **heads), True


@contextmanager
def base_loading_under_zero3(args):
    """Under DeepSpeed ZeRO-3, once accelerate has registered its config, transformers builds every model partitioned
    (`deepspeed.zero.Init`) whatever the config's `zero3_init_flag`. With the flag true (recipes/configs/
    deepspeed_zero3.yaml) that is what happens: the base loads partitioned, no rank holds it whole, and `from_base`
    gathers only the output layer to copy it into W_A (the heads are built whole and partitioned by
    `deepspeed.initialize`). With the flag false the base is read whole on every rank, as the flag asks."""
    from transformers.integrations.deepspeed import (
        is_deepspeed_zero3_enabled,
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None or plugin.zero3_init_flag or not is_deepspeed_zero3_enabled():
        yield
        return
    # the config object transformers holds a weak reference to: the Trainer's (`--deepspeed`) or accelerate's
    registered = getattr(args, "hf_deepspeed_config", None) or plugin.dschf
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(registered)


def configure_backbone(model: CausalQwenForCausalLM, peft_config) -> None:
    """Frozen base weights; LoRA on the backbone when asked (or when the loaded adapter brought some)."""
    backbone = model.model
    has_lora = getattr(backbone, "_hf_peft_config_loaded", False)
    if peft_config is None:
        backbone.requires_grad_(False)
        if has_lora:  # an adapter trained with LoRA: its LoRA matrices keep training with the heads
            for name, param in backbone.named_parameters():
                param.requires_grad_("lora_" in name)
        return
    if has_lora:
        raise ValueError("the backbone already carries a LoRA adapter: drop peft_config to keep training it")
    if getattr(peft_config, "modules_to_save", None):
        raise ValueError("peft_config.modules_to_save is not supported: the causal heads are always trained and saved")
    backbone.add_adapter(peft_config)  # injects LoRA and freezes every other backbone weight
