"""Inputs the CUDA operators' Triton kernels do not take (issue 50, Bad input): a dtype, layout or shape a kernel does
not support runs the torch reference, and the log says so once per operator, device and dtype; never a wrong
result. The operators are the CUDA registration made for the CPU with the kernels in Triton's interpreter
(test_cuda_operators.py's `triton_operators`), asked the way the package asks them: `dispatch.run_operator` for
decoding (heads.py, modeling_causalqwen.py), `dispatch.lookup_operator` with the products' dtype for the loss
(lm_loss.py, losses.py), then the operator on the arguments those callers build.
"""

import logging

import pytest
import torch

pytest.importorskip("triton")

import test_cuda_operators  # noqa: E402
from test_kernels_triton import kt  # noqa: E402

from causalqwen_adapter import dispatch  # noqa: E402
from causalqwen_adapter.cauchy import cauchy_linear, ovr_decision_scores  # noqa: E402

from conftest import decision_scores_float64  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
if not kt.INTERPRETED:
    pytest.skip("the Triton kernels are compiled for the GPU in this run", allow_module_level=True)

triton_operators = test_cuda_operators.triton_operators  # the fixture: the CUDA registration made for the CPU
G = torch.Generator().manual_seed(50)
C, V = 12, 37


def _told(caplog, name):
    return [r.getMessage() for r in caplog.records if r.name == dispatch.logger.name and r.getMessage().startswith(name)]


def _decode_inputs(dtype, rows=3, vocab=V, size=C):
    loc_U, scale_U = torch.randn(rows, size, generator=G).to(dtype), torch.rand(rows, size, generator=G).to(dtype)
    weight, bias = torch.randn(vocab, size, generator=G).to(dtype), torch.randn(vocab, generator=G).to(dtype)
    return loc_U, scale_U, weight, bias


# (case, arguments, whether the kernel takes them)
CAUCHY_LINEAR = {
    "float64": lambda: (_decode_inputs(torch.float64), False),
    "float16": lambda: (_decode_inputs(torch.float16), False),
    "W not contiguous": lambda: ((lambda x, s, w, b: (x, s, w.T.contiguous().T, b))(*_decode_inputs(torch.float32)),
                                 False),
    "no rows": lambda: (_decode_inputs(torch.float32, rows=0), False),
    "input not contiguous": lambda: ((lambda x, s, w, b: (x.T.contiguous().T, s[:, :].T.contiguous().T, w, b))(
        *_decode_inputs(torch.float32)), True),
    "empty vocabulary": lambda: (_decode_inputs(torch.float32, vocab=0), True),
}


@pytest.mark.parametrize("case", CAUCHY_LINEAR)
def test_cauchy_linear_runs_the_reference_where_its_kernel_does_not_apply(triton_operators, caplog, case):
    """Declined: run_operator says None (heads.py then runs `cauchy_linear`), the kernel is not called, and the log says
    why once; taken: the kernel's loc_S and scale_S are float64's within float32's rounding."""
    args, taken = CAUCHY_LINEAR[case]()
    caplog.set_level(logging.INFO, logger=dispatch.logger.name)
    results = [dispatch.run_operator("cauchy_linear", *args) for _ in range(2)]
    assert triton_operators["cauchy_linear_triton"] == (2 if taken else 0)
    told = _told(caplog, "cauchy_linear")
    assert len(told) == 1 and ("does not apply" in told[0]) != taken, told
    if not taken:
        assert results == [None, None]
        results = [cauchy_linear(*args)]  # what the caller runs: it computes these (float16 too, on a CPU)
    loc_U, scale_U, weight, bias = (t.double() for t in args)
    for loc_S, scale_S in results:
        assert loc_S.shape == scale_S.shape == (loc_U.shape[0], weight.shape[0]) and loc_S.dtype == args[2].dtype
        tol = dict(rtol=1e-2, atol=1e-2) if args[2].dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loc_S.double(), loc_U @ weight.T + bias, **tol)
        torch.testing.assert_close(scale_S.double(), scale_U @ weight.abs().T, **tol)


