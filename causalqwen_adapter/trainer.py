"""CausalSFTTrainer: TRL's `SFTTrainer` training the causal heads with the model's own loss.

Everything TRL does for SFT stays: dataset formats (text, prompt/completion, chat messages), completion- and
assistant-only masks, packing, the collator, logging, `accelerate launch`. What changes:

- the loss is the model's: `CausalQwenForCausalLM.forward(labels=...)` computes the loss its config names (the OvR
  loss, in token × vocabulary tiles, or the softmax baseline) and returns its metrics; `compute_loss` calls it,
  checks it and logs the metrics;
- the model: a `CausalQwenForCausalLM`, built from a base (fresh heads) or loaded from an adapter folder;
  the backbone stays frozen (optionally with LoRA on it);
- checkpoints and `save_model` hold adapter folders (heads only), and resuming loads those tensors back.
"""

import os
from dataclasses import dataclass, field

import pyarrow.compute as pc
import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainingArguments, set_seed
from transformers.utils import logging
from trl import SFTConfig, SFTTrainer

from .cauchy import INFERENCE_MODES
from .configuration_causalqwen import check_number
from .data import check_text_dataset
from .evaluation import EvaluationAccumulator, score_positions
from .numeric import NumericCollator, check_numeric_values_present, numeric_statistics
from .training import (
    AdapterCheckpointMixin,
    CausalHeadArguments,
    HeadLearningRatesMixin,
    LossMetricsMixin,
    calibrate_threshold,
    check_output_dir,
    configure_backbone,
    prepare_causal_model,
)
from .training.arguments import check_unsupported_flags
from .training.calibration import check_can_calibrate

logger = logging.get_logger(__name__)


