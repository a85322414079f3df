"""What both trainers share: the head options of their configs, the model they train, adapter checkpoints and
metrics by name.

- `CausalHeadArguments`: the head fields of `CausalSFTConfig` and `CausalDistillConfig` (used for fresh heads);
- `prepare_causal_model`: the `model` argument (a base, an adapter, or a loaded model) as a
  `CausalQwenForCausalLM`, with the head parameters its configured loss can never reach frozen
  (`unreachable_parameters`); `configure_backbone`: frozen, or with LoRA;
- `AdapterCheckpointMixin`: checkpoints, `save_model`, resuming and the model card as adapter folders; only finite
  heads are checkpointed, and only complete checkpoints resumed (`check_output_dir`, `last_complete_checkpoint`);
- `LossMetricsMixin`: the metrics the model's loss returns, averaged per logging window across ranks.
"""

import copy
import inspect
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy
from transformers.utils import SAFE_WEIGHTS_NAME, logging
from transformers.utils.hub import PushInProgress

from .adapter_io import (
    BASE_PREFIXES,
    LORA_FOLDER,
    MODEL_HINT,
    adapter_file_names,
    all_finite,
    check_found,
    check_not_foreign,
    check_supported_base,
    install_folder,
    is_adapter_folder,
    keeps_tokenizer_config,
)
from .configuration_causalqwen import (
    CONFIG_CHOICES,
    INTEGER_FIELDS,
    NUMBER_FIELDS,
    VOCABULARY_LOSS_B_NOISE_INIT,
    VOCABULARY_LOSS_GAMMA_INIT,
    CausalQwenConfig,
    check_choice,
    check_number,
)
from .model_card import write_model_card
from .modeling_causalqwen import CausalQwenForCausalLM
from .sharding import distribute_like, is_partitioned, local_shard
from .tokenization_causalqwen import TOKENIZER_CONFIG_NAME

logger = logging.get_logger(__name__)

_LORA_WEIGHTS_NAME = "adapter_model.safetensors"


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
    described once, in `CausalQwenConfig`'s docstring. The loss options and `ovr_distribution` apply to adapters too."""

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

    def __post_init__(self):
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


class LossMetricsMixin:
    """Metrics the model's loss returns (`outputs.metrics`: a [sum, count] per name), averaged per logging window.

    Summed over ranks on every micro-batch, like TRL gathers its metrics, so no rank waits on another at log time.
    """

    def _check_finite(self, loss: torch.Tensor, mode: str) -> torch.Tensor:
        if not torch.isfinite(loss):
            where = f"step {self.state.global_step + 1}" if mode == "train" else f"evaluation at step {self.state.global_step}"
            raise FloatingPointError(
                f"the training loss is {loss.item()} at {where}: training stopped. The heads diverged or the data is "
                f"bad; lower learning_rate or max_grad_norm and {resume_advice(self.args.output_dir)}"
            )
        return loss

    def _accumulate_metrics(self, mode: str, metrics: dict[str, torch.Tensor]) -> None:
        sums = self.__dict__.setdefault("_metric_sums", {}).setdefault(mode, {})
        for name, value in metrics.items():
            value = self.accelerator.reduce(value.detach(), reduction="sum")
            sums[name] = value if name not in sums else sums[name] + value

    def _pop_metrics(self, mode: str) -> dict[str, tuple[float, float]]:
        """The window's (sum, count) per name for `mode`, and a fresh window."""
        sums = self.__dict__.setdefault("_metric_sums", {}).pop(mode, {})
        return {name: tuple(v.tolist()) for name, v in sums.items()}

    def _log_metrics(self, logs: dict, mode: str) -> dict[str, tuple[float, float]]:
        """Add the window's averages (sum / count; names with no count left out) to `logs`, `eval_`-prefixed in
        evaluation. Returns the raw sums of the names it was asked to leave alone (see `_raw_metric_names`)."""
        raw = self._pop_metrics(mode)
        kept = {name: raw.pop(name) for name in self._raw_metric_names if name in raw}
        prefix = "eval_" if mode == "eval" else ""
        means = {name: total / count for name, (total, count) in raw.items() if count > 0}
        logs.update({prefix + name: value for name, value in means.items()})
        if mode == "train":
            self._warn_if_probabilities_saturate(means)
        return kept

    def _warn_if_probabilities_saturate(self, means: dict[str, float]) -> None:
        """Warn once when every OvR probability of the window sits at ½ (P_y within 0.01 of it, Σ P over the
        scored tokens within 10 % of half their count): the scale dwarfs the locations' spread, so P_k says nothing
        while the ranking still trains. Adam's first steps move W_scale z by about the scale path's rate × ‖z‖₁ each
        (thousands × the rate on a Qwen2 base), and past a point the loss is flat in the scale: it never comes back."""
        config = getattr(self.model, "config", None)
        if getattr(self, "_warned_saturation", False) or "target_prob" not in means or config is None:
            return
        if "candidate_prob_sum" in means:  # the top-k and the target, which may be among them
            prob_sum, scored = means["candidate_prob_sum"], (config.ovr_candidates, config.ovr_candidates + 1)
        elif "ovr_prob_sum" in means:
            prob_sum, scored = means["ovr_prob_sum"], (config.vocab_size, config.vocab_size)
        else:
            return
        if abs(means["target_prob"] - 0.5) < 0.01 and 0.45 * scored[0] <= prob_sum <= 0.55 * scored[1]:
            self._warned_saturation = True
            if not self.is_world_process_zero():
                return
            scale = f", mean scale_U {means['units_mean_scale']:.3g}" if "units_mean_scale" in means else ""
            logger.warning(
                f"Every OvR probability is ½ at step {self.state.global_step} (mean P of the target "
                f"{means['target_prob']:.4f}, their sum over the scored tokens {prob_sum:.4g}{scale}): the scale "
                "dwarfs the spread of the locations, so P_k and the OvR modes' acceptance carry no information (the "
                "ranking still trains). If it grew in training, the scale path's rate (learning_rate) is too high for "
                "this base: lower it (and raise location_lr_ratio to keep the locations' rate); if the heads start "
                "there, lower gamma_init."
            )

    _raw_metric_names: tuple[str, ...] = ()


