"""chunked_ovr_loss against a naive float64 reference: loss, stats and every gradient."""

import math

import pytest
import torch
import torch.nn.functional as F

from causalqwen_adapter.losses import DecisionHead, chunked_ovr_loss, log_partition, zero_rows

NAMES = ("loc_U", "scale_U", "weight", "bias", "b_noise", "threshold")


def ovr_loss_of(tensors, labels, **kwargs):
    """chunked_ovr_loss on a dict of the head tensors (NAMES)."""
    head = DecisionHead(*(tensors[k] for k in NAMES[2:]))
    return chunked_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, labels, **kwargs)


def reference(loc_U, scale_U, weight, bias, b_noise, threshold, labels, num_items_in_batch=None, relative=False):
    """docs/design.md, Training losses written out plainly: full scores, P = ½ + atan(x)/π, BCE against a one-hot.
    `relative` thresholds: loc_S minus its logsumexp, a reference point without gradient."""
    loc_S = loc_U @ weight.T + (0 if bias is None else bias)
    if relative:
        loc_S = loc_S - loc_S.logsumexp(-1, keepdim=True).detach()
    scale_S = (scale_U + b_noise.abs()) @ weight.abs().T
    P = 0.5 + torch.atan((loc_S - threshold) / scale_S) / math.pi
    valid = labels != -100
    one_hot = F.one_hot(labels.clamp(min=0), weight.shape[0]).to(P.dtype)
    per_token = -(one_hot * P.log() + (1 - one_hot) * (1 - P).log()).sum(-1)
    denom = valid.sum() if num_items_in_batch is None else num_items_in_batch
    stats = {
        "target_prob": (P * one_hot).sum(-1)[valid].mean(),
        "ovr_prob_sum": P.sum(-1)[valid].mean(),
        "num_tokens": valid.sum(),
    }
    return per_token[valid].sum() / denom, stats