# The head fields come first in the MRO so the training arguments keep their positions (`output_dir` first).
@dataclass
class CausalSFTConfig(CausalHeadArguments, SFTConfig):
    r"""
    Configuration of [`CausalSFTTrainer`]: TRL's [`~trl.SFTConfig`] plus the causal-head options.

    The head hyper-parameters are used only when the trainer builds fresh heads (when `model` is a base);
    an adapter brings its own.
    """

    learning_rate: float = field(
        default=1e-4,
        metadata={"help": "AdamW learning rate of the scale path (W_scale, b_scale, b_noise); the location path and "
                  "the per-token offsets take it times location_lr_ratio and threshold_lr_ratio."},
    )
    location_lr_ratio: float = field(
        default=0.1,
        metadata={"help": "Learning rate of the location path (W_loc, b_loc, W_A: what ranks the tokens) as a "
                  "multiple of learning_rate."},
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Number of target tokens scored at once by the chunked training loss; by default losses.loss_shape's: "
            "on the CPU as many as 128 MiB of logits hold, on a GPU an eighth of the tokens within 4 GiB of the "
            "chunk's tiles. Changes speed and memory, not the result."
        },
    )
    freeze_backbone: bool = field(
        default=True,
        metadata={
            "help": "Keep the base's weights frozen, so only the causal heads train (and LoRA adapters on the "
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

    # The head parameters the configured loss never reaches are frozen (training.model_setup.unreachable_parameters), so every
    # trainable tensor takes part in every loss and DDP need not search the graph; but numeric heads get no gradient
    # on a rank whose batch has no <NUM> target, which only the data decides.
    ddp_find_unused_parameters: bool | None = field(
        default=None,
        metadata={"help": "Passed to DistributedDataParallel. Unset: on for numeric heads (a batch without a <NUM> "
                  "target leaves the numeric head without gradient on its rank), off otherwise (the head parameters "
                  "the configured loss never reaches are frozen, every other trainable tensor is used)."},
    )

    eval_inference_modes: list[str] = field(
        default_factory=lambda: ["compatible", "standard"],
        metadata={
            "help": "Under `eval_strategy`, the held-out next-token metrics of `causalqwen_adapter.evaluation` "
            "(top1_accuracy, nll, target_prob, prob_sum quantiles, ece_top1, ece_top10) in each of these inference "
            "modes, logged as eval_<mode>_<metric>. Empty: the loss only. Each process reports its share of the "
            "evaluation set."
        },
    )
    # TRL turns bf16 on whenever fp16 is off, which transformers refuses on a machine without a bf16 accelerator
    # ("Your setup doesn't support bf16/gpu"): here an unset bf16 follows the device.
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision. Unset: on when an accelerator supporting bf16 is present (and fp16 is "
                  "off), off on a CPU-only machine."},
    )

    dataloader_pin_memory: bool | None = field(
        default=None,
        metadata={"help": "Pin batches in page-locked memory for faster copies to an accelerator. Unset: on when a "
                  "CUDA device is present (pinning without one only warns)."},
    )

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = not self.fp16 and _accelerator_supports_bf16()
        if self.dataloader_pin_memory is None:
            self.dataloader_pin_memory = torch.cuda.is_available()
        super().__post_init__()
        if self.loss_chunk_size is not None:
            check_number("loss_chunk_size", self.loss_chunk_size, minimum=1, integer=True)
        bad = [m for m in self.eval_inference_modes if m not in INFERENCE_MODES]
        if bad:
            raise ValueError(f"eval_inference_modes has unknown mode(s) {bad}: choose from {', '.join(INFERENCE_MODES)}")


class CausalSFTTrainer(HeadLearningRatesMixin, LossMetricsMixin, AdapterCheckpointMixin, SFTTrainer):
    """
    Trains the causal heads of a [`CausalQwenForCausalLM`] with the one-vs-rest loss, as an [`~trl.SFTTrainer`].

    Args:
        model (`str`, `CausalQwenForCausalLM` or a base `*ForCausalLM`):
            A CausalQwen adapter (folder or Hub id, its config has `model_type: causalqwen`), a base (folder or
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
    _card_metric_names = ("target_prob", "ovr_prob_sum", "candidate_prob_sum", "softmax_nll", "units_mean_loc",
                          "units_mean_scale", "numeric_nll")
    _raw_metric_names = ("num_input_tokens",)  # summed into TRL's running `num_tokens`, not averaged
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
        check_output_dir(args.output_dir)
        check_unsupported_flags(args)
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

        # TRL's own errors for unusable data come late and raw: say what is wrong before anything is loaded.
        if formatting_func is None:
            for name, data in [("train", train_dataset), *(
                    eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval", eval_dataset)])]:
                if isinstance(data, Dataset):
                    check_text_dataset(data, name)
        set_seed(args.seed)  # fresh heads are deterministic, LoRA matrices are not
        model, fresh_heads = prepare_causal_model(model, args)
        configure_backbone(model, peft_config)
        if args.ddp_find_unused_parameters is None:
            args.ddp_find_unused_parameters = bool(model.config.numeric)
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
        model.loss_chunk_size = args.loss_chunk_size
        if model.config.numeric:
            self._prepare_numeric(model, fresh_heads)
        self._card_datasets: list[str] = []
        self._card_tags: list[str] = []

        vocab_size = model.config.text_config.vocab_size
        _check_targets(self.train_dataset, vocab_size, "train", require_targets=True)
        eval_datasets = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
        for name, dataset in eval_datasets.items():
            _check_targets(dataset, vocab_size, name, require_targets=False)
        if fresh_heads and args.ovr_threshold_init is None and not model.config.ovr_relative_threshold:
            check_can_calibrate(model)
            calibrate_threshold(model, self._calibration_batches())

    def _calibration_batches(self, rows: int = 64):
        """The first `rows` training examples in dataset order, collated 8 at a time: the same on every process, at
        any world size and batch size (no sampler, no shard), so calibrated replicas stay equal."""
        dataset = self.train_dataset
        if isinstance(dataset, Dataset):
            dataset = self._remove_unused_columns(dataset.select(range(min(rows, len(dataset)))), "calibration")
            collator = self.data_collator
        else:
            dataset = dataset.take(rows)
            collator = self._get_collator_with_removed_columns(self.data_collator, "calibration")
        # A fixed batch size: the threshold does not depend on the training batch size (padding changes z by ulps)
        loader = torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=collator)
        return (self._prepare_inputs(batch) for batch in loader)

    def _prepare_numeric(self, model, fresh_heads: bool) -> None:
        """Numeric heads: batches carry numeric_values, and fresh heads start from the data (docs/design.md, Numbers)."""
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
        num_token_id = model.config.num_token_id
        self.data_collator = NumericCollator(self.data_collator, truncation_mode=self.args.truncation_mode,
                                             padding_free=self.padding_free, num_token_id=num_token_id)
        for name, dataset in datasets.items():
            check_numeric_values_present(dataset, name)  # a null target named by its row, before any statistic
            _check_numeric_rows(dataset, num_token_id, name)
        if fresh_heads and isinstance(self.train_dataset, Dataset):
            table = self.train_dataset.with_format("arrow").data
            ids = pc.list_flatten(table.column("input_ids"))
            values = pc.list_flatten(table.column("numeric_values"))
            if len(ids) != len(values):
                raise ValueError("the train dataset's numeric_values do not line up with its input_ids (lengths differ)")
            targets = pc.filter(values, pc.equal(ids, num_token_id)).to_numpy(zero_copy_only=False)
            median, scale = numeric_statistics(torch.tensor(targets))
            model.numeric.reset_parameters(median, scale)
            logger.info(f"Numeric head initialised from {len(targets)} <NUM> values: Cauchy({median:g}, {scale:g})")

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "numeric_values" not in self._signature_columns:  # numeric heads read it; TRL's list omits it
            self._signature_columns = [*self._signature_columns, "numeric_values"]

    # ------------------------------------------------------------------ loss and metrics

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's own loss (`forward(labels=...)`, see `CausalQwenForCausalLM`), checked and with its metrics."""
        mode = "train" if self.model.training else "eval"
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        loss = self._check_finite(outputs.loss, mode)
        # `num_items_in_batch` counts the targets of every rank while DDP averages gradients over ranks: scale back
        # so the gradients are those of one big batch (Trainer.compute_loss does the same).
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        metrics = dict(outputs.metrics)
        if mode == "eval":  # eval_loss: the mean over target tokens, not over batches (an empty batch weighs 0)
            count = outputs.metrics["units_mean_loc"][1]
            metrics["loss"] = torch.stack([loss.detach().float() * count, count])
        if mode == "train":  # the input tokens seen, padding excluded (TRL's num_tokens)
            seen = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
            metrics["num_input_tokens"] = torch.stack([torch.as_tensor(seen, dtype=torch.float32, device=loss.device),
                                                       torch.ones((), device=loss.device)])
        self._accumulate_metrics(mode, metrics)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        seen = self._log_metrics(logs, mode).get("num_input_tokens")
        if seen is not None:
            self._total_train_tokens += int(seen[0]) // self._tp_size
            logs["num_tokens"] = self._total_train_tokens
        super().log(logs, start_time)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """The Trainer's loop, plus the held-out next-token metrics of `args.eval_inference_modes`."""
        self._eval_accumulators = {mode: EvaluationAccumulator(mode) for mode in self.args.eval_inference_modes}
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            for mode, accumulator in self._eval_accumulators.items():
                for name, value in accumulator.compute().items():
                    output.metrics[f"{metric_key_prefix}_{mode}_{name}"] = value
        finally:
            self._eval_accumulators = None
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).detach()
            accumulators = getattr(self, "_eval_accumulators", None)
            if accumulators:
                scored = score_positions(self.accelerator.unwrap_model(model), inputs, list(accumulators))
                for positions in scored:
                    accumulators[positions.mode].add(positions)
            if prediction_loss_only:
                return loss, None, None
            # compute_metrics wants logits: the model's own forward, which materialises [batch × length × vocab].
            logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        return loss, logits, inputs.get("labels")


