"""The OvR loss over candidates (`candidate_loss.candidate_ovr_loss`, config `ovr_candidates`) against a float64 reference
written from docs/design.md, Training losses: full scores, the top-k of loc_S as a set, plus the target."""

import math

import pytest
import torch
import torch.nn.functional as F

from causalqwen_adapter import CausalQwenConfig, CausalQwenForCausalLM
from causalqwen_adapter.candidate_loss import candidate_ovr_loss, candidate_rows
from causalqwen_adapter.lm_loss import chunked_lm_loss
from causalqwen_adapter.losses import DecisionHead
from causalqwen_adapter.training import CausalHeadArguments

from conftest import tiny_qwen2_config

NAMES = ("loc_U", "scale_U", "weight", "bias", "b_noise", "threshold")


def make_inputs(n=7, c=6, v=29, *, threshold="vector", seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "loc_U": torch.randn(n, c, generator=g),
        "scale_U": torch.rand(n, c, generator=g) * 0.3 + 0.05,
        "weight": torch.randn(v, c, generator=g),
        "bias": torch.randn(v, generator=g),
        "b_noise": torch.randn(c, generator=g) * 0.1,
        "threshold": torch.randn(v, generator=g) - 2 if threshold == "vector" else torch.tensor(-1.5),
    }
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0] = tensors["weight"].matmul(tensors["loc_U"][0]).add(tensors["bias"]).argmax()  # a target in the top-k
    return {k: t.requires_grad_() for k, t in tensors.items()}, targets


def reference(loc_U, scale_U, weight, bias, b_noise, threshold, targets, k, relative=True, trains_location=False):
    """Σ over positions of Σ_{j in top-k ∪ {y}} BCE(P_j, [j = y]), each token once, float64 in."""
    loc_S = loc_U @ weight.T + bias
    detached = loc_S.detach()
    top = detached.topk(k, -1).indices
    member = torch.zeros_like(detached, dtype=torch.bool).scatter_(1, top, True)
    member[torch.arange(len(targets)), targets] = True
    if not trains_location:
        loc_S = loc_U.detach() @ weight.detach().T + bias.detach()
    if relative:
        loc_S = loc_S - detached.logsumexp(-1, keepdim=True)
    scale_S = (scale_U + b_noise.abs()) @ weight.detach().abs().T if not trains_location else \
        (scale_U + b_noise.abs()) @ weight.abs().T
    P = 0.5 + torch.atan((loc_S - threshold) / scale_S) / math.pi
    one_hot = F.one_hot(targets, weight.shape[0]).bool()
    bce = -torch.where(one_hot, P.log(), (1 - P).log())
    return (bce * member).sum(), P, member


def run(tensors, targets, k, **kwargs):
    head = DecisionHead(*(tensors[name] for name in NAMES[2:]))
    return candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, targets, k, **kwargs)


def gradients(loss, tensors):
    grads = torch.autograd.grad(loss, list(tensors.values()), allow_unused=True)
    return dict(zip(tensors, grads))


@pytest.mark.parametrize("threshold", ["vector", "scalar"])
@pytest.mark.parametrize("trains_location", [False, True])
@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("k", [1, 4])
def test_matches_float64_reference(threshold, trains_location, relative, k):
    tensors, targets = make_inputs(threshold=threshold)
    loss, stats = run(tensors, targets, k, relative_threshold=relative, trains_location=trains_location,
                      chunk_size=3)
    wide = {name: t.detach().double().requires_grad_() for name, t in tensors.items()}
    expected, P, member = reference(*wide.values(), targets, k, relative, trains_location)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    got, want = gradients(loss, tensors), gradients(expected, wide)
    for name in NAMES:
        if want[name] is None or not want[name].abs().sum():
            assert got[name] is None or not got[name].abs().sum(), name
            continue
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-4, atol=1e-5, msg=name)
    n = len(targets)
    torch.testing.assert_close(stats["target_prob"].double(), P.detach()[torch.arange(n), targets].mean(),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["candidate_prob_sum"].double(), (P.detach() * member).sum(-1).mean(),
                               rtol=1e-5, atol=1e-6)
    loc_S = wide["loc_U"].detach() @ wide["weight"].detach().T + wide["bias"].detach()
    torch.testing.assert_close(stats["softmax_nll"].double(), F.cross_entropy(loc_S, targets), rtol=1e-5, atol=1e-6)


