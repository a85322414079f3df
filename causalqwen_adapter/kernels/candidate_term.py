"""The OvR loss over candidates on the GPU: `candidate_term_triton`, the `causalqwen::candidate_term` operator (the
chunk loop of `candidate_loss._CandidateOvRLoss` when the locations do not train: the default loss's second part)."""

import torch

from .triton_utils import DTYPES, _add, _jit, _on_tensors_device, _runs_on, _small_angle, available, tl

__all__ = ["candidate_term_triton"]


# ---------------------------------------------------------------------------------------------------------------------
# The candidates' term (causalqwen::candidate_term)
#
# Grid: one program per position. It gathers its k + 1 rows of W_A BLOCK_C columns at a time, twice: the first sweep
# sums loc_S − C = W_A's rows · loc + shift and scale_S = |W_A's rows| · (scale + T·|b_noise|) (elementwise products
# kept per (row, column) and reduced once at the end), the second writes the scale's gradient Σ_j ∂ℓ/∂scale_S_j ·
# |W_A's row j|, BLOCK_C columns at a time. One launch for every position: no [N, k + 1, C] tensor, no chunks.


@_jit(do_not_specialize=["k1", "width", "w_stride", "loc_stride", "scale_stride", "g_stride"])
def _candidate_term_kernel(
    loc_ptr, loc_stride, scale_ptr, scale_stride, widen_ptr, w_ptr, w_stride, ids_ptr, shift_ptr, sign_ptr, mw_ptr,
    x_ptr, dthr_ptr, g_ptr, g_stride, k1, width,
    GRAD: tl.constexpr, STORE_DTHR: tl.constexpr, STORE_G: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, BLOCK_J)
    jm = js < k1
    at = row * k1 + js
    ids = tl.load(ids_ptr + at, mask=jm, other=0).to(tl.int64)
    rows = w_ptr + ids * w_stride
    loc_acc = tl.full([BLOCK_J, BLOCK_C], 0.0, tl.float32)
    scale_acc = tl.full([BLOCK_J, BLOCK_C], 0.0, tl.float32)
    for c0 in range(0, width, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        cm = cs < width
        w = tl.load(rows[:, None] + cs[None, :], mask=jm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        loc = tl.load(loc_ptr + row * loc_stride + cs, mask=cm, other=0.0).to(tl.float32)
        scale = (tl.load(scale_ptr + row * scale_stride + cs, mask=cm, other=0.0).to(tl.float32)
                 + tl.load(widen_ptr + cs, mask=cm, other=0.0))
        loc_acc += w * loc[None, :]
        scale_acc += tl.abs(w) * scale[None, :]
    loc_S = tl.reduce(loc_acc, 1, _add) + tl.load(shift_ptr + at, mask=jm, other=0.0)
    scale_S = tl.reduce(scale_acc, 1, _add)
    floored = tl.maximum(scale_S, 1.1754943508222875e-38)
    x = loc_S / floored
    tl.store(x_ptr + at, x, mask=jm)
    if GRAD:
        # ∂(−log Q(z))/∂z = 1/((1 + z²)·atan2(1, z)), z = sign·x; atan2(1, z) from its small side, digits kept
        z = x * tl.load(sign_ptr + at, mask=jm, other=1.0)
        small = _small_angle(tl.abs(z))
        angle = tl.where(z >= 0.0, small, 1.0 - small) * 3.141592653589793
        d_thr = tl.load(mw_ptr + at, mask=jm, other=0.0) / ((1.0 + z * z) * angle * floored)
        d_thr = tl.where(jm, d_thr, 0.0)
        if STORE_DTHR:
            tl.store(dthr_ptr + at, d_thr, mask=jm)
        if STORE_G:
            d_scale = tl.where(scale_S < 1.1754943508222875e-38, 0.0, d_thr * x)  # the floor passes no gradient
            for c0 in range(0, width, BLOCK_C):
                cs = c0 + tl.arange(0, BLOCK_C)
                cm = cs < width
                w = tl.load(rows[:, None] + cs[None, :], mask=jm[:, None] & cm[None, :], other=0.0).to(tl.float32)
                g = tl.reduce(tl.abs(w) * d_scale[:, None], 0, _add)
                tl.store(g_ptr + row * g_stride + cs, g, mask=cm)


# k + 1 ≤ MAX_CANDIDATES rows per position in one block (candidate_loss.KERNEL_MAX_CANDIDATES says the same); the
# column block shrinks as the row block grows, so that its two [BLOCK_J × BLOCK_C] float32 accumulators stay within
# 2,048 elements each (the registers of 4 warps, without spills at BLOCK_J = 32: BENCHMARKS.md, Registers)
MAX_CANDIDATES = 128
_TILE = 2048
_NUM_WARPS_TERM = 4


def _contiguous_rows(t: torch.Tensor, shape) -> bool:
    return t.shape == shape and t.is_contiguous()


@_on_tensors_device
def candidate_term_triton(loc, scale, widen, weight, ids, shift, sign, minus_weight, x, d_thr=None, grad_scale=None):
    """The candidates' term of every position in one launch: x [N, k + 1] (float32, written) = (W_A's rows ·
    ``loc`` + ``shift``) / max(|W_A's rows| · (``scale`` + ``widen``), tiny), for each position's rows ``ids`` [N,
    k + 1] of ``weight`` [V × C]; and, where given, ∂ℓ/∂C [N, k + 1] into ``d_thr`` and ∂ℓ/∂scale_U [N × C] into
    ``grad_scale`` (float32, written), as `candidate_loss._score_gradients` and the scale's product compute them from
    ``sign`` and ``minus_weight`` [N, k + 1]. Returns x, or None where the kernel does not apply (the caller
    runs its torch code): Triton missing, tensors on several devices or one it does not run on, W_A not bf16 or
    float32, a layout other than rows of unit stride, more than `MAX_CANDIDATES` rows per position."""
    if not available() or loc.dim() != 2 or weight.dim() != 2 or ids.dim() != 2 or ids.shape[1] > MAX_CANDIDATES:
        return None
    (n, width), k1 = loc.shape, ids.shape[1]
    pairs = (n, k1)
    if (
        weight.dtype not in DTYPES
        or loc.dtype not in DTYPES
        or scale.dtype not in DTYPES
        or weight.shape[1] != width
        or scale.shape != loc.shape
        or widen.shape != (width,)
        or widen.dtype != torch.float32
        or ids.dtype != torch.int64
        or not all(_contiguous_rows(t, pairs) for t in (ids, x))
        or not all(_contiguous_rows(t, pairs) and t.dtype == torch.float32 for t in (shift, sign, minus_weight, x))
        or (d_thr is not None and not (_contiguous_rows(d_thr, pairs) and d_thr.dtype == torch.float32))
        or (grad_scale is not None and not (grad_scale.shape == loc.shape and grad_scale.dtype == torch.float32
                                            and grad_scale.stride(1) == 1))
        or any(t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1 for t in (loc, scale, weight))
        or not widen.is_contiguous()
        or not _runs_on(loc, scale, widen, weight, ids, shift, sign, minus_weight, x, d_thr, grad_scale)
    ):
        return None
    if n == 0:
        return x
    grad = d_thr is not None or grad_scale is not None
    block_j = max(32, 1 << (k1 - 1).bit_length())
    dummy = x  # an unused pointer argument
    _candidate_term_kernel[(n,)](
        loc, loc.stride(0), scale, scale.stride(0), widen, weight, weight.stride(0), ids, shift, sign, minus_weight,
        x, dummy if d_thr is None else d_thr, dummy if grad_scale is None else grad_scale,
        0 if grad_scale is None else grad_scale.stride(0), k1, width,
        GRAD=grad, STORE_DTHR=d_thr is not None, STORE_G=grad_scale is not None,
        BLOCK_J=block_j, BLOCK_C=_TILE // block_j, num_warps=_NUM_WARPS_TERM,
    )
    return x