# Parameter groups of the heads by role, for per-group learning rates (names as in `model.named_parameters()`).
# b_A is a location (loc_S = W_A loc_U + b_A: it ranks); the thresholds only gate.
LOCATION_PARAMETERS = ("abduction.loc.", "action.weight", "action.bias", "action.lora_A", "action.lora_B")
THRESHOLD_PARAMETERS = ("ovr.threshold",)
SCALE_PARAMETERS = ("abduction.scale.", "action.b_noise")  # the scale path


def learning_rate_ratio(name: str, location_lr_ratio: float, threshold_lr_ratio: float) -> float:
    """The multiple of `learning_rate` the parameter `name` (as in `model.named_parameters()`) trains at."""
    if name.startswith(LOCATION_PARAMETERS):
        return location_lr_ratio
    if name.startswith(THRESHOLD_PARAMETERS):
        return threshold_lr_ratio
    return 1.0


class HeadLearningRatesMixin:
    """The Trainer's optimizer with per-role learning rates: `learning_rate` × `location_lr_ratio` for the location
    path (W_loc, b_loc, W_A, b_A: what ranks the tokens), × `threshold_lr_ratio` for learnable thresholds; the scale
    path (W_scale, b_scale, b_noise), numeric head and backbone LoRA at `learning_rate`."""

    def create_optimizer(self, model=None):
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if not fresh:
            return optimizer
        names = {id(p): n for n, p in (self.model if model is None else model).named_parameters()}
        groups = []
        for group in optimizer.param_groups:
            by_ratio: dict[float, list] = {}
            for param in group["params"]:
                ratio = learning_rate_ratio(names.get(id(param), ""), self.args.location_lr_ratio,
                                            self.args.threshold_lr_ratio)
                by_ratio.setdefault(ratio, []).append(param)
            groups += [{**group, "params": params, "lr": group["lr"] * r} for r, params in by_ratio.items()]
        # learning_rate's own groups first: the Trainer logs the first group's rate as `learning_rate`
        groups.sort(key=lambda g: g["lr"] != optimizer.defaults["lr"])
        optimizer.param_groups = groups  # no state yet: the schedulers created next read these learning rates
        return optimizer


