"""CausalSFTTrainer: TRL's `SFTTrainer` training the causal heads with the chunked OvR loss (DESIGN §2.3).

Everything TRL does for SFT stays: dataset formats (text, prompt/completion, chat messages), completion- and
assistant-only masks, packing, the collator, logging, `accelerate launch`. What changes:

- the loss: the backbone gives z, the abduction head gives (loc_U, scale_U) at the positions that have a target, and
  `losses.chunked_ovr_loss` scores them against the action head without building [tokens × vocab] tensors;
- the model: a `CausalQwenForCausalLM`, built from a Qwen2 base (fresh heads) or loaded from an adapter folder;
  the backbone stays frozen (optionally with LoRA on it);
- checkpoints and `save_model` hold adapter folders (heads only, DESIGN §3), and resuming loads those tensors back.

Why the loss runs inside `model(...)`: under DDP the forward must go through the DDP wrapper (it prepares the
gradient reducer there, and with `find_unused_parameters` it walks the graph from the forward's outputs), so a loss
computed on submodules outside the wrapped call would either not sync or fail. Like TRL's fused LM head
(`trl.trainer.utils.add_fused_lm_head`), the trainer gives the model's forward an extra path, `ovr_loss=True`, that
returns the loss and its statistics instead of logits; without it the forward is the model's own.
"""

import functools
import os
import types
from dataclasses import dataclass, field, fields
from pathlib import Path

import pyarrow.compute as pc
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedConfig, Qwen2ForCausalLM, TrainingArguments, set_seed
from transformers.modeling_outputs import ModelOutput
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.utils import logging
from trl import SFTConfig, SFTTrainer

from .losses import chunked_ovr_loss
from .numeric import NumericCollator, numeric_statistics
from .modeling_causalqwen import ADAPTER_WEIGHTS_NAME, LORA_FOLDER, CausalQwenForCausalLM, _shift_labels

logger = logging.get_logger(__name__)

_LORA_WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass
class CausalHeadArguments:
    """The head hyper-parameters of the trainers' configs, used only when a trainer builds fresh heads (when `model`
    is a Qwen2 base); an adapter brings its own."""

    causal_size: int | None = field(
        default=None,
        metadata={"help": "Size C of the individual U for fresh heads; defaults to the base hidden size H."},
    )
    gamma_init: float = field(
        default=10.0,
        metadata={"help": "Initial Cauchy scale of U for fresh heads: softplus(b_scale) = gamma_init."},
    )
    b_noise_init: float = field(
        default=0.1,
        metadata={"help": "Initial value of every component of the action noise b_noise for fresh heads."},
    )
    ovr_threshold_init: float = field(
        default=0.0,
        metadata={"help": "Initial one-vs-rest threshold C_k for fresh heads."},
    )
    learnable_threshold: bool = field(
        default=False,
        metadata={"help": "Learn one OvR threshold per vocabulary entry (fresh heads; saved in the adapter)."},
    )
    action_weight: str = field(
        default="full",
        metadata={
            "help": "Where W_A lives for fresh heads: `full` (a trained copy of the base's output layer, saved), "
            "`tied` (the base's output layer itself, frozen, not saved) or `lora` (the base's plus a trained "
            "low-rank B·A; only A and B are saved).",
            "choices": ["full", "tied", "lora"],
        },
    )
    action_lora_rank: int = field(
        default=16, metadata={"help": "Rank of B·A when action_weight='lora' (fresh heads)."}
    )
    numeric: bool = field(
        default=False,
        metadata={"help": "Numeric-aware heads (DESIGN §2.5): <NUM> tokens with values in, a Cauchy regression head "
                  "out. The data then needs input_ids and numeric_values (causalqwen_adapter.numeric)."},
    )
    num_token_id: int | None = field(
        default=None,
        metadata={"help": "Id of <NUM> for numeric heads: an unused row of the vocabulary (default 151665 for Qwen2)."},
    )
    numeric_loss_weight: float = field(
        default=1.0, metadata={"help": "λ: weight of the Cauchy NLL of <NUM> values beside the OvR loss (numeric heads)."}
    )


