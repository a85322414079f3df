"""Absolute OvR thresholds of fresh heads calibrated on data before training: the uniform C at which the heads rank
tokens most like their base (`calibrate_threshold`, `calibrate_threshold_on_features`)."""

import torch
from transformers.utils import logging

from ..modeling_causalqwen import CausalQwenForCausalLM
from ..sharding import is_partitioned

logger = logging.get_logger(__name__)


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
