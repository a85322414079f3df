"""The decode operators' second CPU backend: the torch functions through `torch.compile`, for CPUs where the C
kernels do not run (no AVX-512, no AVX512-BF16 for bf16, `CAUSALQWEN_CPU_KERNELS=0`; cpu.py routes to
them). Installed package only: TorchInductor writes and compiles C++ in its own cache, which an adapter folder's
remote code must never do; there the eager torch code runs.

The first call of each kernel compiles it (seconds; a warm TorchInductor cache shortens it); where this platform
cannot compile or run it (no C++ toolchain), the call says so by returning None, the kernel is given up for the
process, and the torch reference runs.
"""

import torch

from ..cauchy import cauchy_linear_blocked, ovr_decision_scores

FUSED_MAX_ROWS = 4  # beyond, the compiled kernel's float32 vector code loses to two blocked matmuls (bf16, 2 CPU cores)


class CompiledKernel:
    """``fn`` through `torch.compile`, compiled on first call; calling returns None where this platform cannot compile
    or run it (no backend, no C++ toolchain), and every later call returns None at once."""

    def __init__(self, fn, **options):
        self.fn, self.options, self.compiled = fn, options, None

    @property
    def given_up(self) -> bool:
        return self.compiled is False

    def __call__(self, *args):
        if self.compiled is None:
            try:
                self.compiled = torch.compile(self.fn, **self.options)
            except Exception:  # no compiler backend on this platform
                self.compiled = False
        if self.compiled is False:
            return None
        try:
            return self.compiled(*args)
        except Exception:  # a backend that compiles but cannot run
            self.compiled = False
            return None


def _loc_scale_matvec(loc_U, scale_U, weight):
    # cauchy.cauchy_linear's products written for one pass over W: decoding a few rows is bound by reading W, and a
    # second matmul against |W| would read the vocabulary-sized matrix twice. One reduction per row and product, all
    # fused into one loop over W (compiled per row count): faster than a broadcast [rows, V, C] reduction from 2 rows
    # on.
    w = weight.float()
    abs_w = w.abs()
    loc = torch.stack([(w * row.float()).sum(-1) for row in loc_U.unbind(0)])
    scale = torch.stack([(abs_w * row.float()).sum(-1) for row in scale_U.unbind(0)])
    return loc.to(weight.dtype), scale.to(weight.dtype)


_fused_matvec = CompiledKernel(_loc_scale_matvec, dynamic=False)
_decision_scores = CompiledKernel(ovr_decision_scores)


def _floating_on_cpu(*tensors) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.is_floating_point()) for t in tensors)


def cauchy_linear_applies(loc_U, scale_U, weight, bias) -> bool:
    """1 to `FUSED_MAX_ROWS` rows of a [V, C] weight on the CPU, while the kernel compiles here."""
    rows = loc_U.numel() // loc_U.shape[-1] if loc_U.dim() and loc_U.shape[-1] else 0
    return (0 < rows <= FUSED_MAX_ROWS and weight.dim() == 2 and loc_U.shape[-1] == weight.shape[1]
            and scale_U.shape == loc_U.shape and _floating_on_cpu(loc_U, scale_U, weight, bias)
            and not _fused_matvec.given_up)


def cauchy_linear(loc_U, scale_U, weight, bias):
    """`cauchy.cauchy_linear` (no gradient) reading W once, in W's dtype; the blocked matmuls where it cannot
    compile."""
    shape = loc_U.shape
    fused = _fused_matvec(loc_U.reshape(-1, shape[-1]), scale_U.reshape(-1, shape[-1]), weight)
    if fused is None:
        return cauchy_linear_blocked(loc_U, scale_U, weight, bias)
    loc_S, scale_S = fused
    if bias is not None:
        loc_S = loc_S + bias
    return loc_S.reshape(*shape[:-1], -1), scale_S.reshape(*shape[:-1], -1)


def ovr_scores_applies(loc_S, scale_S, threshold, relative, distribution) -> bool:
    """Floating loc_S and scale_S of one shape on the CPU, while the kernel compiles here."""
    return (loc_S.numel() > 0 and scale_S.shape == loc_S.shape and _floating_on_cpu(loc_S, scale_S, threshold)
            and not _decision_scores.given_up)


def ovr_scores(loc_S, scale_S, threshold, relative, distribution):
    """`cauchy.ovr_decision_scores` as one compiled kernel; its eager code where it cannot compile."""
    scores = _decision_scores(loc_S, scale_S, threshold, relative, distribution)
    return ovr_decision_scores(loc_S, scale_S, threshold, relative, distribution) if scores is None else scores
