"""The head options of the trainers' configs (`CausalHeadArguments`), each described once, in `CausalQwenConfig`'s
docstring (`config_argument`), the config fields they set for fresh heads (`head_options`), the Trainer flags a
causal-heads trainer refuses (`check_unsupported_flags`), and the `deepspeed` value both configs check before
TrainingArguments reads it (`check_deepspeed_config`)."""

import base64
import binascii
import inspect
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..configuration_causalqwen import (
    CONFIG_CHOICES,
    INTEGER_FIELDS,
    NUMBER_FIELDS,
    VOCABULARY_LOSS_B_NOISE_INIT,
    VOCABULARY_LOSS_GAMMA_INIT,
    CausalQwenConfig,
    check_choice,
    check_number,
)
from ..modeling_causalqwen import CausalQwenForCausalLM


def config_field_help(name: str) -> str:
    """The `CausalQwenConfig` docstring's entry for `name`, as one line: the one place a head option is described."""
    doc = inspect.getdoc(CausalQwenConfig) or ""
    match = re.search(rf"^    {name} \(`[^`]*`(?:, \*optional\*)?\): (.*?)(?=^    \w+ \(`|\Z)", doc, re.M | re.S)
    if match is None:
        raise KeyError(f"CausalQwenConfig's docstring does not describe {name!r}")
    return " ".join(match.group(1).split())


def config_argument(name: str, note: str = "", default=None):
    """A trainer argument that sets the config field `name`: its help is the config's (plus the trainer's `note`), its
    choices the config's, and unset (None) keeps the config's value."""
    text = " ".join(filter(None, (config_field_help(name), note, "Default: the model config's.")))
    metadata = {"help": text.replace("%", "%%")}  # argparse formats help strings
    if name in CONFIG_CHOICES:
        metadata["choices"] = list(CONFIG_CHOICES[name])
    return field(default=default, metadata=metadata)


@dataclass
class CausalHeadArguments:
    """The head options of the trainers' configs: `CausalQwenConfig` fields, used when a trainer builds fresh heads
    (when `model` is a base; an adapter brings its own). Unset (None) means the config's value; each option is
    described once, in `CausalQwenConfig`'s docstring. The loss options and `ovr_distribution` apply to adapters too.
    `resume_only_model` is the trainers' own, not a head option."""

    _cli_command = "train"  # the `causalqwen` command that trains with these arguments

    causal_size: int | None = config_argument("causal_size")
    gamma_init: float | None = config_argument("gamma_init")
    b_noise_init: float | None = config_argument("b_noise_init")
    ovr_threshold_init: float | None = config_argument(
        "ovr_threshold_init", "Unset for fresh heads with absolute thresholds: calibrated on the first training rows "
        "(`calibrate_threshold`)."
    )
    ovr_relative_threshold: bool | None = config_argument("ovr_relative_threshold")
    learnable_threshold: bool | None = config_argument("learnable_threshold")
    action_weight: str | None = config_argument("action_weight")
    action_lora_rank: int | None = config_argument("action_lora_rank")
    numeric: bool = config_argument("numeric", "The data then needs input_ids and numeric_values "
                                    "(causalqwen_adapter.numeric).", default=False)
    num_token_id: int | None = config_argument("num_token_id")
    numeric_decimal_comma: bool = field(default=False, metadata={
        "help": "With --numeric, `causalqwen train` reads the text's numbers as written with decimal commas: 3,5 is "
                "3.5 and 1.000 is 1000 (docs/numbers.md). Default: 3,5 is the numbers 3 and 5, and 1,000 is 1000."})
    numeric_loss_weight: float | None = config_argument("numeric_loss_weight")
    objective: str | None = config_argument("objective", "Applies to adapters too.")
    ovr_trains_location: bool | None = config_argument("ovr_trains_location", "Applies to adapters too.")
    softmax_loss_weight: float | None = config_argument("softmax_loss_weight", "Applies to adapters too.")
    ovr_distribution: str | None = config_argument("ovr_distribution", "Applies to adapters too.")
    ovr_candidates: int | None = config_argument("ovr_candidates", "0: every token of the vocabulary. Applies to "
                                                 "adapters too.")
    location_lr_ratio: float = field(
        default=1.0,
        metadata={"help": "Learning rate of the location path (W_loc, b_loc, W_A, b_A: what ranks the tokens) as "
                  "a multiple of learning_rate."},
    )
    threshold_lr_ratio: float = field(
        default=1.0,
        metadata={"help": "Learning rate of the learnable per-token thresholds C_k as a multiple of learning_rate."},
    )
    hub_base_model_id: str | None = field(
        default=None,
        metadata={"help": "With push_to_hub: the Hub id of the base (e.g. Qwen/Qwen2.5-0.5B-Instruct), written into "
                  "the pushed config.json and model card in place of a local base folder, which nobody else could "
                  "load. Required when the base is a local folder; output_dir keeps naming the folder."},
    )

    resume_only_model: bool = field(
        default=False,
        metadata={"help": "With resume_from_checkpoint: resume the heads and the step count only, starting the "
                  "optimizer and the learning-rate schedule fresh (warmup included). Needed to resume from a "
                  "checkpoint without optimizer.pt/scheduler.pt (one written with save_only_model), which is "
                  "otherwise refused."},
    )

    def __post_init__(self):
        # before TrainingArguments' own parse, which fails on a YAML with a bare JSONDecodeError
        check_deepspeed_config(getattr(self, "deepspeed", None), self._cli_command)
        # Up front, naming the field: a bad value would otherwise surface after the model is loaded (the config's own
        # checks), or steps into training (a NaN rate, a negative one that ascends the gradient).
        for name in ("learning_rate", "location_lr_ratio", "threshold_lr_ratio"):
            if hasattr(self, name):
                setattr(self, name, check_number(name, getattr(self, name), minimum=0))
        for name, bounds in NUMBER_FIELDS.items():
            if getattr(self, name, None) is not None:
                check_number(name, getattr(self, name), **bounds)
        for name in (*INTEGER_FIELDS, "num_token_id", "ovr_candidates"):
            if getattr(self, name, None) is not None:
                minimum = 0 if name in ("num_token_id", "ovr_candidates") else 1
                check_number(name, getattr(self, name), minimum=minimum, integer=True)
        for name, choices in CONFIG_CHOICES.items():
            if getattr(self, name, None) is not None:
                check_choice(name, getattr(self, name), choices)
        super().__post_init__()


