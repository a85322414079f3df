"""The evaluation harness against naive float64 references, on random scores and on tiny models."""

import math

import pytest
import torch
from transformers import Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.cauchy import ovr_log_prob
from causalqwen_adapter.evaluation import EvaluationAccumulator, evaluate, markdown_table

from conftest import PAIRS, TINY_VOCAB


def _naive_ece(probs: list[float], hits: list[float], bins: int = 15) -> float:
    total = 0.0
    for b in range(bins):
        members = [i for i, p in enumerate(probs) if min(int(p * bins), bins - 1) == b]
        if members:
            confidence = sum(probs[i] for i in members) / len(members)
            rate = sum(hits[i] for i in members) / len(members)
            total += len(members) / len(probs) * abs(confidence - rate)
    return total


def _naive_metrics(scores: torch.Tensor, targets: torch.Tensor, log_probs: torch.Tensor | None = None) -> dict:
    """q = softmax(scores) position by position; p = q, or exp(log_probs) (OvR modes)."""
    s = scores.double()
    rows = []
    for n in range(len(targets)):
        q = torch.exp(s[n] - torch.logsumexp(s[n], 0))
        p = q if log_probs is None else torch.exp(log_probs[n].double())
        y = targets[n].item()
        q_order = sorted(range(len(q)), key=lambda k: -q[k].item())
        p_order = sorted(range(len(p)), key=lambda k: -p[k].item())
        rows.append({
            "hit": float(q_order[0] == y), "p_y": p[y].item(), "sum": p.sum().item(), "nll": -math.log(q[y].item()),
            "conf": q[q_order[0]].item(), "top10": [(p[k].item(), float(k == y)) for k in p_order[:10]],
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


@pytest.mark.parametrize("kind", ["softmax", "standard-accept", "standard-normalize"])
def test_accumulator_matches_naive_float64_reference(kind):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g) * 3
    log_probs = None
    scores = logits
    if kind != "softmax":  # log P_k of OvR probabilities with a sum far from 1, ranked unlike the logits
        log_probs = ovr_log_prob((logits + torch.randn(37, 50, generator=g) - 4) / (0.5 + torch.rand(50, generator=g)))
        scores = logits + log_probs if kind == "standard-accept" else log_probs
    targets = torch.where(torch.rand(37, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, 50, (37,), generator=g))
    acc = EvaluationAccumulator(kind.split("-")[0])
    for start in range(0, 37, 10):  # batch boundaries do not matter
        acc.update(scores[start : start + 10], targets[start : start + 10],
                   None if log_probs is None else log_probs[start : start + 10])
    got = acc.compute()
    expected = _naive_metrics(scores, targets, log_probs)
    assert got["num_tokens"] == 37
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    if kind == "softmax":
        assert got["prob_sum_median"] == pytest.approx(1.0)
    else:
        with pytest.raises(ValueError, match="'standard' scores take log_probs always"):
            acc.update(scores, targets)


def _naive_auroc(signal: list[float], hits: list[bool]) -> float:
    """Over every (right, wrong) pair of positions: 1 if the right one's signal is higher, ½ on a tie."""
    right = [v for v, h in zip(signal, hits) if h]
    wrong = [v for v, h in zip(signal, hits) if not h]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in right for b in wrong)
    return wins / (len(right) * len(wrong))


@pytest.mark.parametrize("kind", ["softmax", "compatible", "standard"])
def test_confidence_signals_auroc_matches_naive_pairs(kind):
    """AUROC of each confidence signal for "the top-1 is right", against counting every (right, wrong) pair."""
    g = torch.Generator().manual_seed(1)
    n, vocab = 61, 40
    loc_S = torch.randn(n, vocab, generator=g) * 2
    scale_S = 0.3 + torch.rand(n, vocab, generator=g)
    log_P = ovr_log_prob((loc_S - 1.0) / scale_S)
    scores = loc_S + log_P if kind == "standard" else loc_S
    targets = torch.where(torch.rand(n, generator=g) < 0.5, scores.argmax(-1), torch.randint(0, vocab, (n,), generator=g))
    acc = EvaluationAccumulator(kind)
    heads = {} if kind == "softmax" else {"loc_S": loc_S, "scale_S": scale_S}
    for start in range(0, n, 16):
        part = slice(start, start + 16)
        acc.update(scores[part], targets[part], log_P[part] if kind == "standard" else None,
                   **{k: v[part] for k, v in heads.items()})
    got = acc.compute()
    q = torch.softmax(scores.double(), -1)
    top = q.argmax(-1)
    hits = (top == targets).tolist()
    assert 0 < sum(hits) < n
    rows = range(n)
    expected = {"max_prob": [q[i].max().item() for i in rows]}
    if kind != "softmax":
        expected["neg_scale_top"] = [-scale_S[i, top[i]].item() for i in rows]
    if kind == "standard":
        P = log_P.double().exp()
        expected["P_top"] = [P[i, top[i]].item() for i in rows]
        expected["prob_sum"] = [P[i].sum().item() for i in rows]
        expected["softmax_max_prob"] = [torch.softmax(loc_S[i].double(), -1).max().item() for i in rows]
    assert {k for k in got if k.startswith("auroc_")} == {f"auroc_{name}" for name in expected}
    for name, signal in expected.items():
        assert got[f"auroc_{name}"] == pytest.approx(_naive_auroc(signal, hits), abs=1e-6), name