def rows_reference(loc_U, scale_U, weight, bias, b_noise, threshold, rows, temperature):
    """The candidates' term, float64, naively from its definition: every score of the vocabulary, then the BCE of
    each position's set (its top-k ids and its target, each once), with the rows' log-partition as the reference."""
    loc_S = loc_U @ weight.T + bias - rows.log_partition.double().unsqueeze(1)
    scale_S = (scale_U + temperature * b_noise.abs()) @ weight.abs().T
    P = 0.5 + torch.atan((loc_S - threshold) / scale_S) / math.pi
    targets = rows.ids[:, -1]
    member = torch.zeros_like(P, dtype=torch.bool).scatter_(1, rows.ids[:, :-1], True)
    member[torch.arange(len(targets)), targets] = True
    one_hot = F.one_hot(targets, weight.shape[0]).bool()
    return -torch.where(one_hot, P.log(), (1 - P).log())[member].sum(), P, member


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trains_location", [False, True])
@pytest.mark.parametrize("threshold", ["vector", "scalar"])
def test_real_shapes_match_a_float64_reference(dtype, trains_location, threshold):
    """At a real width (C = 896, k = 16, 4,096 tokens, 150 positions in chunks of 64: a last partial chunk of 22, some
    targets among their top-k): the loss, its statistics and every input's gradient within rounding of the float64
    term on the same (rounded) inputs and candidate rows; gradients returned in the inputs' dtype."""
    n, c, v, k = 150, 896, 4096, 16
    g = torch.Generator().manual_seed(5)
    tensors = {"loc_U": torch.randn(n, c, generator=g), "scale_U": torch.rand(n, c, generator=g) * 0.3 + 0.05,
               "weight": torch.randn(v, c, generator=g) / 30, "bias": torch.randn(v, generator=g),
               "b_noise": torch.randn(c, generator=g) * 0.1,
               "threshold": torch.randn(v, generator=g) - 2 if threshold == "vector" else torch.tensor(-1.5)}
    tensors = {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}
    head = DecisionHead(*(tensors[name] for name in NAMES[2:]))
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::3] = candidate_rows(tensors["loc_U"].detach(), head, targets, k)[0].ids[::3, 5]  # among the top-k
    rows, _ = candidate_rows(tensors["loc_U"].detach(), head, targets, k)
    assert (~rows.counted[:, -1]).sum() >= n // 3
    loss, stats = candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, targets, k, rows=rows,
                                     trains_location=trains_location, temperature=0.7, chunk_size=64)
    wide = {name: t.detach().double().requires_grad_() for name, t in tensors.items()}
    if not trains_location:
        for name in ("loc_U", "weight", "bias"):
            wide[name].requires_grad_(False)
    expected, P, member = rows_reference(*wide.values(), rows, 0.7)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(stats["target_prob"].double(), P.detach()[torch.arange(n), targets].mean(),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["candidate_prob_sum"].double(), (P.detach() * member).sum(-1).mean(),
                               rtol=1e-5, atol=1e-6)
    got = dict(zip(NAMES, torch.autograd.grad(loss, list(tensors.values()), allow_unused=True)))
    wanted = [name for name in NAMES if wide[name].requires_grad]
    want = dict(zip(wanted, torch.autograd.grad(expected, [wide[name] for name in wanted])))
    rtol = 1e-4 if dtype == torch.float32 else 8e-3  # float32 math; bf16: the gradient rounded to bf16
    for name in NAMES:
        if name not in want:
            assert got[name] is None or not got[name].abs().sum(), name
            continue
        assert got[name].dtype == dtype, name
        torch.testing.assert_close(got[name].double(), want[name], rtol=rtol, atol=rtol * want[name].abs().max(),
                                   msg=name)


