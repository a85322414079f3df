"""Classification through the language model: a label set scored at the end of each prompt.

Labelled text is `prompt`/`completion` rows whose completion is the label (what `causalqwen train` trains on). A
label is scored by its first token at the prompt's last position, where training put that token's target, so every
label of a set must have a first token of its own. From the final hidden state `z` of that position:

- a CausalQwen adapter gives `loc_S` and the one-vs-rest probabilities `P_k` (docs/design.md, OvR probabilities):
  the `ovr` rule predicts `argmax_k P_k` over the labels, with confidence `max_k P_k`, and each label is accepted or
  rejected on its own (`P_k > ½`), so "none of these" is a possible answer;
- a base (or an adapter read through `loc_S`, the compatible mode) is scored by the `softmax` rule: `argmax_k` of
  the label logits, with confidence the softmax over the label set (renormalised) of that label.

Metrics of one rule (`classification_metrics`): accuracy, macro-F1 (over the classes present in the targets or the
predictions), the ECE of the confidence (15 equal-width bins, as `evaluation`), and abstention: a threshold on the
confidence chosen on validation rows of known labels so that `coverage` of them are kept (`abstention_threshold`),
then the test coverage and the accuracy on the kept rows; and the accuracy–coverage curve.

`rejection_scores` gives the scores an open-set protocol compares (higher: more likely a known label).
"""

import math
from dataclasses import dataclass

import torch

from .cauchy import few_rows_linear, fuse_noise, ovr_log_prob, ovr_standardize
from .evaluation import ECE_BINS, _Bins
from .evaluation import auroc as rank_auroc  # the rank statistic; here with the open-set check

RULES = ("ovr", "softmax")


@dataclass
class LabelSet:
    """Labels (the completion strings) and the first token of each."""

    labels: list[str]
    token_ids: list[int]

    def index(self, label: str) -> int:
        try:
            return self.labels.index(label)
        except ValueError:
            raise ValueError(f"completion {label!r} is not in the label set {self.labels}: add it to the labels or "
                             "drop the rows") from None


def label_set(tokenizer, labels, vocab_size: int) -> LabelSet:
    """The first token of each label, or a ValueError naming the label that cannot be scored: an empty or unknown
    label, a token outside the model's vocabulary, two labels that share a first token, fewer than two labels."""
    labels = list(dict.fromkeys(labels))
    if len(labels) < 2:
        raise ValueError(f"the label set {labels} has {len(labels)} label(s): classification needs two or more "
                         "(a dataset with one class cannot be classified; add rows of other classes)")
    unk = getattr(tokenizer, "unk_token_id", None)
    ids, owner = [], {}
    for label in labels:
        tokens = tokenizer(label, add_special_tokens=False)["input_ids"]
        if not tokens:
            raise ValueError(f"label {label!r} has no token: give every label some text")
        first = tokens[0]
        if unk is not None and first == unk:
            raise ValueError(f"label {label!r} is absent from the tokenizer: it tokenizes to the unknown token "
                             f"{tokenizer.unk_token!r}. Use a word of the tokenizer's vocabulary as the label")
        if not 0 <= first < vocab_size:
            raise ValueError(f"label {label!r}: its first token id {first} is outside the model's vocabulary of "
                             f"{vocab_size}: use the tokenizer of the model's base")
        if first in owner:
            raise ValueError(
                f"labels {owner[first]!r} and {label!r} share their first token {tokenizer.decode([first])!r} (id "
                f"{first}): a label is scored by its first token, so give each label a different first token "
                "(e.g. a different first word)")
        owner[first] = label
        ids.append(first)
    return LabelSet(labels, ids)


