"""The candidates' term kernel (kernels/candidate_term.py) on its own against a naive float64 computation of its
definition: Triton's interpreter on CPU tensors here, the GPU with TRITON_INTERPRET=0 on a CUDA machine (`make
test-gpu`). Shapes cross the kernel's edges: k + 1 not a power of two, a width not a multiple of its column block."""

import math

import pytest
import torch

pytest.importorskip("triton")

from test_kernels_triton import DEVICE, ON_GPU, kt  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), *([pytest.mark.gpu] if ON_GPU else [])]
TINY = torch.finfo(torch.float32).tiny


def _inputs(dtype, n, k1, width, vocab=53, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, width, generator=g) / 8).to(dtype)
    ids = torch.randint(0, vocab, (n, k1), generator=g)
    sign = torch.ones(n, k1)
    sign[:, -1] = -1  # the target's column
    counted = (torch.rand(n, k1, generator=g) > 0.1).float()
    return {"loc": torch.randn(n, width, generator=g).to(dtype), "scale": (torch.rand(n, width, generator=g) * 0.3).to(dtype),
            "widen": torch.rand(width, generator=g) * 0.1, "weight": weight, "ids": ids,
            "shift": torch.randn(n, k1, generator=g) * 3, "sign": sign, "minus_weight": -sign * counted}


def reference(loc, scale, widen, weight, ids, shift, sign, minus_weight):
    """x, ∂ℓ/∂C and ∂ℓ/∂scale of ℓ = Σ weight·(−log Q(sign·x)), Q(z) = atan2(1, z)/π, in float64 by autograd."""
    rows = weight.double()[ids]  # [n, k1, C]
    fused = (scale.double() + widen.double()).requires_grad_()
    threshold = torch.zeros_like(shift, dtype=torch.float64, requires_grad=True)
    loc_S = (rows * loc.double().unsqueeze(1)).sum(-1) + shift.double() - threshold
    scale_S = (rows.abs() * fused.unsqueeze(1)).sum(-1)
    x = loc_S / scale_S.clamp_min(TINY)
    z = x * sign.double()
    loss = (minus_weight.double() * -sign.double() * -torch.log(torch.atan2(torch.ones_like(z), z) / math.pi)).sum()
    d_thr, d_scale = torch.autograd.grad(loss, [threshold, fused])
    return x.detach(), d_thr, d_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k1, width", [(5, 17, 200), (3, 2, 64), (1, 5, 7), (2, 100, 40)])
def test_the_kernel_is_its_definition(dtype, n, k1, width):
    t = _inputs(dtype, n, k1, width)
    args = {k: v.to(DEVICE) for k, v in t.items()}
    x, d_thr, grad = (torch.full((n, k1), math.nan, device=DEVICE), torch.full((n, k1), math.nan, device=DEVICE),
                      torch.full((n, width), math.nan, device=DEVICE))
    assert kt.candidate_term_triton(*args.values(), x, d_thr, grad) is x
    want = reference(*t.values())
    for got, expected in zip((x, d_thr, grad), want):
        torch.testing.assert_close(got.cpu().double(), expected, rtol=2e-5, atol=1e-6)
    # without the gradients: x alone, the same
    x_only = torch.empty(n, k1, device=DEVICE)
    kt.candidate_term_triton(*args.values(), x_only)
    torch.testing.assert_close(x_only, x, rtol=0, atol=0)


def test_the_kernel_declines_what_it_does_not_compute():
    """Float64 operands, int32 ids, a float16 weight, a transposed weight or loc_U, more than 128 candidates: None,
    the caller's torch code runs."""
    t = {k: v.to(DEVICE) for k, v in _inputs(torch.float32, 3, 4, 16).items()}
    x = torch.empty(3, 4, device=DEVICE)
    for name, value in (("loc", t["loc"].double()), ("ids", t["ids"].int()), ("weight", t["weight"].half()),
                        ("weight", t["weight"].T.contiguous().T), ("shift", t["shift"].double()),
                        ("loc", t["loc"][:, None].expand(3, 2, 16)[:, 0].T.contiguous().T)):
        assert kt.candidate_term_triton(*{**t, name: value}.values(), x) is None, name
    wide = {k: v.to(DEVICE) for k, v in _inputs(torch.float32, 2, 129, 16).items()}
    assert kt.candidate_term_triton(*wide.values(), torch.empty(2, 129, device=DEVICE)) is None
    assert kt.candidate_term_triton(*{**t, "loc": t["loc"][:0], "scale": t["scale"][:0], "ids": t["ids"][:0],
                                      "shift": t["shift"][:0], "sign": t["sign"][:0],
                                      "minus_weight": t["minus_weight"][:0]}.values(), x[:0]) is not None
