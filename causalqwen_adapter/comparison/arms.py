"""The arms a comparison trains: fresh heads built from a base with the arm's head fields, and the loss each trains
on. `recipe` arms train on the package's own loss, `model.heads_loss(z, targets)` (what `forward(labels=...)`
computes after the backbone); `gce` and the `logistic` arms train on a loss the package does not have, written here
on the same tensors.

| arm | loss |
|---|---|
| `ovr` | the OvR loss (Cauchy) over the whole vocabulary (`ovr_candidates=None`) + softmax cross-entropy; the OvR gradient stops at the locations |
| `ovr_candidates` | the default recipe: the same over each position's 16 most likely tokens and the target, from γ₀ = 0.005 |
| `softmax` | `--objective softmax`: the cross-entropy of loc_S alone |
| `gce` | generalised cross-entropy (1 − p_y^q)/q, q = 0.7, of softmax(loc_S) over the vocabulary |
| `ovr_logistic` | `ovr` with the logistic link σ(x) in place of the Cauchy CDF |
| `ovr_location` | `ovr` with `ovr_trains_location=True`: the OvR loss's gradient reaches the locations too |
| `ovr_alone` | the OvR loss over the candidates alone (`softmax_loss_weight=0`, `ovr_trains_location=True`), from γ₀ = 0.005 |
| `ovr_alone_logistic` | `ovr_alone` with the logistic link |
| `ovr_candidates_slow_scale` | `ovr_candidates` with the scale path at the location path's rate |
| `ovr_candidates_absolute`, `ovr_alone_absolute` | absolute thresholds (`ovr_relative_threshold=False`, C calibrated on the training prompts as the trainer does) |
| `ovr_alone_absolute_logistic` | `ovr_alone_absolute` with the logistic link |
"""

import math

import torch
import torch.nn.functional as F

# "ovr", "ovr_logistic" and "ovr_location": the OvR loss over the whole vocabulary (the package's default before
# ovr_candidates), from γ₀ = 1e-5
VOCABULARY = {"ovr_candidates": None}
CANDIDATES = {"ovr_candidates": 16, "gamma_init": 0.005, "b_noise_init": 1e-6}
ALONE = {**CANDIDATES, "ovr_trains_location": True, "softmax_loss_weight": 0.0}
ARMS = {
    "ovr": dict(heads=VOCABULARY, loss="recipe"),
    "softmax": dict(heads={"objective": "softmax"}, loss="recipe"),
    "gce": dict(heads={"objective": "softmax"}, loss="gce"),
    "ovr_logistic": dict(heads=VOCABULARY, loss="logistic"),
    "ovr_location": dict(heads={**VOCABULARY, "ovr_trains_location": True}, loss="recipe"),
    # the OvR loss over the top-16 of loc_S and the target, from a scale where P_k is graded (docs/design.md, Training
    # losses), with the noise it was measured with (the package's default is now 0.01)
    "ovr_candidates": dict(heads=CANDIDATES, loss="recipe"),
    # the OvR loss over the candidates alone trains the locations too (no cross-entropy): the robust classifier whose
    # bounded gradient on a confidently wrong label is the claim under test, and its logistic-link ablation
    "ovr_alone": dict(heads=ALONE, loss="recipe"),
    "ovr_alone_logistic": dict(heads=ALONE, loss="logistic"),
    # the default recipe with the scale path held at the location path's rate (0.1 × learning_rate): one Adam step
    # moves W_scale z by about the rate × ‖z‖₁ (≈ 4,000 on the demo base), so a rate of 1e-2 jumps the scale into the
    # flat region where every P_k is ½ (docs/design.md, Training losses)
    "ovr_candidates_slow_scale": dict(heads=CANDIDATES, loss="recipe", scale_lr_ratio=0.1),
    # absolute thresholds: P_k compares loc_S_k itself with C, so every label can be rejected at once whatever the
    # softmax's normalisation says; C calibrated on the training prompts
    "ovr_candidates_absolute": dict(heads={**CANDIDATES, "ovr_relative_threshold": False}, loss="recipe"),
    "ovr_alone_absolute": dict(heads={**ALONE, "ovr_relative_threshold": False}, loss="recipe"),
    "ovr_alone_absolute_logistic": dict(heads={**ALONE, "ovr_relative_threshold": False}, loss="logistic"),
}
GCE_Q = 0.7