def _scores_inputs(dtype, rows=3, vocab=V):
    loc_S = (torch.randn(rows, vocab, generator=G) * 3).to(dtype)
    return loc_S, (torch.rand(rows, vocab, generator=G) + 0.1).to(dtype), torch.randn(vocab, generator=G)


def _wide(loc_S, scale_S, threshold):
    """Every other column of tensors twice as wide: rows of stride 2V, columns of stride 2."""
    return (torch.stack([loc_S, loc_S], -1).flatten(-2)[..., ::2], torch.stack([scale_S, scale_S], -1).flatten(-2)[..., ::2],
            threshold)


OVR_SCORES = {
    "float64": lambda: (_scores_inputs(torch.float64), False),
    "float16": lambda: (_scores_inputs(torch.float16), False),
    "scale of another dtype": lambda: ((lambda loc, s, t: (loc, s.bfloat16(), t))(*_scores_inputs(torch.float32)),
                                       False),
    "no rows": lambda: (_scores_inputs(torch.float32, rows=0), False),
    "empty vocabulary": lambda: (_scores_inputs(torch.float32, vocab=0), False),
    "not contiguous": lambda: (_wide(*_scores_inputs(torch.float32)), True),
    "float64 threshold": lambda: ((lambda loc, s, t: (loc, s, t.double()))(*_scores_inputs(torch.bfloat16)), True),
    "integer threshold": lambda: ((lambda loc, s, t: (loc, s, torch.tensor([1])))(*_scores_inputs(torch.float32)),
                                  True),
}


@pytest.mark.parametrize("case", OVR_SCORES)
def test_ovr_scores_run_the_reference_where_their_kernel_does_not_apply(triton_operators, caplog, case):
    """As `cauchy_linear`; a threshold the query does not look at (an integer tensor) reaches the operator, whose
    kernel declines it and whose torch reference then computes the scores. Scores: float64's, within float32's
    rounding."""
    (loc_S, scale_S, threshold), taken = OVR_SCORES[case]()
    caplog.set_level(logging.INFO, logger=dispatch.logger.name)
    for relative, distribution in ((True, "accept_once"), (False, "normalize")):
        got = dispatch.run_operator("ovr_scores", loc_S, scale_S, threshold, relative, distribution)
        assert (got is not None) == taken
        if got is None:
            got = ovr_decision_scores(loc_S, scale_S, threshold, relative, distribution)  # the caller's torch code
        assert got.dtype == torch.float32 and got.shape == loc_S.shape
        want = decision_scores_float64(loc_S, scale_S, threshold, relative, distribution)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert (triton_operators["ovr_scores_triton"] > 0) == taken
    told = _told(caplog, "ovr_scores")
    assert len(told) == 1 and ("does not apply" in told[0]) != taken, told


