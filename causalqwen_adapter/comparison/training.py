"""Training an arm on cached features: fresh heads on a base, the recipe's optimizer (AdamW with the trainer's
per-role learning rates, linear decay to 0, gradient clipping), a seeded order of the training rows, two targets per
row as TRL's SFT sees a prompt/completion row: the label's token at the prompt's end, EOS at the label's position."""

import math
from dataclasses import dataclass

import torch

from ..modeling_causalqwen import CausalQwenForCausalLM
from ..training.calibration import calibrate_threshold_on_features
from ..training.mixins import SCALE_PARAMETERS, learning_rate_ratio
from .arms import ARMS, arm_loss


@dataclass(frozen=True)
class RecipeRates:
    """The trainer's defaults a run trains with (`CausalSFTConfig`'s: tests/test_compare.py checks they agree),
    without importing TRL."""

    location_lr_ratio: float = 0.1
    threshold_lr_ratio: float = 1.0
    max_grad_norm: float = 1.0


class FreshHeads:
    """Fresh heads of an arm, built once from the base and put back in their initial state for each later run: the
    model `from_base` builds (tests/test_compare.py checks the trained weights are the same), without building one per
    run (that copies W_A, V × H, and runs the base to check its logits). One arm's heads are kept at a time."""

    def __init__(self, base):
        self.base, self.key, self.model, self.initial = base, None, None, None

    def _tensors(self):
        prefix = self.model.base_model_prefix + "."  # the frozen backbone, shared with the base
        named = [*self.model.named_parameters(), *self.model.named_buffers()]
        return {name: t for name, t in named if not name.startswith(prefix)}

    def __call__(self, arm: str):
        key = repr(sorted(ARMS[arm]["heads"].items()))
        if key != self.key:
            self.model = self.initial = None  # one arm's heads in memory at a time
            self.model = CausalQwenForCausalLM.from_base(self.base, **ARMS[arm]["heads"])
            self.key = key
            self.initial = ({name: t.detach().clone() for name, t in self._tensors().items()},
                            self.model.config.ovr_threshold_init, self.model.ovr.threshold_init)
            return self.model
        tensors, threshold_init, ovr_threshold_init = self.initial
        with torch.no_grad():
            for name, t in self._tensors().items():
                t.copy_(tensors[name])
                t.grad = None
        self.model.config.ovr_threshold_init = threshold_init  # calibrate_threshold_on_features moves these
        self.model.ovr.threshold_init = ovr_threshold_init
        return self.model


def optimizer_for(model, learning_rate, location_lr_ratio, threshold_lr_ratio, fused=False, scale_lr_ratio=1.0):
    """AdamW with the trainer's per-role learning rates (see training.mixins.HeadLearningRatesMixin), the scale path
    (W_scale, b_scale, b_noise) at `scale_lr_ratio` × `learning_rate`; `fused`: torch's one-kernel AdamW (the same
    update, about 10× faster on a 151,936 × 896 W_A on one CPU thread)."""
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        ratio = scale_lr_ratio if name.startswith(SCALE_PARAMETERS) else 1.0
        groups.setdefault(ratio * learning_rate_ratio(name, location_lr_ratio, threshold_lr_ratio), []).append(param)
    return torch.optim.AdamW([{"params": p, "lr": learning_rate * r} for r, p in groups.items()], weight_decay=0.0,
                             fused=fused)


def training_targets(features: dict, labels: list[int], rows: torch.Tensor, label_ids: list[int], eos: int,
                     position: int | None = None):
    """(z, targets) of training `rows` as the recipe sees them: the label after the prompt, EOS after the label (z
    at the label's position: z_label[row, label], or z_label[row, position] when given)."""
    y = torch.tensor(labels)[rows]
    z = torch.cat([features["z"][rows], features["z_label"][rows, y if position is None else position]])
    targets = torch.cat([torch.tensor(label_ids)[y], torch.full_like(y, eos)])
    return z, targets


def train_arm(base, arm, features, rows, train_labels, labels, eos, lr, steps, batch_rows, seed, trainer_defaults,
              position=None, on_step=None, heads: FreshHeads | None = None):
    """Fresh heads trained for `steps` on training `rows` (indices into `features`) with labels `train_labels`
    (indexed by row) of the label set `labels`, in the seeded order of `seed`. `trainer_defaults`: the trainer's
    location_lr_ratio, threshold_lr_ratio and max_grad_norm (`RecipeRates()`, or a `CausalSFTConfig`).
    `on_step(step, model, loss)` after each optimizer step (the gradients still in place). `heads`: a `FreshHeads`
    of `base` to take the fresh heads from (the model it returns is reset by its next run)."""
    model = heads(arm) if heads is not None else CausalQwenForCausalLM.from_base(base, **ARMS[arm]["heads"])
    device = model.action.bias.device  # the heads' (the base's); the features stay on the CPU, a batch moves
    if model.config.objective == "ovr" and not model.config.ovr_relative_threshold:
        calibrate_threshold_on_features(model, features["z"][rows].to(device))  # as the trainer does for fresh heads
    optimizer = optimizer_for(model, lr, trainer_defaults.location_lr_ratio, trainer_defaults.threshold_lr_ratio,
                              fused=True, scale_lr_ratio=ARMS[arm].get("scale_lr_ratio", 1.0))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    generator = torch.Generator().manual_seed(seed)
    epochs = math.ceil(steps * batch_rows / len(rows))
    order = torch.cat([rows[torch.randperm(len(rows), generator=generator)] for _ in range(epochs)])
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    for step in range(steps):
        batch = order[step * batch_rows : (step + 1) * batch_rows]
        z, targets = training_targets(features, train_labels, batch, labels.token_ids, eos, position)
        loss = arm_loss(model, arm, z.to(device), targets.to(device))
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"{arm}: loss {loss.item()} at step {step + 1}")
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, trainer_defaults.max_grad_norm)
        optimizer.step()
        schedule.step()
        if on_step is not None:
            on_step(step, model, loss)
    return model.eval()
