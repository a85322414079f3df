"""The training loss's tile on the GPU: `loss_tile_triton`, the `causalqwen::loss_tile` operator (pass B of
`lm_loss.chunked_lm_loss` on one tile, and the tiles of `losses.chunked_ovr_loss`), for tiles as wide as the whole
vocabulary."""

from typing import NamedTuple

import torch

from .triton_utils import (
    _NUM_WARPS,
    DTYPES,
    INTERPRETED,
    TILE_COL_D,
    TILE_COL_T,
    TILE_D,
    TILE_OVR,
    TILE_OVR_GRADS,
    TILE_OVR_LOCATES,
    _add,
    _jit,
    _log1p_small,
    _on_tensors_device,
    _row_major,
    _runs_on,
    _segments,
    _small_angle,
    _store,
    available,
    tl,
)

__all__ = ["LossTileOut", "loss_tile_row_groups", "loss_tile_scratch_numel", "loss_tile_triton"]


# ---------------------------------------------------------------------------------------------------------------------
# The training loss's tile (causalqwen::loss_tile)
#
# Grid: (row groups) × (column segments). A program takes its group's row blocks of BLOCK_R rows one after another,
# each looping over the program's segment BLOCK_N columns at a time. With a whole-vocabulary tile (one per token
# chunk) a grid over rows alone has too few programs to fill a GPU; over row groups × segments it has several per
# multiprocessor. Nothing is added atomically, so the results do not depend on scheduling: each program owns its
# rows' partial sums of its segment (rows_part [segments, 4, r], summed after the kernel, or written straight into
# rows_out with one segment) and its columns' sums over its row group (cols [row groups, w], each (group, column)
# owned by one program: its first row block writes them and the others add, so nothing is zero-filled first; with
# one group (ADD_COLS) they add into the caller's [w] sums directly). A fixed number of row groups keeps those
# partials at a few rows of w floats whatever the chunk (`loss_tile_scratch_numel`).


@_jit(do_not_specialize=["r", "w", "seg", "group", "ce", "of", "loc_stride", "scale_stride", "d_stride", "g_stride",
                         "cd_stride", "ct_stride"])
