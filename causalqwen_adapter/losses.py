"""Training losses of the causal heads: the chunked one-vs-rest loss (docs/design.md, Training losses), fused with the action head,
and the top-K distillation loss (docs/design.md, Offline distillation); the tile and chunk sizes of every loss. The
softmax cross-entropy on loc_S is lm_loss.py's one pass, the OvR loss over candidates candidate_loss.py's.

The naive loss materialises loc_S and scale_S for every token ([N × V] each, 0.6 GB per
tensor at N = 1024, V = 151936) and autograd keeps several more of that size. Here, as in
Liger-Kernel's fused linear cross-entropy, the forward walks over tiles of
(token chunk × vocabulary block), computes the loss and all gradients there, and keeps
only the gradients; backward merely rescales them. Extra memory is the gradient of the
action weight, [N × C] input gradients and O(chunk_size × vocab_chunk_size) tiles; |W|,
sign(W) and the |W|-path gradient only ever exist for one vocabulary block.

Per tile, with z = x off the target and z = −x at the target (so that every entry's loss
is the same function, −log(atan2(1, z)/π): −log(1 − P_k) off target, −log P_y on it):

    ∂ℓ/∂z       = 1 / (π (1 + z²) a),   a = atan2(1, z)/π
    ∂ℓ/∂loc_S   =  (∂x/∂z) ∂ℓ/∂z / scale_S       (∂x/∂z = ±1)
    ∂ℓ/∂scale_S = −z ∂ℓ/∂z / scale_S            (dx/dscale_S = −x / scale_S)
    ∂ℓ/∂C       = −∂ℓ/∂loc_S
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .cauchy import cauchy_linear_rows, check_labels, fuse_noise, ovr_log_probs, ovr_probs, ovr_standardize
from .dispatch import TILE_COL_D, TILE_D, TILE_OVR, TILE_OVR_GRADS, TILE_OVR_LOCATES, lookup_operator, tile_thread_count

OVR_CHUNK_TOKENS = 1024  # tokens per tile of `chunked_ovr_loss` on the CPU, whose tiles are [tokens × 2,048 rows]
OVR_VOCAB_BLOCK = 2048


class DecisionHead(NamedTuple):
    """The action network as the losses read it: loc_S = ``weight`` loc_U + ``bias``, scale_S = |``weight``|
    (scale_U + T·|``b_noise``|), and P_k = P(S_k > ``threshold``).

    ``weight``: [V, C] (W_A as used: own, tied or base + LoRA); ``bias``: [V] or None; ``b_noise``: [C];
    ``threshold``: a float, a 0-dim tensor or a [V] tensor (learnable or not).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    b_noise: torch.Tensor
    threshold: float | torch.Tensor


