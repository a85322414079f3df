"""The rows' logsumexp on the GPU: `block_logsumexp_triton`, the `causalqwen::block_logsumexp` operator (pass A's
logsumexp, + b_A, optionally written back), and the partials the decode scores' log-partition merges."""

import torch

from .triton_utils import (
    _NUM_WARPS,
    _ROW_BLOCK_N,
    DTYPES,
    _add,
    _jit,
    _max,
    _on_tensors_device,
    _row_major,
    _runs_on,
    _segments,
    _to_bf16,
    available,
    tl,
)

__all__ = ["block_logsumexp_triton", "lse_partials_numel"]


# ---------------------------------------------------------------------------------------------------------------------
# Row logsumexp (pass A, and the decode scores' log-partition)
#
# Grid: rows × column segments. Each program keeps a running maximum and a sum rescaled to it per lane (one read of
# the row), and writes its segment's (max, sum) to part [segments, 2, rows]; `_lse_combine` merges them.


@_jit(do_not_specialize=["n_rows", "w", "seg", "loc_stride"])
def _lse_partial_kernel(loc_ptr, loc_stride, bias_ptr, part_ptr, n_rows, w, seg,
                        HAS_BIAS: tl.constexpr, STORE_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    base = loc_ptr + row.to(tl.int64) * loc_stride
    j_start = pid_s * seg
    j_end = tl.minimum(j_start + seg, w)
    top = tl.full([BLOCK_N], float("-inf"), tl.float32)
    total = tl.full([BLOCK_N], 0.0, tl.float32)
    for j0 in range(j_start, j_end, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        msk = cols < j_end
        x = tl.load(base + cols, mask=msk, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            x = x + tl.load(bias_ptr + cols, mask=msk, other=0.0)
            if STORE_BIAS:  # the stored (rounded) value is the one pass B reads: its exponential is summed
                if loc_ptr.dtype.element_ty == tl.bfloat16:
                    x = _to_bf16(x).to(tl.float32)
                tl.store(base + cols, x.to(loc_ptr.dtype.element_ty), mask=msk)
        new_top = tl.maximum(top, x)
        finite = new_top > float("-inf")
        total = tl.where(finite, total * tl.exp(top - new_top) + tl.exp(x - new_top), 0.0)
        top = new_top
    row_top = tl.reduce(top, 0, _max)
    row_total = tl.reduce(tl.where(top > float("-inf"), total * tl.exp(top - row_top), 0.0), 0, _add)
    out = part_ptr + pid_s * 2 * n_rows + row
    tl.store(out, row_top)
    tl.store(out + n_rows, row_total)


@_jit
def _lse_combine(part_ptr, n_seg, n_rows, row):
    """(max, log Σ exp(· − max)) of a row from its segments' partials: kept apart, as their float sum would round."""
    top = float("-inf")
    n_rows = n_rows.to(tl.int64)  # k · 2 · n_rows in int64, as the row (a program id) is
    for k in range(0, n_seg):
        top = tl.maximum(top, tl.load(part_ptr + k * 2 * n_rows + row))
    total = 0.0
    for k in range(0, n_seg):
        seg_top = tl.load(part_ptr + k * 2 * n_rows + row)
        seg_total = tl.load(part_ptr + k * 2 * n_rows + n_rows + row)
        total += tl.where(seg_top > float("-inf"), seg_total * tl.exp(seg_top - top), 0.0)
    return top, tl.log(total)


@_jit(do_not_specialize=["n_seg", "n_rows", "out_stride"])
def _lse_finish_kernel(part_ptr, n_seg, n_rows, out_ptr, out_stride):
    row = tl.program_id(0).to(tl.int64)
    top, log_total = _lse_combine(part_ptr, n_seg, n_rows, row)
    tl.store(out_ptr + row.to(tl.int64) * out_stride, top + log_total)


def lse_partials_numel(n_rows: int, n_seg: int) -> int:
    """float32 elements of the (max, sum) partials of ``n_rows`` rows over ``n_seg`` column segments."""
    return n_seg * 2 * n_rows


def _row_lse_partials(loc, bias, store_bias, segments=None):
    """(part, seg, n_seg): the rows' (max, sum) partials over column segments, [n_seg, 2, rows] float32."""
    n_rows, w = loc.shape
    seg, n_seg = _segments(w, n_rows, _ROW_BLOCK_N, loc.device, segments)
    part = torch.empty(lse_partials_numel(n_rows, n_seg), dtype=torch.float32, device=loc.device)
    _lse_partial_kernel[(n_rows, n_seg)](
        loc, loc.stride(0), part if bias is None else bias, part, n_rows, w, seg,
        HAS_BIAS=bias is not None, STORE_BIAS=bool(store_bias) and bias is not None, BLOCK_N=_ROW_BLOCK_N,
        num_warps=_NUM_WARPS,
    )
    return part, seg, n_seg


@_on_tensors_device
def block_logsumexp_triton(loc, bias, store_bias: bool, lse_out, *, segments=None):
    """`causalqwen::block_logsumexp` on the GPU: lse_out[i] = log Σ_j exp(loc[i, j] + bias[j]) over a [r, w] block
    (any width, the whole vocabulary included). ``loc``: bf16 or float32, rows of unit column stride; ``bias``: [w]
    (float32; None: none), added into ``loc`` in place (rounded to loc's dtype, and the rounded value summed) with
    ``store_bias``; ``lse_out``: float32 [r], any stride (a column of a [r, blocks] table). Two launches: the rows'
    segments, then their merge. Returns ``lse_out``, or None where the kernel does not apply."""
    if (
        loc.dim() != 2
        or loc.dtype not in DTYPES
        or not available()
        or not _runs_on(loc, bias, lse_out)
        or not _row_major(loc)
        or (bias is not None and bias.numel() != loc.shape[1])
        or lse_out.dtype != torch.float32
        or lse_out.numel() != loc.shape[0]
        or lse_out.dim() != 1
    ):
        return None
    n_rows, w = loc.shape
    if n_rows == 0:
        return lse_out
    if w == 0:
        return lse_out.fill_(float("-inf"))
    bias_f = None if bias is None else bias.detach().float().contiguous()
    part, _, n_seg = _row_lse_partials(loc, bias_f, store_bias, segments)
    _lse_finish_kernel[(n_rows,)](part, n_seg, n_rows, lse_out, lse_out.stride(0), num_warps=1)
    return lse_out