# The head fields come first in the MRO so the training arguments keep their positions (`output_dir` first).
@dataclass
class CausalSFTConfig(CausalHeadArguments, SFTConfig):
    r"""
    Configuration of [`CausalSFTTrainer`]: TRL's [`~trl.SFTConfig`] plus the causal-head options.

    The head hyper-parameters are used only when the trainer builds fresh heads (when `model` is a Qwen2 base);
    an adapter brings its own.
    """

    loss_chunk_size: int = field(
        default=1024,
        metadata={
            "help": "Number of target tokens scored at once by the chunked OvR loss. Changes speed and memory, "
            "not the result."
        },
    )
    freeze_backbone: bool = field(
        default=True,
        metadata={
            "help": "Keep the base Qwen2 weights frozen, so only the causal heads train (and LoRA adapters on the "
            "backbone, when a `peft_config` is given). An adapter folder never stores base weights, so training the "
            "full backbone is not supported: pass a LoRA `peft_config` to adapt it."
        },
    )
    # TRL turns activation checkpointing on by default (through this deprecated alias); a frozen backbone runs
    # without autograd and keeps no activations, so here it stays off unless asked for (useful with LoRA).
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (off by default here: only LoRA on the "
                  "backbone keeps activations worth recomputing)."},
    )

    # Every trainable tensor (heads, backbone LoRA) takes part in every loss, so DDP need not search the graph.
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={"help": "Passed to DistributedDataParallel. Off here: every trainable tensor is used by the loss."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be a positive integer, got {self.loss_chunk_size}")


@dataclass
class CausalOvRLossOutput(ModelOutput):
    """What `model(..., ovr_loss=True)` returns: the OvR loss and detached statistics over its target tokens."""

    loss: torch.FloatTensor | None = None
    target_prob: torch.FloatTensor | None = None
    ovr_prob_sum: torch.FloatTensor | None = None
    units_mean_loc: torch.FloatTensor | None = None
    units_mean_scale: torch.FloatTensor | None = None
    num_tokens: torch.LongTensor | None = None
    numeric_nll: torch.FloatTensor | None = None
    num_numbers: torch.LongTensor | None = None


def add_forward_path(model, flag: str, path) -> None:
    """Give `model.forward` an extra path: `model(..., <flag>=True, **kwargs)` returns `path(model, **kwargs)`;
    without the flag the forward is the model's own. The original signature stays visible (`generate` and the
    Trainer's column filter read it)."""
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        if not kwargs.pop(flag, False):
            return original_forward(*args, **kwargs)
        if args:
            raise TypeError(f"model(..., {flag}=True) takes keyword arguments only")
        return path(self, **kwargs)

    model.forward = types.MethodType(forward, model)


def add_ovr_loss_forward(model: CausalQwenForCausalLM, chunk_size: int = 1024) -> None:
    """Give `model.forward` the path `model(input_ids, ..., labels=labels, ovr_loss=True, num_items_in_batch=n)`.

    That call runs the backbone, the abduction head at the positions whose shifted label is not −100, and the
    chunked OvR loss with the action head and thresholds; it returns a [`CausalOvRLossOutput`]. `shift_labels`
    (already aligned with the positions) may replace `labels`. Without `ovr_loss=True` the forward is unchanged.
    """
    add_forward_path(model, "ovr_loss", functools.partial(_ovr_loss_forward, chunk_size=chunk_size))


def _ovr_loss_forward(model, *, labels=None, shift_labels=None, num_items_in_batch=None, chunk_size=1024,
                      **backbone_kwargs) -> CausalOvRLossOutput:
    if labels is None and shift_labels is None:
        raise ValueError("the OvR loss needs targets: pass labels (or shift_labels)")
    backbone_kwargs["use_cache"] = False
    numeric_values = backbone_kwargs.pop("numeric_values", None)
    # A frozen backbone needs no autograd graph: no activations kept, and no backward through the layers even
    # when gradient checkpointing made the embedding output require grad. The numeric direction d enters at the
    # input embedding, so training it needs the backward through the layers.
    trains_backbone = torch.is_grad_enabled() and (
        any(p.requires_grad for p in model.model.parameters())
        or (numeric_values is not None and model.config.numeric and model.numeric.direction.requires_grad)
    )
    with torch.set_grad_enabled(trains_backbone):
        input_ids, inputs_embeds = model.embed_numbers(
            backbone_kwargs.pop("input_ids", None), backbone_kwargs.pop("inputs_embeds", None), numeric_values
        )
        hidden = model.model(input_ids=input_ids, inputs_embeds=inputs_embeds, **backbone_kwargs).last_hidden_state

    targets = _shift_labels(labels) if shift_labels is None else shift_labels
    targets = targets.reshape(-1).to(hidden.device)
    valid = targets != -100
    action = model.action
    # Loss math in float32 whatever the autocast: the kernel upcasts itself, and its in-place/out= matmuls must
    # see the dtypes they were given.
    with torch.autocast(hidden.device.type, enabled=False):
        # W_A as the model uses it: its own matrix, the base's frozen tensor, or base + B·A (grads reach A and B).
        weight = action.effective_weight()
        z = hidden.reshape(-1, hidden.shape[-1])[valid].to(weight.dtype)
        loc_U, scale_U = model.abduction(z)
        loss, stats = chunked_ovr_loss(
            loc_U, scale_U, weight, action.bias, action.b_noise, model.ovr.threshold, targets[valid],
            num_items_in_batch=num_items_in_batch, chunk_size=chunk_size,
        )
    numeric_nll = num_numbers = None
    if model.config.numeric:
        values = None
        if numeric_values is not None:
            values = _shift_labels(numeric_values.float(), fill=0.0).reshape(-1).to(hidden.device)[valid]
        nll = model.numeric_nll(loc_U, scale_U, targets[valid], values)
        denominator = loc_U.shape[0] if num_items_in_batch is None else num_items_in_batch
        loss = loss + model.config.numeric_loss_weight * nll.sum() / denominator
        num_numbers = torch.tensor(nll.numel(), device=loss.device)
        numeric_nll = nll.detach().mean() if nll.numel() else loss.new_zeros(())
    n = max(loc_U.shape[0], 1)
    return CausalOvRLossOutput(
        loss=loss,
        numeric_nll=numeric_nll,
        num_numbers=num_numbers,
        target_prob=stats["target_prob"],
        ovr_prob_sum=stats["ovr_prob_sum"],
        units_mean_loc=loc_U.detach().float().mean(-1).sum() / n,
        units_mean_scale=scale_U.detach().float().mean(-1).sum() / n,
        num_tokens=stats["num_tokens"],
    )


class AdapterCheckpointMixin:
    """Checkpoints, `save_model`, resuming and the model card of a trainer whose model is a `CausalQwenForCausalLM`:
    adapter folders (heads only, DESIGN §3), never full weights and never TRL's generic card.

    The trainer sets `_card_datasets`, `_card_tags` (lists) and `_card_metric_names` (logged metrics the card shows).
    """

    _card_metric_names: tuple[str, ...] = ()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """An adapter folder (DESIGN §3) plus `training_args.bin`; no tokenizer, the base provides it."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        model.training_summary = self._training_summary()  # rendered into the adapter's README.md
        model.save_pretrained(output_dir, state_dict=state_dict)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Load the adapter tensors of a checkpoint (the Trainer's version expects full weights)."""
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        weights_file = os.path.join(resume_from_checkpoint, ADAPTER_WEIGHTS_NAME)
        if not os.path.isfile(weights_file):
            raise ValueError(
                f"{resume_from_checkpoint} holds no {ADAPTER_WEIGHTS_NAME}: it is not a checkpoint written by "
                f"{type(self).__name__} (pass an output_dir/checkpoint-N folder)"
            )
        _load_adapter_tensors(model, weights_file)
        _load_backbone_lora(model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        logger.info(f"Loading best adapter from {self.state.best_model_checkpoint} (score: {self.state.best_metric}).")
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **kwargs):
        """Write the adapter's own model card into `output_dir`, never TRL's.

        TRL writes a generic `README.md` into `output_dir` at every checkpoint and before `push_to_hub`, which would
        replace the adapter's card (DESIGN §3: rendered from `model_card/`). This passes through to the model's card
        writer, with the run recorded in `model.training_summary`. `dataset_name` and `tags` are kept for every
        later card of this run (checkpoints, `save_model`); `model_name` is TRL's and not used.
        """
        for name in [dataset_name] if isinstance(dataset_name, str) else dataset_name or []:
            if name not in self._card_datasets:
                self._card_datasets.append(name)
        for tag in [tags] if isinstance(tags, str) else tags or []:
            if tag not in self._card_tags:
                self._card_tags.append(tag)
        if not self.is_world_process_zero():
            return
        model = self.accelerator.unwrap_model(self.model)
        model.training_summary = self._training_summary()
        output_dir = Path(self.args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        model._write_model_card(output_dir)

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


class CausalSFTTrainer(AdapterCheckpointMixin, SFTTrainer):
    """
    Trains the causal heads of a [`CausalQwenForCausalLM`] with the one-vs-rest loss, as an [`~trl.SFTTrainer`].

    Args:
        model (`str`, `CausalQwenForCausalLM` or `Qwen2ForCausalLM`):
            A CausalQwen adapter (folder or Hub id, its config has `model_type: causalqwen`), a Qwen2 base (folder or
            Hub id; fresh heads are attached with the config's head fields), or a loaded model. Strings are loaded
            with `args.model_init_kwargs` (`dtype` defaults to float32, like TRL).
        args ([`CausalSFTConfig`], *optional*): the training configuration.
        processing_class (*optional*): the tokenizer; defaults to the base's (`config.base_model_name_or_path`),
            since adapter folders carry none.
        peft_config ([`~peft.LoraConfig`], *optional*): LoRA adapters to train on the backbone (`model.model`) next
            to the heads; saved in the `lora/` subfolder of the adapter.

    The other arguments are [`~trl.SFTTrainer`]'s. `compute_loss_func`, `loss_type="dft"` and label smoothing are
    not supported: the loss is the OvR loss.
    """

    _tag_names = ["trl", "sft", "causalqwen"]
    _name = "CausalSFT"
    _card_metric_names = ("target_prob", "ovr_prob_sum", "units_mean_loc", "units_mean_scale", "numeric_nll")
    # `None`: the Trainer counts the loss as already scaled for gradient accumulation exactly when it received
    # `num_items_in_batch` (it divides by the accumulation steps otherwise), which is what `compute_loss` does.
    loss_is_scaled_for_ga = None

    def __init__(
        self,
        model,
        args: CausalSFTConfig | TrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        peft_config=None,
        formatting_func=None,
    ):
        args = _as_causal_config(args, model)
        if compute_loss_func is not None or args.loss_type != "nll" or args.label_smoothing_factor > 0:
            raise ValueError(
                "CausalSFTTrainer trains with the one-vs-rest loss of the causal heads: compute_loss_func, "
                "loss_type='dft' and label_smoothing_factor are not supported"
            )
        if not args.freeze_backbone and peft_config is None:
            raise ValueError(
                "freeze_backbone=False needs a peft_config: an adapter folder stores only the heads (and LoRA "
                "adapters on the backbone, in lora/), never base weights, so a fully trained backbone could not be "
                "saved. Pass peft_config=LoraConfig(...) to adapt the backbone."
            )

        set_seed(args.seed)  # fresh heads are deterministic, LoRA matrices are not
        model, fresh_heads = prepare_causal_model(model, args)
        _configure_backbone(model, peft_config)
        if model.config.numeric and args.packing:
            raise ValueError("packing is not supported with numeric heads: numeric_values would not follow the packed "
                             "input_ids. Drop packing (padding_free=True keeps batches dense)")

        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                model.config.base_model_name_or_path, revision=model.config.base_model_revision
            )

        # The model is built above; TRL would warn that model_init_kwargs are ignored.
        model_init_kwargs, args.model_init_kwargs = args.model_init_kwargs, None
        try:
            super().__init__(
                model=model,
                args=args,
                data_collator=data_collator,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                compute_metrics=compute_metrics,
                callbacks=callbacks,
                optimizers=optimizers,
                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                formatting_func=formatting_func,
            )
        finally:
            args.model_init_kwargs = model_init_kwargs

        # num_items_in_batch must count targets of the shifted labels, and reach compute_loss.
        self._loss_shifts_labels = True
        self.model_accepts_loss_kwargs = True
        add_ovr_loss_forward(self.model, args.loss_chunk_size)
        if model.config.numeric:
            self._prepare_numeric(model, fresh_heads)
        # Per mode, running sums over the logging window: [tokens, Σ P_y, Σ Σ_k P_k, Σ loc_U, Σ scale_U, inputs].
        self._ovr_sums: dict[str, torch.Tensor] = {}
        self._card_datasets: list[str] = []
        self._card_tags: list[str] = []

        vocab_size = model.config.text_config.vocab_size
        _check_targets(self.train_dataset, vocab_size, "train", require_targets=True)
        eval_datasets = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
        for name, dataset in eval_datasets.items():
            _check_targets(dataset, vocab_size, name, require_targets=False)

    def _prepare_numeric(self, model, fresh_heads: bool) -> None:
        """Numeric heads: batches carry numeric_values, and fresh heads start from the data (seed 000)."""
        datasets = {"train": self.train_dataset}
        if isinstance(self.eval_dataset, dict):
            datasets.update(self.eval_dataset)
        elif self.eval_dataset is not None:
            datasets["eval"] = self.eval_dataset
        for name, dataset in datasets.items():
            columns = getattr(dataset, "column_names", None)
            if columns is not None and "numeric_values" not in columns:
                raise ValueError(
                    f"the {name} dataset has no numeric_values column (columns: {columns}): numeric heads train on "
                    "input_ids + numeric_values, e.g. dataset.map(lambda x: encode_with_numbers(tokenizer, x['text'], "
                    "num_token_id)) from causalqwen_adapter.numeric"
                )
        self.data_collator = NumericCollator(
            self.data_collator, truncation_mode=self.args.truncation_mode, padding_free=self.padding_free
        )
        if fresh_heads and isinstance(self.train_dataset, Dataset):
            table = self.train_dataset.with_format("arrow").data
            ids = pc.list_flatten(table.column("input_ids"))
            values = pc.list_flatten(table.column("numeric_values"))
            if len(ids) != len(values):
                raise ValueError("the train dataset's numeric_values do not line up with its input_ids (lengths differ)")
            targets = pc.filter(values, pc.equal(ids, model.config.num_token_id)).to_numpy(zero_copy_only=False)
            median, scale = numeric_statistics(torch.tensor(targets))
            model.numeric.reset_parameters(median, scale)
            logger.info(f"Numeric head initialised from {len(targets)} <NUM> values: Cauchy({median:g}, {scale:g})")

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "numeric_values" not in self._signature_columns:  # numeric heads read it; TRL's list omits it
            self._signature_columns = [*self._signature_columns, "numeric_values"]

    # ------------------------------------------------------------------ loss and metrics

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        outputs = model(**inputs, ovr_loss=True, num_items_in_batch=num_items_in_batch)
        loss = outputs.loss
        if not torch.isfinite(loss):
            where = f"step {self.state.global_step + 1}" if mode == "train" else f"evaluation at step {self.state.global_step}"
            raise FloatingPointError(
                f"the OvR loss is {loss.item()} at {where}: training stopped. The heads diverged or the data is bad; "
                "lower learning_rate or max_grad_norm and resume from the last checkpoint"
            )
        # `num_items_in_batch` counts the targets of every rank while DDP averages gradients over ranks: scale back
        # so the gradients are those of one big batch (Trainer.compute_loss does the same).
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        self._accumulate_metrics(mode, outputs, inputs)
        return (loss, outputs) if return_outputs else loss

    def _accumulate_metrics(self, mode, outputs, inputs):
        n = outputs.num_tokens.float()
        if "attention_mask" in inputs:
            seen = inputs["attention_mask"].sum()
        else:  # padding-free batches are one row without padding
            seen = torch.tensor(inputs["input_ids"].numel(), device=n.device)
        sums = torch.stack([
            n,
            n * outputs.target_prob,
            n * outputs.ovr_prob_sum,
            n * outputs.units_mean_loc,
            n * outputs.units_mean_scale,
            seen.to(n.device, torch.float32),
        ])
        if outputs.num_numbers is not None:  # numeric heads: [<NUM> targets, Σ NLL]
            m = outputs.num_numbers.float()
            sums = torch.cat([sums, torch.stack([m, m * outputs.numeric_nll])])
        # Summed over ranks on every micro-batch, like TRL gathers its metrics, so no rank waits on another at log time.
        sums = self.accelerator.reduce(sums, reduction="sum")
        self._ovr_sums[mode] = sums if mode not in self._ovr_sums else self._ovr_sums[mode] + sums

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        sums = self._ovr_sums.pop(mode, None)
        if sums is not None:
            n, target, prob_sum, loc, scale, seen, *numeric = sums.tolist()
            metrics = {}
            if n > 0:  # token-weighted means over the logging window and all ranks
                metrics = {
                    "target_prob": target / n,
                    "ovr_prob_sum": prob_sum / n,
                    "units_mean_loc": loc / n,
                    "units_mean_scale": scale / n,
                }
            if numeric and numeric[0] > 0:
                metrics["numeric_nll"] = numeric[1] / numeric[0]
            if mode == "train":
                self._total_train_tokens += int(seen) // self._tp_size
                metrics["num_tokens"] = self._total_train_tokens
            prefix = "eval_" if mode == "eval" else ""
            logs.update({prefix + key: value for key, value in metrics.items()})
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).detach()
            if prediction_loss_only:
                return loss, None, None
            # compute_metrics wants logits: the model's own forward, which materialises [batch × length × vocab].
            logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        return loss, logits, inputs.get("labels")


