"""Triton kernels for CUDA GPUs, each with the contract of a torch or C function of this package:

- `loss_tile_triton`: the `causalqwen::loss_tile` operator (pass B of `lm_loss.chunked_lm_loss` on one tile, and the tiles of
  `losses.chunked_ovr_loss`), for tiles as wide as the whole vocabulary;
- `block_logsumexp_triton`: `causalqwen::block_logsumexp` (pass A's logsumexp, + b_A, optionally written back);
- `ovr_scores_triton`: `cauchy.ovr_decision_scores` for decoding (no gradient);
- `cauchy_linear_triton`: `cauchy.cauchy_linear` (no gradient) in one read of W_A;
- `abs_linear_triton`, x @ |W|ᵀ (the loss's scale_S), and `abs_matmul_triton`, a @ |W| (its scale gradient),
  without a |W| tensor.

cuda_kernels.py registers them as the CUDA kernels of the `causalqwen` operators (ops.py).

Float32 math throughout, with the Cauchy CDF's small side atan2(1, |x|)/π and log1p written here as series (the same
range reductions as the C decode kernels), so that a small P keeps its digits (`losses.ovr_tile`'s ``precise`` form) on
every backend; exp and log of values away from 1 are Triton's.

Each function returns None, and the caller runs its torch path, where it does not apply: Triton not installed,
tensors on a device Triton does not run on (CUDA; or the CPU when ``TRITON_INTERPRET=1`` was set before this module
was imported: the tests run the kernels that way), dtypes other than bfloat16 and float32, or shapes it does not
take. `available` says whether the Triton path can run at all.

Part of the installed package only (never shipped as remote code): it imports triton, when present.
"""

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without it: every function here then returns None
    triton = None

    class tl:  # noqa: N801 - stands in for triton.language in the kernels' annotations only
        constexpr = None

if triton is not None:
    _jit = triton.jit
else:
    def _jit(fn=None, **_):
        return fn if fn is not None else (lambda f: f)

# the dtypes of the operands the kernels read (their math is float32 whatever these are)
DTYPES = (torch.bfloat16, torch.float32)

# the flags of causalqwen::loss_tile (dispatch.TILE_*), numbered as there (repeated: this module needs nothing else of the package)
TILE_OVR, TILE_D, TILE_OVR_GRADS, TILE_OVR_LOCATES, TILE_COL_D, TILE_COL_T = 1, 2, 4, 8, 16, 32
_DISTRIBUTIONS = {"normalize": 0, "accept": 1, "accept_once": 2}  # as csrc/kernels.cpp numbers them


# ---------------------------------------------------------------------------------------------------------------------
# Elementwise functions (float32)


@_jit
def _small_angle(t):
    """atan2(1, t)/π for t ≥ 0 (+inf included), in [0, ½]: the smaller of P and 1 − P, computed directly. With
    v = min(t, 1/t) ≤ 1, atan v by its odd series to v¹⁹ after atan v = π/4 + atan((v − 1)/(v + 1)) above tan(π/8)."""
    big = t > 1.0
    v = tl.where(big, 1.0 / tl.maximum(t, 1.0), t)
    red = v > 0.414213562
    w = tl.where(red, (v - 1.0) / (v + 1.0), v)
    w2 = w * w
    p = -1.0 / 19.0
    p = p * w2 + 1.0 / 17.0
    p = p * w2 - 1.0 / 15.0
    p = p * w2 + 1.0 / 13.0
    p = p * w2 - 1.0 / 11.0
    p = p * w2 + 1.0 / 9.0
    p = p * w2 - 1.0 / 7.0
    p = p * w2 + 1.0 / 5.0
    p = p * w2 - 1.0 / 3.0
    p = p * w2 + 1.0
    a = w * p
    a = tl.where(red, a + 0.785398163, a) * 0.318309886  # atan(v)/π
    return tl.where(big, a, 0.5 - a)


@_jit
def _log1p_small(f):
    """log(1 + f) for |f| ≤ ½: 2·atanh(s), s = f/(2 + f), |s| ≤ ⅓, by its series to s¹⁷."""
    s = f / (2.0 + f)
    s2 = s * s
    p = 1.0 / 17.0
    p = p * s2 + 1.0 / 15.0
    p = p * s2 + 1.0 / 13.0
    p = p * s2 + 1.0 / 11.0
    p = p * s2 + 1.0 / 9.0
    p = p * s2 + 1.0 / 7.0
    p = p * s2 + 1.0 / 5.0
    p = p * s2 + 1.0 / 3.0
    p = p * s2 + 1.0
    return 2.0 * s * p


