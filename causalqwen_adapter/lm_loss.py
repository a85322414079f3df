"""The training loss of ``forward(labels=...)`` in one chunked pass: the softmax cross-entropy of loc_S and the OvR
loss (docs/design.md, Training losses), fused with the action head.

Computed apart, the two losses would take seven products of N × V × C: the cross-entropy three (logits, and its two
gradients) or four when its logits are recomputed in backward, as Liger-Kernel's fused linear cross-entropy avoids
keeping them, and the OvR loss loc_S again, scale_S and the scale gradient. Both need the same loc_S, so here one
pass computes it once. Token chunks are the outer loop, as in Liger's kernel, cut into vocabulary blocks on the CPU
(a tile that stays in cache) and whole on an accelerator (`loss_shape`):

    pass A  loc_S = W loc_U + b for the chunk, vocabulary block by block, into one [chunk × V] buffer; its logsumexp;
    pass B  block by block again: scale_S = |W| scale_U (|W| exists for one block), the OvR terms on loc_S − C
            (minus the logsumexp under relative thresholds), and ONE location gradient
            D = w·(softmax − onehot)/denom (+ the OvR's ∂ℓ/∂loc_S when it trains the locations),
            so that ∂loc_U = D W and ∂W = Dᵀ loc_U take one product each.

Five products with the OvR loss on the scale path, where lm_head + cross-entropy takes three. Where the device has
`causalqwen` operators for them (dispatch.py), pass A's logsumexp and pass B's elementwise work are one kernel each
per tile, and the products with |W| read W and take |w| as they load it (no |W| tensor). Like
`chunked_ovr_loss`, every gradient is computed in the forward and backward only rescales it. The chunk holds its
logits, so its size comes from a memory budget (`losses.chunk_tokens`), not from N: memory is flat in N.
"""

import math
from typing import NamedTuple

import torch

from .candidate_loss import candidate_ovr_loss, candidate_set
from .cauchy import check_labels, few_rows_linear, fuse_noise
from .dispatch import (
    TILE_COL_D,
    TILE_COL_T,
    TILE_D,
    TILE_OVR,
    TILE_OVR_GRADS,
    TILE_OVR_LOCATES,
    lookup_operator,
    tile_thread_count,
)
from .losses import (
    DecisionHead,
    check_head_inputs,
    kernel_target_columns,
    loss_shape,
    ovr_tile,
    saved_gradients,
    target_columns,
    zero_row_mask,
    zero_rows,
)


