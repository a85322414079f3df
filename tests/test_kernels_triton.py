"""The Triton kernels (the Triton modules of causalqwen_adapter/kernels/) against the torch code they stand in for and float64 references.

They run on CPU tensors in Triton's interpreter (a copy of the modules decorated with TRITON_INTERPRET=1, so that the
package's own modules are left as other code imported them), with small shapes that still cross several blocks, row
blocks and column segments. On a CUDA machine, TRITON_INTERPRET=0 runs the same tests on the GPU. Without one, what
the interpreter cannot see is checked last: every kernel compiles for a Hopper GPU, and no literal is float64.
"""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")

import causalqwen_adapter  # noqa: E402
from causalqwen_adapter.cauchy import cauchy_linear, ovr_decision_scores  # noqa: E402
from causalqwen_adapter.kernels import cuda  # noqa: E402
from causalqwen_adapter.losses import ovr_tile  # noqa: E402

from conftest import decision_scores_float64  # noqa: E402

ON_GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
# the interpreter's numpy: log 0, 0·inf lanes; on a GPU the module is part of `make test-gpu` (`-m gpu`)
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), *([pytest.mark.gpu] if ON_GPU else [])]
DEVICE = "cuda" if ON_GPU else "cpu"
TINY = torch.finfo(torch.float32).tiny
KERNELS_DIR = Path(causalqwen_adapter.__file__).parent / "kernels"
TRITON_FILES = [KERNELS_DIR / f"{name}.py" for name in cuda.TRITON_MODULES]


def _package_copy(name: str, interpret: str):
    """A copy of the kernels package whose Triton modules are imported with TRITON_INTERPRET=``interpret`` (read by
    triton.jit as each kernel is decorated), so that the package's own modules are left as other code imported them:
    (the namespace of their functions, `cuda.triton_kernels`; the modules)."""
    spec = importlib.util.spec_from_file_location(f"causalqwen_adapter.{name}", KERNELS_DIR / "__init__.py",
                                                  submodule_search_locations=[str(KERNELS_DIR)])
    package = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": interpret}):
        sys.modules[spec.name] = package
        spec.loader.exec_module(package)
        kernels = cuda.triton_kernels(spec.name)
    return kernels, [sys.modules[f"{spec.name}.{module}"] for module in cuda.TRITON_MODULES]


def _load_kernels():
    if ON_GPU:
        return cuda.triton_kernels()
    kernels, _ = _package_copy("_kernels_interpreted", "1")
    assert kernels.INTERPRETED and kernels.available()
    return kernels


kt = _load_kernels()
DTYPES = [torch.bfloat16, torch.float32]
ALL_FLAGS = kt.TILE_OVR | kt.TILE_D | kt.TILE_OVR_GRADS | kt.TILE_OVR_LOCATES | kt.TILE_COL_D | kt.TILE_COL_T