def tokenize_prompts(tokenizer, rows, labels: LabelSet) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, label index) per row, tokenized as TRL's SFT tokenizes `prompt` + `completion`. A row whose
    completion does not start with its label's token right after the prompt's tokens (the prompt's end merges with
    the label) is refused: training would have scored another position."""
    prompts, targets = [], []
    for i, row in enumerate(rows):
        k = labels.index(row["completion"])
        prompt = tokenizer(text=row["prompt"])["input_ids"]
        full = tokenizer(text=row["prompt"] + row["completion"])["input_ids"]
        if not prompt or full[: len(prompt)] != prompt or len(full) <= len(prompt) or full[len(prompt)] != labels.token_ids[k]:
            raise ValueError(
                f"row {i}: the tokens of prompt + completion do not continue the prompt's tokens with the first token "
                f"of {row['completion']!r} (the prompt's end merges with the label, or the prompt is empty): end the "
                "prompt on a token boundary, e.g. 'Label:' with labels that start with a space")
        prompts.append(prompt)
        targets.append(k)
    return prompts, targets


@torch.no_grad()
def prompt_hidden_states(backbone, prompts: list[list[int]], batch_size: int = 16, device=None, *,
                         progress: bool = False, desc: str | None = None) -> torch.Tensor:
    """The final hidden state `z` [N, H] at the last token of each prompt (right-padded batches: the padding comes
    after the position read, so it does not reach it). `progress` shows a bar over the batches."""
    device = device or next(backbone.parameters()).device
    out = []
    starts = range(0, len(prompts), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=desc or "scoring", unit="batch")  # a range has a len: the bar has a total
    for start in starts:
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        hidden = backbone(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        last = torch.tensor([len(p) - 1 for p in chunk], device=hidden.device)
        out.append(hidden[torch.arange(len(chunk), device=hidden.device), last].float().cpu())
    return torch.cat(out)


@dataclass
class LabelScores:
    """What a model says about each label at each prompt: `loc` [N, K] the label logits (loc_S, or a base's
    logits), `log_partition` [N] their full-vocabulary logsumexp, `log_P` [N, K] the OvR log-probabilities (None for
    a base); `x` [N, K] the OvR scores P_k = F(x_k) reads, where kept (`label_scores(label_columns=True)`)."""

    loc: torch.Tensor
    log_partition: torch.Tensor
    log_P: torch.Tensor | None = None
    x: torch.Tensor | None = None

    def rules(self) -> tuple[str, ...]:
        return RULES if self.log_P is not None else ("softmax",)

    def decide(self, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted label index, confidence) per row under `rule`."""
        if rule == "ovr":
            if self.log_P is None:
                raise ValueError("the ovr rule needs OvR probabilities: score a CausalQwen adapter")
            log_conf, pred = self.log_P.max(-1)
            return pred, log_conf.exp()
        if rule == "softmax":
            log_conf, pred = torch.log_softmax(self.loc, -1).max(-1)
            return pred, log_conf.exp()
        raise ValueError(f"unknown rule {rule!r}: choose one of {', '.join(RULES)}")


@torch.no_grad()
def label_scores(model, z: torch.Tensor, labels: LabelSet, *, inference_mode: str = "standard",
                 causal_temperature: float | None = None, chunk_size: int = 64,
                 label_columns: bool = False) -> LabelScores:
    """`LabelScores` from final hidden states `z` [N, H]: a CausalQwen model's heads (in `inference_mode`, which
    fuses the noise as docs/design.md, Action network says), or a causal LM's `lm_head`. In `compatible` mode an
    adapter is read through loc_S alone, as a base through its logits: no OvR probabilities (`log_P` None), the
    `softmax` rule only. `label_columns`: in the standard mode, scale_S at the labels' columns alone (`label_heads`:
    about half the work; equal within rounding, not bit for bit, and so not where a tie between two scorings of one
    prompt decides a count); the scores keep x, the OvR scores before the link."""
    ids = torch.tensor(labels.token_ids)
    heads = getattr(model, "causal_heads", None)
    if heads is not None:  # checked here: the standard mode's scores below do not pass through `causal_heads`
        inference_mode, temperature = model._resolve_mode(inference_mode, causal_temperature)
    device = next(model.parameters()).device
    loc, log_z, log_P, xs = [], [], [], []
    for start in range(0, len(z), chunk_size):
        zz = z[start : start + chunk_size].to(device)
        if heads is not None and inference_mode == "standard" and label_columns:
            loc_S, _, x = label_heads(model, zz, ids.to(device), temperature)
            log_P.append(ovr_log_prob(x).cpu())
            xs.append(x.float().cpu())
        elif heads is not None:
            _, _, loc_S, scale_S = heads(zz, inference_mode, temperature)
            if scale_S is not None:  # None in compatible mode, which scores with loc_S alone
                log_P.append(model.ovr_log_probs(loc_S, scale_S)[:, ids.to(device)].float().cpu())
        else:
            loc_S = model.get_output_embeddings()(zz.to(model.get_output_embeddings().weight.dtype))
        loc_S = loc_S.float()
        loc.append(loc_S[:, ids.to(device)].cpu())
        log_z.append(torch.logsumexp(loc_S, -1).cpu())
    return LabelScores(torch.cat(loc), torch.cat(log_z), torch.cat(log_P) if log_P else None,
                       torch.cat(xs) if xs else None)