def chunked_ovr_loss(
    loc_U: torch.Tensor,
    scale_U: torch.Tensor,
    head: DecisionHead,
    labels: torch.Tensor,
    *,
    num_items_in_batch=None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    ignore_index: int = -100,
    negatives_only: bool = False,
    threshold_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """OvR loss of the action head on the individual distributions, without [N × V] tensors.

    ``loc_U``, ``scale_U``: [N, C]; ``head``: the action network's tensors; ``labels``: [N], already aligned with the
    positions, ``ignore_index`` where there is no target.
    Training noise fusion (scale_U + T·|b_noise|), float32 math whatever the input dtype;
    sum over the vocabulary, mean over valid targets, or sum / ``num_items_in_batch``. With ``negatives_only`` the
    labels only select the positions: every token is a negative, Σ_k −log(1 − P_k) (the distillation's tail term).
    ``threshold_offset`` [N]: an amount added to every threshold of a position, the log-partition of loc_S under
    relative thresholds (``log_partition``); a reference point, no gradient flows into it.

    Returns (loss, stats) with detached ``target_prob`` (mean P_y), ``ovr_prob_sum``
    (mean Σ_k P_k) and ``num_tokens`` (valid targets). ``chunk_size`` × ``vocab_chunk_size`` is the tile size
    (default `ovr_loss_shape`'s for the device); it changes speed and memory, not the result.
    """
    check_head_inputs(loc_U, scale_U, head.weight, labels)
    if threshold_offset is not None and threshold_offset.shape != (loc_U.shape[0],):
        raise ValueError(f"threshold_offset must be [N] = [{loc_U.shape[0]}], got {tuple(threshold_offset.shape)}")
    loss, target_prob, prob_sum, num_tokens = _ChunkedOvRLoss.apply(
        loc_U, scale_U, *head, labels, num_items_in_batch, temperature,
        chunk_size, vocab_chunk_size, ignore_index, negatives_only, threshold_offset, torch.is_grad_enabled(),
    )
    return loss, {"target_prob": target_prob, "ovr_prob_sum": prob_sum, "num_tokens": num_tokens}


def check_head_inputs(loc_U, scale_U, weight, labels) -> None:
    """loc_U (and scale_U, unless None) [N, C], weight [V, C] and one label per position, or a ValueError."""
    scale_shape = loc_U.shape if scale_U is None else scale_U.shape
    if weight.dim() != 2 or loc_U.dim() != 2 or loc_U.shape[1] != weight.shape[1] or scale_shape != loc_U.shape:
        raise ValueError(
            f"expected loc_U, scale_U [N, C] and weight [V, C]; got {tuple(loc_U.shape)}, "
            f"{tuple(scale_shape)} and {tuple(weight.shape)}: flatten the positions first"
        )
    if labels.numel() != loc_U.shape[0]:
        raise ValueError(f"{labels.numel()} labels for {loc_U.shape[0]} positions: pass one (shifted) label per position")


class _ChunkedOvRLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loc_U, scale_U, weight, bias, b_noise, threshold, labels, num_items_in_batch, temperature,
                chunk_size, vocab_chunk_size, ignore_index, negatives_only, threshold_offset, grad_enabled):
        # needs_input_grad stays True under no_grad, hence the explicit grad_enabled.
        need = [grad_enabled and n for n in ctx.needs_input_grad[:6]]
        need_loc, need_scale, need_W, need_bias, need_noise, need_thr = need
        vocab, width = weight.shape
        dtype = torch.promote_types(weight.dtype, torch.float32)

        labels = labels.reshape(-1)
        rows = (labels != ignore_index).nonzero().squeeze(1)
        targets = labels[rows]
        check_labels(targets, vocab)
        n_valid = rows.numel()
        if negatives_only:  # an id no vocabulary block holds: no column is flipped to the target's term
            targets = torch.full_like(targets, -1)

        # Only valid positions enter the tiles; [n_valid, C] copies are small.
        loc, scale = fuse_noise(loc_U[rows].to(dtype), scale_U[rows].to(dtype), b_noise.to(dtype), "standard", temperature)
        thr = threshold.to(dtype) if torch.is_tensor(threshold) else threshold
        # W loc + b − C in one addmm per tile.
        shift = (torch.zeros(vocab, dtype=dtype, device=weight.device) if bias is None else bias.to(dtype)) - thr
        offset = None if threshold_offset is None else threshold_offset.detach()[rows].to(dtype).unsqueeze(1)

        if num_items_in_batch is None:
            denom = float(max(n_valid, 1))
        else:
            denom = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=weight.device)
        # The tiles produce π ∂ℓ/∂loc_S and −π ∂ℓ/∂scale_S (see _ovr_tiles); π, the sign and the
        # reduction are folded into the small results (and into each grad_W block before its cast).
        factor = 1 / (math.pi * denom)

        g_loc = loc.new_zeros(n_valid, width) if need_loc else None
        g_scale = scale.new_zeros(n_valid, width) if need_scale or need_noise else None
        g_shift = shift.new_zeros(vocab) if need_bias or need_thr else None
        grad_W = torch.zeros_like(weight) if need_W else None
        tile_kernel = ovr_tile_operator(dtype, weight.device)
        if chunk_size is None or vocab_chunk_size is None:
            shape = ovr_loss_shape(weight.device, n_valid, vocab, width, tile_kernel is not None)
            chunk_size, vocab_chunk_size = chunk_size or shape[0], vocab_chunk_size or shape[1]
        neg_log_sum, u_row_sum, p_target = _ovr_tiles(
            loc, scale, weight, shift, targets, g_loc, g_scale, g_shift, grad_W, factor,
            max(1, min(chunk_size, n_valid)), min(vocab_chunk_size, vocab), dtype, tile_kernel, precise=negatives_only,
            offset=offset,
        )

        loss = (neg_log_sum / denom).to(torch.float32)
        # Σ_k P_k = Σ_{k≠y} (1 − a_k) + P_y, where a_y = P_y: rows summed in float64.
        prob_sum = u_row_sum if negatives_only else u_row_sum - 1 + 2 * p_target
        n_tok = max(n_valid, 1)
        stats = (
            (p_target.sum() / n_tok).to(torch.float32),
            (prob_sum.sum() / n_tok).to(torch.float32),
            torch.tensor(n_valid, device=weight.device),
        )
        ctx.mark_non_differentiable(*stats)

        grad_loc = grad_scale = grad_bias = grad_noise = grad_thr = None
        if need_loc:
            grad_loc = torch.zeros_like(loc_U).index_copy_(0, rows, (g_loc * factor).to(loc_U.dtype))
        if g_scale is not None:
            g_scale.mul_(-factor)
            if need_scale:
                grad_scale = torch.zeros_like(scale_U).index_copy_(0, rows, g_scale.to(scale_U.dtype))
            if need_noise:
                grad_noise = (temperature * b_noise.to(dtype).sign() * g_scale.sum(0)).to(b_noise.dtype)
        if g_shift is not None:
            g_shift.mul_(factor)
            if need_bias:
                grad_bias = g_shift.to(bias.dtype)
            if need_thr:
                grad_thr = (-g_shift).sum_to_size(threshold.shape).to(threshold.dtype)
        ctx.save_for_backward(grad_loc, grad_scale, grad_W, grad_bias, grad_noise, grad_thr)
        return (loss, *stats)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        return (*saved_gradients(ctx, grad_loss), *([None] * 9))