def check_deepspeed_config(value, command: str = "train") -> None:
    """`deepspeed` as TrainingArguments takes it (a DeepSpeed JSON config file, a dict, or that JSON inline), or a
    clear refusal: an accelerate YAML config (`recipes/configs/*.yaml`) gave a bare JSONDecodeError."""
    if value is None or isinstance(value, dict) or _inline_config(str(value)) is not None:
        return
    takes = ("--deepspeed (deepspeed=) takes a DeepSpeed JSON config file, such as "
             "recipes/configs/deepspeed_zero3.json, or a dict")
    # the other way to run DeepSpeed, for every refusal but an accelerate YAML (whose message names itself)
    launch = (f". Or leave --deepspeed out and launch with an accelerate config: accelerate launch --config_file "
              f"recipes/configs/deepspeed_zero3.yaml -m causalqwen_adapter.cli {command} <the other flags>")
    path = Path(value)
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            accelerate = "distributed_type" in path.read_text(encoding="utf-8")
        except OSError:
            accelerate = False
        instead = (f"it is an accelerate config: launch with it instead, accelerate launch --config_file {path} -m "
                   f"causalqwen_adapter.cli {command} <the other flags, without --deepspeed>" if accelerate else
                   "write the DeepSpeed config as JSON")
        raise ValueError(f"deepspeed={str(value)!r} is a YAML file: {takes}; {instead}")
    if os.path.isfile(path):  # os.path's: False, not OSError, for a name too long
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise ValueError(f"deepspeed={str(value)!r} cannot be read ({err}): {takes}{launch}") from None
        except ValueError as err:
            raise ValueError(f"deepspeed={str(value)!r} is not valid JSON ({err}): {takes}{launch}") from None
        if not isinstance(config, dict):
            raise ValueError(f"deepspeed={str(value)!r} holds a JSON {type(config).__name__}, not an object: {takes}{launch}")
        return
    raise ValueError(f"deepspeed={str(value)!r}: {'a folder' if os.path.isdir(path) else 'no such file'}. {takes}"
                     f"{launch}")


def _inline_config(text: str) -> dict | None:
    """A DeepSpeed config given as JSON text or base64 of it (accelerate's `HfDeepSpeedConfig` takes both)."""
    for decode in (lambda t: t, lambda t: base64.urlsafe_b64decode(t).decode("utf-8")):
        try:
            config = json.loads(decode(text))
        except (ValueError, UnicodeDecodeError, binascii.Error):
            continue
        if isinstance(config, dict):
            return config
    return None


def check_unsupported_flags(args) -> None:
    """Trainer flags a causal-heads trainer cannot honour, refused rather than ignored."""
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            "use_liger_kernel is not supported: Liger patches a model's own layers and loss by its model type, and "
            "would find none to patch in a CausalQwen model (it only logs that) while the heads compute their own "
            "loss, chunked over the vocabulary as Liger's fused linear cross-entropy is (docs/design.md, Training "
            "losses). Drop the flag."
        )


def head_options(args: CausalHeadArguments, loss: str = "sft") -> dict:
    """The config fields the arguments set for fresh heads (None leaves the config's default; the learning-rate
    ratios are the optimizer's, not the config's). Distillation's tail term sums over the whole vocabulary: its fresh
    heads start from that loss's scale and noise (`gamma_init` 1e-5, `b_noise_init` 1e-6) unless the arguments set
    them."""
    config_fields = CausalQwenForCausalLM.config_class.__dataclass_fields__
    options = {f.name: config_value(f.name, getattr(args, f.name)) for f in fields(CausalHeadArguments)
               if f.name in config_fields and getattr(args, f.name) is not None}
    if loss == "distill":
        options.setdefault("gamma_init", VOCABULARY_LOSS_GAMMA_INIT)
        options.setdefault("b_noise_init", VOCABULARY_LOSS_B_NOISE_INIT)
    return options


def config_value(name: str, value):
    """An argument's value as the config field takes it: `ovr_candidates` 0 (a command line has no None) is the
    config's None, the OvR loss over the whole vocabulary."""
    return None if name == "ovr_candidates" and value == 0 else value