@torch.no_grad()
def label_heads(model, z: torch.Tensor, ids: torch.Tensor, temperature: float):
    """(loc_S [N, V], scale_S [N, K], x [N, K]) of a CausalQwen model in the standard mode at final hidden states
    `z`: loc_S over the whole vocabulary (its logsumexp, and log softmax(loc_S) for relative thresholds, need every
    column), scale_S and the OvR scores x_k = (loc_S_k or log softmax_k − C_k) / scale_S_k at the label columns `ids`
    alone: the values of `causal_heads` and `model.ovr` read at those columns, without the [N × V] scale_S (half
    the products, and the elementwise work on V columns nothing reads)."""
    loc_U, scale_U = model.abduction(z.to(model.action.bias.dtype))

    def law(action, loc_U, scale_U):
        loc_U, scale_U = fuse_noise(loc_U, scale_U, action.b_noise, "standard", temperature)
        weight = action.effective_weight()
        loc_S = few_rows_linear(loc_U, weight)
        loc_S = loc_S if action.bias is None else loc_S.add_(action.bias)
        return loc_S, torch.mm(scale_U, weight[ids].abs().T)  # [K × C]: nothing to gain from the layout

    def scores(ovr, loc_S, scale_S):
        loc = loc_S.float()
        reference = loc[:, ids] - torch.logsumexp(loc, -1, keepdim=True) if ovr.relative else loc[:, ids]
        threshold = ovr.threshold.float()
        return ovr_standardize(reference, scale_S.float(), threshold[ids] if threshold.dim() else threshold)

    loc_S, scale_S = model.action(loc_U, scale_U, read=law)
    return loc_S, scale_S, model.ovr(loc_S, scale_S, read=scores)


def rejection_scores(scores: LabelScores) -> dict[str, torch.Tensor]:
    """Scores of "one of the known labels" (higher: more likely known), per row: the OvR acceptance `max_k P_k`;
    the softmax's maximum over the label set renormalised; its full-vocabulary probability of the top label and of
    the label set summed; the energy score `logsumexp_k loc_k`; the maximum label logit."""
    vocab = scores.loc - scores.log_partition[:, None]
    out = {
        "softmax_label_max": torch.softmax(scores.loc, -1).max(-1).values,
        "softmax_vocab_top": vocab.max(-1).values.exp(),
        "softmax_vocab_label_mass": vocab.logsumexp(-1).exp(),
        "energy": scores.loc.logsumexp(-1),
        "max_logit": scores.loc.max(-1).values,
    }
    if scores.log_P is not None:
        out = {"ovr_max_prob": scores.log_P.max(-1).values.exp(), **out}
    return out


# ---------------------------------------------------------------------------------------------- metrics


def macro_f1(pred: torch.Tensor, target: torch.Tensor) -> float:
    """Mean F1 over the classes present in `target` or `pred` (a class predicted and absent counts, with F1 0)."""
    f1 = []
    for k in torch.unique(torch.cat([pred, target])).tolist():
        tp = ((pred == k) & (target == k)).sum().item()
        fp = ((pred == k) & (target != k)).sum().item()
        fn = ((pred != k) & (target == k)).sum().item()
        f1.append(2 * tp / (2 * tp + fp + fn))
    return sum(f1) / len(f1)