# --------------------------------------------------------------------------------------- helpers


def _as_causal_config(args, model) -> CausalSFTConfig:
    if isinstance(args, CausalSFTConfig):
        return args
    if args is None:
        name = str(model) if isinstance(model, (str, os.PathLike)) else model.config.name_or_path or "causalqwen"
        return CausalSFTConfig(f"{os.path.basename(os.path.normpath(name))}-CausalSFT")
    if isinstance(args, TrainingArguments):
        values = args.to_dict()
        values["hub_token"] = args.hub_token  # to_dict hides it
        return CausalSFTConfig(**{k: v for k, v in values.items() if k in CausalSFTConfig.__dataclass_fields__})
    raise TypeError(f"args must be a CausalSFTConfig (or TrainingArguments), got {type(args).__name__}")


def _head_options(args: CausalHeadArguments) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(CausalHeadArguments)}


def prepare_causal_model(model, args) -> tuple[CausalQwenForCausalLM, bool]:
    """The trainers' `model` argument as a `CausalQwenForCausalLM`, and whether its heads are fresh: an adapter
    (folder, Hub id or loaded) keeps its heads; a Qwen2 base (folder, Hub id or loaded) gets fresh heads from the
    config's head fields."""
    fresh = False
    if isinstance(model, (str, os.PathLike)):
        model, fresh = _load_model(str(model), args)
    elif isinstance(model, Qwen2ForCausalLM):
        model, fresh = CausalQwenForCausalLM.from_base(model, **_head_options(args)), True
    elif not isinstance(model, CausalQwenForCausalLM):
        raise TypeError(
            f"model must be a CausalQwenForCausalLM, a Qwen2ForCausalLM, or a path/Hub id of either, got "
            f"{type(model).__name__}"
        )
    if args.learnable_threshold and not model.config.learnable_threshold:
        raise ValueError(
            "learnable_threshold=True but this model's heads have a fixed threshold: it applies to fresh heads "
            "only (pass the Qwen2 base instead of an adapter, or drop the option)"
        )
    if args.numeric and not model.config.numeric:
        raise ValueError("numeric=True but this adapter's heads are not numeric: it applies to fresh heads only (pass "
                         "the Qwen2 base instead of an adapter, or drop the option)")
    return model, fresh