@pytest.mark.parametrize("name", ["loss_tile", "block_logsumexp", "abs_linear", "abs_matmul_add", "candidate_term"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_the_losss_operators_are_not_looked_up_for_other_dtypes(triton_operators, caplog, name, dtype):
    """lm_loss and losses look the loss's operators up with their products' dtype: float64 or float16 products get
    none (the torch code runs, and the log says so once)."""
    caplog.set_level(logging.INFO, logger=dispatch.logger.name)
    products = torch.empty(0, dtype=dtype)
    assert dispatch.lookup_operator(name, products) is None and dispatch.lookup_operator(name, products) is None
    told = _told(caplog, name)
    assert len(told) == 1 and "does not apply" in told[0], told
    assert dispatch.lookup_operator(name, products.float()) is not None  # float32 products: the operator


def _tile_args(r, w, flags):
    loc = torch.randn(r, w, generator=G)
    scale = torch.rand(r, w, generator=G) + 0.1
    return (loc, torch.randn(w, generator=G), torch.logsumexp(loc, 1), torch.randn(w, generator=G), True, scale,
            torch.randint(-1, max(w, 1), (r,), generator=G).clamp(max=w - 1), None, 0.5, 0.25, flags,
            torch.full((r, w), 7.0), torch.full((r, w), 7.0), torch.full((4 * r,), 7.0), torch.full((1, w), 3.0),
            torch.full((1, w), 3.0), 1)


@pytest.mark.parametrize("r, w", [(0, V), (3, 0)], ids=["no rows", "empty vocabulary block"])
def test_the_losss_operators_on_empty_tiles(triton_operators, r, w):
    """A chunk without rows or a block without columns: every operator computes what its reference does on them
    (sums over nothing are 0, a logsumexp over nothing −inf), writes nothing else, and raises nothing."""
    flags = (dispatch.TILE_OVR | dispatch.TILE_D | dispatch.TILE_OVR_GRADS | dispatch.TILE_OVR_LOCATES
             | dispatch.TILE_COL_D | dispatch.TILE_COL_T)
    args = _tile_args(r, w, flags)
    torch.ops.causalqwen.loss_tile(*args)
    rows_out, col_d, col_t = args[13], args[14], args[15]
    assert torch.equal(rows_out, torch.zeros(4 * r))
    assert torch.equal(col_d, torch.full((1, w), 3.0)) and torch.equal(col_t, torch.full((1, w), 3.0))  # added 0
    loc = torch.randn(r, w, generator=G)
    lse = torch.full((r,), 7.0)
    torch.ops.causalqwen.block_logsumexp(loc, torch.randn(w, generator=G), True, lse, 1)
    assert torch.equal(lse, torch.logsumexp(loc, 1))  # −inf for an empty row
    weight = torch.randn(w, C, generator=G)
    out = torch.full((r, w), 7.0)
    torch.ops.causalqwen.abs_linear(torch.randn(r, C, generator=G), weight, out)
    assert torch.equal(out, torch.zeros(r, w))
    acc = torch.full((r, C), 2.0)
    torch.ops.causalqwen.abs_matmul_add(torch.randn(r, w, generator=G), weight, acc)
    assert torch.equal(acc, torch.full((r, C), 2.0))
    assert triton_operators["loss_tile_triton"] == triton_operators["abs_matmul_triton"] == 1


def test_the_products_of_layouts_their_kernels_do_not_take_are_the_references(triton_operators):
    """abs_linear and abs_matmul_add given a transposed operand or output (their kernels take rows of unit stride)
    compute the torch reference inside the operator: float64's numbers, the output written in place."""
    x, weight = torch.randn(C, 5, generator=G).T, torch.randn(V, C, generator=G)
    out_t = torch.full((V, 5), 7.0).T
    torch.ops.causalqwen.abs_linear(x, weight, out_t)
    torch.testing.assert_close(out_t.double(), x.double() @ weight.double().abs().T, rtol=1e-5, atol=1e-5)
    a = torch.randn(V, 5, generator=G).T
    acc = torch.ones(5, C)
    torch.ops.causalqwen.abs_matmul_add(a, weight, acc)
    torch.testing.assert_close(acc.double(), 1 + a.double() @ weight.double().abs(), rtol=1e-5, atol=1e-5)
    assert triton_operators["abs_linear_triton"] == triton_operators["abs_matmul_triton"] == 1  # asked, declined


@pytest.mark.parametrize("name", ["loss_tile", "block_logsumexp"])
def test_the_loss_tiles_operators_refuse_other_layouts_by_name(triton_operators, name):
    """loss_tile and block_logsumexp have no torch reference inside the operator (their callers pass only rows of unit
    stride): another layout is an error naming the operator, never a result."""
    if name == "loss_tile":
        args = list(_tile_args(3, V, dispatch.TILE_OVR | dispatch.TILE_D))
        args[0] = torch.randn(V, 3, generator=G).T
    else:
        args = [torch.randn(V, 3, generator=G).T, None, False, torch.empty(3), 1]
    with pytest.raises(RuntimeError, match=f"causalqwen::{name}"):
        getattr(torch.ops.causalqwen, name)(*args)