def _loss_tile_kernel(
    loc_ptr, loc_stride, bias_ptr, lse_ptr, thr_ptr, scale_ptr, scale_stride, col_ptr, degen_ptr,
    d_ptr, d_stride, g_ptr, g_stride, rows_ptr, cd_ptr, cd_stride, ct_ptr, ct_stride,
    r, w, seg, group, ce, of,
    HAS_BIAS: tl.constexpr, THR_PER_TOKEN: tl.constexpr, RELATIVE: tl.constexpr, HAS_DEGEN: tl.constexpr,
    OVR: tl.constexpr, STORE_D: tl.constexpr, USE_CE: tl.constexpr, OVR_GRADS: tl.constexpr,
    LOCATES: tl.constexpr, COL_D: tl.constexpr, COL_T: tl.constexpr, ADD_COLS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # program ids in int64: pid_g · ct_stride (a row group's column sums) and the rows' offsets can pass 2³¹
    pid_g = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    if not THR_PER_TOKEN:
        c0 = tl.load(thr_ptr).to(tl.float32)
    if ADD_COLS:  # the caller's sums: every row block adds
        add_from = 0
    else:  # the group's own partials: its first row block writes them
        add_from = 1
    j_start = pid_s * seg
    j_end = tl.minimum(j_start + seg, w)
    for rb in range(0, group):
        rows = (pid_g * group + rb) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < r
        adds = (tl.full([BLOCK_N], 0, tl.int32) + rb) >= add_from  # a column mask (the interpreter's rb: an int)
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
        target = tl.load(col_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        if RELATIVE:
            shift = lse
        else:
            shift = tl.full([BLOCK_R], 0.0, tl.float32)
        acc_t = tl.full([BLOCK_R], 0.0, tl.float32)
        acc_log = tl.full([BLOCK_R], 0.0, tl.float32)
        acc_u = tl.full([BLOCK_R], 0.0, tl.float32)
        acc_p = tl.full([BLOCK_R], 0.0, tl.float32)
        for j0 in range(j_start, j_end, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            cmask = cols < j_end
            m = rmask[:, None] & cmask[None, :]
            hit = (cols[None, :].to(tl.int64) == target[:, None]) & m
            x = tl.load(loc_ptr + rows[:, None] * loc_stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_BIAS:
                x += tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
            acc_t += tl.reduce(tl.where(hit, x, 0.0), 1, _add)
            dv = tl.full([BLOCK_R, BLOCK_N], 0.0, tl.float32)
            if STORE_D:
                if USE_CE:  # ce·(softmax − onehot)
                    e = tl.exp(x - lse[:, None])
                    dv = (e - tl.where(hit, 1.0, 0.0)) * ce
            if OVR:
                s = tl.load(scale_ptr + rows[:, None] * scale_stride + cols[None, :], mask=m, other=1.0)
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
                    _store(g_ptr + rows[:, None] * g_stride + cols[None, :], gv, m)
                    t = tl.where(hit, -t, t)  # π ∂ℓ/∂loc_S
                    if COL_T:  # Σ_rows −π ∂ℓ/∂loc_S = π ∂ℓ/∂C
                        ct = ct_ptr + pid_g * ct_stride + cols
                        prev = tl.load(ct, mask=cmask & adds, other=0.0)
                        tl.store(ct, prev - tl.reduce(tl.where(m, t, 0.0), 0, _add), mask=cmask)
                    if LOCATES:
                        dv = dv + t * of
            if STORE_D:
                _store(d_ptr + rows[:, None] * d_stride + cols[None, :], dv, m)
                if COL_D:
                    cd = cd_ptr + pid_g * cd_stride + cols
                    prev = tl.load(cd, mask=cmask & adds, other=0.0)
                    tl.store(cd, prev + tl.reduce(tl.where(m, dv, 0.0), 0, _add), mask=cmask)
        out = rows_ptr + pid_s * 4 * r + rows
        tl.store(out, acc_t, mask=rmask)
        tl.store(out + r, acc_log, mask=rmask)
        tl.store(out + 2 * r, acc_u, mask=rmask)
        tl.store(out + 3 * r, acc_p, mask=rmask)
        if COL_D or COL_T:  # the next row block reads the column sums stored here, maybe by another thread
            tl.debug_barrier()


# loss tile: 4 rows × BLOCK_N columns over 8 warps, the same bytes per step in either dtype: bf16 4 × 256 compiles
# to at most 139 registers for sm_90 (8 × 256: 255, one block per SM), float32 4 × 128 to at most 76, where 4 × 256
# spilled in one flag set (BENCHMARKS.md, Registers); at most 16 row groups: their column partials are 16 rows of w
# floats (9.7 MB at V = 151,936) whatever the chunk
_LOSS_BLOCK_R = 4
_LOSS_BLOCK_N = dict.fromkeys(DTYPES, 32) if INTERPRETED else {torch.bfloat16: 256, torch.float32: 128}
_LOSS_ROW_GROUPS = 2 if INTERPRETED else 16


def loss_tile_row_groups(r: int) -> tuple[int, int]:
    """(row groups, row blocks per group): the programs down the rows of a tile of ``r`` rows, each taking that
    many blocks of `_LOSS_BLOCK_R` rows."""
    blocks = -(-r // _LOSS_BLOCK_R)
    per_group = max(1, -(-blocks // _LOSS_ROW_GROUPS))
    return -(-blocks // per_group), per_group


def loss_tile_scratch_numel(r: int, w: int, flags: int, n_seg: int) -> tuple[int, int, int]:
    """float32 elements of `loss_tile_triton`'s own partial sums for a [r, w] tile in ``n_seg`` column segments: the
    rows' (with several segments), and the columns' of d and of the thresholds' gradient (with several row
    groups: one row of w per group each, written by the kernel, not zero-filled)."""
    ovr_grads = bool(flags & TILE_OVR) and bool(flags & TILE_OVR_GRADS)
    groups = loss_tile_row_groups(r)[0]
    cols = w * groups * (groups > 1)
    return (n_seg * 4 * r * (n_seg > 1), cols * (bool(flags & TILE_D) and bool(flags & TILE_COL_D)),
            cols * (ovr_grads and bool(flags & TILE_COL_T)))


class LossTileOut(NamedTuple):
    """The results of `loss_tile_triton`: ``rows`` [4, r] float32 (the target's logit, Σ log a, Σ (1 − a), P_y per
    row); ``d``, ``g`` [r, w] in loc's dtype; ``col_d``, ``col_t`` [w] float32 column sums. None for what the flags
    leave out."""

    rows: torch.Tensor
    d: torch.Tensor | None
    g: torch.Tensor | None
    col_d: torch.Tensor | None
    col_t: torch.Tensor | None


@_on_tensors_device
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
    - ``d`` may be ``loc`` itself and ``g`` ``scale`` itself: each element is read, then overwritten, by one program;
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

    groups, per_group = loss_tile_row_groups(r)
    block_n = _LOSS_BLOCK_N[loc.dtype]
    seg, n_seg = _segments(w, groups, block_n, dev, segments)
    rows_numel, cd_numel, ct_numel = loss_tile_scratch_numel(r, w, flags, n_seg)
    rows_part = rows_out if n_seg == 1 else torch.empty(rows_numel, **f32)
    # one row group adds into the caller's column sums; several write one row each of a partial, summed after
    col_parts = []
    for on, out, numel in ((col_d_on, col_d, cd_numel), (col_t_on, col_t, ct_numel)):
        if not on:
            col_parts.append(None)
        elif groups == 1:
            col_parts.append(out.reshape(1, w))
        else:
            col_parts.append(torch.empty(numel, **f32).view(groups, w))
    cd, ct = col_parts
    dummy = rows_out  # any pointer for the operands a flag leaves out
    lse_t = lse.detach().reshape(-1).float().contiguous() if need_lse else dummy
    thr = thr.float().contiguous()
    _loss_tile_kernel[(groups, n_seg)](
        loc, loc.stride(0), dummy if bias is None else bias.detach().float().contiguous(), lse_t, thr,
        scale if ovr else dummy, scale.stride(0) if ovr else 0, col.contiguous(),
        dummy if degenerate is None else degenerate.contiguous().view(torch.uint8),
        d if store_d else dummy, d.stride(0) if store_d else 0, g if ovr_grads else dummy,
        g.stride(0) if ovr_grads else 0, rows_part,
        dummy if cd is None else cd, 0 if cd is None else cd.stride(0),
        dummy if ct is None else ct, 0 if ct is None else ct.stride(0),
        r, w, seg, per_group, float(ce), float(of),
        HAS_BIAS=bias is not None, THR_PER_TOKEN=thr.numel() > 1, RELATIVE=bool(relative),
        HAS_DEGEN=degenerate is not None, OVR=ovr, STORE_D=store_d, USE_CE=use_ce, OVR_GRADS=ovr_grads,
        LOCATES=ovr_grads and bool(flags & TILE_OVR_LOCATES), COL_D=col_d_on, COL_T=col_t_on, ADD_COLS=groups == 1,
        BLOCK_R=_LOSS_BLOCK_R, BLOCK_N=block_n, num_warps=_NUM_WARPS,
    )
    if n_seg > 1:
        torch.sum(rows_part.view(n_seg, 4 * r), 0, out=rows_out)
    for out, part in ((col_d, cd), (col_t, ct)):
        if part is not None and groups > 1:
            out.add_(part.sum(0).view_as(out))
    return result