def check_arms(arms) -> list[str]:
    """`arms` as a list, or a ValueError naming the unknown ones and the choices."""
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(map(repr, unknown))}: choose from {', '.join(ARMS)}")
    return list(arms)


def link_ovr_loss(model, z, targets, link: str) -> torch.Tensor:
    """The recipe's loss (softmax_loss_weight × cross-entropy of loc_S + OvR loss, relative thresholds), written on
    [N, V] tensors with the OvR probability P = F(x) for `link` ∈ {cauchy, logistic}, over the vocabulary or, with
    `ovr_candidates` = K, over each position's K largest loc_S and the target. With `cauchy` it is the package's
    `heads_loss` (tests/test_evidence.py checks the loss and the gradients)."""
    config = model.config
    loc_U, scale_U = model.abduction(z)
    weight, bias, b_noise = model.action.effective_weight(), model.action.bias, model.action.b_noise
    loc_S = F.linear(loc_U, weight, bias)
    ce = -torch.log_softmax(loc_S, -1).gather(1, targets[:, None]).squeeze(1)
    keep = config.ovr_trains_location
    y, k = targets[:, None], config.ovr_candidates
    # the OvR terms' columns: the vocabulary, or the K largest loc_S then the target (the negatives are the first K
    # other than the target), read as gathered rows of W_A
    columns = None if k is None else torch.cat([loc_S.detach().topk(k, -1).indices, y], 1)
    # relative thresholds compare C with log softmax(loc_S): the log-partition is a reference point, without gradient
    reference = loc_S - loc_S.logsumexp(-1, keepdim=True).detach() if config.ovr_relative_threshold else loc_S
    weight = weight if keep else weight.detach()
    noisy_scale = scale_U + b_noise.abs()
    threshold = model.ovr.threshold
    if columns is None:
        scale_S = F.linear(noisy_scale, weight.abs())
    else:
        reference = reference.gather(1, columns)
        scale_S = torch.bmm(weight[columns].abs(), noisy_scale.unsqueeze(-1)).squeeze(-1)
        threshold = threshold[columns] if threshold.dim() else threshold
    x = ((reference if keep else reference.detach()) - threshold) / scale_S.clamp_min(torch.finfo(scale_S.dtype).tiny)
    if link == "cauchy":
        log_1mP = torch.log(torch.atan2(torch.ones_like(x), x) / math.pi)
        log_P = torch.log(torch.atan2(torch.ones_like(x), -x) / math.pi)
    elif link == "logistic":
        log_1mP, log_P = F.logsigmoid(-x), F.logsigmoid(x)
    else:
        raise ValueError(f"unknown link {link!r}: cauchy or logistic")
    if columns is None:
        ovr = -log_1mP.sum(-1) + log_1mP.gather(1, y).squeeze(1) - log_P.gather(1, y).squeeze(1)
    else:
        ovr = -log_1mP[:, :k].masked_fill(columns[:, :k] == y, 0.0).sum(-1) - log_P[:, k]
    return (ovr + config.softmax_loss_weight * ce).mean()


def gce_loss(model, z, targets, q: float = GCE_Q) -> torch.Tensor:
    """Generalised cross-entropy (Zhang & Sabuncu 2018), (1 − p_y^q)/q with p = softmax(loc_S) over the vocabulary."""
    loc_U, _ = model.abduction(z)
    loc_S = F.linear(loc_U, model.action.effective_weight(), model.action.bias)
    log_p = torch.log_softmax(loc_S, -1).gather(1, targets[:, None]).squeeze(1)
    return ((1 - torch.exp(q * log_p)) / q).mean()


def arm_loss(model, arm: str, z, targets) -> torch.Tensor:
    kind = ARMS[arm]["loss"]
    if kind == "recipe":
        return model.heads_loss(z, targets).loss
    if kind == "gce":
        return gce_loss(model, z, targets)
    return link_ovr_loss(model, z, targets, "logistic")