def save_training_args(args, folder: Path) -> None:
    """`training_args.bin` as the Trainer writes it, without `hub_token`: the file is a pickle of the whole
    arguments, a checkpoint pushed with `hub_strategy` checkpoint/all_checkpoints uploads it, and a resume never
    reads the token from it."""
    if getattr(args, "hub_token", None) is not None:
        args = copy.copy(args)
        args.hub_token = None
    torch.save(args, Path(folder) / TRAINING_ARGS_NAME)


def install_adapter_copy(source: Path, target: Path) -> None:
    """Copy the adapter files of the saved folder `source` (a trainer's checkpoint) into `target` as a save writes
    them (`adapter_io.install_folder`): nothing else of `source` (optimizer state), and a tokenizer of the user's in
    `target` kept (`keeps_tokenizer_config`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    names = adapter_file_names() | ({TOKENIZER_CONFIG_NAME} if not keeps_tokenizer_config(target) else set())
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        for name in sorted(names):
            item = source / name
            if item.is_dir():
                shutil.copytree(item, staging / name)
            elif item.is_file():
                shutil.copyfile(item, staging / name)
        install_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class AdapterCheckpointMixin:
    """Checkpoints, `save_model`, resuming and the model card of a trainer whose model is a `CausalQwenForCausalLM`:
    adapter folders (heads only, docs/design.md, The adapter folder), never full weights and never TRL's generic card.

    The trainer sets `_card_datasets`, `_card_tags` (lists) and `_card_metric_names` (logged metrics the card shows).
    """

    _card_metric_names: tuple[str, ...] = ()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under FSDP or DeepSpeed, every rank gathers the adapter's tensors alone (the Trainer's own gathers the whole
        model, base included: a 70B base to save 1% of it), and the saving rank writes the adapter folder."""
        if not (self.is_fsdp_enabled or self.is_deepspeed_enabled):
            return super().save_model(output_dir, _internal_call)
        state_dict = self.accelerator.unwrap_model(self.model).gathered_adapter_state_dict()
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """The Trainer's (at `__init__` with `push_to_hub=True`, or at the first push), after checking the base the
        pushes will name (`hub.check_base_for_push`): a local base without `hub_base_model_id` is refused before a
        repo is created or a step is trained."""
        self._check_hub_base()
        super().init_hf_repo(token=token, private=private)

    def _check_hub_base(self) -> None:
        from .hub import check_base_for_push

        config = self.accelerator.unwrap_model(self.model).config
        check_base_for_push(config.base_model_name_or_path, getattr(self.args, "hub_base_model_id", None),
                            via="trainer")

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, token=None,
                    revision=None, private=None, **kwargs):
        """The Trainer's `push_to_hub` (also what `push_to_hub=True` runs when training ends): saves the adapter into
        `output_dir`, waits for the pushes in flight (theirs are older files), and uploads a snapshot of the folder as
        `model.push_to_hub` uploads an adapter (`hub.upload_adapter_folder`): the card retargeted to `hub_model_id`
        (in the upload; `output_dir`'s stays), a tokenizer the repo holds kept, the stale LoRA and remote code of an
        earlier push deleted; only the adapter's files (`hub.adapter_upload_files`): never `training_args.bin`, a
        checkpoint, a link or another file of `output_dir`. `kwargs` go to
        `create_model_card` (`dataset_name`, `tags`). Returns the `CommitInfo`, or its `Future` with
        `blocking=False`."""
        from .hub import snapshot_for_upload, upload_snapshot  # sharing is the installed package's (hub.py)

        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        kwargs.pop("model_name", None)  # TRL's card takes it; the adapter's card names the repo
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self._check_hub_base()
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        tags = kwargs.pop("tags", None)
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [t for t in getattr(self.model, "model_tags", None) or [] if t not in tags]
        self.create_model_card(tags=tags or None, **kwargs)
        self._finish_current_push()  # a save's push landing after this one would put older heads back
        snapshot = snapshot_for_upload(self.args.output_dir)  # the adapter's files only
        options = dict(token=token, private=private, commit_message=commit_message, via="trainer",
                       revision=revision if revision is not None else self.args.hub_revision,
                       base_model_id=getattr(self.args, "hub_base_model_id", None))
        if blocking:
            return upload_snapshot(snapshot, self.hub_model_id, **options)
        return self._hub_jobs().run_as_future(self._reported_push, snapshot, self.hub_model_id, **options)

    def _reported_push(self, snapshot, repo_id: str, **options):
        """`hub.upload_snapshot` in the background, a failure logged at once and kept for the end of `train()` (a
        failed background push raised in a Future nobody reads: training reported success, the repo stayed behind)."""
        from .hub import upload_snapshot

        try:
            return upload_snapshot(snapshot, repo_id, **options)
        except Exception as err:
            what = f"{repo_id}/{options['path_in_repo']}" if options.get("path_in_repo") else repo_id
            failure = f"{options.get('commit_message') or 'push'} to {what}: {type(err).__name__}: {err}"
            self._failed_pushes = [*getattr(self, "_failed_pushes", []), failure]
            logger.warning(f"pushing to the Hub failed ({failure}); training goes on and the files stay in "
                           f"{self.args.output_dir}: push them later with trainer.push_to_hub()")
            raise

    def _hub_jobs(self):
        """The run's queue of background pushes (an `HfApi`'s; every job passes its token): its commits land in the
        order they were made, every request of them off the training loop."""
        from huggingface_hub import HfApi

        if getattr(self, "_hub_api", None) is None:
            self._hub_api = HfApi()
        return self._hub_api

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """The push at each save of a run with `push_to_hub=True` (`hub_strategy` every_save, checkpoint or
        all_checkpoints), in the background as the Trainer's. The Trainer's copies only `config.json` and the weights
        from the checkpoint into `output_dir` and saves the tokenizer there: for an adapter, a repo without its remote
        code and card (it could not be loaded) and the base's tokenizer files in `output_dir`. This installs the
        checkpoint's adapter files into `output_dir` (as a save does) and uploads it as `push_to_hub`; the checkpoint
        itself goes to `last-checkpoint/` or `checkpoint-N/` of the repo as the Trainer sends it."""
        from .hub import checkpoint_upload_files, snapshot_for_upload

        args = self.args
        if not self.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
            return
        if not args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return
        self.callback_handler.on_push_begin(args, self.state, self.control)
        output_dir = Path(args.output_dir)
        install_adapter_copy(Path(checkpoint_folder), output_dir)
        save_training_args(args, output_dir)
        commit_message = (f"Training in progress, step {self.state.global_step}" if args.save_strategy == SaveStrategy.STEPS
                          else f"Training in progress, epoch {int(self.state.epoch)}")
        api = self._hub_jobs()
        # snapshots taken now, on the training loop: the files of this save, whatever later saves and rotation do
        jobs = [api.run_as_future(self._reported_push, snapshot_for_upload(output_dir), self.hub_model_id,
                                  token=args.hub_token, revision=args.hub_revision, commit_message=commit_message,
                                  base_model_id=getattr(args, "hub_base_model_id", None), via="trainer")]
        if args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            checkpoint = Path(checkpoint_folder)
            path_in_repo = "last-checkpoint" if args.hub_strategy == HubStrategy.CHECKPOINT else checkpoint.name
            snapshot = snapshot_for_upload(checkpoint, checkpoint_upload_files(checkpoint), into=output_dir)
            jobs.append(api.run_as_future(self._reported_push, snapshot, self.hub_model_id, path_in_repo=path_in_repo,
                                          token=args.hub_token, revision=args.hub_revision,
                                          commit_message=commit_message + ", checkpoint"))
        if self.push_in_progress is None or self.push_in_progress.is_done():
            self.push_in_progress = PushInProgress(jobs)
        else:
            self.push_in_progress.jobs.extend(jobs)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, never of heads that are not finite: such a checkpoint could not be loaded, and
        rotation (`save_total_limit`) would delete the good ones before it. Checked on every rank before anything
        is written, so that all stop together."""
        bad = self._non_finite_adapter_tensors()
        if bad:
            step = self.state.global_step
            raise FloatingPointError(
                f"at step {step} the adapter tensors {bad} hold NaN or infinite values: training stopped before "
                f"writing {PREFIX_CHECKPOINT_DIR}-{step}, which could not be loaded. The heads diverged; lower "
                f"learning_rate or max_grad_norm and {resume_advice(self.args.output_dir)}"
            )
        super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's, without the frozen base that it would write into every checkpoint under sharding: under FSDP
        the whole model gathered (`pytorch_model_fsdp.bin`) for a resume that reads the adapter folder
        (`_load_from_checkpoint`); under DeepSpeed each rank's partition of the base (`frozen_param_fragments`). A
        70B base, every checkpoint. The optimizer's state covers the trained parameters only."""
        if self.is_deepspeed_enabled:
            from accelerate.utils import DeepSpeedSchedulerWrapper

            self.model_wrapped.save_checkpoint(output_dir, exclude_frozen_parameters=True)
            scheduler_saved = isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper)  # inside DeepSpeed's files
        elif self.is_fsdp_enabled:
            from accelerate.utils import save_fsdp_optimizer

            save_fsdp_optimizer(self.accelerator.state.fsdp_plugin, self.accelerator, self.optimizer, self.model,
                                output_dir)
            scheduler_saved = False
        else:
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save and not scheduler_saved:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _non_finite_adapter_tensors(self) -> list[str]:
        """The adapter tensors holding NaN or ±inf, the same names on every rank (each checks its own shards)."""
        model = self.accelerator.unwrap_model(self.model)
        state = model.state_dict(keep_vars=True)
        names = sorted(model.adapter_keys())
        flags = torch.tensor([float(not all_finite(local_shard(state[k].detach()))) for k in names],
                             device=self.args.device)
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags, reduction="sum")
        return [k for k, flag in zip(names, flags.tolist()) if flag > 0]

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """The Trainer's, resuming only from a complete checkpoint (see `last_complete_checkpoint`): `True` takes the
        last complete one in `output_dir`, logging the incomplete ones after it; a path to an incomplete one is
        refused, naming what to pass instead."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._last_complete_checkpoint()
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            check_resumable(Path(resume_from_checkpoint))
        self._failed_pushes = []
        output = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)  # waits for the pushes in flight
        if self._failed_pushes:
            logger.warning(f"{len(self._failed_pushes)} of this run's pushes to the Hub failed, so the repo "
                           f"{self.hub_model_id} may hold older files than {self.args.output_dir}: "
                           + "; ".join(self._failed_pushes) + ". Push again with trainer.push_to_hub().")
        return output

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The Trainer's; under DeepSpeed a resume loads checkpoints without the frozen base
        (`_save_optimizer_and_scheduler`), which the Trainer's strict load would refuse as missing keys."""
        if not (self.is_deepspeed_enabled and resume_from_checkpoint is not None):
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        from transformers.integrations.deepspeed import deepspeed_load_checkpoint

        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        deepspeed_load_checkpoint(self.model_wrapped, resume_from_checkpoint, load_module_strict=False)
        self._load_optimizer_and_scheduler(resume_from_checkpoint)
        self._load_scaler(resume_from_checkpoint)
        return model, train_dataloader

    def _last_complete_checkpoint(self) -> str | bool:
        output_dir = self.args.output_dir
        last, incomplete = last_complete_checkpoint(output_dir)
        described = "; ".join(f"{path} is incomplete ({problem})" for path, problem in incomplete)
        if last is None:
            if incomplete:
                raise ValueError(f"no complete checkpoint in {output_dir} to resume from ({described}: a run stopped "
                                 "while saving leaves them so). Train without resume_from_checkpoint.")
            return True  # no checkpoint at all: the Trainer's own error
        if incomplete:
            logger.warning(f"{described}: the run was stopped while writing it. Resuming from {last}, the last "
                           "complete checkpoint.")
        return str(last)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """An adapter folder (docs/design.md, The adapter folder) plus `training_args.bin`; no tokenizer files: the base
        provides it (the folder's `tokenizer_config.json` points AutoTokenizer at it)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        if os.path.isdir(output_dir):
            check_not_foreign(Path(output_dir), (TRAINING_ARGS_NAME,))
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        model.training_summary = self._training_summary()  # rendered into the adapter's README.md
        model.save_pretrained(output_dir, state_dict=state_dict)
        save_training_args(self.args, Path(output_dir))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Load the adapter tensors of a checkpoint (the Trainer's version expects full weights)."""
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        weights_file = os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_NAME)
        if not os.path.isfile(weights_file):
            raise ValueError(
                f"{resume_from_checkpoint} holds no {SAFE_WEIGHTS_NAME}: it is not a checkpoint written by "
                f"{type(self).__name__} (pass an output_dir/checkpoint-N folder)"
            )
        load_adapter_tensors(model, weights_file)
        load_backbone_lora(model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        logger.info(f"Loading best adapter from {self.state.best_model_checkpoint} (score: {self.state.best_metric}).")
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **kwargs):
        """Write the adapter's own model card into `output_dir`, never TRL's, and only beside the adapter.

        TRL writes a generic `README.md` into `output_dir` at every checkpoint and before `push_to_hub`, which would
        replace the adapter's card (docs/design.md, The adapter folder: rendered from `model_card/`). This passes through to the model's card
        writer, with the run recorded in `model.training_summary`, once `output_dir` holds the adapter (`save_model`
        writes the card with it): a `README.md` there before would be taken for the user's by that save.
        `dataset_name` and `tags` are kept for every later card of this run (checkpoints, `save_model`);
        `model_name` is TRL's and not used.
        """
        for name in [dataset_name] if isinstance(dataset_name, str) else dataset_name or []:
            if name not in self._card_datasets:
                self._card_datasets.append(name)
        for tag in [tags] if isinstance(tags, str) else tags or []:
            if tag not in self._card_tags:
                self._card_tags.append(tag)
        output_dir = Path(self.args.output_dir)
        if not self.is_world_process_zero() or not is_adapter_folder(output_dir):
            return
        model = self.accelerator.unwrap_model(self.model)
        model.training_summary = self._training_summary()
        write_model_card(model, output_dir)

    def _training_summary(self) -> dict:
        """The run as the model card shows it (see model_card.py): settings, last logged metrics, data, tags."""
        args = self.args
        backbone = self.accelerator.unwrap_model(self.model).model
        lora = backbone.peft_config.get("default") if getattr(backbone, "_hf_peft_config_loaded", False) else None
        hyperparameters = {
            "learning_rate": args.learning_rate,
            "lr_scheduler_type": getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type),
            "optimizer": getattr(args.optim, "value", args.optim),
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "total_train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps
            * args.world_size,
            "steps": self.state.global_step,
            "seed": args.seed,
            "mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "no",
            "backbone": "frozen" if lora is None else f"frozen + LoRA r={lora.r} on {sorted(lora.target_modules)}",
        }
        if getattr(args, "max_length", None) is not None:
            hyperparameters["max_length"] = args.max_length
        metrics = {}
        for entry in self.state.log_history:  # the latest value of each metric
            for key in ("loss", *self._card_metric_names, "train_loss"):
                for name in (key, f"eval_{key}"):
                    if name in entry:
                        metrics[name] = entry[name]
        return {
            "hyperparameters": hyperparameters,
            "metrics": metrics,
            "datasets": list(self._card_datasets),
            "tags": [*self._tag_names, *self._card_tags],
        }