@_jit
def _to_bf16(x):
    """float32 → bfloat16 rounded to nearest even (NaN stays NaN), as torch rounds; written out because Triton's
    interpreter truncates in its own cast (on a GPU this is what the cast does)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bits = tl.where(x != x, 0x7FC0, bits)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@_jit
def _store(ptrs, x, mask):
    """Stores float32 ``x`` in the pointers' dtype (bf16 rounded to nearest even)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, _to_bf16(x), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


# Sums and maxima go through tl.reduce with triton.language's own combine functions (tl.sum and tl.max do the same):
# tl.sum is itself a jit function, decorated when triton.language is imported, so that a kernel of a module
# decorated later for the interpreter could not call it, while the interpreter runs tl.reduce with these combine
# functions as numpy reductions.
if triton is not None:
    _add = getattr(tl.standard, "_sum_combine", None)
    _max = getattr(tl.standard, "_elementwise_max", None)
if triton is None or _add is None or _max is None:
    @_jit
    def _add(a, b):
        return a + b

    @_jit
    def _max(a, b):
        return tl.maximum(a, b)


# ---------------------------------------------------------------------------------------------------------------------
# The training loss's tile (causalqwen::loss_tile)
#
# Grid: (row blocks of BLOCK_R rows) × (column segments), each program looping over its segment BLOCK_N columns at a
# time. With a whole-vocabulary tile (one per token chunk) a grid over rows alone has a chunk's ~200 programs, too
# few to fill a GPU; over row blocks × segments it has several per multiprocessor. Nothing is added atomically, so the
# results do not depend on scheduling: each program owns its rows' partial sums of its segment (rows_part
# [segments, 4, r], summed after the kernel, or written straight into rows_out with one segment) and its columns'
# sums over its row block (cols [row blocks, w], each (row block, column) written by one program; one row block adds
# into the caller's [w] sums directly). BLOCK_R rows per program keep those column partials at w·r/BLOCK_R floats.


@_jit(do_not_specialize=["r", "w", "seg", "ce", "of", "loc_stride", "scale_stride", "d_stride", "g_stride",
                         "cd_stride", "ct_stride"])