def same_rows(got, want):
    """Candidate rows equal as sets per position (the order of the top-k is not part of the loss)."""
    assert got.ids.shape == want.ids.shape
    assert torch.equal(got.ids[:, :-1].sort(1).values, want.ids[:, :-1].sort(1).values)
    assert torch.equal(got.ids[:, -1], want.ids[:, -1]) and torch.equal(got.counted[:, -1], want.counted[:, -1])
    torch.testing.assert_close(got.log_partition, want.log_partition, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_chunk_size", [None, 5])
def test_the_cross_entropy_pass_finds_the_same_candidates(dtype, vocab_chunk_size):
    """chunked_lm_loss(candidates=k) takes each position's top-k from its own logits, block by block then across
    blocks (5 rows per block: the last one narrower than k), on the positions with a target, and the candidate loss
    on its rows equals the loss that finds them itself."""
    tensors, targets = make_inputs(n=9, v=29)
    head = DecisionHead(*(tensors[name].detach().to(dtype) if name in ("weight", "bias") else tensors[name].detach()
                          for name in NAMES[2:]))
    labels = targets.clone()
    labels[3] = -100
    _, stats = chunked_lm_loss(tensors["loc_U"].detach(), None, head, labels, candidates=7, chunk_size=4,
                               vocab_chunk_size=vocab_chunk_size)
    valid = labels != -100
    want, _ = candidate_rows(tensors["loc_U"].detach()[valid], head, targets[valid], 7)
    same_rows(stats["candidate_rows"], want)
    args = (tensors["loc_U"].detach()[valid], tensors["scale_U"].detach()[valid], head, targets[valid], 7)
    fused, _ = candidate_ovr_loss(*args, rows=stats["candidate_rows"])
    torch.testing.assert_close(fused, candidate_ovr_loss(*args)[0])


def test_no_candidate_sized_tensor_outlives_its_chunk():
    """What autograd keeps for backward is the [V, C] and [N, C] gradients, never the [N, k + 1, C] rows of W_A."""
    tensors, targets = make_inputs(n=40, c=6, v=29)
    saved = []

    def keep(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss, _ = run(tensors, targets, 8, trains_location=True, chunk_size=4)
    loss.backward()
    n, c, v = 40, 6, 29
    assert saved and max(saved) <= max(n * c, v * c)
    assert tensors["weight"].grad.abs().sum() > 0


def test_candidate_rows_of_another_shape_are_refused():
    tensors, targets = make_inputs()
    head = DecisionHead(*(tensors[name] for name in NAMES[2:]))
    rows, _ = candidate_rows(tensors["loc_U"].detach(), head, targets, 3)
    with pytest.raises(ValueError, match="candidate rows of shape"):
        candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, targets, 4, rows=rows)
    with pytest.raises(ValueError, match="their last column is the target"):  # rows of other targets
        candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, targets.roll(1), 3, rows=rows)


def test_location_path_gets_no_gradient_by_default():
    tensors, targets = make_inputs()
    loss, _ = run(tensors, targets, 4)
    got = gradients(loss, tensors)
    for name in ("loc_U", "weight", "bias"):
        assert got[name] is None or not got[name].abs().sum(), name
    for name in ("scale_U", "b_noise", "threshold"):
        assert got[name].abs().sum() > 0, name


def test_a_target_among_the_top_k_counts_once():
    tensors, targets = make_inputs()
    k = 4
    loss_all, _ = run(tensors, targets, k)
    # position 0's target is its argmax: with the appended copy counted too, its −log P_y would count twice
    single, _ = run({n: t[:1] if n in ("loc_U", "scale_U") else t for n, t in tensors.items()}, targets[:1], k)
    wide = {name: t.detach().double()[:1] if name in ("loc_U", "scale_U") else t.detach().double()
            for name, t in tensors.items()}
    expected, _, member = reference(*wide.values(), targets[:1], k)
    assert member.sum() == k
    torch.testing.assert_close(single.double(), expected, rtol=1e-5, atol=1e-6)
    assert loss_all > single


def test_bfloat16_weight_uses_float32_math():
    tensors, targets = make_inputs()
    head = DecisionHead(tensors["weight"].detach().bfloat16(), tensors["bias"].detach().bfloat16(),
                        tensors["b_noise"].detach(), tensors["threshold"].detach())
    loss, _ = candidate_ovr_loss(tensors["loc_U"].detach(), tensors["scale_U"].detach(), head, targets, 4)
    wide = {name: t.detach().double() for name, t in tensors.items()}
    wide["weight"] = tensors["weight"].detach().bfloat16().double()
    wide["bias"] = tensors["bias"].detach().bfloat16().double()
    expected, _, _ = reference(*wide.values(), targets, 4)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("k", [0, -1, 29, 2.0, True])