def check_unsupported_flags(args) -> None:
    """Trainer flags a causal-heads trainer cannot honour, refused rather than ignored."""
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            "use_liger_kernel is not supported: Liger patches a model's own layers and loss by its model type, and "
            "would find none to patch in a CausalQwen model (it only logs that) while the heads compute their own "
            "loss, chunked over the vocabulary as Liger's fused linear cross-entropy is (docs/design.md, Training "
            "losses). Drop the flag."
        )


def check_output_dir(output_dir) -> None:
    """Before a trainer loads anything: its checkpoints, card and adapter go into `output_dir`; refuse a file there,
    or a folder whose files a save would replace (`adapter_io.check_not_foreign`)."""
    target = Path(output_dir)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"output_dir {target} is a file, not a folder: checkpoints and the adapter are folders "
                              "written there. Choose another output_dir")
    if target.is_dir():
        check_not_foreign(target, (TRAINING_ARGS_NAME,))


def checkpoint_problem(folder: Path) -> str | None:
    """Why a run cannot resume from `folder`, or None. The Trainer writes a checkpoint's `trainer_state.json` last, so
    a run killed while saving leaves the adapter files (or some of them) without it."""
    for name in ("config.json", SAFE_WEIGHTS_NAME, TRAINER_STATE_NAME):
        if not (folder / name).is_file():
            return f"no {name}"
    try:
        json.loads((folder / TRAINER_STATE_NAME).read_text())
    except (OSError, ValueError):
        return f"{TRAINER_STATE_NAME} is unreadable"
    return None


