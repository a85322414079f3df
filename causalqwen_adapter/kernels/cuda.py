"""The `causalqwen` operators on CUDA GPUs: the Triton functions of this package's Triton modules, registered as the
operators' CUDA kernels with an `_applies` query each (dispatch.py finds them; the torch reference runs wherever one says no).

Registering is cheap and needs neither a GPU nor Triton: the queries say no where Triton is missing, and Triton is
imported at the first query. Where a Triton function declines its arguments although the query said yes (a layout
the query does not look at), the decode and product operators compute the torch reference instead; the loss tile
and logsumexp have no such fallback inside an operator, so their callers (lm_loss.py, losses.py) pass only what
the kernels take and a refusal is an error that names the operator (the candidates' term likewise:
candidate_loss.py).

Installed package only, never remote code, like cpu.py.
"""

import functools
import importlib
import types

import torch

from . import ops

# Rows of decoding served by the fused `cauchy_linear` kernel: its tiles suit batches up to this; beyond (a prompt's
# prefill) two cuBLAS products are the better choice.
CAUCHY_LINEAR_MAX_ROWS = 64
DTYPES = (torch.bfloat16, torch.float32)
TRITON_MODULES = ("triton_utils", "loss_tile", "logsumexp", "ovr_scores", "abs_matmul", "candidate_term")


def triton_kernels(package: str = __package__) -> types.SimpleNamespace:
    """The Triton modules of ``package`` (this one, or a copy the tests import for Triton's interpreter), imported,
    and their public names (``__all__``) in one namespace: the functions, `available`, `INTERPRETED`, the flags."""
    modules = [importlib.import_module(f"{package}.{name}") for name in TRITON_MODULES]
    return types.SimpleNamespace(**{name: getattr(module, name) for module in modules for name in module.__all__})


@functools.cache  # asked by every query, i.e. at each decode step: import and probe the device once
def _triton():
    """The Triton functions (`triton_kernels`), imported at first use (they import triton), or None without triton."""
    try:
        kernels = triton_kernels()
    except ImportError:  # pragma: no cover - triton_utils guards its own import of triton
        return None
    return kernels if kernels.available() else None


def _first_row(sums: torch.Tensor, width: int) -> torch.Tensor:
    """Row 0 of the loss tile's [threads, width] column sums, a view (the kernel adds into it), for any width (a
    block without columns included: reshape(-1, 0) is ambiguous)."""
    return sums.reshape(-1, width)[0] if width else sums.reshape(-1)[:0]


def register(dispatch_key: str = "CUDA", kernels=None, library=None) -> None:
    """Registers the Triton kernels as the ``dispatch_key`` kernels of the operators, and their queries.
    ``kernels``: a namespace holding them (default: `triton_kernels()` at first use; the tests pass that of a copy
    decorated for Triton's CPU interpreter and register it for the CPU); ``library``: the torch.library.Library to register in
    (default: the package's own, for the life of the process)."""
    library = library or ops.library

    def triton():
        return kernels if kernels is not None else _triton()

    def usable(*tensors, dtypes=DTYPES):
        return triton() is not None and all(t.dtype in dtypes for t in tensors)

    # decoding
    def cauchy_linear_applies(loc_U, scale_U, weight, bias):
        rows = loc_U.numel() // loc_U.shape[-1] if loc_U.dim() and loc_U.shape[-1] else 0
        return 0 < rows <= CAUCHY_LINEAR_MAX_ROWS and weight.is_contiguous() and usable(weight)

    def cauchy_linear(loc_U, scale_U, weight, bias):
        fused = triton().cauchy_linear_triton(loc_U, scale_U, weight, bias)
        if fused is None:
            from ..cauchy import cauchy_linear as reference

            fused = tuple(t.contiguous() for t in reference(loc_U, scale_U, weight, bias))
        return fused

    def ovr_scores_applies(loc_S, scale_S, threshold, relative, distribution):
        return loc_S.numel() > 0 and scale_S.dtype == loc_S.dtype and usable(loc_S)

    def ovr_scores(loc_S, scale_S, threshold, relative, distribution):
        scores = triton().ovr_scores_triton(loc_S, scale_S, threshold, relative, distribution)
        if scores is None:
            from ..cauchy import ovr_decision_scores

            scores = ovr_decision_scores(loc_S, scale_S, threshold, relative, distribution)
        return scores

    # the training loss (lm_loss.chunked_lm_loss, losses.chunked_ovr_loss)
    def products_apply(products):
        return usable(products)

    def loss_tile(loc, bias, lse, threshold, relative, scale, col, degenerate, ce, of, flags, d, g, rows_out, col_d,
                  col_t, threads):
        # The column sums' layout is [threads, w], summed by the caller after zeroing them: the kernel adds into the
        # first row (the only one where threads = 1, as the loss passes it for a GPU)
        done = triton().loss_tile_triton(loc, bias, lse, threshold, relative, scale, col, degenerate, ce, of, flags,
                                         d, g, rows_out, _first_row(col_d, loc.shape[1]),
                                         _first_row(col_t, loc.shape[1]))
        if done is None:
            raise RuntimeError("causalqwen::loss_tile: the Triton kernel does not take these arguments (every tensor "
                               "on one device, rows of unit stride)")

    def block_logsumexp(loc, bias, store_bias, lse, threads):
        if triton().block_logsumexp_triton(loc, bias, store_bias, lse) is None:
            raise RuntimeError("causalqwen::block_logsumexp: the Triton kernel does not take these arguments")

    def abs_linear(x, weight, out):
        if triton().abs_linear_triton(x, weight, out) is None:
            torch.mm(x, weight.abs().T, out=out)

    def abs_matmul_add(a, weight, out):
        if triton().abs_matmul_triton(a, weight, out) is None:
            out.add_(a @ weight.abs())

    def candidate_term(loc, scale, widen, weight, ids, shift, sign, minus_weight, x, d_thr, grad_scale):
        if triton().candidate_term_triton(loc, scale, widen, weight, ids, shift, sign, minus_weight, x, d_thr,
                                          grad_scale) is None:
            raise RuntimeError("causalqwen::candidate_term: the Triton kernel does not take these arguments (every "
                               "tensor on one device, rows of unit stride, the [N, k + 1] terms float32 and contiguous)")

    for name, kernel, query in (
        ("cauchy_linear", cauchy_linear, cauchy_linear_applies),
        ("ovr_scores", ovr_scores, ovr_scores_applies),
        ("loss_tile", loss_tile, products_apply),
        ("block_logsumexp", block_logsumexp, products_apply),
        ("abs_linear", abs_linear, products_apply),
        ("abs_matmul_add", abs_matmul_add, products_apply),
        ("candidate_term", candidate_term, products_apply),
    ):
        library.impl(name, kernel, dispatch_key)
        library.impl(f"{name}_applies", query, dispatch_key)
        ops.add_query(name, dispatch_key.lower(), query)  # what the fake query (and torch.compile's tracing) asks


if not torch._C._dispatch_has_kernel_for_dispatch_key("causalqwen::loss_tile", "CUDA"):  # once per process
    register()
