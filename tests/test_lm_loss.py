"""chunked_lm_loss (cross-entropy of loc_S + OvR loss in one pass) against a naive float64 reference."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_losses import NAMES, as_float64, assert_rel_close, grads_of, make_inputs

from causalqwen_adapter.cauchy import SKINNY_ROWS, few_rows_linear
from causalqwen_adapter.lm_loss import chunked_lm_loss
from causalqwen_adapter.losses import LOGITS_BUDGET_BYTES, DecisionHead, chunk_tokens, chunked_ovr_loss


def lm_loss_of(tensors, labels, ovr=True, **kwargs):
    head = DecisionHead(*(tensors[k] for k in NAMES[2:]))
    return chunked_lm_loss(tensors["loc_U"], tensors["scale_U"] if ovr else None, head, labels, **kwargs)


def reference(t, labels, softmax_weight=1.0, ovr=True, ovr_trains_location=False, relative_threshold=True,
              num_items_in_batch=None):
    """The two losses written out plainly on full [N × V] scores; the OvR term sees the locations through .detach()
    unless it trains them, and the log-partition of relative thresholds is detached."""
    valid = labels != -100
    denom = valid.sum() if num_items_in_batch is None else num_items_in_batch
    bias = 0 if t["bias"] is None else t["bias"]
    loc_S = t["loc_U"] @ t["weight"].T + bias
    nll = F.cross_entropy(loc_S[valid], labels[valid], reduction="sum")
    loss, stats = softmax_weight * nll / denom, {"softmax_nll": nll / valid.sum()}
    if ovr:
        weight = t["weight"] if ovr_trains_location else t["weight"].detach()
        loc = loc_S if ovr_trains_location else (t["loc_U"].detach() @ weight.T + (
            bias.detach() if torch.is_tensor(bias) else 0))
        if relative_threshold:
            loc = loc - loc_S.logsumexp(-1, keepdim=True).detach()
        scale_S = (t["scale_U"] + t["b_noise"].abs()) @ weight.abs().T
        P = 0.5 + torch.atan((loc - t["threshold"]) / scale_S) / math.pi
        one_hot = F.one_hot(labels.clamp(min=0), t["weight"].shape[0]).to(P.dtype)
        per_token = -(one_hot * P.log() + (1 - one_hot) * (1 - P).log()).sum(-1)
        loss = loss + per_token[valid].sum() / denom
        stats.update(target_prob=(P * one_hot).sum(-1)[valid].mean(), ovr_prob_sum=P.sum(-1)[valid].mean())
    return loss, stats


def check(tensors, labels, rtol=1e-5, grad_rtol=1e-5, ovr=True, softmax_weight=1.0, ovr_trains_location=False,
          relative_threshold=True, num_items_in_batch=None, **tiles):
    options = dict(softmax_weight=softmax_weight, ovr_trains_location=ovr_trains_location,
                   relative_threshold=relative_threshold, num_items_in_batch=num_items_in_batch)
    loss, stats = lm_loss_of(tensors, labels, ovr=ovr, **options, **tiles)
    ref_tensors = as_float64(tensors)
    ref_loss, ref_stats = reference(ref_tensors, labels, ovr=ovr, **options)
    assert loss.dtype == torch.float32
    assert_rel_close(loss, ref_loss, rtol, "loss")
    assert stats.keys() == ref_stats.keys() | {"num_tokens"}
    for key, value in ref_stats.items():
        assert not stats[key].requires_grad
        assert_rel_close(stats[key], value, rtol, key)
    assert stats["num_tokens"].item() == (labels != -100).sum().item()
    used = {k: v for k, v in tensors.items() if ovr or k not in ("scale_U", "b_noise", "threshold")}
    grads, ref_grads = grads_of(loss, used), grads_of(ref_loss, {k: ref_tensors[k] for k in used})
    for name, g in grads.items():
        assert g.dtype == tensors[name].dtype and g.shape == tensors[name].shape
        assert_rel_close(g, ref_grads[name], grad_rtol, f"grad {name}")


@pytest.mark.parametrize(
    "n, c, v, chunk_size, vocab_chunk_size",
    [
        (13, 8, 37, 5, 6),  # neither N nor V divisible by the tile
        (13, 8, 37, 1, 37),  # one token per chunk, one vocabulary block
        (13, 8, 37, None, 4096),  # the defaults: a single tile
        (7, 16, 5, 3, 2),  # C > V
        (30, 4, 101, 7, 1),  # one vocabulary entry per block
    ],
)
@pytest.mark.parametrize("threshold", ["vector", "scalar_learnable", "scalar_buffer", "float"])
def test_matches_float64_reference(n, c, v, chunk_size, vocab_chunk_size, threshold):
    tensors, labels = make_inputs(n, c, v, threshold=threshold)
    check(tensors, labels, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)


@pytest.mark.parametrize("ovr_trains_location", [False, True])
@pytest.mark.parametrize("relative_threshold", [False, True])
@pytest.mark.parametrize("softmax_weight", [0.0, 0.5])
def test_every_loss_option_matches_the_reference(ovr_trains_location, relative_threshold, softmax_weight):
    tensors, labels = make_inputs(13, 8, 37)
    check(tensors, labels, softmax_weight=softmax_weight, ovr_trains_location=ovr_trains_location,
          relative_threshold=relative_threshold, chunk_size=4, vocab_chunk_size=8)


def test_softmax_alone_is_the_cross_entropy():
    tensors, labels = make_inputs(13, 8, 37)
    check(tensors, labels, ovr=False, chunk_size=4, vocab_chunk_size=8)
    check(dict(tensors, bias=None), labels, ovr=False, chunk_size=5, vocab_chunk_size=37)


def test_ovr_part_equals_chunked_ovr_loss():
    """Without the cross-entropy and with the OvR loss on every head tensor, the fused pass is chunked_ovr_loss."""
    tensors, labels = make_inputs(13, 8, 37)
    head = DecisionHead(*(tensors[k] for k in NAMES[2:]))
    fused, fused_stats = lm_loss_of(tensors, labels, softmax_weight=0.0, ovr_trains_location=True,
                                    relative_threshold=False, chunk_size=4, vocab_chunk_size=8)
    alone, alone_stats = chunked_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, labels, chunk_size=3,
                                          vocab_chunk_size=5)
    torch.testing.assert_close(fused, alone)
    for key in ("target_prob", "ovr_prob_sum"):
        torch.testing.assert_close(fused_stats[key], alone_stats[key])
    alone_grads = grads_of(alone, tensors)
    for name, g in grads_of(fused, tensors).items():
        assert_rel_close(g, alone_grads[name], 1e-5, f"grad {name}")


@pytest.mark.parametrize("num_items_in_batch", [20, torch.tensor(20)])
def test_num_items_in_batch_divides_the_sums(num_items_in_batch):
    tensors, labels = make_inputs(13, 8, 37)
    check(tensors, labels, num_items_in_batch=num_items_in_batch, ovr_trains_location=True, chunk_size=4,
          vocab_chunk_size=10)


def test_bfloat16_inputs_multiply_in_bfloat16():
    """bfloat16 products round each score to 8 bits (relative 2^-9), as lm_head does in a bfloat16 model; the
    softmax, CDFs and sums stay float32 (W_A's gradient sums its 4 chunks in bfloat16, as a .grad over 4
    micro-batches would), so the loss is off by about that rounding, not more."""
    tensors, labels = make_inputs(13, 8, 37, dtype=torch.bfloat16)
    check(tensors, labels, rtol=4e-3, grad_rtol=3e-2, ovr_trains_location=True, chunk_size=4, vocab_chunk_size=8)
    # asked for float32 products, the same inputs give float32 results
    check(tensors, labels, grad_rtol=1e-2, ovr_trains_location=True, chunk_size=4, vocab_chunk_size=8,
          matmul_dtype=torch.float32)


def test_float32_inputs_with_bfloat16_products():
    """matmul_dtype=bfloat16 is what an autocast step asks for: float32 inputs, products at bfloat16 precision."""
    tensors, labels = make_inputs(13, 8, 37)
    check(tensors, labels, rtol=4e-3, grad_rtol=3e-2, ovr_trains_location=True, chunk_size=4, vocab_chunk_size=8,
          matmul_dtype=torch.bfloat16)
    loss, _ = lm_loss_of(tensors, labels, chunk_size=4, vocab_chunk_size=8)
    low, _ = lm_loss_of(tensors, labels, chunk_size=4, vocab_chunk_size=8, matmul_dtype=torch.bfloat16)
    assert loss.item() != low.item()  # the option is not ignored


def test_no_target_gives_zero_loss_and_gradients():
    tensors, labels = make_inputs(6, 8, 37)
    labels[:] = -100
    loss, stats = lm_loss_of(tensors, labels, chunk_size=4)
    assert loss.item() == 0 and stats["num_tokens"].item() == 0
    assert all((g == 0).all() for g in grads_of(loss, tensors).values())


def test_no_grad_and_a_scaled_backward():
    tensors, labels = make_inputs(13, 8, 37)
    with torch.no_grad():
        value, _ = lm_loss_of(tensors, labels, chunk_size=4)
    loss, _ = lm_loss_of(tensors, labels, chunk_size=4)
    torch.testing.assert_close(value, loss.detach())
    grads = grads_of(loss, tensors)
    loss2, _ = lm_loss_of(tensors, labels, chunk_size=4)
    for name, g in grads_of(3 * loss2, tensors).items():
        torch.testing.assert_close(g, 3 * grads[name])


def test_bad_inputs_are_refused():
    tensors, labels = make_inputs(13, 8, 37)
    with pytest.raises(ValueError, match="softmax_weight"):
        lm_loss_of(tensors, labels, ovr=False, softmax_weight=0.0)
    with pytest.raises(ValueError, match="softmax_weight"):
        lm_loss_of(tensors, labels, softmax_weight=float("nan"))
    with pytest.raises(ValueError, match="chunk_size"):
        lm_loss_of(tensors, labels, chunk_size=0)
    with pytest.raises(ValueError, match="matmul_dtype must be a floating-point dtype"):
        lm_loss_of(tensors, labels, matmul_dtype=torch.int32)
    with pytest.raises(ValueError, match="labels for"):
        lm_loss_of(tensors, labels[:5])
    bad = labels.clone()
    bad[0] = 37
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm_loss_of(tensors, bad)


def test_chunk_size_follows_the_memory_budget():
    budget = LOGITS_BUDGET_BYTES
    assert chunk_tokens(151936) * 4 * 151936 <= budget < (chunk_tokens(151936) + 1) * 4 * 151936
    assert chunk_tokens(10**9) == 1


def test_zero_row_of_W_gives_finite_loss_and_gradients():
    """A padding row of W_A (scale_S = 0, floored as cauchy.ovr_standardize does) far below a positive threshold:
    the loss is the model's naive loss, every gradient finite, and the row's own OvR gradients 0 (a step's)."""
    from causalqwen_adapter.cauchy import ovr_loss

    g = torch.Generator().manual_seed(0)
    loc_U, scale_U = torch.randn(5, 4, generator=g), torch.rand(5, 4, generator=g) * 1e-5 + 1e-6
    weight = torch.randn(7, 4, generator=g)
    weight[0] = 0.0
    bias, b_noise, threshold = torch.zeros(7), torch.full((4,), 1e-6), torch.full((7,), 16.0)
    tensors = (loc_U, scale_U, weight, bias, b_noise, threshold)
    for t in tensors:
        t.requires_grad_(True)
    labels = torch.tensor([1, 2, 3, 4, 5])
    loss, _ = chunked_lm_loss(loc_U, scale_U, DecisionHead(weight, bias, b_noise, threshold), labels, softmax_weight=0.0,
                              relative_threshold=False, ovr_trains_location=True, chunk_size=2, vocab_chunk_size=3)
    loss.backward()
    with torch.no_grad():
        expected = ovr_loss(loc_U @ weight.T + bias, (scale_U + b_noise.abs()) @ weight.abs().T, threshold, labels)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for t in tensors:
        assert torch.isfinite(t.grad).all()
    assert bias.grad[0] == 0 and threshold.grad[0] == 0


@pytest.mark.parametrize("rows", [1, 32, SKINNY_ROWS, SKINNY_ROWS + 3])
def test_few_rows_linear_is_the_product(rows):
    """x @ Wᵀ in the transposed layout (few rows) or as it is (more), into `out` (float32 or wider) or a new tensor:
    the float64 product within float32 rounding."""
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 64, generator=generator), torch.randn(300, 64, generator=generator)
    expected = x.double() @ weight.double().T
    scratch = torch.empty(rows * 300)
    for out in (None, torch.empty(rows, 300), torch.empty(rows, 300, dtype=torch.float64)):
        got = few_rows_linear(x, weight, out=out, scratch=scratch if out is not None else None)
        assert got.shape == (rows, 300) and got.is_contiguous() and (out is None or got is out)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_loss_chunk_beyond_the_few_rows_layout_matches_the_reference():
    """A chunk of more than SKINNY_ROWS tokens takes the products as they are; one of fewer the transposed layout
    (the other tests): both the float64 reference."""
    tensors, labels = make_inputs(SKINNY_ROWS + 5, 8, 37)
    check(tensors, labels, ovr_trains_location=True, chunk_size=SKINNY_ROWS + 5, vocab_chunk_size=16)
