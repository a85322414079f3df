"""The OvR loss over each position's candidates (docs/design.md, Training losses): the binary cross-entropy of the k
tokens of largest loc_S and of the target, instead of over the whole vocabulary (config `ovr_candidates`). The
candidates come from the cross-entropy's fused pass (`lm_loss.chunked_lm_loss`) or from `candidate_rows`' own
no-grad pass; the loss reads only their rows of W_A, token chunk by token chunk.
"""

import math
from typing import NamedTuple

import torch

from .cauchy import check_labels, few_rows_linear, fuse_noise
from .dispatch import lookup_operator
from .losses import (
    LOGITS_BUDGET_BYTES,
    DecisionHead,
    check_head_inputs,
    chunk_tokens,
    liger_logits_bytes,
    saved_gradients,
)


class CandidateRows(NamedTuple):
    """The rows the OvR loss over candidates scores (`candidate_ovr_loss`), per position: ``ids`` [N, k + 1], the k
    tokens of largest loc_S then the target; ``counted`` [N, k + 1], False for the target's own column when the target
    is already among the k; ``log_partition`` [N], logsumexp of loc_S (float32), the reference of relative
    thresholds."""

    ids: torch.Tensor
    counted: torch.Tensor
    log_partition: torch.Tensor


def candidate_set(top: torch.Tensor, targets: torch.Tensor, log_partition: torch.Tensor) -> CandidateRows:
    """`CandidateRows` from the top-k ids [N, k] of loc_S, the targets [N] and the log-partition [N]."""
    ids = torch.cat([top, targets.unsqueeze(1)], 1)
    counted = torch.ones_like(ids, dtype=torch.bool)
    counted[:, -1] = ~(top == targets.unsqueeze(1)).any(1)
    return CandidateRows(ids, counted, log_partition)


@torch.no_grad()
def candidate_rows(loc_U: torch.Tensor, head: DecisionHead, targets: torch.Tensor, k: int,
                   chunk_size: int | None = None, matmul_dtype: torch.dtype | None = None):
    """(`CandidateRows`, −log softmax(loc_S)_y [N] in float32) from one no-grad pass over the vocabulary, token
    chunks of `chunk_tokens`' budget. The cross-entropy's fused pass finds the same rows from its own logits
    (`lm_loss.chunked_lm_loss` with ``candidates``); this pass serves the OvR loss without the cross-entropy."""
    weight, bias = head.weight, head.bias
    mm_dtype = matmul_dtype or weight.dtype
    w = weight if weight.dtype == mm_dtype else weight.to(mm_dtype)
    chunk_size = chunk_size or chunk_tokens(weight.shape[0])
    top, lse, nll = [], [], []
    for r0 in range(0, len(loc_U), chunk_size):
        logits = few_rows_linear(loc_U[r0 : r0 + chunk_size].to(mm_dtype), w).float()  # F.linear, CPU layout
        if bias is not None:
            logits += bias.float()
        tgt = targets[r0 : r0 + chunk_size]
        part = torch.logsumexp(logits, -1)
        lse.append(part)
        nll.append(part - logits.gather(1, tgt.unsqueeze(1)).squeeze(1))
        top.append(logits.topk(k, -1).indices)
    if not top:
        empty = loc_U.new_zeros(0, dtype=torch.float32)
        return candidate_set(targets.new_zeros(0, k), targets, empty), empty
    return candidate_set(torch.cat(top), targets, torch.cat(lse)), torch.cat(nll)