def test_bad_number_of_candidates_is_a_clear_error(k):
    tensors, targets = make_inputs()
    with pytest.raises(ValueError, match="number of OvR candidates"):
        run(tensors, targets, k)


def test_config_refuses_bad_values():
    text_config = tiny_qwen2_config()
    with pytest.raises(ValueError, match="ovr_candidates"):
        CausalQwenConfig(text_config=text_config, ovr_candidates=0)
    with pytest.raises(ValueError, match="below the vocabulary size"):
        CausalQwenConfig(text_config=text_config, ovr_candidates=text_config.vocab_size)
    with pytest.raises(ValueError, match="ovr_candidates"):
        CausalHeadArguments(ovr_candidates=-1)


def test_model_loss_is_the_cross_entropy_plus_the_candidate_term(tiny_base):
    """forward's loss with ovr_candidates: softmax_loss_weight × the mean cross-entropy of loc_S + the candidates'
    BCE sum over targets / their count, each written out on the model's own tensors."""
    model = CausalQwenForCausalLM.from_base(tiny_base, gamma_init=0.05, b_noise_init=0.01, ovr_candidates=5,
                                            softmax_loss_weight=0.5)
    torch.manual_seed(0)
    with torch.no_grad():
        model.abduction.scale.weight.normal_(std=0.02)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 9))
    out = model(input_ids=input_ids, labels=input_ids)
    z = model.model(input_ids).last_hidden_state[:, :-1].reshape(-1, model.config.hidden_size)
    targets = input_ids[:, 1:].reshape(-1)
    with torch.no_grad():
        loc_U, scale_U = model.abduction(z)
        wide = [t.double() for t in (loc_U, scale_U, model.action.weight, model.action.bias, model.action.b_noise)]
        threshold = torch.tensor(model.config.ovr_threshold_init, dtype=torch.float64)
        candidates, _, _ = reference(*wide, threshold, targets, 5)
        ce = F.cross_entropy(wide[0] @ wide[2].T + wide[3], targets)
    torch.testing.assert_close(out.loss.double(), 0.5 * ce + candidates / len(targets), rtol=1e-4, atol=1e-5)
    assert {"candidate_prob_sum", "target_prob", "softmax_nll"} <= set(out.metrics)
    assert "ovr_prob_sum" not in out.metrics
    out.loss.backward()
    assert model.abduction.scale.weight.grad.abs().sum() > 0
    assert model.action.weight.grad.abs().sum() > 0  # from the cross-entropy


def test_without_the_cross_entropy_only_the_candidate_term_trains(tiny_base):
    model = CausalQwenForCausalLM.from_base(tiny_base, gamma_init=0.05, ovr_candidates=3, softmax_loss_weight=0.0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.loss > 0
    assert model.abduction.scale.bias.grad.abs().sum() > 0
    assert model.action.weight.grad is None or not model.action.weight.grad.abs().sum()


def test_defaults_and_adapters_saved_before_the_option():
    """Fresh heads score 16 candidates from γ₀ = 0.005 and b_noise 0.01; without candidates γ₀ and b_noise are the
    vocabulary loss's 1e-5 and 1e-6; a saved config without the field is an adapter trained with the loss over the
    whole vocabulary, and loads so; a saved b_noise_init is kept."""
    config = CausalQwenConfig(text_config=tiny_qwen2_config())
    assert (config.ovr_candidates, config.gamma_init, config.b_noise_init) == (16, 0.005, 0.01)
    vocabulary = CausalQwenConfig(text_config=tiny_qwen2_config(), ovr_candidates=None)
    assert (vocabulary.gamma_init, vocabulary.b_noise_init) == (1e-5, 1e-6)
    saved = config.to_dict()
    del saved["ovr_candidates"]
    assert CausalQwenConfig.from_dict(saved).ovr_candidates is None
    assert CausalQwenConfig.from_dict(saved).b_noise_init == 0.01  # what the file says, whatever the loss
    assert CausalQwenConfig.from_dict(config.to_dict()).ovr_candidates == 16