# --------------------------------------------------------------------------------------- helpers


def _accelerator_supports_bf16() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


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


def _check_numeric_rows(dataset, num_token_id: int, split: str) -> None:
    """Before training, naming the example: one numeric value per token, 0 wherever the token is not <NUM> (the
    collator checks each batch as it comes; streaming datasets are checked there only)."""
    if not isinstance(dataset, Dataset) or not {"input_ids", "numeric_values"} <= set(dataset.column_names):
        return
    table = dataset.with_format("arrow").data
    ids, values = table.column("input_ids"), table.column("numeric_values")
    short = pc.less(pc.list_value_length(values), pc.list_value_length(ids))
    if pc.any(short).as_py():
        row = pc.index(short, True).as_py()
        raise ValueError(f"{split} example {row} has {len(dataset[row]['numeric_values'])} numeric_values for "
                         f"{len(dataset[row]['input_ids'])} input_ids: pass one value per token (0 where the token "
                         "is not <NUM>; encode_with_numbers lines them up)")
    lengths_match = pc.equal(pc.list_value_length(values), pc.list_value_length(ids))
    if not pc.all(lengths_match).as_py():  # longer value rows: the collator aligns them per batch
        return
    flat_ids, flat_values = pc.list_flatten(ids), pc.list_flatten(values)
    stray = pc.and_(pc.not_equal(flat_values, 0), pc.not_equal(flat_ids, num_token_id))
    if pc.any(stray).as_py():
        position = pc.index(stray, True).as_py()
        row = pc.list_parent_indices(ids)[position].as_py()
        raise ValueError(f"{split} example {row} has the value {flat_values[position].as_py()} at a token that is not "
                         f"<NUM> ({flat_ids[position].as_py()}): a value counts only at a <NUM> token ({num_token_id}); "
                         "set the others to 0 (encode_with_numbers lines them up)")


def _check_targets(dataset, vocab_size: int, split: str, *, require_targets: bool) -> None:
    """Before training: every target and input id must index the vocabulary, and training needs a target.

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
        if column != "input_ids" and "input_ids" in table.column_names:  # the embedding lookup would fail raw
            ids = pc.list_flatten(table.column("input_ids"))
            bounds = pc.min_max(ids) if len(ids) else None
            if bounds is not None and (bounds["min"].as_py() < 0 or bounds["max"].as_py() >= vocab_size):
                bad = pc.or_(pc.less(ids, 0), pc.greater_equal(ids, vocab_size))
                row = pc.filter(pc.list_parent_indices(table.column("input_ids")), bad)[0].as_py()
                raise ValueError(
                    f"{split} example {offset + row} has input id {pc.filter(ids, bad)[0].as_py()}, outside the "
                    f"model's vocabulary [0, {vocab_size}): the tokenizer does not belong to this base"
                )
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


__all__ = ["CausalSFTConfig", "CausalSFTTrainer"]