def saved_gradients(ctx, grad_loss: torch.Tensor) -> list:
    """The backward of the losses that compute their gradients in the forward: the saved gradients times the loss's
    incoming gradient. In place, so no second [V × C] buffer; the saved tensors' version check then makes a second
    backward through the same graph fail loudly instead of scaling twice."""
    grads = list(ctx.saved_tensors)
    if not torch.equal(grad_loss, torch.ones_like(grad_loss)):
        grads = [None if g is None else g.mul_(grad_loss) for g in grads]
    return grads


def ovr_tile_operator(dtype: torch.dtype, device: torch.device):
    """The loss_tile operator `_ovr_tiles` runs its tiles' elementwise work in (float32 tiles only), or None: the torch
    code's `ovr_tile`."""
    if dtype != torch.float32:
        return None
    return lookup_operator("loss_tile", torch.empty(0, dtype=dtype, device=device))


def _ovr_tiles(loc, scale, weight, shift, targets, g_loc, g_scale, g_shift, grad_W, factor, chunk, vblock, dtype,
               tile_kernel, precise=False, offset=None):
    """Loss terms, stats and (unscaled) gradients over all (token chunk × vocabulary block) tiles.

    Vocabulary blocks are the outer loop, so |W|, sign(W) and the fp32 copy of a bf16 W exist
    for one block at a time, and each block of grad_W is finished (and cast) before the next.
    g_loc, g_scale, g_shift receive token sums of π ∂ℓ/∂loc_S and −π ∂ℓ/∂scale_S paths; grad_W
    (left zero when there are no valid tokens) receives its final value, ``factor`` included.
    Returns (Σ ℓ, per-token Σ_k (1 − a_k), per-token P_y), the last two in float64; ``precise`` keeps the digits of
    P_k < 6e-8 in both sums (the distillation's tail term); ``offset`` [n_valid, 1] is subtracted from each row's
    loc_S − C (relative thresholds).
    """
    n_valid, width = loc.shape
    vocab = weight.shape[0]
    dev = loc.device
    # a and u only for the torch code's `ovr_tile` (`ovr_loss_shape` counts them)
    x_buf, s_buf, t_buf = (torch.empty(chunk * vblock, dtype=dtype, device=dev) for _ in range(3))
    a_buf, u_buf = (torch.empty(chunk * vblock if tile_kernel is None else 0, dtype=dtype, device=dev)
                    for _ in range(2))
    abs_buf = torch.empty(vblock, width, dtype=dtype, device=dev)
    if grad_W is not None:
        acc_loc, acc_scale = (torch.empty(vblock, width, dtype=dtype, device=dev) for _ in range(2))
    neg_log_sum = torch.zeros((), dtype=torch.float64, device=dev)
    u_row_sum = torch.zeros(n_valid, dtype=torch.float64, device=dev)
    p_target = torch.zeros(n_valid, dtype=torch.float64, device=dev)
    want_grads = any(g is not None for g in (g_loc, g_scale, g_shift, grad_W))
    # The tile's elementwise work in one pass where an operator serves it (``tile_kernel``: causalqwen::loss_tile,
    # dispatch.py; always with the digits of `precise`) on x = loc_S − C (− offset): t gets π ∂ℓ/∂loc_S (ce = 0, of =
    # 1), x is overwritten by −π ∂ℓ/∂scale_S, as ovr_tile leaves them.
    if tile_kernel is not None:
        threads = tile_thread_count(dev)
        flags = TILE_OVR | (TILE_D | TILE_OVR_GRADS | TILE_OVR_LOCATES) * want_grads | TILE_COL_D * (g_shift is not None)
        rows_out = torch.empty(4 * chunk, dtype=dtype, device=dev)
        col_sums = torch.empty(2, threads * vblock, dtype=dtype, device=dev)
        no_threshold = torch.zeros(1, dtype=dtype, device=dev)
        no_lse = torch.zeros(chunk, dtype=dtype, device=dev)  # read by the kernel, used only with ce > 0 or relative

    for v0 in range(0, vocab if n_valid else 0, vblock):  # no valid token: nothing to add
        v1 = min(v0 + vblock, vocab)
        w = v1 - v0
        w_blk = weight[v0:v1].to(dtype)
        abs_w = torch.abs(w_blk, out=abs_buf[:w])
        degenerate = zero_rows(abs_w)
        zero_mask = zero_row_mask(degenerate, w) if tile_kernel is not None else None
        if grad_W is not None:
            acc_l, acc_s = acc_loc[:w].zero_(), acc_scale[:w].zero_()
        for r0 in range(0, n_valid, chunk):
            r1 = min(r0 + chunk, n_valid)
            x, s, t = (buf[: (r1 - r0) * w].view(r1 - r0, w) for buf in (x_buf, s_buf, t_buf))
            torch.addmm(shift[v0:v1], loc[r0:r1], w_blk.T, out=x)
            if offset is not None:
                x.sub_(offset[r0:r1])
            torch.mm(scale[r0:r1], abs_w.T, out=s)
            if tile_kernel is not None:
                r = r1 - r0
                cols = col_sums[:, : threads * w].view(2, threads, w)
                if g_shift is not None:
                    cols.zero_()
                tile_kernel(x, None, no_lse, no_threshold, False, s, kernel_target_columns(targets[r0:r1], v0, w),
                            zero_mask, 0.0, 1.0, flags, t, x, rows_out[: 4 * r], cols[0], cols[1], threads)
                sums = rows_out[: 4 * r].view(4, r)
                neg_log_sum -= sums[1].sum(dtype=torch.float64)
                u_row_sum[r0:r1] += sums[2]
                p_target[r0:r1] += sums[3]
            else:
                a, u = (buf[: (r1 - r0) * w].view(r1 - r0, w) for buf in (a_buf, u_buf))
                col, hit, flip = target_columns(targets[r0:r1], v0, w, dtype)
                neg_log, u_rows, p_y = ovr_tile(x, s, col, hit, flip, a, t, u, degenerate, want_grads, precise)
                neg_log_sum += neg_log
                u_row_sum[r0:r1] += u_rows
                p_target[r0:r1] += p_y
            if want_grads:
                if grad_W is not None:
                    acc_l.addmm_(t.T, loc[r0:r1])
                    acc_s.addmm_(x.T, scale[r0:r1])
                if g_loc is not None:
                    g_loc[r0:r1].addmm_(t, w_blk)
                if g_scale is not None:
                    g_scale[r0:r1].addmm_(x, abs_w)
                if g_shift is not None:
                    g_shift[v0:v1] += t.sum(0) if tile_kernel is None else cols[0].sum(0)
        if grad_W is not None:
            # ∂/∂W of |W|·scale is sign(W)·(…); the scale path carries a minus sign (see above).
            acc_l.sub_(acc_s.mul_(torch.sign(w_blk, out=abs_w)))
            grad_W[v0:v1] = acc_l.mul_(factor)
    return neg_log_sum, u_row_sum, p_target