def make_inputs(n, c, v, *, threshold="vector", bias=True, dtype=torch.float32, seed=0):
    """Random head inputs (leaf tensors requiring grad) and labels with some −100."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "loc_U": torch.randn(n, c, generator=g),
        "scale_U": torch.rand(n, c, generator=g) + 0.1,
        "weight": torch.randn(v, c, generator=g),
        "bias": torch.randn(v, generator=g) if bias else None,
        "b_noise": torch.randn(c, generator=g) * 0.3,
        "threshold": {
            "vector": torch.randn(v, generator=g),
            "scalar_learnable": torch.tensor(0.2),
            "scalar_buffer": torch.tensor(-0.3),
            "float": 0.25,
        }[threshold],
    }
    for name, t in tensors.items():
        if torch.is_tensor(t):
            # thresholds stay float32 like the model keeps them
            tensors[name] = t.to(dtype if name != "threshold" else torch.float32)
            if threshold != "scalar_buffer" or name != "threshold":
                tensors[name].requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[: max(1, n // 4)]] = -100
    return tensors, labels


def grads_of(loss, tensors):
    leaves = {k: t for k, t in tensors.items() if torch.is_tensor(t) and t.requires_grad}
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def as_float64(tensors):
    return {
        k: t.detach().double().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t
        for k, t in tensors.items()
    }


def assert_rel_close(actual, expected, rtol, what):
    # Relative to the tensor's largest entry, so sums that cancel to ~0 are judged at the right scale.
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(), rtol=rtol,
                               atol=rtol * expected.abs().max().item(), msg=lambda m: f"{what}: {m}")


def check_against_reference(tensors, labels, rtol, grad_rtol, **kwargs):
    loss, stats = ovr_loss_of(tensors, labels, **kwargs)
    ref_tensors = as_float64(tensors)
    ref_loss, ref_stats = reference(*(ref_tensors[k] for k in NAMES), labels,
                                    num_items_in_batch=kwargs.get("num_items_in_batch"),
                                    relative=kwargs.get("threshold_offset") is not None)
    assert loss.dtype == torch.float32
    assert_rel_close(loss, ref_loss, rtol, "loss")
    for key in ("target_prob", "ovr_prob_sum"):
        assert not stats[key].requires_grad
        assert_rel_close(stats[key], ref_stats[key], rtol, key)
    assert stats["num_tokens"].item() == ref_stats["num_tokens"].item()

    grads, ref_grads = grads_of(loss, tensors), grads_of(ref_loss, ref_tensors)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert g.dtype == tensors[name].dtype and g.shape == tensors[name].shape
        assert_rel_close(g, ref_grads[name], grad_rtol, f"grad {name}")


@pytest.mark.parametrize(
    "n, c, v, chunk_size, vocab_chunk_size",
    [
        (13, 8, 37, 5, 6),  # neither N nor V divisible by the tile
        (13, 8, 37, 1, 37),  # one token per chunk, one vocabulary block
        (13, 8, 37, 1024, 2048),  # the defaults: a single tile
        (7, 16, 5, 3, 2),  # C > V
        (30, 4, 101, 7, 1),  # one vocabulary entry per block
    ],
)
@pytest.mark.parametrize("threshold", ["vector", "scalar_learnable", "scalar_buffer", "float"])
def test_matches_float64_reference(n, c, v, chunk_size, vocab_chunk_size, threshold):
    tensors, labels = make_inputs(n, c, v, threshold=threshold)
    check_against_reference(tensors, labels, 1e-5, 1e-5, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)


@pytest.mark.parametrize("threshold", ["vector", "scalar_buffer"])
def test_relative_thresholds_match_float64_reference(threshold):
    """threshold_offset = the log-partition of loc_S: P_k compares log softmax(loc_S)_k with C_k; the offset is a
    reference point, so every gradient is the reference's with logsumexp detached."""
    tensors, labels = make_inputs(13, 8, 37, threshold=threshold)
    head = DecisionHead(*(tensors[k] for k in NAMES[2:]))
    offset = log_partition(tensors["loc_U"], head, chunk_size=4)
    loc_S = tensors["loc_U"].double() @ tensors["weight"].double().T + tensors["bias"].double()
    torch.testing.assert_close(offset.double(), loc_S.logsumexp(-1), rtol=1e-6, atol=1e-6)
    assert not offset.requires_grad
    torch.testing.assert_close(log_partition(tensors["loc_U"], head), offset)  # the budget's chunk: one here
    check_against_reference(tensors, labels, 1e-5, 1e-5, chunk_size=5, vocab_chunk_size=6, threshold_offset=offset)


def test_without_bias_and_with_temperature():
    tensors, labels = make_inputs(13, 8, 37, bias=False)
    check_against_reference(tensors, labels, 1e-5, 1e-5, chunk_size=4, vocab_chunk_size=8)
    # T scales |b_noise| in the fused scale: T = 2 equals T = 1 with a doubled b_noise.
    doubled = dict(tensors, b_noise=(2 * tensors["b_noise"]).detach())
    loss_t2, _ = ovr_loss_of(tensors, labels, temperature=2.0)
    loss_2b, _ = ovr_loss_of(doubled, labels)
    torch.testing.assert_close(loss_t2, loss_2b)


@pytest.mark.parametrize("num_items_in_batch", [20, torch.tensor(20)])
def test_num_items_in_batch_divides_the_sum(num_items_in_batch):
    tensors, labels = make_inputs(13, 8, 37)
    check_against_reference(tensors, labels, 1e-5, 1e-5, chunk_size=4, vocab_chunk_size=10,
                            num_items_in_batch=num_items_in_batch)


def test_gradient_accumulation_equals_the_full_batch():
    tensors, labels = make_inputs(16, 8, 37)
    labels[:6] = -100  # unequal valid counts in the two halves
    full_loss, _ = ovr_loss_of(tensors, labels, chunk_size=3, vocab_chunk_size=5)
    full_grads = grads_of(full_loss, tensors)

    total = int((labels != -100).sum())
    halves = [slice(0, 8), slice(8, 16)]
    losses = [
        ovr_loss_of(dict(tensors, loc_U=tensors["loc_U"][h], scale_U=tensors["scale_U"][h]), labels[h],
                    num_items_in_batch=total, chunk_size=3, vocab_chunk_size=5)[0]
        for h in halves
    ]
    acc_grads = [grads_of(loss, tensors) for loss in losses]
    torch.testing.assert_close(losses[0] + losses[1], full_loss, rtol=1e-6, atol=0)
    for name, g in full_grads.items():
        assert_rel_close(acc_grads[0][name] + acc_grads[1][name], g, 1e-6, f"grad {name}")