def test_a_signal_equal_everywhere_has_auroc_one_half_and_no_wrong_top1_gives_nan():
    acc = EvaluationAccumulator("softmax")
    acc.update(torch.zeros(6, 4), torch.tensor([0, 1, 2, 3, 0, 1]))  # a flat q: top-1 is token 0, right twice
    assert acc.compute()["auroc_max_prob"] == 0.5
    acc = EvaluationAccumulator("softmax")
    acc.update(torch.eye(4) * 5, torch.arange(4))
    assert math.isnan(acc.compute()["auroc_max_prob"])


@pytest.mark.parametrize("distribution", ["accept", "normalize"])
def test_compatible_mode_scores_exactly_as_the_base(tied_base, input_ids, distribution):
    base = Qwen2ForCausalLM.from_pretrained(tied_base).eval()
    model = CausalQwenForCausalLM.from_base(tied_base, ovr_distribution=distribution).eval()
    labels = input_ids.clone()
    labels[:, :3] = -100  # a prompt: no target there
    batch = {"input_ids": input_ids, "labels": labels}
    base_metrics = evaluate(base, [batch])["softmax"]
    adapter_metrics = evaluate(model, [batch], modes=("compatible", "standard"))
    assert base_metrics["num_tokens"] == 2 * (9 - 3)
    for name in ("top1_accuracy", "nll", "target_prob", "ece_top1", "ece_top10"):
        assert adapter_metrics["compatible"][name] == pytest.approx(base_metrics[name], rel=1e-5, abs=1e-7), name
    # the standard mode scores the logits of the model's own forward, and P_k from its loc_S and scale_S
    with torch.no_grad():
        out = model(input_ids, inference_mode="standard")
    loc_S = out.loc_S.double()
    reference = torch.log_softmax(loc_S, -1) if model.config.ovr_relative_threshold else loc_S
    x = (reference - model.config.ovr_threshold_init) / out.scale_S.double()
    log_P = torch.log(0.5 + torch.atan(x) / math.pi)
    expected_logits = log_P if distribution == "normalize" else out.loc_S.double() + log_P
    torch.testing.assert_close(out.logits.double() - out.logits.double().logsumexp(-1, keepdim=True),
                               expected_logits - expected_logits.logsumexp(-1, keepdim=True), rtol=1e-4, atol=1e-4)
    targets = labels[:, 1:]
    keep = targets != -100
    expected = _naive_metrics(expected_logits[:, :-1][keep], targets[keep], log_P[:, :-1][keep])
    for name, value in expected.items():
        assert adapter_metrics["standard"][name] == pytest.approx(value, rel=1e-4, abs=1e-5), name


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


def test_evaluate_recipe_scores_bases_and_adapters(sft_base, tmp_path):
    import json

    from causalqwen_adapter.cli import evaluate as recipe

    adapter = tmp_path / "adapter"
    CausalQwenForCausalLM.from_base(sft_base).save_pretrained(adapter)
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"text": p + c}) + "\n" for p, c in PAIRS))

    def run(out, **overrides):
        return recipe.run(recipe.EvaluationArguments(model_name_or_path=[str(sft_base), str(adapter)],
                                                     dataset_name=str(data), output_dir=str(out), dtype="float32",
                                                     **overrides))

    results = run(tmp_path / "eval")
    base, heads = results[str(sft_base)], results[str(adapter)]
    assert set(base) == {"softmax"} and set(heads) == {"compatible", "standard", "causal"}
    assert heads["compatible"]["nll"] == pytest.approx(base["softmax"]["nll"], rel=1e-5)
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())[str(adapter)]["standard"]["num_tokens"] > 0
    tables = (tmp_path / "eval" / "metrics.md").read_text().split("\n\n")
    assert [len(t.splitlines()) for t in tables] == [2 + 1 + 3, 1, 2 + 1 + 3]  # header, a row per (model, mode)
    assert heads["standard"]["auroc_P_top"] == pytest.approx(float(tables[2].splitlines()[4].split("|")[5]), abs=1e-3)
    normalized = run(tmp_path / "eval-normalize", ovr_distribution="normalize")[str(adapter)]
    assert normalized["standard"]["prob_sum_median"] == pytest.approx(heads["standard"]["prob_sum_median"])
    assert normalized["standard"]["nll"] != pytest.approx(heads["standard"]["nll"])  # another distribution q
    with pytest.raises(ValueError, match="ovr_distribution=.both.: choose one of accept, accept_once, normalize"):
        run(tmp_path / "bad", ovr_distribution="both")
    assert not (tmp_path / "bad").exists()


def test_top1_changed_counts_the_decisions_the_heads_change():
    """An OvR mode's top-1 against loc_S's, counted position by position; absent where there is no loc_S to compare."""
    g = torch.Generator().manual_seed(3)
    loc_S = torch.randn(23, 40, generator=g) * 2
    log_P = ovr_log_prob(torch.randn(23, 40, generator=g) * 3)
    scores = loc_S + log_P
    targets = torch.randint(0, 40, (23,), generator=g)
    acc = EvaluationAccumulator("standard")
    for start in range(0, 23, 7):
        rows = slice(start, start + 7)
        acc.update(scores[rows], targets[rows], log_P[rows], loc_S=loc_S[rows])
    expected = sum(scores[n].argmax().item() != loc_S[n].argmax().item() for n in range(23)) / 23
    assert 0 < expected < 1
    assert acc.compute()["top1_changed"] == pytest.approx(expected)
    acc = EvaluationAccumulator("standard")
    acc.update(scores, targets, log_P)
    assert "top1_changed" not in acc.compute()
    acc = EvaluationAccumulator("compatible")
    acc.update(loc_S, targets, loc_S=loc_S)
    assert "top1_changed" not in acc.compute()
