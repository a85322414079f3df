"""What the CausalSFTTrainer tests share: a CPU-only config for short runs, the tiny prompt-completion data set, and
reading back the heads and the logged losses.
"""


import torch
from datasets import Dataset

from causalqwen_adapter.trainer import CausalSFTConfig

from conftest import PAIRS


def _args(output_dir, **overrides) -> CausalSFTConfig:
    values = dict(
        bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_pin_memory=False, per_device_train_batch_size=2, learning_rate=1e-2, seed=0,
    )
    values.update(overrides)
    return CausalSFTConfig(str(output_dir), **values)


def _prompt_completion(n=len(PAIRS)) -> Dataset:
    return Dataset.from_dict({"prompt": [p for p, _ in PAIRS[:n]], "completion": [c for _, c in PAIRS[:n]]})


def _heads(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.adapter_state_dict().items()}


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