def test_bfloat16_inputs_use_float32_math():
    tensors, labels = make_inputs(13, 8, 37, dtype=torch.bfloat16)
    # The math is float32 on the bf16 values, so the loss is as exact as in float32; the
    # gradients are returned in bf16 (8 bits of mantissa).
    check_against_reference(tensors, labels, 1e-5, 1e-2, chunk_size=4, vocab_chunk_size=8)


def test_extreme_inputs_stay_finite_and_accurate():
    """|x| ~ 1e12 (loc ~ 1e6, scales ~ 1e-6): P_k and 1 − P_k within 1e-12 of 0 or 1."""
    tensors, labels = make_inputs(13, 8, 37)
    with torch.no_grad():
        tensors["loc_U"].mul_(1e6)
        tensors["scale_U"].mul_(1e-6)
        tensors["b_noise"].mul_(1e-6)
        tensors["threshold"].mul_(1e3)
    loss, stats = ovr_loss_of(tensors, labels, chunk_size=4, vocab_chunk_size=8)
    ref_tensors = as_float64(tensors)
    ref_loss, _ = reference(*(ref_tensors[k] for k in NAMES), labels)
    grads = grads_of(loss, tensors)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert torch.isfinite(stats["target_prob"]) and torch.isfinite(stats["ovr_prob_sum"])
    # The float64 reference itself loses digits in 1 − P here, hence 1e-3.
    assert_rel_close(loss, ref_loss, 1e-3, "loss")
    for name, g in grads_of(ref_loss, ref_tensors).items():
        assert_rel_close(grads[name], g, 1e-3, f"grad {name}")


def test_huge_standardized_scores_give_finite_gradients():
    """|x| up to ~1e30, where (1 + x²) overflows float32: still no inf or nan anywhere."""
    tensors, labels = make_inputs(6, 4, 9, threshold="float")
    with torch.no_grad():
        tensors["loc_U"].mul_(1e6)
        tensors["scale_U"].mul_(1e-30)
        tensors["b_noise"].zero_()
    loss, _ = ovr_loss_of(tensors, labels)
    grads = grads_of(loss, tensors)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())


def test_label_outside_the_vocabulary_is_a_clear_error():
    tensors, labels = make_inputs(13, 8, 37)
    labels[3] = 37
    with pytest.raises(ValueError, match="label 37 is outside the vocabulary"):
        ovr_loss_of(tensors, labels)


def test_mismatched_shapes_are_a_clear_error():
    tensors, labels = make_inputs(13, 8, 37)
    with pytest.raises(ValueError, match="labels for 13 positions"):
        ovr_loss_of(tensors, labels[:-1])
    with pytest.raises(ValueError, match="flatten the positions"):
        ovr_loss_of(dict(tensors, loc_U=tensors["loc_U"][None]), labels)


def test_no_valid_target_gives_a_zero_loss_with_a_graph():
    tensors, labels = make_inputs(5, 8, 37)
    labels[:] = -100
    loss, stats = ovr_loss_of(tensors, labels)
    assert loss.item() == 0 and loss.requires_grad
    assert stats["num_tokens"].item() == 0
    for g in grads_of(loss, tensors).values():
        assert not g.any()


