"""The evaluation harness against naive float64 references, on random scores and on tiny models."""

import math

import pytest
import torch
from transformers import Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.cauchy import ovr_log_prob
from causalqwen_adapter.evaluation import EvaluationAccumulator, evaluate, markdown_table

from conftest import TINY_VOCAB


def _naive_ece(probs: list[float], hits: list[float], bins: int = 15) -> float:
    total = 0.0
    for b in range(bins):
        members = [i for i, p in enumerate(probs) if min(int(p * bins), bins - 1) == b]
        if members:
            confidence = sum(probs[i] for i in members) / len(members)
            rate = sum(hits[i] for i in members) / len(members)
            total += len(members) / len(probs) * abs(confidence - rate)
    return total


def _naive_metrics(scores: torch.Tensor, targets: torch.Tensor, softmax: bool) -> dict:
    s = scores.double()
    rows = []
    for n in range(len(targets)):
        if softmax:
            p = torch.exp(s[n] - torch.logsumexp(s[n], 0))
        else:
            p = torch.exp(s[n])
        q = p / p.sum()
        y = targets[n].item()
        order = sorted(range(len(p)), key=lambda k: -p[k].item())
        rows.append({
            "hit": float(order[0] == y), "p_y": p[y].item(), "sum": p.sum().item(), "nll": -math.log(q[y].item()),
            "conf": q[order[0]].item(), "top10": [(p[k].item(), float(k == y)) for k in order[:10]],
        })
    sums = torch.tensor([r["sum"] for r in rows], dtype=torch.float64)
    pairs = [pair for r in rows for pair in r["top10"]]
    return {
        "top1_accuracy": sum(r["hit"] for r in rows) / len(rows),
        "target_prob": sum(r["p_y"] for r in rows) / len(rows),
        "nll": sum(r["nll"] for r in rows) / len(rows),
        "prob_sum_median": torch.quantile(sums, 0.5).item(),
        "prob_sum_p10": torch.quantile(sums, 0.1).item(),
        "prob_sum_p90": torch.quantile(sums, 0.9).item(),
        "ece_top1": _naive_ece([r["conf"] for r in rows], [r["hit"] for r in rows]),
        "ece_top10": _naive_ece([p for p, _ in pairs], [h for _, h in pairs]),
    }


@pytest.mark.parametrize("kind", ["softmax", "standard"])
def test_accumulator_matches_naive_float64_reference(kind):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g) * 3
    if kind == "softmax":
        scores = logits
    else:  # log P_k of OvR probabilities with a sum far from 1
        scores = ovr_log_prob((logits - 4) / (0.5 + torch.rand(50, generator=g)))
    targets = torch.where(torch.rand(37, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, 50, (37,), generator=g))
    acc = EvaluationAccumulator(kind)
    for start in range(0, 37, 10):  # batch boundaries do not matter
        acc.update(scores[start : start + 10], targets[start : start + 10])
    got = acc.compute()
    expected = _naive_metrics(scores, targets, softmax=kind == "softmax")
    assert got["num_tokens"] == 37
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    if kind == "softmax":
        assert got["prob_sum_median"] == pytest.approx(1.0)


def test_compatible_mode_scores_exactly_as_the_base(tied_base, input_ids):
    base = Qwen2ForCausalLM.from_pretrained(tied_base).eval()
    model = CausalQwenForCausalLM.from_base(tied_base).eval()
    labels = input_ids.clone()
    labels[:, :3] = -100  # a prompt: no target there
    batch = {"input_ids": input_ids, "labels": labels}
    base_metrics = evaluate(base, [batch])["softmax"]
    adapter_metrics = evaluate(model, [batch], modes=("compatible", "standard"))
    assert base_metrics["num_tokens"] == 2 * (9 - 3)
    for name in ("top1_accuracy", "nll", "target_prob", "ece_top1", "ece_top10"):
        assert adapter_metrics["compatible"][name] == pytest.approx(base_metrics[name], rel=1e-5, abs=1e-7), name
    # the standard mode scores log P_k of the model's own forward
    with torch.no_grad():
        log_p = model(input_ids, inference_mode="standard").logits
    targets = labels[:, 1:]
    keep = targets != -100
    expected = _naive_metrics(log_p[:, :-1][keep], targets[keep], softmax=False)
    for name, value in expected.items():
        assert adapter_metrics["standard"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_padding_is_not_scored(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base).eval()
    mask = torch.ones_like(input_ids)
    mask[1, :4] = 0  # left padding in the second row
    metrics = evaluate(model, [{"input_ids": input_ids, "attention_mask": mask}], modes=("standard",))["standard"]
    assert metrics["num_tokens"] == 8 + 4  # the first row's 8 targets, the second row's targets after its padding


def test_bad_mode_and_table(tied_base, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base).eval()
    with pytest.raises(ValueError, match="unknown inference mode 'greedy'"):
        evaluate(model, [{"input_ids": input_ids}], modes=("greedy",))
    results = evaluate(model, [{"input_ids": input_ids}], modes=("causal",))
    table = markdown_table({"adapter": results})
    assert table.splitlines()[2].startswith("| adapter | causal | ")
    assert "accumulators" not in table
    assert TINY_VOCAB == model.config.vocab_size


def test_reliability_diagram_is_a_png(tied_base, input_ids, tmp_path):
    pytest.importorskip("matplotlib")
    from causalqwen_adapter.evaluation import reliability_diagram

    model = CausalQwenForCausalLM.from_base(tied_base).eval()
    results = evaluate(model, [{"input_ids": input_ids}], modes=("compatible", "standard"))
    reliability_diagram({"adapter": results["accumulators"]}, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
