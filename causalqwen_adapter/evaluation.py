"""What a model predicts on held-out text: next-token metrics for a base and for adapters in every mode.

For each scored position (a target token y after the causal shift) a model gives logits s_k over the vocabulary; its
next-token distribution is q = softmax(s) (what greedy decoding maximises and sampling draws from):

- a softmax model (the base, or an adapter's `compatible` mode): s = its logits, and its per-token
  probabilities are p_k = q_k (they sum to 1);
- an OvR mode (`standard`, `causal`, `sampling`): s = the mode's logits (the config's `ovr_distribution`:
  loc_S + log P_k, or log P_k), and its per-token probabilities are p_k = P_k, the one-vs-rest probabilities of
  the Cauchy heads (they need not sum to 1).

Metrics (all over target tokens):

| name | what |
|---|---|
| `top1_accuracy` | argmax_k q_k == y |
| `target_prob` | mean p_y (P_y for OvR modes, the softmax probability otherwise) |
| `prob_sum_p10`, `prob_sum_median`, `prob_sum_p90` | quantiles of Σ_k p_k (1 for softmax models) |
| `nll` | mean −log q_y: the cross-entropy of the mode's distribution (for `normalize`, −log(P_y / ΣP)) |
| `ece_top1` | expected calibration error (15 equal-width bins) of the top-1 confidence max_k q_k |
| `ece_top10` | the same over the 10 largest p_k of each position against whether each is y: does p_k mean what it says? |
| `top1_changed` | OvR modes: the fraction of positions whose top-1 is not loc_S's, i.e. the decisions the heads change |
| `auroc_<signal>` | how well a confidence signal tells right top-1 tokens (argmax_k q_k == y) from wrong ones: the area under its ROC curve (0.5: no information; below 0.5, the signal is higher where the top-1 is wrong) |

The confidence signals (`CONFIDENCE_SIGNALS`), each where the model has it:

| signal | what | scored for |
|---|---|---|
| `max_prob` | the mode's top probability max_k q_k | every model and mode |
| `softmax_max_prob` | max_k softmax(loc_S)_k: the softmax of the same heads, read beside an OvR mode | the OvR modes |
| `P_top` | P_k of the top-1 token, its one-vs-rest probability | the OvR modes |
| `neg_scale_top` | −scale_S of the top-1 token: a narrower decision score, a surer one | CausalQwen, every mode |
| `prob_sum` | Σ_k P_k: how many tokens the heads accept at once | the OvR modes |

`EvaluationAccumulator` gathers them batch by batch (the trainer uses it under `eval_strategy`); `evaluate` runs
models over a tokenized dataset; `reliability_diagram` draws both calibrations (needs matplotlib).
"""

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .cauchy import INFERENCE_MODES
from .configuration_causalqwen import check_number

ECE_BINS = 15
TOP_K_CALIBRATION = 10
SOFTMAX = "softmax"  # the mode name of a plain base model's scores
CONFIDENCE_SIGNALS = ("max_prob", "softmax_max_prob", "P_top", "neg_scale_top", "prob_sum")


class ScoredPositions(NamedTuple):
    """Scored target positions of one mode: what `EvaluationAccumulator.update` takes."""

    mode: str
    scores: torch.Tensor  # [n, V] the logits of q
    log_probs: torch.Tensor | None  # [n, V] log P_k of an OvR mode; None for softmax scores
    targets: torch.Tensor  # [n]
    loc_S: torch.Tensor | None = None  # [n, V] the heads' decision scores (None for a plain causal LM)
    scale_S: torch.Tensor | None = None


def auroc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """P(score of a positive > score of a negative) + ½ P(tie): the area under the ROC curve of telling positives from
    negatives by a score, higher meaning positive (the Mann–Whitney U statistic over midranks). NaN without both."""
    if len(positive) == 0 or len(negative) == 0:
        return float("nan")
    scores = torch.cat([positive, negative]).double()
    order = torch.argsort(scores, stable=True)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    values, inverse = torch.unique(scores, return_inverse=True)  # ties share their mean rank
    mean_rank = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, ranks)
    mean_rank /= torch.bincount(inverse, minlength=len(values)).double()
    u = mean_rank[inverse[: len(positive)]].sum().item() - len(positive) * (len(positive) + 1) / 2
    return u / (len(positive) * len(negative))