def chunked_lm_loss(
    loc_U: torch.Tensor,
    scale_U: torch.Tensor | None,
    head: DecisionHead,
    labels: torch.Tensor,
    *,
    softmax_weight: float = 1.0,
    ovr_trains_location: bool = False,
    relative_threshold: bool = True,
    num_items_in_batch=None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    ignore_index: int = -100,
    matmul_dtype: torch.dtype | None = None,
    candidates: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``softmax_weight`` × the cross-entropy of loc_S plus the OvR loss, without [N × V] tensors kept.

    ``loc_U``, ``scale_U``: [N, C]; ``scale_U=None`` leaves the OvR loss out (the softmax baseline). ``head``: the
    action network's tensors; ``labels``: [N] aligned with the positions, ``ignore_index`` where there is no target.
    The OvR loss is `chunked_ovr_loss`'s (training noise fusion scale_U + T·|b_noise|); its gradient reaches loc_U,
    W_A and b_A only with ``ovr_trains_location`` (otherwise the locations learn from the cross-entropy alone), and
    with ``relative_threshold`` each position's C_k is compared with log softmax(loc_S)_k (the logsumexp is a
    reference point, no gradient flows through it). Sums over targets divided by their count, or by
    ``num_items_in_batch``. ``chunk_size`` tokens per chunk and ``vocab_chunk_size`` rows per block (defaults:
    `loss_shape`) change speed and memory, not the result.

    Precision: the products with W_A run in ``matmul_dtype`` (default: W_A's dtype), as ``lm_head`` runs in the
    model's dtype or autocast's: bfloat16 products are twice as fast on CPUs with bfloat16 instructions. Everything
    else (softmax, Cauchy CDFs, sums, the gradients' accumulation across chunks) is float32 or wider, but W_A's own
    gradient when the products run in W_A's dtype: it sums in that dtype, as autograd sums a bfloat16 ``.grad``.

    Returns (loss, stats) with detached means per target: ``softmax_nll`` (−log softmax(loc_S)_y), with the OvR loss
    ``target_prob`` (P_y) and ``ovr_prob_sum`` (Σ_k P_k); and ``num_tokens``. With ``candidates`` = k, stats also
    hold ``candidate_rows``: the `candidate_loss.CandidateRows` of the positions with a target (the k tokens of largest loc_S,
    found from the pass's own logits, the target, the log-partition), for `candidate_loss.candidate_ovr_loss`.
    """
    check_head_inputs(loc_U, scale_U, head.weight, labels)
    if not (math.isfinite(softmax_weight) and softmax_weight >= 0) or (scale_U is None and softmax_weight == 0):
        raise ValueError(f"softmax_weight must be a finite number >= 0 (> 0 without the OvR loss), got {softmax_weight}")
    if chunk_size is not None and chunk_size < 1 or vocab_chunk_size is not None and vocab_chunk_size < 1:
        raise ValueError(f"chunk_size and vocab_chunk_size must be positive, got {chunk_size}, {vocab_chunk_size}")
    matmul_dtype = matmul_dtype or head.weight.dtype
    if not matmul_dtype.is_floating_point:
        raise ValueError(f"matmul_dtype must be a floating-point dtype (e.g. torch.bfloat16), got {matmul_dtype}")
    if candidates is not None and (isinstance(candidates, bool) or not isinstance(candidates, int)
                                   or not 1 <= candidates < head.weight.shape[0]):
        raise ValueError(f"candidates must be an integer in [1, {head.weight.shape[0]}), got {candidates!r}")
    options = (softmax_weight, ovr_trains_location, relative_threshold, num_items_in_batch, temperature, chunk_size,
               vocab_chunk_size, ignore_index, matmul_dtype, candidates)
    loss, *stats, top, lse = _ChunkedLMLoss.apply(loc_U, scale_U, *head, labels, options, torch.is_grad_enabled())
    names = ("softmax_nll", "target_prob", "ovr_prob_sum", "num_tokens")
    stats = {k: v for k, v in zip(names, stats) if scale_U is not None or k not in ("target_prob", "ovr_prob_sum")}
    if candidates is not None:
        labels = labels.reshape(-1)
        stats["candidate_rows"] = candidate_set(top, labels[labels != ignore_index], lse)
    return loss, stats


def training_loss(loc_U, scale_U, head: DecisionHead, targets: torch.Tensor, config, *, num_items_in_batch=None,
                  chunk_size: int | None = None, vocab_chunk_size: int | None = None,
                  matmul_dtype: torch.dtype | None = None):
    """The loss of ``forward(labels=...)`` after the abduction network, as ``config`` (a `CausalQwenConfig`) sets it,
    on positions that all have a target: the cross-entropy of loc_S and the OvR loss over the vocabulary in one
    `chunked_lm_loss` pass (the softmax objective: the same pass without the OvR term), or, with ``ovr_candidates``,
    the pass finding each position's candidates and `candidate_loss.candidate_ovr_loss` over them. Returns (loss, stats)."""
    ovr = config.objective == "ovr"
    candidates = config.ovr_candidates if ovr else None
    denom = max(len(targets), 1) if num_items_in_batch is None else num_items_in_batch
    loss, stats = torch.zeros((), device=loc_U.device), {}
    if candidates is None or config.softmax_loss_weight > 0:
        loss, stats = chunked_lm_loss(
            loc_U, scale_U if ovr and candidates is None else None, head, targets,
            softmax_weight=config.softmax_loss_weight if ovr else 1.0, ovr_trains_location=config.ovr_trains_location,
            relative_threshold=config.ovr_relative_threshold, num_items_in_batch=denom, chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size, matmul_dtype=matmul_dtype, candidates=candidates,
        )
    if candidates is not None:
        total, candidate_stats = candidate_ovr_loss(
            loc_U, scale_U, head, targets, candidates, relative_threshold=config.ovr_relative_threshold,
            trains_location=config.ovr_trains_location, matmul_dtype=matmul_dtype,
            rows=stats.pop("candidate_rows", None),
        )
        loss = loss + total / denom
        stats = {**candidate_stats, **stats}  # the fused pass's softmax_nll where it ran
    return loss, stats


def equal_chunk_size(n: int, chunk: int) -> int:
    """Tokens per chunk when ``n`` tokens are cut into as many equal chunks as ``chunk`` tokens each need (no small
    last one); 1 when there are none."""
    chunk = max(1, min(chunk, n))
    return -(-n // -(-n // chunk)) if n else 1


def logits_dtype(matmul_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype a chunk's logits are kept in: the products' when narrower than the float32 math, else the math's."""
    return matmul_dtype if matmul_dtype.itemsize < dtype.itemsize else dtype


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loc_U, scale_U, weight, bias, b_noise, threshold, labels, options, grad_enabled):
        (softmax_weight, ovr_trains_location, relative, num_items_in_batch, temperature, chunk, vblock,
         ignore_index, mm_dtype, candidates) = options
        # needs_input_grad stays True under no_grad, hence the explicit grad_enabled.
        need_loc, need_scale, need_W, need_bias, need_noise, need_thr = (
            grad_enabled and n for n in ctx.needs_input_grad[:6])
        ovr = scale_U is not None
        vocab, width = weight.shape
        dtype = torch.promote_types(weight.dtype, torch.float32)
        dev = weight.device

        labels = labels.reshape(-1)
        rows = (labels != ignore_index).nonzero().squeeze(1)
        targets = labels[rows]
        check_labels(targets, vocab)
        n_valid = rows.numel()
        # No [N × C] copy of the inputs: each chunk gathers its rows (`chunk_rows`), the scale's with the training
        # noise T·|b_noise| (float32) added
        noise_width = (fuse_noise(None, torch.zeros(width, dtype=dtype, device=dev), b_noise.to(dtype), "standard",
                                  temperature)[1] if ovr else None)
        thr = threshold.to(dtype) if torch.is_tensor(threshold) else threshold
        thr_per_token = torch.is_tensor(thr) and thr.dim() == 1
        if num_items_in_batch is None:
            denom = float(max(n_valid, 1))
        else:
            denom = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=dev)
        ce_factor = softmax_weight / denom
        # The tiles give π ∂ℓ/∂loc_S and −π ∂ℓ/∂scale_S (see `ovr_tile`): π, the sign and the reduction go here.
        ovr_factor = 1 / (math.pi * denom)

        ovr_locates = ovr and ovr_trains_location
        # The location gradient D of the module docstring; without the cross-entropy or the OvR's share it is 0.
        need_D = (need_loc or need_W or need_bias) and (softmax_weight > 0 or ovr_locates)
        ovr_grads = ovr and (need_scale or need_noise or need_thr or (ovr_locates and need_D))
        scale_path_W = ovr_locates and need_W

        # Pass B's elementwise work (and pass A's logsumexp) in one pass where an operator serves it (the
        # causalqwen::loss_tile and block_logsumexp operators, dispatch.py): the torch code makes about twenty passes
        # over each tile. Its operands and results stay in the products' dtype.
        tile_kernel = lse_kernel = abs_linear = abs_add = None
        if dtype == torch.float32 and logits_dtype(mm_dtype, dtype) == mm_dtype:
            products = torch.empty(0, dtype=mm_dtype, device=dev)
            lse_kernel = lookup_operator("block_logsumexp", products)
            tile_kernel = lookup_operator("loss_tile", products) if lse_kernel is not None else None
            if ovr and tile_kernel is not None:  # scale_S and its gradient from W itself, where both serve
                abs_linear = lookup_operator("abs_linear", products)
                abs_add = lookup_operator("abs_matmul_add", products) if abs_linear is not None else None
                abs_linear = abs_linear if abs_add is not None else None
        uses = LossUses(
            ovr=ovr, operator=tile_kernel is not None, abs_operator=abs_add is not None, loc=need_loc,
            scale=ovr and (need_scale or need_noise), W=need_W, bias=need_bias, thr=ovr and need_thr, D=need_D,
            ovr_grads=ovr_grads, scale_path_W=scale_path_W, candidates=candidates or 0,
            threads=tile_thread_count(dev) if tile_kernel is not None else 0)
        if chunk is None or vblock is None:
            shape = loss_shape(dev, n_valid, vocab, width, logits_dtype(mm_dtype, dtype).itemsize,
                               chunk_tile_bytes(mm_dtype, weight.dtype, uses, vocab, width))
            chunk, vblock = chunk or shape[0], vblock or shape[1]
        chunk, vblock = equal_chunk_size(n_valid, chunk), min(vblock, vocab)
        # Every tile-sized tensor of the loop lives in a buffer allocated once (`lm_loss_buffers` says which): a fresh
        # multi-MiB tensor per block costs its page faults each time, more than the elementwise work on it.
        buf = {name: (torch.zeros if zero else torch.empty)(shape, dtype=dt, device=dev)
               for name, (shape, dt, zero) in lm_loss_buffers(n_valid, chunk, vblock, vocab, width, weight.dtype,
                                                              mm_dtype, uses).items()}
        # loc_U's and scale_U's gradients are written in their own dtype chunk by chunk, from a [chunk × C] float32
        # (g_scale: the |W| product adds in float32, then scaled) or, with one block, product-dtype (g_loc: the one
        # product's own rounding) accumulator: no [N × C] float32 gradient
        g_loc, g_scale, g_bias, g_thr = (buf[k] if on else None for k, on in (
            ("g_loc", uses.loc and need_D), ("g_scale", uses.scale), ("g_bias", uses.bias), ("g_thr", uses.thr)))
        grad_loc = torch.zeros_like(loc_U) if need_loc else None
        grad_scale = torch.zeros_like(scale_U) if ovr and need_scale else None
        g_noise = buf["g_noise"]  # Σ_rows of the scale's gradient, unscaled, for b_noise's
        # grad_W: in W's dtype when the products run in it (a bfloat16 W sums its chunks' products in bfloat16, as
        # autograd sums a bfloat16 .grad over micro-batches: a second V × C tensor in float32 would cost more memory
        # than the logits), else float32. Written, not added to, by the first chunk when D exists (no pass to zero
        # V × C floats first).
        grad_W = buf["grad_W"] if need_W else None
        # The chunk's products are kept as they come out (bfloat16 ones in bfloat16, half the bytes: twice the
        # tokens per chunk) and read in float32, plus b_A, one block at a time.
        logits_buf = buf["logits"]
        # float32 tiles for the torch code; x_buf: a block's float32 loc_S read from narrower stored products
        # (`scores`), for the torch tiles and their candidates' top-k
        d_buf, s_buf, a_buf, t_buf, u_buf, x_buf = (buf[k] for k in ("d", "s", "a", "t", "u", "x"))
        abs_buf, w_lo, xd_lo, prod_lo = (buf[k] for k in ("abs_W", "w_lo", "xd_lo", "prod_lo"))

        def lowered(src, buf):
            """src in the products' dtype: itself, or a copy into buf."""
            return src if src.dtype == mm_dtype else buf[: src.numel()].view(src.shape).copy_(src)

        def product(out, a, b, overwrite=False):
            return _product(out, a, b, overwrite, prod_lo)

        def product_t(out, a, b, scratch):
            """out = a @ bᵀ, b a block of W_A or |W_A|: on the CPU's torch tiles in `few_rows_linear`'s layout (its
            [block × chunk] product in ``scratch``, a free tile of a's dtype), elsewhere `product`."""
            if tile_kernel is None and dev.type == "cpu" and scratch.dtype == a.dtype:
                return few_rows_linear(a, b, out=out, scratch=scratch)
            return product(out, a, b.T, overwrite=True)

        tmp_W = buf["tmp_W"] if scale_path_W else None  # one block of sign(W) ⊙ (…) for the scale path's share
        nll_sum = torch.zeros((), dtype=torch.float64, device=dev)
        ovr_sum = torch.zeros((), dtype=torch.float64, device=dev)
        u_row_sum, p_target = buf["u_row_sum"], buf["p_target"]
        row_nll, row_ovr = buf["row_nll"], buf["row_ovr"]  # the operator's per-row terms of the two sums
        blocks = [(v0, min(v0 + vblock, vocab)) for v0 in range(0, vocab, vblock)]
        # With candidates: each position's k largest loc_S (per block, then across blocks) and its log-partition.
        cand_top, cand_lse = buf["cand_top"], buf["cand_lse"]
        # `zero_rows` of each block (the tile operator's mask there), found in the first chunk
        degenerate = [None] * len(blocks)
        g_lo = buf["g_lo"]
        if tile_kernel is not None:
            tile_flags = (TILE_OVR * ovr | TILE_D * need_D | TILE_OVR_GRADS * ovr_grads
                          | TILE_OVR_LOCATES * (ovr_locates and need_D) | TILE_COL_D * (need_D and need_bias)
                          | TILE_COL_T * (g_thr is not None and ovr_grads))
            # the operator's scale_S input, in the products' dtype; its outputs d and g overwrite the logits and
            # scale_S they are computed from (each element read, then written, by one program)
            s_tile = buf["s_tile"]
            tile_threads, rows_out, col_sums = uses.threads, buf["rows_out"], buf["col_sums"]
            # b_A, added into the stored logits by pass A's logsumexp kernel (rounded to their dtype: the values
            # the top-k, the logsumexp and pass B all read), so no float32 copy of a bf16 tile is ever made
            bias_f = None if bias is None else bias.to(dtype).contiguous()
            thr_tile = (thr.contiguous() if thr_per_token else
                        torch.as_tensor(thr, dtype=dtype, device=dev).reshape(1).contiguous())
            ce_tile, of_tile = float(ce_factor) if softmax_weight > 0 else 0.0, float(ovr_factor)

        def scores(stored, v0, v1):
            """A block's float32 loc_S from its stored product: in place when it is float32 (b_A added once, in
            pass A), else into x_buf with b_A."""
            if stored.dtype == dtype:
                return stored
            x = x_buf[: stored.numel()].view_as(stored).copy_(stored)
            return x if bias is None else x.add_(bias[v0:v1])

        def tile_torch(i, v0, v1, stored, w_blk, abs_w, r, r0, r1, tgt, scale_mm):
            """Pass B on one tile with torch ops on float32 buffers: the sums and the location and scale gradients
            (x_mm, d_mm in the products' dtype, and Σ_rows d for b_A)."""
            nonlocal nll_sum, ovr_sum
            x = scores(stored, v0, v1)
            w = v1 - v0
            d, s, a, t, u = (buf[: r * w].view(r, w) for buf in (d_buf, s_buf, a_buf, t_buf, u_buf))
            col, hit, flip = target_columns(tgt, v0, w, dtype)
            nll_sum -= (x.gather(1, col).squeeze(1) * hit).sum(dtype=torch.float64)
            if need_D:
                if softmax_weight > 0:  # softmax − onehot, times w/denom
                    torch.sub(x, lse.unsqueeze(1), out=d).exp_()
                    d.scatter_add_(1, col, -hit.to(dtype).unsqueeze(1))
                    d.mul_(ce_factor)
                else:  # the OvR's share alone
                    d.zero_()
            x_mm = None
            if ovr:
                product_t(s, scale_mm, abs_w, a_buf if mm_dtype == dtype else g_lo)  # a, g_lo: free until ovr_tile
                x.sub_(thr[v0:v1] if thr_per_token else thr)  # the logits' last use: x becomes loc_S − C
                if relative:
                    x.sub_(lse.unsqueeze(1))
                neg_log, u_rows, p_y = ovr_tile(x, s, col, hit, flip, a, t, u, degenerate[i], ovr_grads)
                ovr_sum += neg_log
                u_row_sum[r0:r1] += u_rows
                p_target[r0:r1] += p_y
                if ovr_grads:  # t = π ∂ℓ/∂loc_S, x = −π ∂ℓ/∂scale_S
                    if g_thr is not None:  # ∂ℓ/∂C = −∂ℓ/∂loc_S
                        g_thr[v0:v1] -= t.sum(0)
                    x_mm = lowered(x, g_lo)
                    if ovr_locates and need_D:
                        d.add_(t.mul_(ovr_factor))
            d_mm = lowered(d, xd_lo) if need_D else None
            return x_mm, d_mm, d.sum(0) if need_D and need_bias else None

        def tile_operator(i, v0, v1, stored, w_blk, abs_w, r, r0, r1, tgt, scale_mm):
            """`tile_torch` in one pass of the loss_tile operator (products in bf16 or float32, the math float32)."""
            nonlocal nll_sum, ovr_sum
            w = v1 - v0
            s = None
            if ovr and abs_linear is not None:
                s = s_tile[: r * w].view(r, w)
                abs_linear(scale_mm, w_blk, s)
            elif ovr:
                s = torch.mm(scale_mm, abs_w.T, out=s_tile[: r * w].view(r, w))
            d = stored if need_D else None  # pass B's last read of the logits
            g = s if ovr_grads else None
            cols = col_sums[:, : tile_threads * w].view(2, tile_threads, w)  # [sum, thread, column], each contiguous
            col_d, col_t = cols[0], cols[1]
            if tile_threads == 1:  # a GPU's: the kernel adds its column sums into the gradients, nothing to zero
                col_d = g_bias[v0:v1] if tile_flags & TILE_COL_D else col_d
                col_t = g_thr[v0:v1] if tile_flags & TILE_COL_T else col_t
            elif tile_flags & (TILE_COL_D | TILE_COL_T):
                cols.zero_()
            # one block (an accelerator's): every target's column is the target itself (check_labels: in [0, V))
            cols_t = tgt if w == vocab else kernel_target_columns(tgt, v0, w)
            tile_kernel(stored, None, lse,
                        thr_tile[v0:v1] if thr_per_token else thr_tile, relative, s, cols_t,
                        degenerate[i], ce_tile, of_tile,
                        tile_flags, d, g, rows_out[: 4 * r], col_d, col_t, tile_threads)
            sums = rows_out[: 4 * r].view(4, r)
            row_nll[r0:r1] -= sums[0]  # per row, summed once after the last chunk: one launch, not two per sum
            if ovr:
                row_ovr[r0:r1] -= sums[1]
                u_row_sum[r0:r1] += sums[2]
                p_target[r0:r1] += sums[3]
            if g_thr is not None and ovr_grads and tile_threads > 1:
                g_thr[v0:v1] += cols[1].sum(0)
            return g, d, cols[0].sum(0) if need_D and need_bias and tile_threads > 1 else None

        for r0 in range(0, n_valid, chunk):
            r1 = min(r0 + chunk, n_valid)
            r, first = r1 - r0, r0 == 0
            idx, tgt = rows[r0:r1], targets[r0:r1]
            loc_mm = chunk_rows(loc_U, idx, dtype).to(mm_dtype)  # [chunk × C]: small next to the tiles
            scale_mm = torch.add(chunk_rows(scale_U, idx, dtype), noise_width).to(mm_dtype) if ovr else None
            g_loc_r = None if g_loc is None else g_loc[:r]
            g_scale_r = None if g_scale is None else g_scale[:r]
            if g_scale_r is not None and abs_add is not None:  # the operator adds
                g_scale_r.zero_()
            # Block b's logits are the contiguous [r, w] slice logits_buf[r·v0 : r·v1].
            logits = [logits_buf[r * v0 : r * v1].view(r, v1 - v0) for v0, v1 in blocks]
            block_lse = torch.empty(r, len(blocks), dtype=dtype, device=dev)
            block_top = []
            for i, ((v0, v1), stored) in enumerate(zip(blocks, logits)):  # pass A
                product_t(stored, loc_mm, lowered(weight[v0:v1], w_lo), d_buf if mm_dtype == dtype else xd_lo)
                if tile_kernel is not None:  # the stored logits keep b_A from here on
                    lse_kernel(stored, None if bias_f is None else bias_f[v0:v1], True, block_lse[:, i],
                               tile_threads)
                    if candidates:  # on the stored logits themselves, in their dtype
                        block_top.append(stored.topk(min(candidates, v1 - v0), 1))
                    continue
                if bias is not None and stored.dtype == dtype:
                    stored.add_(bias[v0:v1])
                x = scores(stored, v0, v1)
                if candidates:
                    block_top.append(x.topk(min(candidates, v1 - v0), 1))
                top = x.amax(1, keepdim=True)  # logsumexp, with d_buf for its exponentials
                exps = torch.sub(x, top, out=d_buf[: x.numel()].view_as(x)).exp_()
                block_lse[:, i] = exps.sum(1).log_().add_(top.squeeze(1))
            # one block (an accelerator's): its logsumexp is the chunk's (no logsumexp over an [r × 1] tensor)
            lse = block_lse[:, 0] if len(blocks) == 1 else torch.logsumexp(block_lse, 1)
            if tile_kernel is None:
                nll_sum += lse.sum(dtype=torch.float64)
            else:
                row_nll[r0:r1] = lse
            if candidates and len(blocks) == 1:  # one block's k largest are the chunk's
                cand_top[r0:r1] = block_top[0].indices
                cand_lse[r0:r1] = lse
            elif candidates:  # the k largest of the blocks' k largest
                values = torch.cat([t.values.float() for t in block_top], 1)
                ids = torch.cat([t.indices + v0 for t, (v0, _) in zip(block_top, blocks)], 1)
                cand_top[r0:r1] = ids.gather(1, values.topk(candidates, 1).indices)
                cand_lse[r0:r1] = lse

            for i, ((v0, v1), stored) in enumerate(zip(blocks, logits)):  # pass B
                w = v1 - v0
                w_blk = lowered(weight[v0:v1], w_lo)
                abs_w = torch.abs(w_blk, out=abs_buf[:w]) if ovr and abs_add is None else None
                if ovr and first:
                    zero = zero_rows(w_blk)
                    degenerate[i] = zero if tile_kernel is None else zero_row_mask(zero, w)
                tile = tile_operator if tile_kernel is not None else tile_torch
                x_mm, d_mm, d_cols = tile(i, v0, v1, stored, w_blk, abs_w, r, r0, r1, tgt, scale_mm)
                if ovr_grads and g_scale is not None:
                    if abs_add is not None:
                        abs_add(x_mm, w_blk, g_scale_r)
                    else:
                        product(g_scale_r, x_mm, abs_w, overwrite=i == 0)
                if ovr_grads and scale_path_W:  # ∂/∂W of |W|·scale is sign(W)·(…), with the scale path's minus sign
                    tmp = product(tmp_W[:w], x_mm.T, scale_mm, overwrite=True)
                    tmp.mul_(torch.sign(w_blk) if abs_w is None else torch.sign(w_blk, out=abs_w))  # abs_w's last use
                    tmp.mul_(-ovr_factor)
                    if first:
                        grad_W[v0:v1].copy_(tmp)
                    else:
                        grad_W[v0:v1] += tmp
                if need_D and need_loc:
                    product(g_loc_r, d_mm, w_blk, overwrite=i == 0)
                if need_D and need_W:
                    product(grad_W[v0:v1], d_mm.T, loc_mm, overwrite=first and not scale_path_W)
                if d_cols is not None:
                    g_bias[v0:v1] += d_cols
            if g_loc_r is not None:
                grad_loc.index_copy_(0, idx, g_loc_r.to(grad_loc.dtype))
            if g_scale_r is not None:
                if need_noise:
                    g_noise += g_scale_r.sum(0)
                if grad_scale is not None:
                    grad_scale.index_copy_(0, idx, g_scale_r.mul_(-ovr_factor).to(grad_scale.dtype))

        if tile_kernel is not None:
            nll_sum, ovr_sum = row_nll.sum(), row_ovr.sum()
        n_tok = max(n_valid, 1)
        loss = ((softmax_weight * nll_sum + ovr_sum) / denom).to(torch.float32)
        # Σ_k P_k = Σ_{k≠y} (1 − a_k) + P_y, where a_y = P_y: rows summed in float64.
        stats = (
            (nll_sum / n_tok).to(torch.float32),
            (p_target.sum() / n_tok).to(torch.float32),
            ((u_row_sum - 1 + 2 * p_target).sum() / n_tok).to(torch.float32),
            torch.tensor(n_valid, device=dev),
        )
        ctx.mark_non_differentiable(*stats, cand_lse)

        grad_bias = grad_noise = grad_thr = None
        if ovr and need_noise:
            grad_noise = (temperature * b_noise.to(dtype).sign() * g_noise.mul_(-ovr_factor)).to(b_noise.dtype)
        if need_bias:
            grad_bias = g_bias.to(bias.dtype)
        if g_thr is not None:
            grad_thr = g_thr.mul_(ovr_factor).sum_to_size(threshold.shape).to(threshold.dtype)
        if need_W:
            grad_W = grad_W.to(weight.dtype)
        ctx.save_for_backward(grad_loc, grad_scale, grad_W, grad_bias, grad_noise, grad_thr)
        return (loss, *stats, cand_top, cand_lse)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        return (*saved_gradients(ctx, grad_loss), None, None, None)


class LossUses(NamedTuple):
    """What one call of `_ChunkedLMLoss` computes and with what, as far as its buffers depend on it: the OvR term,
    the Triton operators (`operator`: loss_tile and block_logsumexp; `abs_operator`: the products with |W|), the
    gradients it keeps (of loc_U, scale_U or b_noise, W_A, b_A, the thresholds), the location gradient D, the OvR's
    gradients, the scale path's share of W_A's gradient, k candidates (0: none), and the operator's column-sum rows
    (`dispatch.tile_thread_count`; 0 without the operator)."""

    ovr: bool
    operator: bool
    abs_operator: bool
    loc: bool
    scale: bool
    W: bool
    bias: bool
    thr: bool
    D: bool
    ovr_grads: bool
    scale_path_W: bool
    candidates: int
    threads: int


def lm_loss_buffers(n_valid: int, chunk: int, vblock: int, vocab: int, width: int, weight_dtype: torch.dtype,
                    mm_dtype: torch.dtype, uses: LossUses) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]]:
    """Every buffer `_ChunkedLMLoss` allocates once per call, by name: (shape, dtype, zero-filled). The forward
    allocates exactly these, and `loss_plan` counts them; a buffer a call does not use has no elements."""
    dtype = torch.promote_types(weight_dtype, torch.float32)
    low = mm_dtype != dtype
    stored = logits_dtype(mm_dtype, dtype)
    op = uses.operator
    torch_tile = 0 if op else chunk * vblock
    grad_dtype = weight_dtype if weight_dtype == mm_dtype else dtype
    # prod_lo holds a product of operands in the products' dtype whose destination is wider (`_product`): the
    # location gradient [chunk × C] with several blocks, the scale path's [chunk × C] and its W share [block × C]
    # without the |W| operator, W_A's [block × C] when its gradient is wider, and the torch code's scale_S tile
    held = [chunk * width * (uses.D and uses.loc and vblock < vocab),
            vblock * width * (uses.D and uses.W and grad_dtype != mm_dtype),
            chunk * width * (uses.ovr_grads and uses.scale and not uses.abs_operator),
            vblock * width * (uses.ovr_grads and uses.scale_path_W), torch_tile * uses.ovr]
    k = uses.candidates
    return {
        # a chunk's gradients of loc_U (one block: in the products' dtype, their one product's rounding) and of the
        # scale (float32); the Σ_rows of the latter for b_noise's
        "g_loc": ((chunk * (uses.loc and uses.D), width), mm_dtype if vblock >= vocab else dtype, False),
        "g_scale": ((chunk * uses.scale, width), dtype, False),
        "g_noise": ((width * uses.scale,), dtype, True),
        "g_bias": ((vocab * uses.bias,), dtype, True),
        "g_thr": ((vocab * uses.thr,), dtype, True),
        "grad_W": ((vocab * uses.W, width), grad_dtype, not (uses.D and n_valid)),
        "logits": ((chunk * vocab if n_valid else 0,), stored, False),
        **{name: ((torch_tile,), dtype, False) for name in ("d", "s", "a", "t", "u")},
        "x": ((torch_tile,), dtype, False),
        "abs_W": ((vblock * (uses.ovr and not uses.abs_operator), width), mm_dtype, False),
        "w_lo": ((vblock * width * (weight_dtype != mm_dtype),), mm_dtype, False),
        "xd_lo": ((torch_tile * low,), mm_dtype, False),
        "prod_lo": ((max(held) * low,), mm_dtype, False),
        "g_lo": ((torch_tile * low,), mm_dtype, False),
        "tmp_W": ((vblock * uses.scale_path_W, width), dtype, False),
        "u_row_sum": ((n_valid,), torch.float64, True),
        # the operator's path: each row's −log softmax of its target (its lse, less the target's logit) and OvR term
        "row_nll": ((n_valid * op,), torch.float64, False),
        "row_ovr": ((n_valid * (op and uses.ovr),), torch.float64, True),
        "p_target": ((n_valid,), torch.float64, True),
        "cand_top": ((n_valid * bool(k), k), torch.long, False),
        "cand_lse": ((n_valid * bool(k),), torch.float32, False),
        # the operator's scale_S input (its outputs d and g overwrite the logits and scale_S); its row sums and the
        # [threads × block] column sums of D and of the thresholds' gradient
        "s_tile": ((chunk * vblock * (op and uses.ovr),), mm_dtype, False),
        "rows_out": ((4 * chunk * op,), dtype, False),
        "col_sums": ((2 * op, uses.threads * vblock), dtype, False),
    }


def buffer_bytes(buffers: dict) -> int:
    """Bytes of `lm_loss_buffers`' buffers, all together."""
    return sum(math.prod(shape) * dt.itemsize for shape, dt, _ in buffers.values())


def chunk_tile_bytes(mm_dtype: torch.dtype, weight_dtype: torch.dtype, uses: LossUses, vocab: int = 1 << 16,
                     width: int = 64) -> float:
    """Bytes per element of a [chunk × V] tile that `lm_loss_buffers` allocates per token of the chunk, all
    together (the logits, every tile and scratch; a [chunk × C] or [chunk] one counted as its share of a row of V):
    what a chunk budget divides by."""
    grow = (buffer_bytes(lm_loss_buffers(2, 2, vocab, vocab, width, weight_dtype, mm_dtype, uses))
            - buffer_bytes(lm_loss_buffers(2, 1, vocab, vocab, width, weight_dtype, mm_dtype, uses)))
    return grow / vocab


def chunk_rows(x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``idx`` of an input, a fresh tensor: rounded to ``dtype`` first where the input is wider, as the math's
    copy of it is (from a narrower input, ``dtype`` is exact and a later cast rounds as from that copy)."""
    rows = x[idx]
    return rows.to(dtype) if rows.dtype.itemsize > dtype.itemsize else rows


def _product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool, scratch: torch.Tensor):
    """out += a @ b, or out = a @ b with ``overwrite``. ``out`` is float32 (or wider); with operands of a narrower
    dtype the product runs in theirs into ``scratch`` (CPU matmuls have no float32 output for bfloat16 operands) and
    is then added."""
    if a.dtype == out.dtype:
        return torch.mm(a, b, out=out) if overwrite else out.addmm_(a, b)
    result = torch.mm(a, b, out=scratch[: out.numel()].view(out.shape))
    return out.copy_(result) if overwrite else out.add_(result)