def candidate_ovr_loss(
    loc_U: torch.Tensor,
    scale_U: torch.Tensor,
    head: DecisionHead,
    targets: torch.Tensor,
    k: int,
    *,
    relative_threshold: bool = True,
    trains_location: bool = False,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    matmul_dtype: torch.dtype | None = None,
    rows: CandidateRows | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The OvR loss over each position's candidates (docs/design.md, Training losses): the binary cross-entropy of
    the k tokens the compatible model ranks highest (largest loc_S) and of the target,

        ℓ = Σ_{j ∈ top-k, j ≠ y} −log(1 − P_j)  −  log P_y,

    instead of over the whole vocabulary. Returns the SUM over positions (the caller divides) and detached means per
    position: ``target_prob`` (P_y), ``candidate_prob_sum`` (Σ over the candidates of P_j) and, when this function
    finds the candidates itself, ``softmax_nll``.

    ``loc_U``, ``scale_U``: [N, C]; ``targets``: [N] valid token ids. P uses the training noise fusion
    (scale_U + T·|b_noise|) and, with ``relative_threshold``, log softmax(loc_S) as the threshold's reference (the
    log-partition is a reference point: no gradient). The gradient reaches the locations (loc_U, W_A and b_A rows)
    only with ``trains_location``. ``rows``: the candidates when the caller has them (the cross-entropy's pass finds
    them, `lm_loss.chunked_lm_loss`); otherwise one no-grad product finds them (`candidate_rows`).

    Memory is flat in N: token chunks of ``chunk_size`` (default `candidate_chunk_tokens`) read their k + 1 rows of
    W_A each in float32, and each chunk's gradients are computed in the forward and summed (W_A's and b_A's rows
    into [V]-row tensors), so that no [N, k + 1, C] tensor outlives its chunk. On a GPU with this package installed
    and ``trains_location`` off, one kernel (`causalqwen::candidate_term`) takes every position instead: no chunks.
    """
    vocab = head.weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < vocab:
        raise ValueError(f"the number of OvR candidates must be an integer in [1, {vocab}), got {k!r}")
    check_head_inputs(loc_U, scale_U, head.weight, targets)
    check_labels(targets, vocab)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    nll = None
    if rows is None:
        rows, nll = candidate_rows(loc_U.detach(), head, targets, k, matmul_dtype=matmul_dtype)
    fits = rows.ids.shape == (len(targets), k + 1)
    if fits and torch.compiler.is_compiling():  # no branch on values in a traced graph: the check stops the call
        torch._assert_async(torch.eq(rows.ids[:, -1], targets).all(), "the candidate rows' last column is not the "
                            "targets: pass the rows found for these positions and targets")
    elif not fits or not torch.equal(rows.ids[:, -1], targets):
        raise ValueError(f"candidate rows of shape {tuple(rows.ids.shape)} for {len(targets)} positions and k = {k}: "
                         "pass the rows found for these positions and targets (their last column is the target)")
    options = (relative_threshold, trains_location, temperature,
               chunk_size or candidate_chunk_tokens(k, loc_U.shape[1], loc_U.device, len(targets), vocab))
    loss, target_prob, prob_sum = _CandidateOvRLoss.apply(loc_U, scale_U, *head, rows, options,
                                                           torch.is_grad_enabled())
    stats = {"target_prob": target_prob, "candidate_prob_sum": prob_sum}
    if nll is not None:
        stats["softmax_nll"] = nll.sum() / max(len(targets), 1)
    return loss, stats


KERNEL_DTYPES = {torch.bfloat16, torch.float32}  # of loc_U and scale_U, for causalqwen::candidate_term
KERNEL_MAX_CANDIDATES = 128  # k + 1 the kernel takes (kernels/candidate_term.py: its row block's accumulators)
CANDIDATE_CHUNK_BYTES_PER_ROW = 8  # per element of [chunk, k + 1, C]: W_A's rows and their |W_A| in float32 (W_A's
# rows' gradient, when the locations train, is written over the rows; a bf16 gather is freed by its cast)


def candidate_chunk_tokens(k: int, width: int, device: torch.device | str = "cpu", n_tokens: int = 16384,
                           vocab: int = 151936) -> int:
    """Tokens per chunk of `candidate_ovr_loss`: its [chunk, k + 1, C] tensors, `CANDIDATE_CHUNK_BYTES_PER_ROW` per
    element, within a budget: the cross-entropy's logits budget on the CPU (a chunk's tensors stay small next to its
    tiles), the cross-entropy's on an accelerator (Liger-Kernel's logits for ``n_tokens`` at ``vocab``,
    `losses.liger_logits_bytes`: 316 tokens at k = 16, C = 896, V = 151,936, 16k targets), where each chunk of the
    torch code costs about 19 kernel launches whatever its size (`loss_plan.candidate_launches` counts them; the
    package's kernel, where it serves, takes every position at once)."""
    cpu = torch.device(device).type == "cpu"
    budget = LOGITS_BUDGET_BYTES if cpu else liger_logits_bytes(n_tokens, vocab, width)
    per_element = 16 if cpu else CANDIDATE_CHUNK_BYTES_PER_ROW  # the CPU's chunks as they were timed
    return max(1, budget // (per_element * (k + 1) * max(width, 1)))


def _standardized_scores(w_rows, abs_rows, loc, scale, shift):
    """(x, scale_S, scale_S floored) [r, k + 1] on one token chunk: x = (loc_S − C) / scale_S (`ovr_standardize`), loc_S
    = W_A's rows · ``loc`` + ``shift`` (b_A's rows minus the log-partition and the threshold), scale_S = |W_A's rows|
    · ``scale`` (the fused scale): two batched products, the shift added by the first."""
    loc_S = torch.baddbmm(shift.unsqueeze(-1), w_rows, loc.unsqueeze(-1)).squeeze(-1)
    scale_S = torch.bmm(abs_rows, scale.unsqueeze(-1)).squeeze(-1)
    floored = scale_S.clamp_min(torch.finfo(scale_S.dtype).tiny)
    return loc_S / floored, scale_S, floored


def _candidate_losses(x, sign):
    """(−log of each candidate's likelihood, P) [N, k + 1] from x and ``sign`` (−1 at the target, +1 elsewhere): with
    z = sign·x the likelihood is Q(z) = atan2(1, z)/π (P_y at the target, 1 − P_j elsewhere: `cauchy.ovr_log_probs`),
    its log through log1p(−atan2(1, −z)/π) below 0 so that no digit of a small 1 − Q is lost."""
    z = x * sign
    q = torch.atan2(torch.ones((), dtype=x.dtype, device=x.device), z.abs()) / math.pi  # min(Q, 1 − Q)
    minus_log = torch.where(z < 0, torch.log1p(-q), torch.log(q)).neg_()
    return minus_log, torch.where(x < 0, q, 1 - q)


def _score_gradients(x, scale_S, floored, sign, minus_weight, one):
    """(∂ℓ/∂C, ∂ℓ/∂scale_S) [r, k + 1] of one chunk's ℓ = Σ weight·(−log Q(sign·x)) (`_candidate_losses`), by hand in
    place: ∂(−log Q(z))/∂z = 1/((1 + z²)·atan2(1, z)) (autograd's formula), ∂ℓ/∂C = −∂ℓ/∂loc_S; the floor of scale_S
    passes no gradient. ``minus_weight`` = −sign·weight, ``one`` a 0-dim 1."""
    z = x * sign
    d_threshold = minus_weight / torch.addcmul(one, z, z).mul_(torch.atan2(one, z)).mul_(floored)
    d_scale = (d_threshold * x).masked_fill_(scale_S < torch.finfo(scale_S.dtype).tiny, 0.0)
    return d_threshold, d_scale


class _CandidateOvRLoss(torch.autograd.Function):
    """Forward and gradients in one pass, token chunk by chunk (`candidate_ovr_loss`): per chunk a gather of W_A's
    rows, two batched products for x, the gradient's elementwise work in place and one batched product per input
    that trains; the [N, k + 1] terms (x, the gradient at the shift) kept, their values and sums taken once."""

    @staticmethod
    def forward(ctx, loc_U, scale_U, weight, bias, b_noise, threshold, rows, options, grad_enabled):
        relative, trains_location, temperature, chunk = options
        need_loc, need_scale, need_W, need_bias, need_noise, need_thr = (
            grad_enabled and n for n in ctx.needs_input_grad[:6])
        # Without trains_location the locations are constants of this loss (the gradient reaches the scale path and
        # the thresholds only).
        need_loc, need_W, need_bias = (need and trains_location for need in (need_loc, need_W, need_bias))
        dtype = torch.promote_types(weight.dtype, torch.float32)
        n, (vocab, width), k1 = len(rows.ids), weight.shape, rows.ids.shape[1]
        thr_is_tensor = torch.is_tensor(threshold)
        need_thr = need_thr and thr_is_tensor
        flat_ids = rows.ids.reshape(-1)
        # per position, once: the sign of z (−1 at the target), the weights (0 for a target already among the top-k)
        is_target = rows.ids == rows.ids[:, -1:]
        sign = torch.where(is_target, -1.0, 1.0).to(dtype)
        weight_of = rows.counted.to(dtype)
        minus_weight = -sign * weight_of
        # loc_S − C = W_A's rows · loc + shift: b_A's rows − the threshold (a [V] vector's rows) − the log-partition
        thr = threshold.detach().to(dtype) if thr_is_tensor else threshold
        base = (0.0 if bias is None else bias.detach().to(dtype)) - thr
        shift = (base[rows.ids] if torch.is_tensor(base) and base.dim() == 1
                 else torch.zeros(rows.ids.shape, dtype=dtype, device=weight.device) + base)
        if relative:
            shift = shift - rows.log_partition.to(dtype).unsqueeze(1)
        noise = b_noise.detach().to(dtype)
        widen = fuse_noise(noise, torch.zeros_like(noise), noise, "standard", temperature)[1]  # T·|b_noise|
        one = torch.ones((), dtype=dtype, device=weight.device)
        backward = need_loc or need_scale or need_W or need_bias or need_noise or need_thr
        grad_loc = loc_U.new_zeros(loc_U.shape, dtype=dtype) if need_loc else None  # −∂ℓ/∂loc_U until the end
        grad_scale = scale_U.new_empty(scale_U.shape, dtype=dtype) if need_scale or need_noise else None  # every row written
        grad_W = weight.new_zeros(vocab, width, dtype=dtype) if need_W else None
        xs, d_thresholds = [], []
        # On a GPU (the package's Triton kernel) every position in one launch, when only the scale path trains and
        # the operands are as the kernel takes them (its query reads W_A's dtype; the rest is checked here)
        served = (not (need_loc or need_W or need_bias) and {loc_U.dtype, scale_U.dtype} <= KERNEL_DTYPES
                  and k1 <= KERNEL_MAX_CANDIDATES and weight.stride(-1) == 1 and widen.shape == (width,))
        term = lookup_operator("candidate_term", weight) if served else None
        if term is not None:
            xs.append(torch.empty(rows.ids.shape, dtype=torch.float32, device=weight.device))
            d_thresholds += [torch.empty_like(xs[0])] if need_thr and backward else []
            loc, scale = (t.detach() if t.stride(-1) == 1 else t.detach().contiguous() for t in (loc_U, scale_U))
            term(loc, scale, widen, weight.detach(), rows.ids.contiguous(), shift.contiguous(), sign, minus_weight,
                 xs[0], d_thresholds[0] if d_thresholds else None, grad_scale)
        for r0 in range(0 if term is None else n, n, chunk):
            r1 = min(r0 + chunk, n)
            flat = flat_ids[r0 * k1 : r1 * k1]
            w_rows = weight.detach().index_select(0, flat).to(dtype).view(r1 - r0, k1, width)
            abs_rows = w_rows.abs()
            loc = loc_U[r0:r1].detach().to(dtype)
            fused_scale = (scale_U[r0:r1].detach() + widen).to(dtype)  # fuse_noise's training scale
            x, scale_S, floored = _standardized_scores(w_rows, abs_rows, loc, fused_scale, shift[r0:r1])
            xs.append(x)
            if backward:
                d_thr, d_scale = _score_gradients(x, scale_S, floored, sign[r0:r1], minus_weight[r0:r1], one)
                if need_bias or need_thr:
                    d_thresholds.append(d_thr)
                if grad_scale is not None:
                    torch.bmm(d_scale.unsqueeze(1), abs_rows, out=grad_scale[r0:r1].unsqueeze(1))
                if need_loc:
                    torch.bmm(d_thr.unsqueeze(1), w_rows, out=grad_loc[r0:r1].unsqueeze(1))
                if need_W:  # ∂ℓ/∂W_A's rows = sign(W)·∂ℓ/∂scale_S ⊗ scale − ∂ℓ/∂C ⊗ loc, written over the rows
                    w_rows.sign_().mul_(d_scale.unsqueeze(-1)).mul_(fused_scale.unsqueeze(1))
                    w_rows.baddbmm_(d_thr.unsqueeze(-1), loc.unsqueeze(1), alpha=-1)
                    grad_W.index_add_(0, flat, w_rows.view(-1, width))
            del w_rows, abs_rows, loc, fused_scale  # freed before the next chunk's
        del shift, minus_weight
        x = xs[0] if len(xs) == 1 else torch.cat(xs) if xs else sign.new_zeros(0, k1)
        del xs
        minus_log, probs = _candidate_losses(x, sign)
        loss = (minus_log * weight_of).sum(dtype=torch.float64)
        probs = probs * weight_of
        n_pos = max(n, 1)
        stats = ((probs * is_target).sum(dtype=torch.float64) / n_pos, probs.sum(dtype=torch.float64) / n_pos)
        stats = tuple(s.to(torch.float32) for s in stats)
        ctx.mark_non_differentiable(*stats)
        del x, minus_log, probs, sign, weight_of, is_target  # before the gradients' copies in their dtypes
        grads = {"loc": None, "scale": grad_scale if need_scale else None, "W": grad_W, "bias": None,
                 "noise": None, "thr": None}
        if need_loc:
            grads["loc"] = grad_loc.neg_()
        if need_noise:
            grads["noise"] = grad_scale.sum(0).mul_(noise.sign()).mul_(temperature)
        d_thr = torch.cat(d_thresholds) if d_thresholds else noise.new_zeros(0, k1)
        if need_bias:
            grads["bias"] = bias.new_zeros(vocab, dtype=dtype).index_add_(0, flat_ids, d_thr.view(-1), alpha=-1)
        if need_thr:
            grads["thr"] = (thr.new_zeros(vocab).index_add_(0, flat_ids, d_thr.view(-1)) if thr.dim() == 1
                            else d_thr.sum())
        dtypes = {"loc": loc_U.dtype, "scale": scale_U.dtype, "W": weight.dtype,
                  "bias": None if bias is None else bias.dtype, "noise": b_noise.dtype,
                  "thr": threshold.dtype if thr_is_tensor else None}
        ctx.save_for_backward(*(None if g is None else g.to(dtypes[name]) for name, g in grads.items()))
        return (loss.to(torch.float32), *stats)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        return (*saved_gradients(ctx, grad_loss), None, None, None)