def test_backward_scales_by_the_incoming_gradient_and_skips_frozen_inputs():
    tensors, labels = make_inputs(13, 8, 37)
    tensors["weight"].requires_grad_(False)
    tensors["bias"].requires_grad_(False)
    loss, _ = ovr_loss_of(tensors, labels, chunk_size=4, vocab_chunk_size=8)
    grads = grads_of(loss, tensors)
    assert grads.keys() == {"loc_U", "scale_U", "b_noise", "threshold"}
    loss, _ = ovr_loss_of(tensors, labels, chunk_size=4, vocab_chunk_size=8)
    for name, g in grads_of(-2.5 * loss, tensors).items():
        torch.testing.assert_close(g, -2.5 * grads[name])


def test_no_grad_mode_computes_the_loss_only():
    tensors, labels = make_inputs(13, 8, 37)
    loss, _ = ovr_loss_of(tensors, labels)
    with torch.no_grad():
        loss_eval, stats = ovr_loss_of(tensors, labels)
    assert not loss_eval.requires_grad
    torch.testing.assert_close(loss_eval, loss.detach())
    assert stats["num_tokens"].item() == int((labels != -100).sum())


def test_zero_row_of_W_matches_the_model_convention():
    # A zero vocabulary row (Qwen2 zeroes the padding embedding) gives scale_S = 0; both the chunked
    # loss and the model's naive loss floor it the same way instead of producing NaN.
    from causalqwen_adapter.cauchy import ovr_loss

    torch.manual_seed(0)
    loc_U, scale_U = torch.randn(6, 8), torch.rand(6, 8) + 0.1
    weight, bias, b_noise = torch.randn(11, 8), torch.zeros(11), torch.full((8,), 0.1)
    weight[3] = 0.0
    labels = torch.tensor([1, 3, 5, -100, 3, 0])
    loss, _ = chunked_ovr_loss(loc_U, scale_U, DecisionHead(weight, bias, b_noise, 0.0), labels, chunk_size=4, vocab_chunk_size=5)
    loc_S = loc_U @ weight.T + bias
    scale_S = (scale_U + b_noise.abs()) @ weight.abs().T
    expected = ovr_loss(loc_S, scale_S, torch.tensor(0.0), labels)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_zero_row_below_a_threshold_gives_finite_gradients():
    # a padding row of W_A (scale_S = 0) far below a positive threshold: x = −inf there; every gradient stays finite,
    # and the degenerate row's own gradients are 0 (the derivative of a step)
    g = torch.Generator().manual_seed(0)
    loc_U, scale_U = torch.randn(5, 4, generator=g), torch.rand(5, 4, generator=g) * 1e-5 + 1e-6
    weight = torch.randn(7, 4, generator=g)
    weight[0] = 0.0
    bias, b_noise = torch.zeros(7), torch.full((4,), 1e-6)
    threshold = torch.full((7,), 16.0)
    for t in (loc_U, scale_U, weight, bias, b_noise, threshold):
        t.requires_grad_(True)
    labels = torch.tensor([1, 2, 3, 4, 5])
    loss, _ = chunked_ovr_loss(loc_U, scale_U, DecisionHead(weight, bias, b_noise, threshold), labels, chunk_size=2, vocab_chunk_size=3)
    loss.backward()
    assert torch.isfinite(loss)
    for t in (loc_U, scale_U, weight, bias, b_noise, threshold):
        assert torch.isfinite(t.grad).all()
    assert bias.grad[0] == 0 and threshold.grad[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_finds_exactly_the_all_zero_rows(dtype):
    """Against a loop over the rows: −0.0 counts as zero; a tiny, an infinite or a NaN entry does not; signed and
    |W| blocks alike."""
    torch.manual_seed(0)
    w = torch.randn(64, 12)
    w[3] = 0.0
    w[10] = -0.0
    w[20] = 0.0
    w[20, 5] = -1e-30  # one tiny entry: not a zero row (1e-30 is representable in bf16's range)
    w[30] = 0.0
    w[30, 0] = float("inf")
    w[40] = 0.0
    w[40, 11] = float("nan")
    w[50, :6] = 0.0
    w = w.to(dtype)
    expected = [i for i in range(len(w)) if all(float(v) == 0.0 for v in w[i])]
    assert expected == [3, 10]
    assert zero_rows(w).tolist() == expected
    assert zero_rows(w.abs()).tolist() == expected
