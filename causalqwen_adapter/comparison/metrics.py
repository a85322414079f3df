"""What a trained arm is scored on, from final hidden states z of the prompts: accuracy by its own rule (argmax P_k
over the labels for the OvR arms, under the arm's link; the label logits otherwise) and by the softmax rule on loc_S,
macro-F1, the ECE of the own rule's confidence, and, with classes held out, the open-set scores (AUROC, FPR at 95 %
TPR, open-set macro-F1)."""

import torch
import torch.nn.functional as F

from ..cauchy import ovr_log_prob, ovr_probs
from ..classification import (
    abstention_threshold,
    auroc,
    expected_calibration_error,
    fpr_at_tpr,
    label_heads,
    label_scores,
    macro_f1,
    rejection_scores,
)
from .arms import ARMS


def logistic(arm: str) -> bool:
    return ARMS[arm]["loss"] == "logistic"


@torch.no_grad()
def label_odds(model, z, labels, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, scale_S) [N, K] of the labels, standard mode, in chunks of prompts (no [N, V] tensor): x is what the OvR
    link reads, P_k = F(x_k) with F the Cauchy CDF, or σ for the logistic arms."""
    device = model.action.bias.device  # the heads'; z and the results on the CPU
    ids = torch.tensor(labels.token_ids, device=device)
    x, scale = [], []
    for start in range(0, len(z), chunk_size):
        _, scale_S, x_k = label_heads(model, z[start : start + chunk_size].to(device), ids,
                                      model.config.causal_temperature)
        x.append(x_k.cpu())
        scale.append(scale_S.cpu())
    return torch.cat(x), torch.cat(scale)


def link_probs(arm: str, x: torch.Tensor) -> torch.Tensor:
    """P = F(x) under the arm's link, in float64 (σ(x) is 0 in float32 below x ≈ −104; in float64 below −745)."""
    x = x.double()
    return torch.sigmoid(x) if logistic(arm) else ovr_probs(x)


def link_prob(arm: str, x: float) -> float:
    """`link_probs` of one x."""
    return link_probs(arm, torch.tensor(x, dtype=torch.float64)).item()


