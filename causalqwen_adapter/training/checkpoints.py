"""Adapter checkpoints: `AdapterCheckpointMixin` (checkpoints, `save_model`, pushes, resuming and the model card as
adapter folders; only finite heads are checkpointed; resuming only from a checkpoint `resume.py` finds whole), the
check of `output_dir` (`check_output_dir`), and loading a checkpoint's tensors (`load_adapter_tensors`,
`load_backbone_lora`)."""

import copy
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy
from transformers.utils import SAFE_WEIGHTS_NAME, logging
from transformers.utils.hub import PushInProgress

from ..adapter_folder import check_can_write, staged_save
from ..adapter_io import (
    LORA_FOLDER,
    adapter_file_names,
    all_finite,
    check_not_foreign,
    install_folder,
    is_adapter_folder,
    keeps_tokenizer_config,
)
from ..model_card import write_model_card
from ..modeling_causalqwen import CausalQwenForCausalLM
from ..sharding import distribute_like, local_shard
from ..tokenization_causalqwen import TOKENIZER_CONFIG_NAME
from .resume import (
    check_resumable,
    complete_checkpoints,
    from_the_heads,
    last_complete_checkpoint,
    missing_optimizer_state,
    resume_advice,
)

logger = logging.get_logger(__name__)


_LORA_WEIGHTS_NAME = "adapter_model.safetensors"


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
    names = adapter_file_names() | ({TOKENIZER_CONFIG_NAME} if not keeps_tokenizer_config(target) else set())
    with staged_save(target, "the adapter") as staging:
        for name in sorted(names):
            item = source / name
            if item.is_dir():
                shutil.copytree(item, staging / name)
            elif item.is_file():
                shutil.copyfile(item, staging / name)
        install_folder(staging, target)


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
        from ..hub import check_base_for_push

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
        from ..hub import snapshot_for_upload, upload_snapshot  # sharing is the installed package's (hub.py)

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
        from ..hub import upload_snapshot

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
        from ..hub import checkpoint_upload_files, snapshot_for_upload

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
        last complete one in `output_dir`, logging the incomplete ones after it; a path to an incomplete one, or to
        an adapter folder, is refused, naming what to pass instead. So is a checkpoint without the optimizer and
        schedule unless `resume_only_model` (`_check_optimizer_state`)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._last_complete_checkpoint()
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            check_resumable(Path(resume_from_checkpoint), type(self).__name__)
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and os.path.isdir(resume_from_checkpoint):
            self._check_optimizer_state(Path(resume_from_checkpoint))  # not a folder: the Trainer's error
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
        if self.args.resume_only_model:  # the heads from DeepSpeed's files, without its optimizer and schedule
            self.model_wrapped.load_checkpoint(resume_from_checkpoint, load_module_strict=False,
                                               load_optimizer_states=False, load_lr_scheduler_states=False)
        else:
            deepspeed_load_checkpoint(self.model_wrapped, resume_from_checkpoint, load_module_strict=False)
        self._load_optimizer_and_scheduler(resume_from_checkpoint)
        self._load_scaler(resume_from_checkpoint)
        return model, train_dataloader

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's, unless `resume_only_model`: then the optimizer and schedule start fresh."""
        if not self.args.resume_only_model:
            super()._load_optimizer_and_scheduler(checkpoint)

    def _check_optimizer_state(self, checkpoint: Path) -> None:
        """Before a resume: the Trainer starts a fresh optimizer and schedule, silently, from a checkpoint without
        theirs (a `save_only_model` run's, files deleted). Refused unless `resume_only_model` asks for that."""
        sharding = "deepspeed" if self.is_deepspeed_enabled else "fsdp" if self.is_fsdp_enabled else None
        missing = missing_optimizer_state(checkpoint, sharding, self._deepspeed_schedules())
        if self.args.resume_only_model:
            lacks = f" (it has no {', '.join(missing)})" if missing else ""
            logger.warning(f"resume_only_model: resuming the heads and step count of {checkpoint}{lacks}; the "
                           "optimizer (its moments) and the learning-rate schedule start fresh, warmup included")
            if sharding == "deepspeed" and not any(checkpoint.glob("global_step*")):
                raise ValueError(f"{checkpoint} has no DeepSpeed global_step*/ folder, where a run under DeepSpeed "
                                 f"resumes the heads from: {from_the_heads(checkpoint, type(self).__name__)}")
            return
        if not missing:
            return
        others = [p for p in complete_checkpoints(checkpoint.parent) if p != checkpoint
                  and not missing_optimizer_state(p, sharding, self._deepspeed_schedules())]
        another = (f"Resume from {others[-1]}, which has them, or s" if others else
                   f"No other checkpoint in {checkpoint.parent} has them: s")
        raise ValueError(
            f"{checkpoint} has no {' and no '.join(missing)}: resuming from it would restart the optimizer and the "
            f"learning-rate schedule (a run with save_only_model=True writes checkpoints so). {another}et "
            "resume_only_model=True (--resume_only_model) to resume its heads and step count with a fresh "
            "optimizer and schedule"
        )

    def _deepspeed_schedules(self) -> bool:
        """Whether the DeepSpeed config names the scheduler: DeepSpeed's files then hold it, not `scheduler.pt`."""
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        return plugin is not None and "scheduler" in plugin.deepspeed_config

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


def check_output_dir(output_dir) -> None:
    """Before a trainer loads anything: its checkpoints, card and adapter go into `output_dir`; refuse a file there,
    a folder whose files a save would replace (`adapter_io.check_not_foreign`), and a folder this process cannot
    write (or, not there yet, cannot create: `adapter_folder.check_can_write`)."""
    target = Path(output_dir)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"output_dir {target} is a file, not a folder: checkpoints and the adapter are folders "
                              "written there. Choose another output_dir")
    if target.is_dir():
        check_not_foreign(target, (TRAINING_ARGS_NAME,))
    check_can_write(target, "the checkpoints and the adapter")  # not at the final save, hours later


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
