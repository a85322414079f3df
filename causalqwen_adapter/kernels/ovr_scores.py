"""The OvR modes' decision scores on the GPU: `ovr_scores_triton`, `cauchy.ovr_decision_scores` for decoding (no
gradient)."""

import torch

from .logsumexp import _lse_combine, _row_lse_partials
from .triton_utils import (
    _NUM_WARPS,
    _ROW_BLOCK_N,
    DTYPES,
    _add,
    _jit,
    _log1p_small,
    _on_tensors_device,
    _runs_on,
    _segments,
    _small_angle,
    available,
    tl,
)

__all__ = ["ovr_scores_triton"]

_DISTRIBUTIONS = {"normalize": 0, "accept": 1, "accept_once": 2}  # as csrc/kernels.cpp numbers them


# ---------------------------------------------------------------------------------------------------------------------
# The OvR modes' decision scores (cauchy.ovr_decision_scores)
#
# Grid: rows × column segments, so that a decode step of one row still spreads the vocabulary over the GPU. Launches:
# the rows' (max, sum) partials when the log-partition is needed (relative thresholds, accept_once), the scores (each
# program merges its row's partials first), and for accept_once a last pass once 1 − A = Σ_j r_j (1 − P_j) is known.


@_jit(do_not_specialize=["n_rows", "V", "seg", "n_seg"])
def _scores_kernel(loc_ptr, scale_ptr, thr_ptr, part_ptr, out_ptr, rej_ptr, n_rows, V, seg, n_seg,
                   THR_PER_TOKEN: tl.constexpr, RELATIVE: tl.constexpr, DIST: tl.constexpr,
                   NEED_LSE: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    if NEED_LSE:
        top, log_total = _lse_combine(part_ptr, n_seg, n_rows, row)
    else:
        top = 0.0
        log_total = 0.0
    if not THR_PER_TOKEN:
        c0 = tl.load(thr_ptr).to(tl.float32)
    base = row.to(tl.int64) * V
    j_start = pid_s * seg
    j_end = tl.minimum(j_start + seg, V)
    rejected = tl.full([BLOCK_N], 0.0, tl.float32)
    for j0 in range(j_start, j_end, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        msk = cols < j_end
        lv = tl.load(loc_ptr + base + cols, mask=msk, other=0.0).to(tl.float32)
        sv = tl.load(scale_ptr + base + cols, mask=msk, other=1.0).to(tl.float32)
        if THR_PER_TOKEN:
            c = tl.load(thr_ptr + cols, mask=msk, other=0.0)
        else:
            c = c0
        log_r = (lv - top) - log_total
        if RELATIVE:
            x = (log_r - c) / tl.maximum(sv, 1.1754943508222875e-38)
        else:
            x = (lv - c) / tl.maximum(sv, 1.1754943508222875e-38)
        small = _small_angle(tl.abs(x))
        pos = x >= 0.0
        big = 1.0 - small
        if DIST == 2:
            p = tl.where(pos, big, small)
            q = tl.where(pos, small, big)  # 1 − P, its digits kept
            rejected += tl.where(msk, tl.exp(log_r) * q, 0.0)
            tl.store(out_ptr + base + cols, p, mask=msk)
        else:
            log_p = tl.where(pos, _log1p_small(-small), tl.log(small))
            if DIST == 1:
                log_p = lv + log_p
            tl.store(out_ptr + base + cols, log_p, mask=msk)
    if DIST == 2:
        tl.store(rej_ptr + pid_s * n_rows + row, tl.reduce(rejected, 0, _add))


@_jit(do_not_specialize=["n_rows", "V", "seg", "n_seg"])
def _accept_once_kernel(loc_ptr, part_ptr, out_ptr, rej_ptr, n_rows, V, seg, n_seg, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    top, log_total = _lse_combine(part_ptr, n_seg, n_rows, row)
    rejected = 0.0
    for k in range(0, n_seg):
        rejected += tl.load(rej_ptr + k * n_rows + row)
    base = row.to(tl.int64) * V
    j_start = pid_s * seg
    j_end = tl.minimum(j_start + seg, V)
    for j0 in range(j_start, j_end, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        msk = cols < j_end
        lv = tl.load(loc_ptr + base + cols, mask=msk, other=0.0).to(tl.float32)
        p = tl.load(out_ptr + base + cols, mask=msk, other=1.0)
        tl.store(out_ptr + base + cols, ((lv - top) - log_total) + tl.log(rejected + p), mask=msk)


@_on_tensors_device
def ovr_scores_triton(loc_S, scale_S, threshold, relative: bool, distribution: str, *, segments=None):
    """`cauchy.ovr_decision_scores` (no gradient) of bf16 or float32 loc_S, scale_S [..., V] on the GPU: float32
    scores [..., V], or None where the kernel does not apply (the caller runs the torch or compiled code).
    ``threshold``: a number, or a tensor of 1 or V values; ``distribution``: ``normalize``, ``accept`` or
    ``accept_once``. Any number of rows, with one to three launches (the log-partition's partials when relative or
    accept_once, the scores, accept_once's last pass) and no recompilation per row count."""
    if distribution not in _DISTRIBUTIONS or loc_S.dim() == 0 or loc_S.numel() == 0 or not available():
        return None
    vocab = loc_S.shape[-1]
    if not torch.is_tensor(threshold):
        threshold = torch.tensor([float(threshold)], dtype=torch.float32, device=loc_S.device)
    threshold = threshold.detach().reshape(-1)
    if (
        loc_S.dtype not in DTYPES
        or scale_S.dtype != loc_S.dtype
        or scale_S.shape != loc_S.shape
        or threshold.numel() not in (1, vocab)
        or not threshold.dtype.is_floating_point
        or not _runs_on(loc_S, scale_S, threshold)
    ):
        return None
    loc = loc_S.detach().reshape(-1, vocab).contiguous()
    scale = scale_S.detach().reshape(-1, vocab).contiguous()
    thr = threshold.float().contiguous()
    n_rows = loc.shape[0]
    dist = _DISTRIBUTIONS[distribution]
    need_lse = bool(relative) or dist == 2
    if need_lse:
        part, seg, n_seg = _row_lse_partials(loc, None, False, segments)
    else:
        seg, n_seg = _segments(vocab, n_rows, _ROW_BLOCK_N, loc.device, segments)
        part = thr
    out = torch.empty(loc.shape, dtype=torch.float32, device=loc.device)
    rejected = torch.empty(n_seg * n_rows if dist == 2 else 1, dtype=torch.float32, device=loc.device)
    grid = (n_rows, n_seg)
    _scores_kernel[grid](loc, scale, thr, part, out, rejected, n_rows, vocab, seg, n_seg,
                         THR_PER_TOKEN=thr.numel() > 1, RELATIVE=bool(relative), DIST=dist, NEED_LSE=need_lse,
                         BLOCK_N=_ROW_BLOCK_N, num_warps=_NUM_WARPS)
    if dist == 2:
        _accept_once_kernel[grid](loc, part, out, rejected, n_rows, vocab, seg, n_seg, BLOCK_N=_ROW_BLOCK_N,
                                  num_warps=_NUM_WARPS)
    return out.reshape(loc_S.shape)