def label_ovr(model, arm: str, z, labels, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(log P_k, scale_S) [N, K] of the labels under the arm's link (the Cauchy CDF, or σ for the logistic arms)."""
    x, scale = label_odds(model, z, labels, chunk_size)
    return (F.logsigmoid(x) if logistic(arm) else ovr_log_prob(x)), scale


def arm_scores(model, arm: str, z, labels):
    """`classification.label_scores` of the arm, its OvR probabilities under the arm's link (read from the scores'
    x: one scoring)."""
    scores = label_scores(model, z, labels, label_columns=True)
    if logistic(arm):
        scores.log_P = F.logsigmoid(scores.x)
    return scores


def own_rule(model) -> str:
    return "ovr" if model.config.objective == "ovr" else "softmax"


@torch.no_grad()
def accuracies(model, arm: str, z, target, labels) -> dict[str, float]:
    """Accuracy of the arm's rules on (clean or noisy) `target`."""
    scores = arm_scores(model, arm, z, labels)
    out = {"softmax": (scores.decide("softmax")[0] == target).double().mean().item()}
    if model.config.objective == "ovr":
        out["ovr"] = (scores.decide("ovr")[0] == target).double().mean().item()
    return out


@torch.no_grad()
def noise_metrics(model, arm: str, z, target, labels, scores=None) -> dict[str, float]:
    """Test metrics on `target`: accuracy by the arm's own rule and by the softmax rule on loc_S, macro-F1 of the own
    rule, the ECE (15 bins) of the own rule's confidence (max_k P_k under the arm's link for the OvR arms, the label
    set's maximum softmax probability otherwise), and the AUROC of that confidence separating the right top-1 from
    the wrong. `scores`: the arm's scores of `z` when already computed. The OvR confidence is F(max_k x_k) in float64
    and its AUROC ranks max_k x_k (the same order, F increases): a float32 P rounds to 0 or 1 where |x| is large and
    every tie counts half in the AUROC (as `open_set`)."""
    scores = arm_scores(model, arm, z, labels) if scores is None else scores
    pred, confidence = scores.decide(own_rule(model))
    rank = confidence
    if own_rule(model) == "ovr" and scores.x is not None:
        rank = scores.x.max(-1).values
        confidence = link_probs(arm, rank)
    correct = pred == target
    both = bool(correct.any()) and not bool(correct.all())
    return {"accuracy": correct.double().mean().item(),
            "accuracy_softmax_rule": (scores.decide("softmax")[0] == target).double().mean().item(),
            "ece": expected_calibration_error(confidence, correct),
            "confidence_auroc": auroc(rank[correct], rank[~correct]) if both else float("nan")}


FLAT_SPREAD = 0.01  # a P_top whose 10–90 % range is narrower than this says about the same of 80 % of the rows
FLAT_MIN_ROWS = 10  # fewer test rows say nothing about the spread


def p_top_spread(arm: str, scores) -> dict[str, float]:
    """What an OvR arm's confidence says across rows: the 10th, 50th and 90th percentiles of P_top = F(max_k x_k)
    (float64, under the arm's link) and the rows counted. Heads whose scale ran away give P_top ≈ ½ on every row (a
    10–90 % range near 0) while their argmax, and so the accuracy, is intact: the ECE then reads |accuracy − ½|."""
    p_top = link_probs(arm, scores.x.max(-1).values)
    q = torch.quantile(p_top, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {"p_top_p10": q[0], "p_top_median": q[1], "p_top_p90": q[2], "p_top_rows": len(p_top)}


def head_outputs(model, arm: str, z, labels) -> dict[str, float] | None:
    """What an OvR arm's heads say beyond the ranking, over prompts `z`: the median P_k of the label they pick, the
    share of prompts where no label's P_k passes ½ (the heads answer "none of these"), the median Σ_k P_k over the
    labels, and the median scale_S of the picked label (logit units). None for the softmax arms."""
    if model.config.objective != "ovr":
        return None
    log_P, scale = label_ovr(model, arm, z, labels)
    P = log_P.exp()
    top, pick = P.max(-1)
    return {"picked_prob": top.median().item(), "none_accepted": (top <= 0.5).double().mean().item(),
            "label_prob_sum": P.sum(-1).median().item(), "picked_scale": scale.gather(1, pick[:, None]).median().item()}


def open_set(model, arm, z, fine, known: list[int], val_z, val_fine, labels, coverage=0.95) -> dict[str, dict]:
    """Per rejection score: AUROC and FPR at 95 % TPR of known (fine ∈ known) against unknown test rows, the threshold
    that keeps `coverage` of the validation's known rows, and the open-set macro-F1 of (argmax label, or "unknown"
    below that threshold) over the known classes and "unknown". The OvR acceptance max_k P_k is read under the arm's
    link: its threshold is a P_k under that link, and the rows are ranked by max_k x_k, the same order as max_k P_k
    under either link (F increases), without P rounding to 0 or 1 where |x| is large (σ(x) is 0 in float32 below
    x ≈ −104, and every tie counts half in the AUROC; heads started at γ₀ = 0.005 put every row of the tests' tiny
    base near x ≈ −700)."""
    index = {k: i for i, k in enumerate(known)}
    is_known = torch.tensor([f in index for f in fine.tolist()])
    if is_known.all() or not is_known.any():
        raise ValueError("the test split has no unknown class (or no known one): lower (raise) the fraction of "
                         "classes known in training")
    target = torch.tensor([index.get(f, -1) for f in fine.tolist()])
    val_known = torch.tensor([f in index for f in val_fine.tolist()])
    # per score: (test scores, test predictions, validation scores of known rows, the threshold in the score's units)
    read = {}
    scores = label_scores(model, z, labels, label_columns=True)
    val_scores = label_scores(model, val_z, labels, label_columns=True)
    if model.config.objective == "ovr":  # the softmax objective never trained the scales
        top, pred = scores.x.max(-1)
        read["ovr_max_prob"] = (top, pred, val_scores.x.max(-1).values[val_known], lambda x: link_prob(arm, x))
    test_scores, pred = rejection_scores(scores), scores.decide("softmax")[0]
    for name, val_score in rejection_scores(val_scores).items():
        if name != "ovr_max_prob":
            read[name] = (test_scores[name], pred, val_score[val_known], float)
    out = {}
    for name, (score, pred, val_score, units) in read.items():
        threshold = abstention_threshold(val_score, coverage)
        pred = torch.where(score >= threshold, pred, torch.full_like(pred, -1))
        out[name] = {"auroc": auroc(score[is_known], score[~is_known]),
                     "fpr_at_95_tpr": fpr_at_tpr(score[is_known], score[~is_known], 0.95),
                     "open_set_macro_f1": macro_f1(pred, target), "threshold": units(threshold)}
    return out