@dataclass
class _Bins:
    """Confidence, hit-rate and count per equal-width bin of [0, 1]."""

    confidence: torch.Tensor = field(default_factory=lambda: torch.zeros(ECE_BINS, dtype=torch.float64))
    hits: torch.Tensor = field(default_factory=lambda: torch.zeros(ECE_BINS, dtype=torch.float64))
    count: torch.Tensor = field(default_factory=lambda: torch.zeros(ECE_BINS, dtype=torch.float64))

    def add(self, prob: torch.Tensor, hit: torch.Tensor) -> None:
        prob, hit = prob.reshape(-1).double().cpu(), hit.reshape(-1).double().cpu()
        index = (prob * ECE_BINS).long().clamp_(0, ECE_BINS - 1)  # p = 1 falls in the last bin
        self.confidence.index_add_(0, index, prob)
        self.hits.index_add_(0, index, hit)
        self.count.index_add_(0, index, torch.ones_like(prob))

    def ece(self) -> float:
        total = self.count.sum()
        if total == 0:
            return float("nan")
        return ((self.confidence - self.hits).abs().sum() / total).item()

    def curve(self) -> tuple[list, list, list]:
        """(mean confidence, hit rate, count) of the non-empty bins."""
        keep = self.count > 0
        n = self.count[keep]
        return (self.confidence[keep] / n).tolist(), (self.hits[keep] / n).tolist(), n.tolist()


class EvaluationAccumulator:
    """Next-token metrics of one model in one mode, accumulated over batches of scored positions."""

    def __init__(self, kind: str):
        if kind not in (SOFTMAX, *INFERENCE_MODES):
            raise ValueError(f"unknown score kind {kind!r}: choose softmax or one of {', '.join(INFERENCE_MODES)}")
        self.kind = kind
        self.n = 0
        self.correct = 0
        self.target_prob = 0.0
        self.nll = 0.0
        self.prob_sums: list[torch.Tensor] = []
        self.top1 = _Bins()
        self.top10 = _Bins()
        self.hits: list[torch.Tensor] = []  # top-1 right or wrong, per position
        self.changed = None  # positions whose top-1 is not loc_S's (an OvR mode given loc_S): decisions the heads change
        self.signals: dict[str, list[torch.Tensor]] = {name: [] for name in CONFIDENCE_SIGNALS}

    @property
    def is_softmax(self) -> bool:
        return self.kind in (SOFTMAX, "compatible")

    @torch.no_grad()
    def update(self, scores: torch.Tensor, targets: torch.Tensor, log_probs: torch.Tensor | None = None,
               loc_S: torch.Tensor | None = None, scale_S: torch.Tensor | None = None) -> None:
        """`scores` [N, V]: the logits of q; `log_probs` [N, V]: log P_k (OvR modes, required there); `targets` [N];
        `loc_S`, `scale_S` [N, V]: the heads' decision scores, for the confidence signals that read them."""
        if len(targets) == 0:
            return
        if self.is_softmax == (log_probs is not None):
            raise ValueError(f"{self.kind!r} scores take log_probs {'never' if self.is_softmax else 'always'}: "
                             "the OvR modes' per-token probabilities P_k are not their logits")
        log_q = F.log_softmax(scores.float(), -1)
        targets = targets.to(scores.device)
        log_p = log_q if log_probs is None else log_probs.float()  # per-token probabilities p_k
        log_sum = torch.zeros(len(targets), device=scores.device) if log_probs is None else torch.logsumexp(log_p, -1)
        log_q_y = log_q.gather(1, targets[:, None]).squeeze(1)
        top_log_q, top_id = log_q.max(-1)
        top_log_p, top_ids = log_p.topk(min(TOP_K_CALIBRATION, log_p.shape[1]), -1)
        self.n += len(targets)
        self.correct += (top_id == targets).sum().item()
        self.target_prob += log_p.gather(1, targets[:, None]).double().exp().sum().item()
        self.nll += -log_q_y.double().sum().item()
        self.prob_sums.append(log_sum.double().exp().cpu())
        self.top1.add(top_log_q.exp(), top_id == targets)
        self.top10.add(top_log_p.exp(), top_ids == targets[:, None])
        self.hits.append((top_id == targets).cpu())
        signals = {"max_prob": top_log_q.exp()}
        if log_probs is not None:
            signals["P_top"] = log_p.gather(1, top_id[:, None]).squeeze(1).exp()
            if loc_S is not None:
                loc = loc_S.float()
                loc_max, loc_top = loc.max(-1)
                signals["softmax_max_prob"] = (loc_max - torch.logsumexp(loc, -1)).exp()
                self.changed = (self.changed or 0) + (top_id != loc_top).sum().item()
        if scale_S is not None:
            signals["neg_scale_top"] = -scale_S.float().gather(1, top_id[:, None]).squeeze(1)
        for name, values in signals.items():
            self.signals[name].append(values.float().cpu())

    def add(self, scored: ScoredPositions) -> None:
        """`update` with what `score_positions` / `score_hidden_states` yield."""
        self.update(scored.scores, scored.targets, scored.log_probs, scored.loc_S, scored.scale_S)

    def compute(self) -> dict[str, float]:
        if self.n == 0:
            return {"num_tokens": 0}
        sums = torch.cat(self.prob_sums)
        levels = torch.tensor([0.1, 0.5, 0.9], dtype=sums.dtype, device=sums.device)  # quantile wants one device
        p10, median, p90 = torch.quantile(sums, levels).tolist()
        hits = torch.cat(self.hits)
        signals = {name: torch.cat(parts) for name, parts in self.signals.items()
                   if len(parts) == len(self.hits)}  # the signals this model and mode have at every position
        if not self.is_softmax:
            signals["prob_sum"] = sums  # Σ_k P_k, kept for its quantiles
        confidence = {f"auroc_{name}": auroc(signals[name][hits], signals[name][~hits])
                      for name in CONFIDENCE_SIGNALS if name in signals}
        return {
            "top1_accuracy": self.correct / self.n,
            "target_prob": self.target_prob / self.n,
            "prob_sum_p10": p10,
            "prob_sum_median": median,
            "prob_sum_p90": p90,
            "nll": self.nll / self.n,
            "ece_top1": self.top1.ece(),
            "ece_top10": self.top10.ece(),
            **({} if self.changed is None else {"top1_changed": self.changed / self.n}),
            **confidence,
            "num_tokens": self.n,
        }