def _load_model(name: str, args) -> CausalQwenForCausalLM:
    """An adapter (model_type causalqwen) loads with its heads; a Qwen2 base gets fresh heads from the config."""
    kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    kwargs.pop("trust_remote_code", None)  # the package's own code is used, not the folder's copy
    revision = kwargs.pop("revision", None)
    dtype = kwargs.pop("dtype", "float32")
    if isinstance(dtype, str) and dtype in ("bfloat16", "float16", "float32"):
        dtype = getattr(torch, dtype)
    config, _ = PreTrainedConfig.get_config_dict(name, revision=revision)
    model_type = config.get("model_type")
    if model_type == CausalQwenForCausalLM.config_class.model_type:
        return CausalQwenForCausalLM.from_pretrained(name, revision=revision, dtype=dtype, **kwargs), False
    heads = _head_options(args)
    if model_type != "qwen2":
        return CausalQwenForCausalLM.from_base(name, revision=revision, **heads), True  # raises the not-Qwen2 error
    base = Qwen2ForCausalLM.from_pretrained(name, revision=revision, dtype=dtype, **kwargs)
    return CausalQwenForCausalLM.from_base(base, revision=revision, **heads), True


def _configure_backbone(model: CausalQwenForCausalLM, peft_config) -> None:
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


