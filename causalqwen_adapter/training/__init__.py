"""What both trainers share (as TRL's `trainer/`): the head options of their configs, the model they train, adapter
checkpoints and metrics by name. One role per module:

- `arguments.py`: `CausalHeadArguments`, the head fields of `CausalSFTConfig` and `CausalDistillConfig` (used for
  fresh heads), each described by the config's docstring (`config_argument`);
- `model_setup.py`: `prepare_causal_model`, the `model` argument (a base, an adapter, or a loaded model) as a
  `CausalQwenForCausalLM`, with the head parameters its configured loss can never reach frozen
  (`unreachable_parameters`); `configure_backbone`: frozen, or with LoRA;
- `checkpoints.py`: `AdapterCheckpointMixin`, checkpoints, `save_model`, pushes, resuming and the model card as
  adapter folders; only finite heads are checkpointed (`check_output_dir`);
- `resume.py`: what a run resumes from: only complete checkpoints (`last_complete_checkpoint`), never an adapter
  folder, and with their optimizer and schedule unless `resume_only_model` (`check_resumable`,
  `missing_optimizer_state`);
- `mixins.py`: `LossMetricsMixin`, the metrics the model's loss returns, averaged per logging window across ranks;
  `HeadLearningRatesMixin`, the heads' learning rates by role;
- `calibration.py`: absolute thresholds of fresh heads calibrated on data (`calibrate_threshold`).

The names below are the package's API; the trainers import the rest from the modules.
"""

from .arguments import CausalHeadArguments, head_options
from .calibration import calibrate_threshold, calibrate_threshold_on_features
from .checkpoints import AdapterCheckpointMixin, check_output_dir
from .mixins import HeadLearningRatesMixin, LossMetricsMixin, learning_rate_ratio
from .model_setup import (
    configure_backbone,
    freeze_unreachable_parameters,
    prepare_causal_model,
    unreachable_parameters,
)
from .resume import check_resumable, last_complete_checkpoint, resume_advice

__all__ = [
    "AdapterCheckpointMixin", "CausalHeadArguments", "HeadLearningRatesMixin", "LossMetricsMixin", "calibrate_threshold",
    "calibrate_threshold_on_features", "check_output_dir", "check_resumable", "last_complete_checkpoint",
    "learning_rate_ratio", "resume_advice",
    "configure_backbone", "freeze_unreachable_parameters", "head_options", "prepare_causal_model",
    "unreachable_parameters",
]
