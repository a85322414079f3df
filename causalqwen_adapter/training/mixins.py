"""What both trainers add to the Trainer by mixin besides checkpoints: the metrics the model's loss returns, averaged
per logging window across ranks (`LossMetricsMixin`), and the heads' learning rates by role
(`HeadLearningRatesMixin`)."""

import torch
from transformers.utils import logging

from .resume import resume_advice

logger = logging.get_logger(__name__)


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