def _load_adapter_tensors(model: CausalQwenForCausalLM, weights_file: str) -> None:
    """Copy a checkpoint's adapter tensors into the model, strict on the adapter keys.

    In place (not `assign`): the optimizer and the DDP wrapper keep references to these very parameters.
    """
    tensors = load_file(weights_file)
    expected = model.adapter_keys()
    if set(tensors) != expected:
        raise ValueError(
            f"{weights_file} does not hold this model's adapter tensors: missing {sorted(expected - set(tensors))}, "
            f"unexpected {sorted(set(tensors) - expected)}. Resume with the heads configuration the checkpoint was "
            "trained with (causal_size, learnable_threshold)."
        )
    model.load_state_dict(tensors, strict=False)  # raises on a shape mismatch


def _load_backbone_lora(model: CausalQwenForCausalLM, checkpoint: str) -> None:
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


def _check_targets(dataset, vocab_size: int, split: str, *, require_targets: bool) -> None:
    """Before training: every target must index the vocabulary, and training needs at least one target.

    Targets are the labels after the causal shift (position t predicts t + 1), so a label at position 0 never
    trains. Streaming datasets cannot be scanned here; the loss checks their labels batch by batch.
    """
    if not isinstance(dataset, Dataset):
        return
    column = "labels" if "labels" in dataset.column_names else "input_ids"
    if column not in dataset.column_names:
        return  # a custom collator builds the batches; nothing to scan
    num_targets, offset = 0, 0
    for table in dataset.with_format("arrow").iter(batch_size=4096):
        shifted = pc.list_slice(table.column(column), 1)
        values = pc.list_flatten(shifted)
        keep = pc.not_equal(values, -100)
        targets = pc.filter(values, keep)
        num_targets += len(targets)
        if len(targets):
            bounds = pc.min_max(targets)
            if bounds["min"].as_py() < 0 or bounds["max"].as_py() >= vocab_size:
                bad = pc.or_(pc.less(values, 0), pc.greater_equal(values, vocab_size))
                bad = pc.and_(bad, keep)
                row = pc.filter(pc.list_parent_indices(shifted), bad)[0].as_py()
                label = pc.filter(values, bad)[0].as_py()
                raise ValueError(
                    f"{split} example {offset + row} has label {label}, outside the model's vocabulary [0, "
                    f"{vocab_size}): the tokenizer does not belong to this base, or the labels are not token ids "
                    "(use -100 for positions without a target)"
                )
        offset += table.num_rows
    if require_targets and num_targets == 0:
        raise ValueError(
            f"the {split} dataset has no trainable target token ({offset} examples): every label is -100 after "
            "completion-only / assistant-only masking and the causal shift. Check that completions are not empty "
            "or truncated away by max_length, and that assistant_only_loss matches the chat template."
        )


__all__ = [
    "AdapterCheckpointMixin", "CausalHeadArguments", "CausalOvRLossOutput", "CausalSFTConfig", "CausalSFTTrainer",
    "add_forward_path", "add_ovr_loss_forward", "prepare_causal_model",
]