def score_positions(model, batch: dict, modes, *, causal_temperature=None, chunk_size: int = 256):
    """Yield `ScoredPositions` (mode, scores [n, V], log P [n, V] or None, targets [n], loc_S, scale_S) over the
    target positions of `batch`, `chunk_size` at a time (the arguments of `EvaluationAccumulator.update`).

    `model` is a `CausalQwenForCausalLM` (scored in each of `modes` from one backbone pass) or any causal LM with
    `logits` (scored as `softmax`). `batch` holds `input_ids`, optionally `attention_mask`, `labels` (−100 where there
    is no target; `input_ids` otherwise) and `numeric_values`.
    """
    input_ids = batch["input_ids"]
    labels = batch.get("labels")
    labels = input_ids if labels is None else labels
    vocab = model.config.get_text_config().vocab_size
    for name, ids in (("input_ids", input_ids), ("labels", labels)):
        bad = (ids < 0) | (ids >= vocab)
        if name == "labels":
            bad &= ids != -100
        if bad.any():  # the embedding lookup or the gather would fail with a bare IndexError
            row, column = (i.item() for i in bad.nonzero()[0])
            raise ValueError(f"{name} of row {row} holds token id {ids[row, column].item()} at position {column}, "
                             f"outside the model's vocabulary [0, {vocab}): the ids were not made by this base's "
                             "tokenizer")
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
    if batch.get("attention_mask") is not None:  # neither a padding token nor a padding position is scored
        mask = batch["attention_mask"].bool()
        targets = targets.masked_fill(~(mask & F.pad(mask, (0, 1), value=False)[:, 1:]), -100)
    targets = targets.reshape(-1)
    valid = (targets != -100).nonzero().squeeze(1)
    targets = targets[valid]
    heads = getattr(model, "causal_heads", None)
    with torch.no_grad():
        if heads is None:  # a plain causal LM
            logits = model(input_ids=input_ids, attention_mask=batch.get("attention_mask"),
                           position_ids=batch.get("position_ids")).logits
            logits = logits.reshape(-1, logits.shape[-1])
            for start in range(0, len(valid), chunk_size):
                rows = valid[start : start + chunk_size]
                yield ScoredPositions(SOFTMAX, logits[rows], None, targets[start : start + chunk_size])
            return
        ids, embeds = model.embed_numbers(input_ids, None, batch.get("numeric_values"))
        hidden = model.model(input_ids=ids, inputs_embeds=embeds, attention_mask=batch.get("attention_mask"),
                             position_ids=batch.get("position_ids")).last_hidden_state
        yield from score_hidden_states(model, hidden.reshape(-1, hidden.shape[-1])[valid], targets, modes,
                                       causal_temperature=causal_temperature, chunk_size=chunk_size)


@torch.no_grad()
def score_hidden_states(model, z, targets, modes, *, causal_temperature=None, chunk_size: int = 256):
    """`score_positions` on final hidden states `z` [n, H] already taken (a cache, a feature store): yield
    `ScoredPositions` for each of `modes`, `chunk_size` positions at a time."""
    temperature = model.config.causal_temperature if causal_temperature is None else causal_temperature
    for mode in modes:
        for start in range(0, len(targets), chunk_size):
            _, _, loc_S, scale_S = model.causal_heads(z[start : start + chunk_size], mode, temperature)
            log_P = None if mode == "compatible" else model.ovr_log_probs(loc_S, scale_S)
            yield ScoredPositions(mode, model.mode_scores(loc_S, scale_S, mode, log_P), log_P,
                                  targets[start : start + chunk_size], loc_S, scale_S)