def zero_rows(w: torch.Tensor) -> torch.Tensor:
    """Indices of the all-zero rows of a block of W_A or |W_A| (a padding embedding). There scale_S = 0 and P is a
    step in loc_S, whose derivative is 0 (a Dirac at the step itself, which no finite gradient can represent). A row
    whose largest and smallest entries are both 0 (NaN is neither), no |W| tensor: `vector_norm(w, inf, dim=1)`, the
    same test, took 10–30× as long on a CPU (2.9 ms against 0.1–0.2 ms for a 2,048 × 896 block)."""
    return ((w.amax(1) == 0) & (w.amin(1) == 0)).nonzero().squeeze(1)


def zero_row_mask(zero: torch.Tensor, width: int) -> torch.Tensor | None:
    """`zero_rows`' indices as the [width] bool mask the loss_tile operator reads, None when there are none."""
    return torch.zeros(width, dtype=torch.bool, device=zero.device).index_fill_(0, zero, True) if zero.numel() else None


def kernel_target_columns(targets: torch.Tensor, v0: int, width: int) -> torch.Tensor:
    """`target_columns` as the loss_tile operator reads them: the target's column in the block [v0, v0 + width) per
    row, −1 where it lies outside."""
    col = targets - v0
    return torch.where((col >= 0) & (col < width), col, -1)