def expected_calibration_error(confidence: torch.Tensor, correct: torch.Tensor) -> float:
    bins = _Bins()
    bins.add(confidence, correct)
    return bins.ece()


def abstention_threshold(validation_confidence: torch.Tensor, coverage: float) -> float:
    """The confidence threshold that keeps (score ≥ threshold) at least `coverage` of the validation rows: the
    ⌊(1 − coverage)·n⌋-th smallest validation score. Chosen on rows of known labels only."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    values = validation_confidence.double().sort().values
    if len(values) == 0:
        raise ValueError("no validation rows to choose the abstention threshold on")
    return values[math.floor((1 - coverage) * len(values))].item()


def accuracy_coverage_curve(confidence: torch.Tensor, correct: torch.Tensor, points: int = 20) -> dict[str, list]:
    """Accuracy of the ⌈c·n⌉ most confident rows at coverages c = 1/points … 1, and its area (mean over c)."""
    order = torch.argsort(confidence.double(), descending=True, stable=True)
    hits = correct.double()[order].cumsum(0)
    n = len(order)
    coverages = [(i + 1) / points for i in range(points)]
    accuracy = [(hits[math.ceil(c * n) - 1] / math.ceil(c * n)).item() for c in coverages]
    return {"coverage": coverages, "accuracy": accuracy, "area": sum(accuracy) / points}


def classification_metrics(pred: torch.Tensor, target: torch.Tensor, confidence: torch.Tensor,
                           threshold: float | None = None) -> dict:
    """Accuracy, macro-F1, ECE; with a `threshold` the abstention figures (rows with confidence < threshold are
    rejected): coverage, accuracy on the kept rows, and the rejected rows' accuracy (what abstaining saved)."""
    correct = (pred == target).double()
    out = {
        "accuracy": correct.mean().item(),
        "macro_f1": macro_f1(pred, target),
        "ece": expected_calibration_error(confidence, correct),
        "num_rows": len(target),
        "accuracy_coverage": accuracy_coverage_curve(confidence, correct),
    }
    if threshold is not None:
        kept = confidence.double() >= threshold
        out["threshold"] = threshold
        out["coverage"] = kept.double().mean().item()
        out["selective_accuracy"] = correct[kept].mean().item() if kept.any() else float("nan")
        out["rejected_accuracy"] = correct[~kept].mean().item() if (~kept).any() else float("nan")
    return out


def auroc(known: torch.Tensor, unknown: torch.Tensor) -> float:
    """The area under the ROC curve of telling known rows (positives) from unknown ones by a score, higher meaning
    known (`evaluation.auroc`)."""
    if len(known) == 0 or len(unknown) == 0:
        raise ValueError("AUROC needs known and unknown rows: the split has no unknown class (lower the fraction of "
                         "classes known in training) or no known one")
    return rank_auroc(known, unknown)


def fpr_at_tpr(known: torch.Tensor, unknown: torch.Tensor, tpr: float = 0.95) -> float:
    """The fraction of unknown rows accepted (score ≥ t) at the largest threshold t that accepts `tpr` of the known
    rows."""
    threshold = abstention_threshold(known, tpr)
    return (unknown.double() >= threshold).double().mean().item()


def reliability_bins(confidence: torch.Tensor, correct: torch.Tensor) -> tuple[list, list, list]:
    """(mean confidence, accuracy, count) of the non-empty bins of the ECE."""
    bins = _Bins()
    bins.add(confidence, correct.double())
    return bins.curve()


__all__ = [
    "ECE_BINS", "LabelScores", "LabelSet", "RULES", "abstention_threshold", "accuracy_coverage_curve", "auroc",
    "classification_metrics", "fpr_at_tpr", "expected_calibration_error", "label_scores", "label_set", "macro_f1",
    "prompt_hidden_states", "rejection_scores", "reliability_bins", "tokenize_prompts",
]