def _dev(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def _cpu(t):
    return None if t is None else t.detach().cpu()


# ---------------------------------------------------------------------------------------------------------------------
# The loss tile


def tile_float64(loc, bias, lse, thr, relative, scale, col, ce, of, flags):
    """causalqwen::loss_tile's outputs from docs/design.md's formulas in float64 (no degenerate columns)."""
    x32 = loc.float() + (0 if bias is None else bias)  # float32 as the kernel adds them, then float64
    x = x32.double()
    r, w = x.shape
    hit = torch.arange(w)[None, :] == col[:, None]
    rows = torch.zeros(4, r, dtype=torch.float64)
    rows[0] = (x * hit).sum(1)
    d = torch.zeros_like(x)
    if flags & kt.TILE_D and ce:
        d = ce * ((x - lse.double()[:, None]).exp() - hit.double())
    out = {"rows": rows, "d": d, "g": None, "col_t": None}
    if flags & kt.TILE_OVR:
        # z in float32 as the kernel rounds it (x − C − lse cancels: its rounding is the input's, not the math's)
        s32 = scale.float().clamp_min(TINY)
        z = ((x32 - thr) - (lse[:, None] if relative else 0)).div(s32).double()
        s = s32.double()
        z = torch.where(hit, -z, z)
        one = torch.ones((), dtype=torch.float64)
        a, u = torch.atan2(one, z) / math.pi, torch.atan2(one, -z) / math.pi
        rows[1] = torch.where(z < 0, torch.log1p(-u), torch.log(a)).sum(1)
        rows[2] = u.sum(1)
        rows[3] = (a * hit).sum(1)
        if flags & kt.TILE_OVR_GRADS:
            t = 1 / ((1 + z * z) * a * s)  # π ∂ℓ/∂z / scale
            out["g"] = z * t
            t = torch.where(hit, -t, t)
            out["col_t"] = -t.sum(0)
            if flags & kt.TILE_OVR_LOCATES:
                d = d + of * t
    out["d"] = d
    out["col_d"] = d.sum(0)
    return out


def tile_torch(loc, bias, lse, thr, relative, scale, col, degenerate, ce, of, flags):
    """The same tile through losses.ovr_tile (``precise``), as lm_loss's tile_torch runs it, float32."""
    x = loc.float() + (0 if bias is None else bias)
    r, w = x.shape
    hit = col >= 0
    colc = col.clamp(0).unsqueeze(1)
    out = {"nll": x.gather(1, colc).squeeze(1) * hit}
    d = torch.zeros(r, w)
    if flags & kt.TILE_D and ce:
        d = (x - lse[:, None]).exp().scatter_add_(1, colc, -hit.float().unsqueeze(1)).mul_(ce)
    if flags & kt.TILE_OVR:
        xs = x - thr - (lse[:, None] if relative else 0)
        a, t, u = (torch.empty(r, w) for _ in range(3))
        zero = degenerate.nonzero().squeeze(1) if degenerate is not None else torch.zeros(0, dtype=torch.long)
        flip = torch.where(hit, -1.0, 1.0).unsqueeze(1)
        out["neg_log"], out["u_rows"], out["p_y"] = ovr_tile(xs, scale.float().clone(), colc, hit, flip, a, t, u,
                                                             zero, True, precise=True)
        out["g"], out["col_t"] = xs, -t.sum(0)
        if flags & kt.TILE_OVR_LOCATES:
            d = d + of * t
    out["d"], out["col_d"] = d, d.sum(0)
    return out


def _tile_inputs(dtype, r, w, relative, per_token, seed, targets_outside=True):
    gen = torch.Generator().manual_seed(seed)
    loc = (torch.randn(r, w, generator=gen) * 3).to(dtype)
    scale = (torch.rand(r, w, generator=gen) + 0.05).to(dtype)
    bias = torch.randn(w, generator=gen) if dtype == torch.bfloat16 else None  # bf16 logits are stored without b_A
    x = loc.float() + (0 if bias is None else bias)
    lse = torch.logsumexp(x, 1)
    shift = -5.0 if relative else 0.0
    thr = torch.randn(w, generator=gen) + shift if per_token else torch.tensor([shift + 0.5])
    col = torch.randint(0, w, (r,), generator=gen)
    if targets_outside:
        col[::3] = -1  # the target in another tile
    return loc, bias, lse, thr, scale, col


def _run_tile(loc, bias, lse, thr, relative, scale, col, degenerate, ce, of, flags, **kwargs):
    args = _dev(loc, bias, lse, thr, scale, col, degenerate)
    out = kt.loss_tile_triton(args[0], args[1], args[2], args[3], relative, args[4], args[5], args[6], ce, of, flags,
                              **kwargs)
    assert out is not None
    return out


def _close(got, want, dtype, rtol=1e-5, atol=1e-5):
    """Within float32's rounding, or one bf16 rounding for outputs stored in bf16."""
    if dtype == torch.bfloat16:
        rtol = max(rtol, 2**-8)
    torch.testing.assert_close(_cpu(got).double(), want.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("per_token", [True, False])
def test_loss_tile_matches_references(dtype, relative, per_token):
    """All flags (lm_loss's pass B with the OvR loss training the locations and learnable thresholds): 9 rows (three
    row blocks, the last partial), 203 columns (not a multiple of the block), three column segments, targets inside
    and outside the tile; against float64 and against losses.ovr_tile."""
    r, w = 9, 203
    loc, bias, lse, thr, scale, col = _tile_inputs(dtype, r, w, relative, per_token, seed=r * w + relative)
    ce, of = 0.25, 0.125
    out = _run_tile(loc, bias, lse, thr, relative, scale, col, None, ce, of, ALL_FLAGS, segments=3)
    assert out.d.dtype == out.g.dtype == dtype and out.rows.shape == (4, r)
    ref = tile_float64(loc, bias, lse, thr, relative, scale, col, ce, of, ALL_FLAGS)
    torch.testing.assert_close(_cpu(out.rows).double(), ref["rows"], rtol=1e-5, atol=1e-4)
    _close(out.d, ref["d"], dtype)
    _close(out.g, ref["g"], dtype)
    _close(out.col_d, ref["col_d"], torch.float32, atol=1e-4)
    _close(out.col_t, ref["col_t"], torch.float32, atol=1e-4)

    torch_ref = tile_torch(loc, bias, lse, thr, relative, scale, col, None, ce, of, ALL_FLAGS)
    rows = _cpu(out.rows)
    torch.testing.assert_close(rows[0], torch_ref["nll"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(-rows[1].double().sum(), torch_ref["neg_log"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(rows[2].double(), torch_ref["u_rows"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(rows[3], torch_ref["p_y"], rtol=1e-5, atol=1e-6)
    _close(out.g, torch_ref["g"], dtype)
    _close(out.d, torch_ref["d"], dtype)


def test_loss_tile_adds_into_given_buffers_and_segments_do_not_change_it():
    """Given outputs are written in place (column sums added to), and one segment looping over the whole width gives
    what several do."""
    r, w = 5, 150
    loc, bias, lse, thr, scale, col = _tile_inputs(torch.float32, r, w, True, True, seed=7)
    base = torch.arange(w, dtype=torch.float32)
    d, g, rows, col_d, col_t = _dev(torch.empty(r, w), torch.empty(r, w), torch.empty(4 * r), base.clone(),
                                    base.clone())
    one = _run_tile(loc, bias, lse, thr, True, scale, col, None, 1.0, 0.5, ALL_FLAGS, d=d, g=g, rows_out=rows,
                    col_d=col_d, col_t=col_t, segments=1)
    assert one.d is d and one.g is g and one.col_d is col_d and one.rows.data_ptr() == rows.data_ptr()
    many = _run_tile(loc, bias, lse, thr, True, scale, col, None, 1.0, 0.5, ALL_FLAGS, segments=4)
    torch.testing.assert_close(_cpu(one.rows), _cpu(many.rows), rtol=1e-6, atol=1e-5)
    for name in ("d", "g"):
        torch.testing.assert_close(_cpu(getattr(one, name)), _cpu(getattr(many, name)), rtol=0, atol=0)
    torch.testing.assert_close(_cpu(col_d) - base, _cpu(many.col_d), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_cpu(col_t) - base, _cpu(many.col_t), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_tile_flag_subsets(dtype):
    """The softmax baseline (no OvR: scale unread, rows 1-3 zero), the OvR loss alone of chunked_ovr_loss (ce = 0,
    of = 1, threshold 0 absolute: d = π ∂ℓ/∂loc_S, no lse), and the OvR terms without gradients."""
    r, w = 6, 97
    loc, bias, lse, thr, scale, col = _tile_inputs(dtype, r, w, False, False, seed=3)
    flags = kt.TILE_D | kt.TILE_COL_D
    out = _run_tile(loc, bias, lse, thr, False, None, col, None, 0.5, 0.0, flags)
    ref = tile_float64(loc, bias, lse, thr, False, scale, col, 0.5, 0.0, flags)
    assert out.g is None and out.col_t is None
    torch.testing.assert_close(_cpu(out.rows).double(), ref["rows"], rtol=1e-5, atol=1e-5)
    assert (_cpu(out.rows)[1:] == 0).all()
    _close(out.d, ref["d"], dtype)

    flags = kt.TILE_OVR | kt.TILE_D | kt.TILE_OVR_GRADS | kt.TILE_OVR_LOCATES | kt.TILE_COL_D
    zero = torch.zeros(1)
    out = _run_tile(loc, None, None, zero, False, scale, col, None, 0.0, 1.0, flags)
    ref = tile_float64(loc, None, lse, zero, False, scale, col, 0.0, 1.0, flags)
    torch.testing.assert_close(_cpu(out.rows).double(), ref["rows"], rtol=1e-5, atol=1e-4)
    _close(out.d, ref["d"], dtype)
    _close(out.g, ref["g"], dtype)
    _close(out.col_d, ref["col_d"], torch.float32, atol=1e-4)

    out = _run_tile(loc, bias, lse, thr, True, scale, col, None, 0.0, 0.0, kt.TILE_OVR)
    ref = tile_float64(loc, bias, lse, thr, True, scale, col, 0.0, 0.0, kt.TILE_OVR)
    assert out.d is None and out.g is None and out.col_d is None
    torch.testing.assert_close(_cpu(out.rows).double(), ref["rows"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_tile_keeps_the_digits_of_small_p(dtype):
    """|z| up to 10⁶ (P ≈ 3·10⁻⁷, under float32's ulp at 1): P_y, Σ (1 − a) and Σ log a of rows far below their
    thresholds, and the gradients there, within float32's rounding of float64 (1 − P in float32 would lose them)."""
    gaps = torch.tensor([1e6, -1e6, 3e5, -3e5, 1e3, -1e3, 50.0, -50.0, 1.0, -1.0, 0.0])
    w = len(gaps)
    below = -gaps.abs() - 1e3  # every token far below its threshold: Σ log a is a sum of tiny terms
    loc = torch.stack([gaps, below, -gaps]).to(dtype)
    scale = torch.ones(3, w, dtype=dtype)
    col = torch.tensor([1, 0, 3])  # targets at z = +1e6 (P_y tiny), z = +2e6 (row 2), z = −3e5 ... (row 3)
    zero = torch.zeros(1)
    flags = kt.TILE_OVR | kt.TILE_D | kt.TILE_OVR_GRADS | kt.TILE_OVR_LOCATES | kt.TILE_COL_T
    lse = torch.zeros(3)
    out = _run_tile(loc, None, lse, zero, False, scale, col, None, 0.0, 1.0, flags)
    ref = tile_float64(loc, None, lse, zero, False, scale, col, 0.0, 1.0, flags)
    rows = _cpu(out.rows).double()
    torch.testing.assert_close(rows[1:], ref["rows"][1:], rtol=2e-6, atol=0.0)
    assert 3e-7 < rows[3, 0] < 3.3e-7 and rows[2, 1] > 0 and rows[1, 1] < 0
    _close(out.g, ref["g"], dtype, rtol=2e-6, atol=0.0)
    _close(out.d, ref["d"], dtype, rtol=2e-6, atol=0.0)


def test_loss_tile_degenerate_columns():
    """Zero rows of W_A (scale 0, floored at the smallest normal): a token at its threshold (P = ½) or below it
    (z = −inf), their gradients 0, nothing NaN; the same numbers as losses.ovr_tile."""
    r, w = 4, 40
    loc, bias, lse, thr, scale, col = _tile_inputs(torch.float32, r, w, False, False, seed=11)
    thr = torch.tensor([0.25])
    degenerate = torch.zeros(w, dtype=torch.bool)
    degenerate[[3, 17, 30]] = True
    scale[:, degenerate] = 0.0
    loc[:, 3] = 0.25  # at the threshold
    loc[:, 17] = -4.0  # below: z = −inf
    loc[:, 30] = -0.5  # below, z finite but huge
    col[0], col[1] = 3, 17  # a degenerate target
    out = _run_tile(loc, None, lse, thr, False, scale, col, degenerate, 0.3, 0.2, ALL_FLAGS)
    ref = tile_torch(loc, None, lse, thr, False, scale, col, degenerate, 0.3, 0.2, ALL_FLAGS)
    for t in (out.rows, out.d, out.g, out.col_d, out.col_t):
        assert not _cpu(t).isnan().any()
    assert (_cpu(out.g)[:, degenerate] == 0).all() and (_cpu(out.col_t)[degenerate] == 0).all()
    rows = _cpu(out.rows)
    torch.testing.assert_close(-rows[1].double().sum(), ref["neg_log"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(rows[2].double(), ref["u_rows"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows[3], ref["p_y"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_cpu(out.g), ref["g"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_cpu(out.d), ref["d"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_cpu(out.col_t), ref["col_t"], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# Pass A's logsumexp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("store_bias", [True, False])
def test_block_logsumexp(dtype, store_bias):
    """Per-row logsumexp (+ b) into a strided column, b written back (rounded) with store_bias; one segment or
    several, a width that is not a multiple of the block, a row of −inf but one entry."""
    r, w = 5, 203
    gen = torch.Generator().manual_seed(5)
    loc = (torch.randn(r, w, generator=gen) * 4).to(dtype)
    loc[2, 1:] = float("-inf")
    bias = torch.randn(w, generator=gen)
    for b in (bias, None):
        for segments in (1, None):
            table = torch.zeros(r, 3, device=DEVICE)
            block = loc.clone().to(DEVICE)
            assert kt.block_logsumexp_triton(block, _dev(b)[0], store_bias, table[:, 1], segments=segments) is not None
            summed = loc.float() + (0 if b is None else b)
            if store_bias and b is not None:
                summed = summed.to(dtype)
                assert torch.equal(_cpu(block), summed)
            else:
                assert torch.equal(_cpu(block), loc)
            want = torch.logsumexp(summed.double(), 1)
            torch.testing.assert_close(_cpu(table[:, 1]).double(), want, rtol=1e-6, atol=1e-5)
            assert (_cpu(table)[:, [0, 2]] == 0).all()


# ---------------------------------------------------------------------------------------------------------------------
# Decode scores


SCORE_DISTRIBUTIONS = ["accept_once", "accept", "normalize"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("distribution", SCORE_DISTRIBUTIONS)
@pytest.mark.parametrize("relative", [True, False])
def test_scores_match_references(dtype, distribution, relative):
    """cauchy.ovr_decision_scores: within float32's rounding of float64, and of the torch code, for one threshold or
    one per token, 1 row and [2, 3] rows, a vocabulary that is not a multiple of the block."""
    vocab = 203
    for shape in ((1, vocab), (2, 3, vocab)):
        gen = torch.Generator().manual_seed(len(shape) + vocab)
        loc_S = (torch.randn(shape, generator=gen) * 3).to(dtype)
        scale_S = (torch.rand(shape, generator=gen) + 0.05).to(dtype)
        shift = -8.0 if relative else 0.0
        for threshold in (torch.tensor(shift + 0.5), torch.randn(vocab, generator=gen) + shift):
            got = kt.ovr_scores_triton(*_dev(loc_S, scale_S, threshold), relative, distribution)
            assert got.dtype == torch.float32 and got.shape == shape
            want = decision_scores_float64(loc_S, scale_S, threshold, relative, distribution)
            torch.testing.assert_close(_cpu(got).double(), want, rtol=1e-5, atol=1e-5)
            torch_code = ovr_decision_scores(loc_S, scale_S, threshold, relative, distribution)
            torch.testing.assert_close(_cpu(got), torch_code, rtol=1e-5, atol=1e-5)
    # a plain number as the threshold, and one segment per row
    got = kt.ovr_scores_triton(*_dev(loc_S, scale_S), shift + 0.5, relative, distribution, segments=1)
    want = decision_scores_float64(loc_S, scale_S, torch.tensor(shift + 0.5), relative, distribution)
    torch.testing.assert_close(_cpu(got).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("distribution", SCORE_DISTRIBUTIONS)
def test_scores_in_the_tails(distribution):
    """|x| up to 10³⁰ (a P of 10⁻³¹ keeps its digits) and zero scales (x ±inf, P exactly 0 or 1): float64's numbers
    where the scale is positive, the torch code's (−inf included) where it is 0, never NaN."""
    gaps = torch.tensor([0.0, 1e-3, -1e-3, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 1e3, -1e3, 1e6, -1e6])
    scales = torch.tensor([1.0, 1e-3, 1e-24, 0.0])
    loc_S = gaps.repeat(len(scales)) + 7.0
    scale_S = scales.repeat_interleave(len(gaps))
    threshold = torch.tensor(7.0)
    got = _cpu(kt.ovr_scores_triton(*_dev(loc_S, scale_S, threshold), False, distribution)).double()
    assert not got.isnan().any()
    want = decision_scores_float64(loc_S, scale_S, threshold, False, distribution)
    positive = scale_S > 0
    torch.testing.assert_close(got[positive], want[positive], rtol=1e-5, atol=1e-5)
    torch_code = ovr_decision_scores(loc_S, scale_S, threshold, False, distribution).double()
    torch.testing.assert_close(got[~positive], torch_code[~positive], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Products


def _linear_inputs(dtype, rows, vocab, size, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, size, generator=gen)
    weight[[3, vocab - 1]] = 0.0  # zero rows (padding embeddings): scale_S exactly 0
    bias = torch.randn(vocab, generator=gen)
    loc_U = torch.randn(rows, size, generator=gen)
    scale_U = torch.rand(rows, size, generator=gen)
    return weight.to(dtype), bias.to(dtype), loc_U.to(dtype), scale_U.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 17])  # the decode blocks (16 rows), then the wider ones
def test_cauchy_linear(dtype, rows):
    """loc_S = W x + b and scale_S = |W| s in W's dtype: float64 within one rounding, and cauchy.cauchy_linear."""
    vocab, size = 70, 40  # neither a multiple of the blocks
    weight, bias, loc_U, scale_U = _linear_inputs(dtype, rows, vocab, size, seed=rows)
    rel, absolute = (2**-8, 1e-3) if dtype == torch.bfloat16 else (1e-5, 1e-4)
    for b in (bias, None):
        got = kt.cauchy_linear_triton(*_dev(loc_U.unsqueeze(1), scale_U.unsqueeze(1), weight, b))
        assert got is not None
        loc_S, scale_S = (_cpu(t) for t in got)
        assert loc_S.dtype == scale_S.dtype == dtype and loc_S.shape == (rows, 1, vocab)
        w64 = weight.double()
        want_loc = loc_U.double() @ w64.T + (0 if b is None else b.double())
        want_scale = scale_U.double() @ w64.abs().T
        torch.testing.assert_close(loc_S.squeeze(1).double(), want_loc, rtol=rel, atol=absolute)
        torch.testing.assert_close(scale_S.squeeze(1).double(), want_scale, rtol=rel, atol=absolute)
        assert (scale_S[..., [3, vocab - 1]] == 0).all()
        torch_loc, torch_scale = cauchy_linear(loc_U.float(), scale_U.float(), weight.float(),
                                               None if b is None else b.float())
        torch.testing.assert_close(loc_S.squeeze(1).float(), torch_loc, rtol=rel, atol=absolute)
        torch.testing.assert_close(scale_S.squeeze(1).float(), torch_scale, rtol=rel, atol=absolute)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [3, 20])  # the decode tiles and the training ones
def test_abs_linear(dtype, rows):
    """x @ |W|ᵀ in W's dtype, returned or written into ``out``, within one rounding of float64; declined for mixed
    dtypes."""
    vocab, size = 70, 40
    weight, _, _, scale_U = _linear_inputs(dtype, rows, vocab, size, seed=rows)
    rel, absolute = (2**-8, 1e-3) if dtype == torch.bfloat16 else (1e-5, 1e-4)
    want = scale_U.double() @ weight.double().abs().T
    got = kt.abs_linear_triton(*_dev(scale_U, weight))
    assert got.dtype == dtype and got.shape == (rows, vocab)
    torch.testing.assert_close(_cpu(got).double(), want, rtol=rel, atol=absolute)
    out = torch.full((rows, vocab), 7.0, dtype=dtype, device=DEVICE)
    assert kt.abs_linear_triton(*_dev(scale_U, weight), out=out) is out
    torch.testing.assert_close(_cpu(out).double(), want, rtol=rel, atol=absolute)
    assert kt.abs_linear_triton(*_dev(scale_U.double(), weight)) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_abs_matmul(dtype):
    """a @ |W| in float32, returned or added into ``out`` (a strided view), V in one segment or split in three."""
    rows, vocab, size = 7, 150, 40
    weight, _, _, _ = _linear_inputs(dtype, rows, vocab, size, seed=1)
    a = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = a.double() @ weight.double().abs()
    for segments in (1, 3):
        got = kt.abs_matmul_triton(*_dev(a, weight), segments=segments)
        assert got.dtype == torch.float32 and got.shape == (rows, size)
        torch.testing.assert_close(_cpu(got).double(), want, rtol=1e-5, atol=1e-4)
        table = torch.ones(rows, size + 5, device=DEVICE)
        out = table[:, 2 : 2 + size]
        assert kt.abs_matmul_triton(*_dev(a, weight), out=out, segments=segments) is out
        torch.testing.assert_close(_cpu(out).double(), want + 1, rtol=1e-5, atol=1e-4)
        assert (_cpu(table)[:, :2] == 1).all() and (_cpu(table)[:, 2 + size :] == 1).all()


# ---------------------------------------------------------------------------------------------------------------------
# What the kernels decline


def test_functions_decline_what_they_do_not_compute():
    """None (the caller's torch path runs) for float16 and integer operands, meta tensors, mismatched shapes."""
    r, w = 3, 40
    loc, bias, lse, thr, scale, col = _dev(*_tile_inputs(torch.float32, r, w, False, False, seed=0))
    args = (lse, thr, False, scale, col, None, 1.0, 0.0, ALL_FLAGS)
    assert kt.loss_tile_triton(loc, None, *args) is not None
    assert kt.loss_tile_triton(loc.half(), None, *args) is None
    assert kt.loss_tile_triton(loc.int(), None, *args) is None
    assert kt.loss_tile_triton(loc.to("meta"), None, *args) is None
    assert kt.loss_tile_triton(loc, None, lse, thr, False, scale[:, :-1], col, None, 1.0, 0.0, ALL_FLAGS) is None
    assert kt.loss_tile_triton(loc, None, lse, torch.zeros(3, device=DEVICE), False, scale, col, None, 1.0, 0.0,
                               ALL_FLAGS) is None
    assert kt.loss_tile_triton(loc, None, lse, thr, False, scale.bfloat16(), col, None, 1.0, 0.0, ALL_FLAGS) is None

    lse_out = torch.empty(r, device=DEVICE)
    assert kt.block_logsumexp_triton(loc.half(), None, False, lse_out) is None
    assert kt.block_logsumexp_triton(loc, None, False, lse_out.double()) is None
    assert kt.block_logsumexp_triton(loc.to("meta"), None, False, lse_out.to("meta")) is None

    threshold = torch.tensor(0.5, device=DEVICE)
    assert kt.ovr_scores_triton(loc, scale, threshold, True, "accept_once") is not None
    assert kt.ovr_scores_triton(loc.half(), scale.half(), threshold, True, "accept_once") is None
    assert kt.ovr_scores_triton(loc, scale.bfloat16(), threshold, True, "accept_once") is None
    assert kt.ovr_scores_triton(loc, scale[:1], threshold, True, "accept_once") is None
    assert kt.ovr_scores_triton(loc, scale, torch.zeros(3, device=DEVICE), True, "accept_once") is None
    assert kt.ovr_scores_triton(loc, scale, threshold, True, "no-such-distribution") is None
    assert kt.ovr_scores_triton(loc[:0], scale[:0], threshold, True, "accept_once") is None
    assert kt.ovr_scores_triton(loc.to("meta"), scale.to("meta"), threshold.to("meta"), True, "accept") is None

    weight = torch.randn(50, w, device=DEVICE)
    assert kt.cauchy_linear_triton(loc, scale, weight.half(), None) is None
    assert kt.cauchy_linear_triton(loc, scale, weight.T.contiguous().T, None) is None
    assert kt.cauchy_linear_triton(loc.to("meta"), scale.to("meta"), weight.to("meta"), None) is None
    assert kt.cauchy_linear_triton(loc.int(), scale.int(), weight, None) is None
    a = torch.randn(r, 50, device=DEVICE)
    assert kt.abs_matmul_triton(a, weight) is not None
    assert kt.abs_matmul_triton(a.bfloat16(), weight) is None
    assert kt.abs_matmul_triton(a.half(), weight.half()) is None


def test_module_imports_without_triton():
    """Without Triton the modules import (on their own: torch is all they need), report themselves unavailable, and
    every function returns None."""
    code = (
        "import importlib, importlib.util, sys; sys.modules['triton'] = None\n"
        "import torch\n"
        f"spec = importlib.util.spec_from_file_location('kernels', {str(KERNELS_DIR / '__init__.py')!r},"
        f" submodule_search_locations=[{str(KERNELS_DIR)!r}])\n"
        "sys.modules['kernels'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(sys.modules['kernels'])\n"
        "k = importlib.import_module('kernels.cuda').triton_kernels('kernels')\n"
        "x = torch.ones(2, 8)\n"
        "assert not k.available() and not k.INTERPRETED\n"
        "assert k.ovr_scores_triton(x, x, 0.0, False, 'normalize') is None\n"
        "assert k.cauchy_linear_triton(x, x, torch.ones(4, 8), None) is None\n"
        "assert k.block_logsumexp_triton(x, None, False, torch.empty(2)) is None\n"
        "assert k.abs_matmul_triton(torch.ones(2, 4), torch.ones(4, 8)) is None\n"
        "assert k.loss_tile_triton(x, None, torch.zeros(2), torch.zeros(1), False, x, torch.zeros(2).long(), None,"
        " 1.0, 0.0, 3) is None\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ---------------------------------------------------------------------------------------------------------------------
# What the interpreter does not see


def test_float_literals_in_the_kernels_are_float32():
    """Triton types a float literal float64 unless 2⁻¹²⁶ ≤ |x| ≤ float32's max (or it is 0, ±inf or NaN). A float64
    literal makes the arithmetic around it float64 on a GPU (slow), and Triton 3.6 then refuses a loop-carried float32
    variable that turns float64 in the loop; the interpreter computes in numpy and shows neither."""
    import ast

    smallest, largest = 2.0**-126, (2 - 2**-23) * 2.0**127
    wide = [(path.name, node.lineno, node.value) for path in TRITON_FILES for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, float)
            and node.value != 0 and math.isfinite(node.value) and not smallest <= abs(node.value) <= largest]
    assert wide == [], f"float literals Triton types float64 (file, line, value): {wide}"


KERNELS = ("_loss_tile_kernel", "_lse_partial_kernel", "_lse_finish_kernel", "_scores_kernel", "_accept_once_kernel",
           "_cauchy_linear_kernel", "_abs_matmul_kernel")
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
                torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1"}


def _recording_copy(name, state=lambda: None):
    """(functions, modules, launches): a copy of the modules as a GPU imports them (GPU block sizes, no interpreter),
    told that they can run on any one device, whose kernels record their launches instead of running, as
    (kernel, args, kwargs, ``state()`` at the launch)."""
    module, modules = _package_copy(name, "0")
    assert not module.INTERPRETED
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs, state()))

    for each in modules:  # where each function looks these up: its own module's names
        for kernel in KERNELS:
            if kernel in vars(each):
                setattr(each, kernel, Recorder(getattr(each, kernel)))
        if "_runs_on" in vars(each):
            each.available = lambda: True
            each._runs_on = lambda *tensors: len({t.device for t in tensors if t is not None}) == 1
    return module, modules, launches


def _gpu_launches():
    """Every kernel launch the functions make on a GPU, for float32 and bf16 operands and each flag, distribution and
    shape class the tests above use (`_recording_copy`, on these CPU tensors)."""
    module, _, launches = _recording_copy("_kernels_recorded")
    for dtype in DTYPES:
        for relative in (True, False):
            for per_token in (True, False):
                loc, bias, lse, thr, scale, col = _tile_inputs(dtype, 6, 300, relative, per_token, seed=1)
                degenerate = torch.zeros(300, dtype=torch.bool)
                degenerate[[0, 7]] = True
                for flags, degen in ((ALL_FLAGS, degenerate), (ALL_FLAGS, None), (kt.TILE_D, None),
                                     (kt.TILE_OVR, None), (kt.TILE_OVR | kt.TILE_OVR_GRADS | kt.TILE_COL_T, None)):
                    assert module.loss_tile_triton(loc, bias, lse, thr, relative, scale, col, degen, 0.5, 0.25,
                                                   flags) is not None
        loc = torch.randn(5, 3000).to(dtype)
        for b in (torch.randn(3000), None):
            for store in (True, False):
                assert module.block_logsumexp_triton(loc, b, store, torch.empty(5)) is not None
        for distribution in SCORE_DISTRIBUTIONS:
            for relative in (True, False):
                for threshold in (0.5, torch.randn(3000)):
                    assert module.ovr_scores_triton(loc, loc.abs(), threshold, relative, distribution) is not None
        for rows in (1, 17):
            weight, bias, loc_U, scale_U = _linear_inputs(dtype, rows, 70, 40, seed=rows)
            for b in (bias, None):
                assert module.cauchy_linear_triton(loc_U, scale_U, weight, b) is not None
            assert module.abs_linear_triton(scale_U, weight) is not None
        assert module.abs_matmul_triton(torch.randn(7, 70).to(dtype), weight) is not None
    return module, launches


def _signature(kernel, args, kwargs):
    """(signature, constexprs, options) of one launch, as Triton's launcher would build them (no specialisation)."""
    names = kernel.arg_names
    values = dict(zip(names, args))
    values.update((k, v) for k, v in kwargs.items() if k in names)
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif torch.is_tensor(value):
            signature[param.name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {param.name} of type {type(value).__name__}")
    return signature, constexprs, options


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests compile and run every kernel")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_every_kernel_compiles_for_a_hopper_gpu(monkeypatch, tmp_path):
    """The interpreter runs the kernels' Python, not Triton's compiler: a kernel it runs may not compile (float64
    typing, a loop-carried variable that changes type, an op the GPU lowering lacks). Every launch the functions
    make on a GPU, over the flags and dtypes of the tests above, is compiled to Triton IR for sm_90 (Hopper), and one
    launch of each kernel all the way to a cubin."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    if "nvidia" not in backends:
        pytest.skip("this Triton has no CUDA backend")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # the compiled kernels stay in the test's folder
    module, launches = _gpu_launches()
    assert {kernel.fn.__name__ for kernel, _, _, _ in launches} == set(KERNELS)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    seen, to_cubin = set(), set(KERNELS)
    for kernel, args, kwargs, _ in launches:
        signature, constexprs, options = _signature(kernel, args, kwargs)
        key = (kernel.fn.__name__, tuple(signature.items()), tuple(constexprs.items()), tuple(options.items()))
        if key in seen:
            continue
        seen.add(key)
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        if kernel.fn.__name__ in to_cubin:  # the whole pipeline, ptxas included, once per kernel
            to_cubin.discard(kernel.fn.__name__)
            assert triton.compile(source, target=target, options=options).asm["cubin"]
            continue
        opts = backend.parse_options(options)
        context = triton._C.libtriton.ir.context()
        triton._C.libtriton.ir.load_dialects(context)
        backend.load_dialects(context)
        ir = source.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
        assert "f64" not in str(ir), f"{kernel.fn.__name__} {constexprs}: float64 arithmetic on the GPU"
    assert len(seen) > 20, len(seen)


def test_every_launch_runs_on_its_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device, and an operator registered from Python gets no DeviceGuard: each
    function makes its tensors' device current around its launches (`torch.cuda.device`), so that tensors on cuda:1
    while cuda:0 is current are computed on cuda:1. No GPU here: fake tensors claiming cuda:1, `torch.cuda.device`
    recorded, every kernel's launch recorded with the device current then."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    current = [torch.device("cuda", 0)]

    class Device:  # torch.cuda.device, without a GPU
        def __init__(self, device):
            self.device = torch.device(device)

        def __enter__(self):
            current.append(self.device)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", Device)
    module, modules, launches = _recording_copy("_kernels_guarded", state=lambda: current[-1])
    monkeypatch.setattr(modules[0], "_target_programs", lambda device: 132)  # triton_utils: no device to ask
    loc, bias, lse, thr, scale, col = _tile_inputs(torch.bfloat16, 6, 300, True, True, seed=1)
    weight, b, loc_U, scale_U = _linear_inputs(torch.bfloat16, 3, 300, 40, seed=3)
    with FakeTensorMode(allow_non_fake_inputs=True):
        loc, bias, lse, thr, scale, col, weight, b, loc_U, scale_U = (
            t.to("cuda:1") for t in (loc, bias, lse, thr, scale, col, weight, b, loc_U, scale_U))
        assert module.loss_tile_triton(loc, bias, lse, thr, True, scale, col, None, 0.5, 0.25, ALL_FLAGS) is not None
        assert module.block_logsumexp_triton(loc, bias, True, torch.empty(6, device="cuda:1")) is not None
        assert module.ovr_scores_triton(loc, scale, thr, True, "accept_once") is not None
        assert module.cauchy_linear_triton(loc_U, scale_U, weight, b) is not None
        assert module.abs_linear_triton(scale_U, weight) is not None
        assert module.abs_matmul_triton(torch.randn(3, 300, device="cuda:1").bfloat16(), weight, segments=1) is not None
    assert {kernel.fn.__name__ for kernel, _, _, _ in launches} == set(KERNELS)
    assert [where for _, _, _, where in launches] == [torch.device("cuda", 1)] * len(launches)
    assert current == [torch.device("cuda", 0)]  # restored after each


def test_every_program_id_is_widened_to_int64():
    """A program id times a stride passes 2³¹ on real shapes (a row block's column sums of the loss tile at
    pid_r · V: from 56,537 rows at V = 151,936), where int32 arithmetic wraps into another row's memory; the numeric
    tests cannot reach such sizes, so every `tl.program_id(i)` of every kernel is cast to int64 where it is read
    (alongside them: the cast changes no number)."""
    import ast

    narrow = []
    for path in TRITON_FILES:
        tree = ast.parse(path.read_text())
        widened = {id(node.func.value) for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                   and ast.unparse(node.args[0]) == "tl.int64"}
        narrow += [(path.name, node.lineno) for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.program_id" and id(node) not in widened]
    assert narrow == [], f"program ids used in int32 (file, line): {narrow}"