def _loss_tile_kernel(
    loc_ptr, loc_stride, bias_ptr, lse_ptr, thr_ptr, scale_ptr, scale_stride, col_ptr, degen_ptr,
    d_ptr, d_stride, g_ptr, g_stride, rows_ptr, cd_ptr, cd_stride, ct_ptr, ct_stride,
    r, w, seg, ce, of,
    HAS_BIAS: tl.constexpr, THR_PER_TOKEN: tl.constexpr, RELATIVE: tl.constexpr, HAS_DEGEN: tl.constexpr,
    OVR: tl.constexpr, STORE_D: tl.constexpr, USE_CE: tl.constexpr, OVR_GRADS: tl.constexpr,
    LOCATES: tl.constexpr, COL_D: tl.constexpr, COL_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < r
    rows64 = rows.to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    target = tl.load(col_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    if RELATIVE:
        shift = lse
    else:
        shift = tl.full([BLOCK_R], 0.0, tl.float32)
    if not THR_PER_TOKEN:
        c0 = tl.load(thr_ptr).to(tl.float32)
    acc_t = tl.full([BLOCK_R], 0.0, tl.float32)
    acc_log = tl.full([BLOCK_R], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_R], 0.0, tl.float32)
    acc_p = tl.full([BLOCK_R], 0.0, tl.float32)
    j_start = pid_s * seg
    j_end = tl.minimum(j_start + seg, w)
    for j0 in range(j_start, j_end, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        cmask = cols < j_end
        m = rmask[:, None] & cmask[None, :]
        hit = (cols[None, :].to(tl.int64) == target[:, None]) & m
        x = tl.load(loc_ptr + rows64[:, None] * loc_stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
        acc_t += tl.reduce(tl.where(hit, x, 0.0), 1, _add)
        dv = tl.full([BLOCK_R, BLOCK_N], 0.0, tl.float32)
        if STORE_D:
            if USE_CE:  # ce·(softmax − onehot)
                e = tl.exp(x - lse[:, None])
                dv = (e - tl.where(hit, 1.0, 0.0)) * ce
        if OVR:
            s = tl.load(scale_ptr + rows64[:, None] * scale_stride + cols[None, :], mask=m, other=1.0)
            # float32's smallest normal, 2⁻¹²⁶ in full: Triton types a literal below it float64
            s = tl.maximum(s.to(tl.float32), 1.1754943508222875e-38)
            if THR_PER_TOKEN:
                c = tl.load(thr_ptr + cols, mask=cmask, other=0.0)[None, :]
            else:
                c = c0
            z = ((x - c) - shift[:, None]) / s
            z = tl.where(hit, -z, z)  # the target's term is on the other side
            # a = atan2(1, z)/π and u = 1 − a: one is `small`, the other 1 − small, so the small one keeps its
            # digits, and log a = log1p(−small) where a is near 1
            small = _small_angle(tl.abs(z))
            pos = z >= 0.0
            big = 1.0 - small
            a = tl.where(pos, small, big)
            u = tl.where(pos, big, small)
            log_a = tl.where(pos, tl.log(small), _log1p_small(-small))
            acc_p += tl.reduce(tl.where(hit, a, 0.0), 1, _add)
            acc_u += tl.reduce(tl.where(m, u, 0.0), 1, _add)
            acc_log += tl.reduce(tl.where(m, log_a, 0.0), 1, _add)
            if OVR_GRADS:
                # π ∂ℓ/∂z = 1/(a + z·(z·a)): the product form of losses.ovr_tile (z² never overflows into inf·0)
                t = (1.0 / ((z * a) * z + a)) / s
                if HAS_DEGEN:  # zero rows of W_A: x is ±inf or a step there, its gradient 0
                    dg = tl.load(degen_ptr + cols, mask=cmask, other=0) != 0
                    t = tl.where(dg[None, :], 0.0, t)
                    z = tl.where(dg[None, :], 0.0, z)
                gv = z * t  # −π ∂ℓ/∂scale_S
                _store(g_ptr + rows64[:, None] * g_stride + cols[None, :], gv, m)
                t = tl.where(hit, -t, t)  # π ∂ℓ/∂loc_S
                if COL_T:  # Σ_rows −π ∂ℓ/∂loc_S = π ∂ℓ/∂C
                    ct = ct_ptr + pid_r * ct_stride + cols
                    tl.store(ct, tl.load(ct, mask=cmask, other=0.0) - tl.reduce(tl.where(m, t, 0.0), 0, _add), mask=cmask)
                if LOCATES:
                    dv = dv + t * of
        if STORE_D:
            _store(d_ptr + rows64[:, None] * d_stride + cols[None, :], dv, m)
            if COL_D:
                cd = cd_ptr + pid_r * cd_stride + cols
                tl.store(cd, tl.load(cd, mask=cmask, other=0.0) + tl.reduce(tl.where(m, dv, 0.0), 0, _add), mask=cmask)
    out = rows_ptr + pid_s * 4 * r + rows
    tl.store(out, acc_t, mask=rmask)
    tl.store(out + r, acc_log, mask=rmask)
    tl.store(out + 2 * r, acc_u, mask=rmask)
    tl.store(out + 3 * r, acc_p, mask=rmask)


# ---------------------------------------------------------------------------------------------------------------------
# Row logsumexp (pass A, and the decode scores' log-partition)
#
# Grid: rows × column segments. Each program keeps a running maximum and a sum rescaled to it per lane (one read of
# the row), and writes its segment's (max, sum) to part [segments, 2, rows]; `_lse_combine` merges them.


@_jit(do_not_specialize=["n_rows", "w", "seg", "loc_stride"])
def _lse_partial_kernel(loc_ptr, loc_stride, bias_ptr, part_ptr, n_rows, w, seg,
                        HAS_BIAS: tl.constexpr, STORE_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    pid_s = tl.program_id(1)
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
    row = tl.program_id(0)
    top, log_total = _lse_combine(part_ptr, n_seg, n_rows, row)
    tl.store(out_ptr + row.to(tl.int64) * out_stride, top + log_total)


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
    row = tl.program_id(0)
    pid_s = tl.program_id(1)
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
    row = tl.program_id(0)
    pid_s = tl.program_id(1)
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


# ---------------------------------------------------------------------------------------------------------------------
# Products with |W| taken as the tile is loaded


@_jit(do_not_specialize=["M"])
def _cauchy_linear_kernel(xl_ptr, xs_ptr, w_ptr, b_ptr, loc_ptr, scale_ptr, M, V, K,
                          HAS_LOC: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """loc = x_loc Wᵀ + b and scale = x_scale |W|ᵀ, [M, V], from one load of each W tile; float32 accumulation.
    Without HAS_LOC, scale alone. Row blocks are the grid's fast axis: the programs that run together share their W
    tile (read from memory once, then from L2)."""
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    vmask = offs_v < V
    rows_m = offs_m.to(tl.int64)[:, None] * K
    rows_v = offs_v.to(tl.int64)[:, None] * K
    acc_l = tl.full([BLOCK_M, BLOCK_V], 0.0, tl.float32)
    acc_s = tl.full([BLOCK_M, BLOCK_V], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        kmask = ks < K
        wt = tl.load(w_ptr + rows_v + ks[None, :], mask=vmask[:, None] & kmask[None, :], other=0.0)
        xm = mmask[:, None] & kmask[None, :]
        xs = tl.load(xs_ptr + rows_m + ks[None, :], mask=xm, other=0.0)
        if UPCAST:  # the interpreter's dot and abs read bf16 as its raw bits: float32 there (exact)
            wt = wt.to(tl.float32)
            xs = xs.to(tl.float32)
        if HAS_LOC:
            xl = tl.load(xl_ptr + rows_m + ks[None, :], mask=xm, other=0.0)
            if UPCAST:
                xl = xl.to(tl.float32)
            acc_l = tl.dot(xl, tl.trans(wt), acc_l, input_precision=PRECISION)
        acc_s = tl.dot(xs, tl.trans(tl.abs(wt)), acc_s, input_precision=PRECISION)
    out = offs_m.to(tl.int64)[:, None] * V + offs_v[None, :]
    omask = mmask[:, None] & vmask[None, :]
    if HAS_LOC:
        if HAS_BIAS:
            acc_l += tl.load(b_ptr + offs_v, mask=vmask, other=0.0).to(tl.float32)[None, :]
        _store(loc_ptr + out, acc_l, omask)
    _store(scale_ptr + out, acc_s, omask)


@_jit(do_not_specialize=["M", "a_stride", "out_stride", "seg_v", "part_stride"])
def _abs_matmul_kernel(a_ptr, a_stride, w_ptr, out_ptr, out_stride, part_stride, M, V, K, seg_v,
                       ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """a @ |W| over one segment of V (split-K: V is the long side): a [M, V], W [V, K]; the float32 [M, K] result
    added into ``out`` (ACCUMULATE) or written into the segment's slice ``out + pid_s·part_stride``."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, BLOCK_V)
    mmask = offs_m < M
    kmask = offs_k < K
    rows_m = offs_m.to(tl.int64)[:, None] * a_stride
    acc = tl.full([BLOCK_M, BLOCK_K], 0.0, tl.float32)
    v_start = pid_s * seg_v
    v_end = tl.minimum(v_start + seg_v, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        vs = v0 + offs_v
        vmask = vs < v_end
        at = tl.load(a_ptr + rows_m + vs[None, :], mask=mmask[:, None] & vmask[None, :], other=0.0)
        wt = tl.load(w_ptr + vs.to(tl.int64)[:, None] * K + offs_k[None, :], mask=vmask[:, None] & kmask[None, :],
                     other=0.0)
        if UPCAST:
            at = at.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(at, tl.abs(wt), acc, input_precision=PRECISION)
    out = out_ptr + pid_s.to(tl.int64) * part_stride + offs_m.to(tl.int64)[:, None] * out_stride + offs_k[None, :]
    omask = mmask[:, None] & kmask[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=omask, other=0.0)
    tl.store(out, acc, mask=omask)


# ---------------------------------------------------------------------------------------------------------------------
# Python side


def _interpreted() -> bool:
    """Whether the kernels above were decorated for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return triton is not None and not isinstance(_loss_tile_kernel, triton.runtime.JITFunction)


INTERPRETED = _interpreted()

# Block sizes: the GPU's, or small ones under the interpreter, whose cost is per block step and whose tests then
# cross several blocks and segments at small widths (the code paths are the same).
# loss tile: 4 × 256 with 8 warps compiles to 91 registers for sm_90 (8 × 256: 255, one block per SM)
_LOSS_BLOCK_R, _LOSS_BLOCK_N = (4, 32) if INTERPRETED else (4, 256)
_ROW_BLOCK_N = 64 if INTERPRETED else 1024
_NUM_WARPS = 8


def available() -> bool:
    """Whether the Triton path can run here: Triton installed, and a CUDA device (or the CPU interpreter)."""
    return triton is not None and (INTERPRETED or torch.cuda.is_available())


def _runs_on(*tensors) -> bool:
    """The tensors (None skipped) are on one device the kernels run on."""
    if triton is None:
        return False
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        return False
    kind = next(iter(devices)).type
    return kind in ("cpu", "cuda") if INTERPRETED else kind == "cuda"


_SM_COUNT = {}


def _target_programs(device: torch.device) -> int:
    """Programs a launch should have to fill the device: a few per multiprocessor (a handful under the
    interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return 4 * _SM_COUNT[index]


def _segments(width: int, blocks_across: int, block: int, device, segments: int | None = None) -> tuple[int, int]:
    """(segment width, segment count) splitting ``width`` columns into whole blocks so that ``blocks_across`` row
    programs × segments reach the device's target."""
    n_blocks = max(1, -(-width // block))
    if segments is None:
        segments = -(-_target_programs(device) // max(1, blocks_across))
    segments = max(1, min(segments, n_blocks, 65535))
    seg = -(-n_blocks // segments) * block
    return seg, max(1, -(-width // seg))


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's precision for float32 operands: torch's (TF32 only where torch allows it for its matmuls)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _row_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


class LossTileOut(NamedTuple):
    """The results of `loss_tile_triton`: ``rows`` [4, r] float32 (the target's logit, Σ log a, Σ (1 − a), P_y per
    row); ``d``, ``g`` [r, w] in loc's dtype; ``col_d``, ``col_t`` [w] float32 column sums. None for what the flags
    leave out."""

    rows: torch.Tensor
    d: torch.Tensor | None
    g: torch.Tensor | None
    col_d: torch.Tensor | None
    col_t: torch.Tensor | None


def loss_tile_triton(loc, bias, lse, thr, relative, scale, col, degenerate, ce, of, flags, d=None, g=None,
                     rows_out=None, col_d=None, col_t=None, *, segments=None):
    """The `causalqwen::loss_tile` operator (`ops.py`) on the GPU: one (token × vocabulary) tile of the training loss,
    any width up to the whole vocabulary. Arguments as the operator's, without ``kernel`` and ``threads``:

    - ``loc`` [r, w] bf16 or float32 (rows of unit column stride, any row stride): loc_S (= W loc_U, + b when
      ``bias`` is None) or, for `losses.chunked_ovr_loss`, loc_S − C (− offset);
    - ``bias`` [w] float32 or None: added to loc in float32 (bf16 logits stored without b_A);
    - ``lse`` [r] float32: the rows' log-partition, read with ``TILE_D`` and ce ≠ 0, or ``relative`` (may be None
      otherwise);
    - ``thr``: a number, or a float32 tensor of 1 or w thresholds; ``relative``: compare loc − lse with them;
    - ``scale`` [r, w] in loc's dtype: scale_S, read with ``TILE_OVR`` (may be None otherwise);
    - ``col`` [r] integer: the target's column in this tile, −1 where it lies outside (`losses.kernel_target_columns`);
    - ``degenerate`` [w] bool or None: the zero rows of W_A (`losses.zero_row_mask`);
    - ``ce``, ``of``: the factors of the softmax gradient and of the OvR's ∂ℓ/∂loc_S in d; ``flags``: ``TILE_*``.

    Outputs (allocated when None and the flags need them; given ones are used in place):

    - ``d`` [r, w] loc's dtype (``TILE_D``): ce·(softmax − onehot) (+ of·π ∂ℓ/∂loc_S with ``TILE_OVR_LOCATES``);
    - ``g`` [r, w] loc's dtype (``TILE_OVR_GRADS``): −π ∂ℓ/∂scale_S (0 at degenerate columns);
    - ``rows_out`` float32, [4, r] or 4·r contiguous, written: per row the target's logit (0 when outside the tile),
      Σ log a (a = 1 − P off target, P_y on it), Σ (1 − a), P_y, the last three with ``TILE_OVR`` only (else 0);
    - ``col_d`` (with both ``TILE_D`` and ``TILE_COL_D``): Σ_rows d; ``col_t`` (with ``TILE_OVR``,
      ``TILE_OVR_GRADS`` and ``TILE_COL_T``): Σ_rows −π ∂ℓ/∂loc_S (= π ∂ℓ/∂C); each float32 [w] (unit stride), ADDED
      to: zero them first (a fresh one is zeros). The operator's [threads, w] layout, summed by the caller, is one
      row here: pass ``cols[0][0]`` or a [w] tensor and read it directly.

    ``segments``: column segments per row block (default: enough programs to fill the device).
    Returns a `LossTileOut`, or None where the kernel does not apply (the caller runs its torch tile).
    """
    if loc.dim() != 2 or loc.dtype not in DTYPES or not available():
        return None
    r, w = loc.shape
    ovr = bool(flags & TILE_OVR)
    store_d = bool(flags & TILE_D)
    ovr_grads = ovr and bool(flags & TILE_OVR_GRADS)
    col_d_on = store_d and bool(flags & TILE_COL_D)
    col_t_on = ovr_grads and bool(flags & TILE_COL_T)
    use_ce = store_d and float(ce) != 0.0
    need_lse = use_ce or (ovr and relative)
    dev = loc.device
    if not torch.is_tensor(thr):
        thr = torch.tensor([float(thr)], dtype=torch.float32, device=dev)
    thr = thr.detach().reshape(-1)
    if (
        not _runs_on(loc, bias, lse if need_lse else None, thr, scale if ovr else None, col, degenerate, d, g,
                     rows_out, col_d, col_t)
        or not _row_major(loc)
        or (ovr and (scale is None or scale.shape != loc.shape or scale.dtype != loc.dtype or not _row_major(scale)))
        or (need_lse and (lse is None or lse.numel() != r))
        or col.numel() != r
        or (ovr and thr.numel() not in (1, w))
        or (bias is not None and bias.numel() != w)
        or (degenerate is not None and degenerate.numel() != w)
    ):
        return None
    for out, on in ((d, store_d), (g, ovr_grads)):
        if on and out is not None and (out.shape != loc.shape or out.dtype != loc.dtype or not _row_major(out)):
            return None
    for out, on in ((col_d, col_d_on), (col_t, col_t_on)):
        if on and out is not None and (out.numel() != w or out.dtype != torch.float32 or (w > 1 and out.stride(-1) != 1)):
            return None
    if rows_out is not None and (rows_out.numel() != 4 * r or rows_out.dtype != torch.float32
                                 or not rows_out.is_contiguous()):
        return None

    f32 = dict(dtype=torch.float32, device=dev)
    rows_out = torch.empty(4 * r, **f32) if rows_out is None else rows_out
    if store_d and d is None:
        d = torch.empty_like(loc)
    if ovr_grads and g is None:
        g = torch.empty_like(loc)
    if col_d_on and col_d is None:
        col_d = torch.zeros(w, **f32)
    if col_t_on and col_t is None:
        col_t = torch.zeros(w, **f32)
    result = LossTileOut(rows_out.view(4, r), d if store_d else None, g if ovr_grads else None,
                         col_d if col_d_on else None, col_t if col_t_on else None)
    if r == 0 or w == 0:
        rows_out.zero_()
        return result

    row_blocks = -(-r // _LOSS_BLOCK_R)
    seg, n_seg = _segments(w, row_blocks, _LOSS_BLOCK_N, dev, segments)
    rows_part = rows_out if n_seg == 1 else torch.empty(n_seg * 4 * r, **f32)
    # one row block adds into the caller's column sums; several write one row each of a partial, summed after
    col_parts = []
    for on, out in ((col_d_on, col_d), (col_t_on, col_t)):
        if not on:
            col_parts.append(None)
        elif row_blocks == 1:
            col_parts.append(out.reshape(1, w))
        else:
            col_parts.append(torch.zeros(row_blocks, w, **f32))
    cd, ct = col_parts
    dummy = rows_out  # any pointer for the operands a flag leaves out
    lse_t = lse.detach().reshape(-1).float().contiguous() if need_lse else dummy
    thr = thr.float().contiguous()
    _loss_tile_kernel[(row_blocks, n_seg)](
        loc, loc.stride(0), dummy if bias is None else bias.detach().float().contiguous(), lse_t, thr,
        scale if ovr else dummy, scale.stride(0) if ovr else 0, col.contiguous(),
        dummy if degenerate is None else degenerate.contiguous().view(torch.uint8),
        d if store_d else dummy, d.stride(0) if store_d else 0, g if ovr_grads else dummy,
        g.stride(0) if ovr_grads else 0, rows_part,
        dummy if cd is None else cd, 0 if cd is None else cd.stride(0),
        dummy if ct is None else ct, 0 if ct is None else ct.stride(0),
        r, w, seg, float(ce), float(of),
        HAS_BIAS=bias is not None, THR_PER_TOKEN=thr.numel() > 1, RELATIVE=bool(relative),
        HAS_DEGEN=degenerate is not None, OVR=ovr, STORE_D=store_d, USE_CE=use_ce, OVR_GRADS=ovr_grads,
        LOCATES=ovr_grads and bool(flags & TILE_OVR_LOCATES), COL_D=col_d_on, COL_T=col_t_on,
        BLOCK_R=_LOSS_BLOCK_R, BLOCK_N=_LOSS_BLOCK_N, num_warps=_NUM_WARPS,
    )
    if n_seg > 1:
        torch.sum(rows_part.view(n_seg, 4 * r), 0, out=rows_out)
    for out, part in ((col_d, cd), (col_t, ct)):
        if part is not None and row_blocks > 1:
            out.add_(part.sum(0).view_as(out))
    return result


def _row_lse_partials(loc, bias, store_bias, segments=None):
    """(part, seg, n_seg): the rows' (max, sum) partials over column segments, [n_seg, 2, rows] float32."""
    n_rows, w = loc.shape
    seg, n_seg = _segments(w, n_rows, _ROW_BLOCK_N, loc.device, segments)
    part = torch.empty(n_seg * 2 * n_rows, dtype=torch.float32, device=loc.device)
    _lse_partial_kernel[(n_rows, n_seg)](
        loc, loc.stride(0), part if bias is None else bias, part, n_rows, w, seg,
        HAS_BIAS=bias is not None, STORE_BIAS=bool(store_bias) and bias is not None, BLOCK_N=_ROW_BLOCK_N,
        num_warps=_NUM_WARPS,
    )
    return part, seg, n_seg


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


def _matmul_blocks(rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_V, BLOCK_K): 16 rows (tl.dot's least) for decoding, 64 beyond: two compiled variants."""
    return (16, 64, 64) if rows <= 16 else (64, 64, 32)


def cauchy_linear_triton(loc_U, scale_U, weight, bias):
    """`cauchy.cauchy_linear` (no gradient) on the GPU in one read of ``weight``: loc_S = loc_U Wᵀ + b and
    scale_S = scale_U |W|ᵀ, the sign bits cleared as each W tile is loaded, float32 accumulation, results in W's
    dtype (bf16 or float32) [..., V]. Any row count (one launch, no recompilation per count). Returns None where it
    does not apply: other dtypes, a non-contiguous W, a bias or input of another shape, autocast to another dtype."""
    if weight.dim() != 2 or weight.dtype not in DTYPES or not available() or loc_U.dim() == 0:
        return None
    if -(-weight.shape[0] // 64) > 65535:  # the grid's second axis
        return None
    vocab, size = weight.shape
    dev_type = weight.device.type
    if (
        loc_U.shape[-1] != size
        or scale_U.shape != loc_U.shape
        or not weight.is_contiguous()
        or (bias is not None and bias.numel() != vocab)
        or not (loc_U.dtype.is_floating_point and scale_U.dtype.is_floating_point)
        or not _runs_on(loc_U, scale_U, weight, bias)
        or (dev_type == "cuda" and torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") != weight.dtype)
    ):
        return None
    dtype = weight.dtype
    shape = loc_U.shape
    x_loc = loc_U.detach().reshape(-1, size).to(dtype).contiguous()
    x_scale = scale_U.detach().reshape(-1, size).to(dtype).contiguous()
    rows = x_loc.shape[0]
    loc_S = torch.empty(rows, vocab, dtype=dtype, device=weight.device)
    scale_S = torch.empty(rows, vocab, dtype=dtype, device=weight.device)
    if rows and vocab:
        bm, bv, bk = _matmul_blocks(rows)
        b = None if bias is None else bias.detach().to(dtype).contiguous()
        _cauchy_linear_kernel[(-(-rows // bm), -(-vocab // bv))](
            x_loc, x_scale, weight.detach(), loc_S if b is None else b, loc_S, scale_S, rows, vocab, size,
            HAS_LOC=True, HAS_BIAS=b is not None, PRECISION=_precision(dtype), UPCAST=INTERPRETED, BLOCK_M=bm, BLOCK_V=bv, BLOCK_K=bk, num_warps=4,
        )
    return loc_S.reshape(*shape[:-1], vocab), scale_S.reshape(*shape[:-1], vocab)


def abs_linear_triton(x, weight, out=None):
    """x @ |W|ᵀ on the GPU without a |W| tensor (the loss's scale_S = scale_U |W_A|ᵀ): ``x`` [M, K] and ``weight``
    [V, K] of one dtype (bf16 or float32), both contiguous, float32 accumulation; the result [M, V] in that dtype,
    written into ``out`` (contiguous, that dtype) when given. None where it does not apply."""
    if (
        x.dim() != 2
        or weight.dim() != 2
        or weight.dtype not in DTYPES
        or x.dtype != weight.dtype
        or x.shape[1] != weight.shape[1]
        or not (x.is_contiguous() and weight.is_contiguous())
        or -(-weight.shape[0] // 64) > 65535  # the grid's second axis
        or not available()
        or not _runs_on(x, weight, out)
        or (out is not None and (out.shape != (x.shape[0], weight.shape[0]) or out.dtype != x.dtype
                                 or not out.is_contiguous()))
    ):
        return None
    (rows, size), vocab = x.shape, weight.shape[0]
    if out is None:
        out = torch.empty(rows, vocab, dtype=x.dtype, device=x.device)
    if rows and vocab:
        bm, bv, bk = _matmul_blocks(rows)
        _cauchy_linear_kernel[(-(-rows // bm), -(-vocab // bv))](
            x, x.detach(), weight.detach(), out, out, out, rows, vocab, size,
            HAS_LOC=False, HAS_BIAS=False, PRECISION=_precision(x.dtype), UPCAST=INTERPRETED, BLOCK_M=bm, BLOCK_V=bv,
            BLOCK_K=bk, num_warps=4,
        )
    return out


def abs_matmul_triton(a, weight, out=None, *, segments=None):
    """a @ |W| on the GPU without a |W| tensor: ``a`` [M, V] and ``weight`` [V, K] of one dtype (bf16 or float32;
    a's rows of unit column stride), float32 accumulation. Returns a float32 [M, K]; with ``out`` (float32 [M, K],
    unit column stride) the product is ADDED to it and ``out`` returned (`lm_loss._product`'s out += a @ |W|).
    V, the reduced side, is split into ``segments`` (default: enough programs to fill the device) whose float32
    partial products are summed after the kernel (no atomics: the same result whatever the scheduling).
    None where it does not apply."""
    if (
        a.dim() != 2
        or weight.dim() != 2
        or weight.dtype not in DTYPES
        or a.dtype != weight.dtype
        or a.shape[1] != weight.shape[0]
        or not weight.is_contiguous()
        or not _row_major(a)
        or not available()
        or not _runs_on(a, weight, out)
        or (out is not None and (out.shape != (a.shape[0], weight.shape[1]) or out.dtype != torch.float32
                                 or not _row_major(out)))
    ):
        return None
    rows, (vocab, size) = a.shape[0], weight.shape
    accumulate = out is not None
    if out is None:
        out = torch.empty(rows, size, dtype=torch.float32, device=a.device)
    if rows == 0 or size == 0:
        return out
    if vocab == 0:
        return out if accumulate else out.zero_()
    bm, bv, bk = _matmul_blocks(rows)
    grid_mk = -(-rows // bm) * -(-size // bk)
    seg_v, n_seg = _segments(vocab, grid_mk, bv, a.device, segments)
    if n_seg == 1:
        target, stride, part_stride = out, out.stride(0), 0
    else:
        target = torch.empty(n_seg, rows, size, dtype=torch.float32, device=a.device)
        stride, part_stride = size, rows * size
    _abs_matmul_kernel[(-(-rows // bm), -(-size // bk), n_seg)](
        a, a.stride(0), weight, target, stride, part_stride, rows, vocab, size, seg_v,
        ACCUMULATE=accumulate and n_seg == 1, PRECISION=_precision(a.dtype), UPCAST=INTERPRETED,
        BLOCK_M=bm, BLOCK_V=bv, BLOCK_K=bk, num_warps=4,
    )
    if n_seg > 1:
        total = target.sum(0)
        out.add_(total) if accumulate else out.copy_(total)
    return out
