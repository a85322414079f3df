"""Products with |W| on the GPU, the sign bits cleared as each W tile is loaded: `cauchy_linear_triton`
(`cauchy.cauchy_linear`, no gradient, in one read of W_A), `abs_linear_triton`, x @ |W|ᵀ (the loss's scale_S), and
`abs_matmul_triton`, a @ |W| (its scale gradient), without a |W| tensor."""

import torch

from .triton_utils import (
    DTYPES,
    INTERPRETED,
    _jit,
    _on_tensors_device,
    _precision,
    _row_major,
    _runs_on,
    _segments,
    _store,
    available,
    tl,
)

__all__ = ["abs_linear_triton", "abs_matmul_triton", "cauchy_linear_triton"]


# ---------------------------------------------------------------------------------------------------------------------
# Products with |W| taken as the tile is loaded


@_jit(do_not_specialize=["M"])
def _cauchy_linear_kernel(xl_ptr, xs_ptr, w_ptr, b_ptr, loc_ptr, scale_ptr, M, V, K,
                          HAS_LOC: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """loc = x_loc Wᵀ + b and scale = x_scale |W|ᵀ, [M, V], from one load of each W tile; float32 accumulation.
    Without HAS_LOC, scale alone. Row blocks are the grid's fast axis: the programs that run together share their W
    tile (read from memory once, then from L2)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1).to(tl.int64)
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
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
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


def _matmul_blocks(rows: int, precision: str, reduced: str) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_V, BLOCK_K, num_warps) of a product over ``rows`` rows reducing the ``reduced`` axis ("V" or
    "K"): 16 rows (tl.dot's least) for decoding, 64 beyond. On tensor cores (bf16, or float32 where torch allows TF32)
    64-wide blocks. IEEE float32 has no tensor-core instruction: its dot is a loop of FMAs whose operands each thread
    holds in registers along the reduced axis, so that axis is 8 wide there (16 spills on sm_90 at 64 rows, 64 at
    16: BENCHMARKS.md, Registers), with 8 warps over the 64 × 64 tiles."""
    if precision != "ieee":
        return (16, 64, 64, 4) if rows <= 16 else (64, 64, 32, 4)
    block_m, warps = (16, 4) if rows <= 16 else (64, 8)
    return (block_m, 8, 64, warps) if reduced == "V" else (block_m, 64, 8, warps)


@_on_tensors_device
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
        precision = _precision(dtype)
        bm, bv, bk, warps = _matmul_blocks(rows, precision, reduced="K")
        b = None if bias is None else bias.detach().to(dtype).contiguous()
        _cauchy_linear_kernel[(-(-rows // bm), -(-vocab // bv))](
            x_loc, x_scale, weight.detach(), loc_S if b is None else b, loc_S, scale_S, rows, vocab, size,
            HAS_LOC=True, HAS_BIAS=b is not None, PRECISION=precision, UPCAST=INTERPRETED, BLOCK_M=bm, BLOCK_V=bv,
            BLOCK_K=bk, num_warps=warps,
        )
    return loc_S.reshape(*shape[:-1], vocab), scale_S.reshape(*shape[:-1], vocab)


@_on_tensors_device
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
        precision = _precision(x.dtype)
        bm, bv, bk, warps = _matmul_blocks(rows, precision, reduced="K")
        _cauchy_linear_kernel[(-(-rows // bm), -(-vocab // bv))](
            x, x.detach(), weight.detach(), out, out, out, rows, vocab, size,
            HAS_LOC=False, HAS_BIAS=False, PRECISION=precision, UPCAST=INTERPRETED, BLOCK_M=bm, BLOCK_V=bv,
            BLOCK_K=bk, num_warps=warps,
        )
    return out


@_on_tensors_device
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
    precision = _precision(a.dtype)
    bm, bv, bk, warps = _matmul_blocks(rows, precision, reduced="V")
    grid_mk = -(-rows // bm) * -(-size // bk)
    seg_v, n_seg = _segments(vocab, grid_mk, bv, a.device, segments)
    if n_seg == 1:
        target, stride, part_stride = out, out.stride(0), 0
    else:
        target = torch.empty(n_seg, rows, size, dtype=torch.float32, device=a.device)
        stride, part_stride = size, rows * size
    _abs_matmul_kernel[(-(-rows // bm), -(-size // bk), n_seg)](
        a, a.stride(0), weight, target, stride, part_stride, rows, vocab, size, seg_v,
        ACCUMULATE=accumulate and n_seg == 1, PRECISION=precision, UPCAST=INTERPRETED,
        BLOCK_M=bm, BLOCK_V=bv, BLOCK_K=bk, num_warps=warps,
    )
    if n_seg > 1:
        total = target.sum(0)
        out.add_(total) if accumulate else out.copy_(total)
    return out