def evaluate(model, batches, modes=("compatible", "standard", "causal"), *, causal_temperature=None,
             progress: bool = False, desc: str | None = None, total: int | None = None):
    """Metrics of `model` over `batches` (dicts as in `score_positions`): {mode: {metric: value}} plus, under the
    key `"accumulators"`, the `EvaluationAccumulator` of each mode (for reliability diagrams).

    A plain causal LM is scored once, as `softmax`; a CausalQwen model in every mode of `modes`. The batches' tensors
    are moved to the model's device. `progress` shows a bar (of `total` batches, when given: a generator has no len).
    """
    if causal_temperature is not None:  # checked before any batch is scored, even where no mode reads it
        check_number("causal_temperature", causal_temperature, minimum=0)
    is_causal = hasattr(model, "causal_heads")
    kinds = list(modes) if is_causal else [SOFTMAX]
    for mode in kinds:
        if mode != SOFTMAX and mode not in INFERENCE_MODES:
            raise ValueError(f"unknown inference mode {mode!r}: choose from {', '.join(INFERENCE_MODES)}")
    accumulators = {kind: EvaluationAccumulator(kind) for kind in kinds}
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=desc or "evaluating", total=total, unit="batch")
    device = next(model.parameters()).device
    for batch in batches:  # the batches go where the model is
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        for scored in score_positions(model, batch, kinds, causal_temperature=causal_temperature):
            accumulators[scored.mode].add(scored)
    results = {kind: acc.compute() for kind, acc in accumulators.items()}
    results["accumulators"] = accumulators
    return results


def markdown_table(results: dict[str, dict[str, dict]]) -> str:
    """One row per (model, mode): {model name: {mode: metrics}} as a markdown table."""
    columns = ["top1_accuracy", "nll", "target_prob", "prob_sum_median", "prob_sum_p10", "prob_sum_p90", "ece_top1",
               "ece_top10", "top1_changed", "num_tokens"]
    lines = ["| model | mode | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
    for name, per_mode in results.items():
        for mode, metrics in per_mode.items():
            if mode == "accumulators":
                continue
            cells = [_format(metrics.get(c)) for c in columns]
            lines.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def confidence_table(results: dict[str, dict[str, dict]]) -> str:
    """AUROC of each confidence signal for "the top-1 is right", one row per (model, mode); – where a model or mode has
    no such signal."""
    columns = [f"auroc_{name}" for name in CONFIDENCE_SIGNALS]
    lines = ["| model | mode | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
    for name, per_mode in results.items():
        for mode, metrics in per_mode.items():
            if mode != "accumulators":
                lines.append(f"| {name} | {mode} | " + " | ".join(_format(metrics.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _format(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"


def reliability_diagram(accumulators: dict[str, dict[str, EvaluationAccumulator]], path) -> None:
    """A PNG with two panels, top-1 confidence and top-10 OvR probabilities, one curve per (model, mode)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("the reliability diagram needs matplotlib: pip install matplotlib (the [plots] extra)") from err
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, attr, title in ((axes[0], "top1", "top-1 confidence (q = P/ΣP)"), (axes[1], "top10", "top-10 p_k (OvR)")):
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
        for name, per_mode in accumulators.items():
            for mode, acc in per_mode.items():
                confidence, hit_rate, _ = getattr(acc, attr).curve()
                ece = getattr(acc, attr).ece()
                ax.plot(confidence, hit_rate, marker="o", markersize=3, label=f"{name} {mode} (ECE {ece:.3f})")
        ax.set(title=title, xlabel="predicted probability", ylabel="observed frequency", xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_model(name: str, dtype):
    """(model, name of its base) for a CausalQwen adapter or any causal LM (a base), folder or Hub id."""
    from transformers import AutoModelForCausalLM, PreTrainedConfig

    from .modeling_causalqwen import CausalQwenForCausalLM

    config, _ = PreTrainedConfig.get_config_dict(name)
    if config.get("model_type") == CausalQwenForCausalLM.config_class.model_type:
        model = CausalQwenForCausalLM.from_pretrained(name, dtype=dtype)
        return model, model.config.base_model_name_or_path
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype), name


__all__ = ["CONFIDENCE_SIGNALS", "EvaluationAccumulator", "ScoredPositions", "auroc", "confidence_table", "evaluate",
           "load_model", "markdown_table", "reliability_diagram", "score_hidden_states", "score_positions"]