def target_columns(targets: torch.Tensor, v0: int, width: int, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(col [r, 1], hit [r], flip [r, 1]) of a vocabulary block [v0, v0 + width): the target's column when it lies in
    the block (hit), elsewhere column 0 with a no-op flip (+1); flip is −1 at a hit."""
    col = targets - v0
    hit = (col >= 0) & (col < width)
    return col.clamp(0, width - 1).unsqueeze(1), hit, torch.where(hit, -1.0, 1.0).to(dtype).unsqueeze(1)


def ovr_tile(x, s, col, hit, flip, a, t, u, degenerate, want_grads, precise=False):
    """The OvR terms of one (token × vocabulary) tile, in place on [r, w] buffers.

    ``x``: loc_S − C (minus the offset of relative thresholds); ``s``: scale_S; ``a``, ``t``, ``u``: scratch of the
    same shape; ``col``, ``hit``, ``flip``: `target_columns`; ``degenerate``: `zero_rows` of the block. Returns
    (Σ ℓ in float64, per-row Σ (1 − a) in float64, per-row P_y). With ``want_grads``, on return ``t`` holds
    π ∂ℓ/∂loc_S and ``x`` holds −π ∂ℓ/∂scale_S. ``precise``: see `_ovr_tiles`.
    """
    s.clamp_min_(torch.finfo(s.dtype).tiny)  # a zero row of W_A: the floor of cauchy.ovr_standardize
    x.div_(s)
    x.scatter_(1, col, x.gather(1, col) * flip)  # now z
    one = torch.ones((), dtype=x.dtype, device=x.device)
    torch.atan2(one, x, out=a).mul_(1 / math.pi)  # 1 − P_k off target, P_y on it
    p_y = a.gather(1, col).squeeze(1) * hit
    if precise:
        # u = 1 − a as atan2(1, −z)/π: where z < 0, a is within a few ulps of 1 and has lost the digits of the
        # small P_k (float32's ulp at 1 is 6e-8), which u keeps. One more transcendental per entry: only for
        # the tail term, where the tiny P_k are the whole loss.
        torch.atan2(one, torch.neg(x, out=u), out=u).mul_(1 / math.pi)
        log_p = torch.where(x < 0, torch.log1p(-u), torch.log(a))
    else:
        torch.sub(one, a, out=u)
        log_p = torch.log(a, out=t)  # t is free until the gradients
    # Row sums in the tile's dtype (pairwise summation), rows in float64: a float64 sum of the tile would first copy
    # it to float64, which costs more than the tile's transcendentals.
    neg_log = log_p.sum(1).sum(dtype=torch.float64)
    u_rows = u.sum(1).double()
    if want_grads:
        # π ∂ℓ/∂z = 1/(a + z·(z·a)): a product form, so z² never overflows into inf·0.
        # For z → +∞, z·a → 1/π and the gradient → 1/z; for z → −∞ the denominator → +∞
        # and the gradient → 0, its true limit.
        torch.mul(x, a, out=t)
        torch.addcmul(a, t, x, out=t).reciprocal_()
        t.div_(s)
        if degenerate.numel():  # x is ±inf there (a finite gap over scale 0): 0·inf would be NaN
            t.index_fill_(1, degenerate, 0.0)
            x.index_fill_(1, degenerate, 0.0)
        x.mul_(t)  # −π ∂ℓ/∂scale_S
        t.scatter_(1, col, t.gather(1, col) * flip)  # π ∂ℓ/∂loc_S
    return -neg_log, u_rows, p_y


def topk_mse_loss(
    loc_U: torch.Tensor,
    scale_U: torch.Tensor,
    head: DecisionHead,
    topk_ids: torch.Tensor,
    topk_probs: torch.Tensor,
    *,
    temperature: float = 1.0,
    tail_weight: float = 0.0,
    chunk_size: int | None = None,
    threshold_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Distillation loss of docs/design.md, Offline distillation: Σ_{k∈K} (P_k − p_teacher,k)² (summed over K, mean
    over positions), plus ``tail_weight`` × the tail term Σ_{k∉K} −log(1 − P_k): the OvR loss of every token outside
    the teacher's top-K as a negative, which keeps Σ_k P_k from growing over the 151,936 − K tokens the MSE leaves
    free.

    ``loc_U``, ``scale_U``: [N, C]; ``head``: the action network's tensors; ``topk_ids``: [N, K] the teacher's top-K token ids, its
    top-1 first; ``topk_probs``: [N, K] its softmax probabilities there. P_k is the OvR probability under the
    training noise fusion (scale_U + T·|b_noise|), float32 math whatever the input dtype. The MSE reads only the K
    rows of W_A of each position; the tail term is `chunked_ovr_loss` with every token a negative (tiles, no [N × V]
    tensor) minus the K stored tokens' own terms, computed on their rows.

    Returns (loss, stats) with detached ``top1_match`` (fraction of positions whose largest P among the K is the
    teacher's top-1), ``topk_prob_sum`` (mean Σ_{k∈K} P_k) and, with the tail term, ``ovr_prob_sum`` (mean Σ_k P_k
    over the vocabulary) and ``tail_loss``.
    """
    if topk_ids.shape != topk_probs.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != loc_U.shape[0]:
        raise ValueError(
            f"expected topk_ids and topk_probs [N, K] for {loc_U.shape[0]} positions, got {tuple(topk_ids.shape)} "
            f"and {tuple(topk_probs.shape)}"
        )
    if not (math.isfinite(tail_weight) and tail_weight >= 0):
        raise ValueError(f"tail_weight must be a finite number >= 0, got {tail_weight}")
    weight, bias, b_noise, threshold = head
    check_labels(topk_ids.reshape(-1), weight.shape[0])
    dtype = torch.promote_types(weight.dtype, torch.float32)
    loc, scale = fuse_noise(loc_U.to(dtype), scale_U.to(dtype), b_noise.to(dtype), "standard", temperature)
    ids = topk_ids.long()
    loc_S, scale_S = cauchy_linear_rows(loc, scale, weight.to(dtype), None if bias is None else bias.to(dtype), ids)
    thr = threshold.to(dtype) if torch.is_tensor(threshold) else threshold
    if torch.is_tensor(thr) and thr.dim() == 1:
        thr = thr[ids]
    if threshold_offset is not None:  # relative thresholds: see chunked_ovr_loss
        loc_S = loc_S - threshold_offset.detach().to(dtype).unsqueeze(1)
    x = ovr_standardize(loc_S, scale_S, thr)
    probs = ovr_probs(x)
    loss = (probs - topk_probs.to(dtype)).square().sum(-1).mean() if len(probs) else probs.sum()
    stats = {}
    if tail_weight > 0 and len(probs):
        # Σ_k −log(1 − P_k) over the vocabulary, then the K stored tokens' own terms off (same fusion, threshold).
        every, kernel_stats = chunked_ovr_loss(loc_U, scale_U, head, ids[:, 0], temperature=temperature,
                                               chunk_size=chunk_size, negatives_only=True,
                                               threshold_offset=threshold_offset)
        tail = every + ovr_log_probs(x)[1].sum(-1).mean()
        loss = loss + tail_weight * tail
        stats = {"ovr_prob_sum": kernel_stats["ovr_prob_sum"], "tail_loss": tail.detach()}
    with torch.no_grad():
        stats.update({
            "top1_match": (probs.argmax(-1) == 0).float().mean() if len(probs) else probs.new_zeros(()),
            "topk_prob_sum": probs.sum(-1).mean() if len(probs) else probs.new_zeros(()),
        })
    return loss.to(torch.float32), {k: v.to(torch.float32) for k, v in stats.items()}


LOGITS_BUDGET_BYTES = 128 * 2**20  # one chunk's logits: 220 tokens of float32 (441 of bfloat16) at Qwen2's V = 151,936


def chunk_tokens(vocab_size: int, itemsize: int = 4, budget_bytes: int = LOGITS_BUDGET_BYTES) -> int:
    """Tokens per chunk whose [chunk × V] logits of ``itemsize`` bytes fit the budget (as Liger-Kernel sizes its
    chunks)."""
    return max(1, budget_bytes // (itemsize * vocab_size))


CPU_VOCAB_BLOCK = 4096  # rows of W_A per block on the CPU: a tile of a few hundred tokens stays in cache


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def loss_shape(device: torch.device, n_tokens: int, vocab: int, width: int, itemsize: int,
               tile_bytes: float) -> tuple[int, int]:
    """(tokens per chunk, vocabulary rows per block) by default. On the CPU, the chunk's [chunk × V] logits of
    ``itemsize`` bytes fit `chunk_tokens`' budget and blocks of `CPU_VOCAB_BLOCK` rows keep a tile in cache.

    On an accelerator one block spans the vocabulary (a product and a kernel per pass, not a loop over blocks), and
    a chunk's buffers, ``tile_bytes`` per [chunk × V] element all together (the logits, every tile and every
    per-token buffer of the pass that runs: `lm_loss.chunk_tile_bytes`), fit the budget of Liger-Kernel's fused linear
    cross-entropy: its one [chunk × V] logits buffer of ``itemsize`` bytes, at its chunk of
    next_power_of_2(⌈N / ⌈V / C⌉⌉) tokens, which is about the bytes of the [N × C] input (as many as the largest chunk
    that fits: a bf16 pass through the Triton kernels holds little more than its logits, about Liger's chunk)."""
    if device.type == "cpu":
        return chunk_tokens(vocab, itemsize), CPU_VOCAB_BLOCK
    return max(1, int(liger_logits_bytes(n_tokens, vocab, width, itemsize) // (vocab * tile_bytes))), vocab


def liger_logits_bytes(n_tokens: int, vocab: int, width: int, itemsize: int = 2) -> int:
    """Bytes of Liger-Kernel's fused linear cross-entropy's one [chunk × V] logits buffer for ``n_tokens`` (its
    chunk: next_power_of_2(⌈N / ⌈V / C⌉⌉) tokens): the budget of the loss's chunks on an accelerator."""
    return _power_of_two_at_least(-(-max(n_tokens, 1) // -(-vocab // max(width, 1)))) * vocab * itemsize


def ovr_loss_shape(device: torch.device, n_tokens: int, vocab: int, width: int, operator: bool) -> tuple[int, int]:
    """`chunked_ovr_loss`'s (tokens per chunk, vocabulary rows per block) by default: on the CPU tiles of
    `OVR_CHUNK_TOKENS` × `OVR_VOCAB_BLOCK` (float32, kept in cache), on an accelerator `loss_shape`'s for its float32
    tiles (three where the loss_tile ``operator`` serves, five for the torch code)."""
    if device.type == "cpu":
        return OVR_CHUNK_TOKENS, OVR_VOCAB_BLOCK
    return loss_shape(device, n_tokens, vocab, width, 4, 4 * (3 if operator else 5))


@torch.no_grad()
def log_partition(loc_U: torch.Tensor, head: DecisionHead, chunk_size: int | None = None) -> torch.Tensor:
    """logsumexp_k loc_S_k per position [N] (float32, no gradient): the reference of relative thresholds, token
    chunk by token chunk (one [chunk × V] tile at a time; ``chunk_size`` defaults to `chunk_tokens`)."""
    chunk_size = chunk_size or chunk_tokens(head.weight.shape[0])
    dtype = torch.promote_types(head.weight.dtype, torch.float32)
    weight, bias = head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype)
    return torch.cat([torch.logsumexp(F.linear(loc_U[r0 : r0 + chunk_size].to(dtype), weight, bias), -1)
                      for r0 in range(0, len(loc_U), chunk_size)] or [loc_U.new_zeros(0, dtype=torch.float32)])