def last_complete_checkpoint(output_dir) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The `checkpoint-N` folder of `output_dir` with the highest N that a run can resume from (None if there is
    none), and the incomplete ones after it with what they lack."""
    pattern = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")
    found = [p for p in Path(output_dir).iterdir() if pattern.fullmatch(p.name) and p.is_dir()] \
        if os.path.isdir(output_dir) else []
    incomplete = []
    for path in sorted(found, key=lambda p: int(pattern.fullmatch(p.name).group(1)), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, incomplete[::-1]
        incomplete.append((path, problem))
    return None, incomplete[::-1]


def resume_advice(output_dir) -> str:
    """What to resume from after training stopped: the last checkpoint a run can resume from, or that there is none."""
    last, _ = last_complete_checkpoint(output_dir)
    if last is None:
        return f"train again: there is no checkpoint to resume from in {output_dir}"
    return f"resume from {last} (resume_from_checkpoint={str(last)!r})"


def check_resumable(checkpoint: Path) -> None:
    """Refuse an explicit `resume_from_checkpoint` that a killed run left incomplete, naming what to pass."""
    problem = checkpoint_problem(checkpoint) if checkpoint.is_dir() else None
    if problem is None:
        return  # a complete checkpoint, or not a folder at all (the Trainer's and `_load_from_checkpoint`'s errors)
    last, _ = last_complete_checkpoint(checkpoint.parent)
    what = (f"pass resume_from_checkpoint={last}, the last complete checkpoint in {checkpoint.parent}" if last else
            f"{checkpoint.parent} holds no complete checkpoint: train without resume_from_checkpoint")
    raise ValueError(f"{checkpoint} is incomplete ({problem}): it is not a checkpoint the trainer finished writing (a "
                     f"run stopped while saving leaves it so), so training cannot resume from it; {what}")


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


def check_can_calibrate(model: CausalQwenForCausalLM) -> None:
    """Calibrating absolute thresholds runs the backbone before training: refused when it is partitioned."""
    if any(map(is_partitioned, model.model.parameters())):
        raise ValueError(
            "absolute OvR thresholds (ovr_relative_threshold false) are calibrated on the base's hidden states before "
            "training, but DeepSpeed ZeRO-3 with zero3_init_flag true has loaded the base partitioned: pass "
            "--ovr_threshold_init (a threshold), or set zero3_init_flag: false in the accelerate config "
            "(ACCELERATE_DEEPSPEED_ZERO3_INIT=false) so that the base loads whole"
        )


@torch.no_grad()
def calibrate_threshold(model: CausalQwenForCausalLM, batches, max_positions: int = 1024) -> float:
    """The uniform OvR threshold C at which fresh heads rank tokens most like their base, measured on data.

    At init loc_S is the base's logits and scale_S ∝ ‖W_k‖₁, so argmax_k P_k depends on C alone: too low or too high
    and the row norms, not the logits, pick the token. Over up to `max_positions` target positions of `batches`
    (dicts with input_ids, attention_mask, labels), C is chosen among quantiles of the per-position largest logit as
    the one whose standard-mode argmax agrees most often with the base's argmax. Sets and returns it.
    """
    zs = []
    for batch in batches:
        labels = batch.get("labels", batch["input_ids"])
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                             position_ids=batch.get("position_ids")).last_hidden_state
        targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        zs.append(hidden[targets != -100])
        if sum(len(z) for z in zs) >= max_positions:
            break
    if not zs or sum(len(z) for z in zs) == 0:
        raise ValueError("no target position to calibrate the OvR threshold on: pass ovr_threshold_init explicitly")
    return calibrate_threshold_on_features(model, torch.cat(zs)[:max_positions])


@torch.no_grad()
def calibrate_threshold_on_features(model: CausalQwenForCausalLM, z: torch.Tensor) -> float:
    """`calibrate_threshold` on final hidden states z [N, H] already computed (cached features)."""
    if model.config.ovr_relative_threshold:
        raise ValueError(
            "calibrate_threshold chooses an absolute threshold (compared with loc_S); these heads compare C with "
            "log softmax(loc_S), where C = log ½ needs no data. Build the heads with ovr_relative_threshold=False "
            "to calibrate"
        )
    loc_U, scale_U = model.abduction(z.to(model.action.bias.dtype))
    loc_S, scale_S = model.action(loc_U, scale_U, "standard", 1.0)
    loc_S, scale_S = loc_S.float(), scale_S.float().clamp_min(torch.finfo(torch.float32).tiny)
    base_argmax = loc_S.argmax(-1)
    quantiles = torch.linspace(0.0, 0.95, 20, device=loc_S.device)  # torch.quantile wants both on one device
    candidates = torch.quantile(loc_S.max(-1).values, quantiles).tolist()
    agreement = [((loc_S - c) / scale_S).argmax(-1).eq(base_argmax).float().mean().item() for c in candidates]
    best = max(range(len(candidates)), key=lambda i: agreement[i])
    threshold = float(candidates[best])
    model.ovr.threshold.fill_(threshold)  # under no_grad: a learnable threshold is a leaf
    model.config.ovr_threshold_init = threshold
    model.ovr.threshold_init = threshold
    logger.info(f"OvR threshold calibrated on {len(z)} positions: C = {threshold:.3f} (standard-mode argmax agrees "
                f"with the base's on {agreement[best]:.1%} of them)")
    return threshold


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


def load_adapter_tensors(model: CausalQwenForCausalLM, weights_file: str) -> None:
    """Copy a checkpoint's adapter tensors into the model, strict on the adapter keys.

    In place (not `assign`): the optimizer and the DDP wrapper keep references to these very parameters. Under FSDP2
    each rank keeps its shard of every tensor (the file holds whole ones).
    """
    tensors = load_file(weights_file)
    expected = model.adapter_keys()
    if set(tensors) != expected:
        raise ValueError(
            f"{weights_file} does not hold this model's adapter tensors: missing {sorted(expected - set(tensors))}, "
            f"unexpected {sorted(set(tensors) - expected)}. Resume with the heads configuration the checkpoint was "
            "trained with (causal_size, learnable_threshold)."
        )
    params = model.state_dict(keep_vars=True)
    for key, value in tensors.items():
        if value.shape != params[key].shape:
            raise ValueError(f"{weights_file} holds {key} of shape {tuple(value.shape)}, the model's is "
                             f"{tuple(params[key].shape)}: resume with the heads configuration it was trained with")
    bad = sorted(k for k, v in tensors.items() if not all_finite(v))
    if bad:
        raise ValueError(f"{weights_file}: {bad} hold NaN or infinite values, so training cannot resume from it: "
                         "resume from an earlier checkpoint")
    tensors = {k: distribute_like(v, params[k]) for k, v in tensors.items()}
    model.load_state_dict(tensors, strict=False)  # raises on a shape mismatch


def load_backbone_lora(model: CausalQwenForCausalLM, checkpoint: str) -> None:
    from_disk = os.path.join(checkpoint, LORA_FOLDER, _LORA_WEIGHTS_NAME)
    has_lora = getattr(model.model, "_hf_peft_config_loaded", False)
    if not os.path.isfile(from_disk):
        if has_lora:
            raise ValueError(f"{checkpoint} has no {LORA_FOLDER}/{_LORA_WEIGHTS_NAME} but the backbone is trained with LoRA")
        return
    if not has_lora:
        raise ValueError(f"{checkpoint} holds backbone LoRA weights: pass the same peft_config to resume from it")
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    # transformers saves backbone adapters in PEFT's layout, under the `base_model.model.` prefix.
    tensors = {k.removeprefix("base_model.model."): v for k, v in load_file(from_disk).items()}
    expected = set(get_peft_model_state_dict(model.model))
    if set(tensors) != expected:
        raise ValueError(
            f"{from_disk} does not match the LoRA adapter on the backbone: missing {sorted(expected - set(tensors))}, "
            f"unexpected {sorted(set(tensors) - expected)}. Resume with the peft_config the checkpoint was trained with."
        )
    set_peft_model_state_dict(model.model, tensors)


__all__ = [
    "AdapterCheckpointMixin", "CausalHeadArguments", "HeadLearningRatesMixin", "LossMetricsMixin", "calibrate_threshold",
    "calibrate_threshold_on_features", "check_output_dir", "check_resumable", "last_complete_checkpoint",
    "learning_rate_ratio", "resume_advice",
    "configure_backbone", "freeze_unreachable_parameters", "head_options", "prepare_causal_model",
    "unreachable_parameters",
]
