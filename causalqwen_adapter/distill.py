"""Stage 2 of offline distillation (docs/design.md, Offline distillation): train the causal heads on stored features.

`CausalDistillTrainer` (a `transformers.Trainer`) trains only the heads on the rows `features.extract_features`
wrote, with the top-K MSE `Σ_{k∈K} (P_k − p_teacher,k)²` plus the tail term `Σ_{k∉K} −log(1 − P_k)`; the
transformer never runs, so an epoch costs the heads' matmuls per token. Checkpoints, `save_model`, resuming and the
model card are the adapter folders of `CausalSFTTrainer`.

Heads trained this way see the base's z: they belong on the base without a backbone LoRA.
"""

import json
import os
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments

from .features import FEATURES_CONFIG_NAME, check_feature_dataset, extract_features, features_info, load_features
from .training import (
    AdapterCheckpointMixin,
    CausalHeadArguments,
    HeadLearningRatesMixin,
    LossMetricsMixin,
    check_output_dir,
    prepare_causal_model,
)
from .training.arguments import check_unsupported_flags, config_argument


@dataclass
class CausalDistillConfig(CausalHeadArguments, TrainingArguments):
    r"""
    Configuration of [`CausalDistillTrainer`]: transformers' [`~transformers.TrainingArguments`] plus the head
    options (used when the trainer builds fresh heads on a base).
    """

    model_init_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments of from_pretrained when `model` is a string (e.g. dtype)."},
    )
    # The feature columns are not arguments of the model's forward: the Trainer must not drop them.
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Must stay False: the feature columns feed the heads, not the model's forward."},
    )
    learning_rate: float = field(default=1e-3, metadata={"help": "The initial learning rate for AdamW."})
    distill_tail_weight: float | None = config_argument("distill_tail_weight", "Applies to adapters too.")
    _cli_command = "distill"

    def __post_init__(self):
        if isinstance(self.model_init_kwargs, str):
            self.model_init_kwargs = json.loads(self.model_init_kwargs)
        super().__post_init__()
        if self.remove_unused_columns:
            raise ValueError("remove_unused_columns=True would drop the feature columns: leave it False")


class CausalDistillTrainer(HeadLearningRatesMixin, LossMetricsMixin, AdapterCheckpointMixin, Trainer):
    """
    Trains the causal heads on stored teacher features with the top-K MSE (docs/design.md, Offline distillation), as a
    [`~transformers.Trainer`]; stage 2 of offline distillation.

    Args:
        model (`str`, `CausalQwenForCausalLM` or a base `*ForCausalLM`): an adapter (its heads keep training) or the
            base the features were extracted from (fresh heads from the config's head fields).
        args ([`CausalDistillConfig`], *optional*)
        train_dataset, eval_dataset: feature stores: a folder written by [`extract_features`] or the `Dataset`
            [`load_features`] returns.

    The backbone stays frozen and never runs. The other arguments are [`~transformers.Trainer`]'s.
    """

    _tag_names = ["causalqwen", "distillation"]
    _card_metric_names = ("top1_match", "topk_prob_sum")

    def __init__(
        self,
        model,
        args: CausalDistillConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
    ):
        if args is None:
            name = str(model) if isinstance(model, (str, os.PathLike)) else model.config.name_or_path or "causalqwen"
            args = CausalDistillConfig(f"{os.path.basename(os.path.normpath(name))}-CausalDistill")
        if not isinstance(args, CausalDistillConfig):
            raise TypeError(f"args must be a CausalDistillConfig, got {type(args).__name__}")
        check_output_dir(args.output_dir)
        check_unsupported_flags(args)
        model, _ = prepare_causal_model(model, args, loss="distill")
        if getattr(model.model, "_hf_peft_config_loaded", False):
            raise ValueError(
                "this adapter carries a backbone LoRA (lora/): stored features are z of the plain base, so heads "
                "distilled on them would not match the adapted backbone. Distill on the base or an adapter without lora/"
            )
        model.model.requires_grad_(False)

        if train_dataset is None:
            raise ValueError("train_dataset is required: a feature store written by extract_features")
        train_dataset = check_feature_dataset(train_dataset, model, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: check_feature_dataset(v, model, k) for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = check_feature_dataset(eval_dataset, model, "eval")

        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
        self.model_accepts_loss_kwargs = False  # a mean over the batch; the Trainer scales it for accumulation
        self._card_datasets: list[str] = []
        self._card_tags: list[str] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's own distillation loss, `model(hidden_state=z, topk_ids=..., topk_probs=...)`, with its metrics."""
        mode = "train" if self.model.training else "eval"
        outputs = model(**inputs)
        loss = self._check_finite(outputs.loss, mode)
        self._accumulate_metrics(mode, outputs.metrics)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._log_metrics(logs, "train" if self.model.training else "eval")
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).detach()
        return loss, None, None


# extract_features, load_features and features_info are importable from here too (stage 1 lives in features.py).
__all__ = [
    "CausalDistillConfig", "CausalDistillTrainer", "FEATURES_CONFIG_NAME",
    "extract_features", "features_info", "load_features",
]
