"""The formulas of the numeric heads (docs/design.md, Numbers): signed log1p, the Cauchy NLL (finite for far
targets in float32), Cauchy quantiles and intervals, plain and truncated to a range.

References: the formulas written out in float64, and a float64 bisection on the truncated CDF.
"""

import math

import pytest
import torch

from causalqwen_adapter.cauchy import cauchy_interval, cauchy_nll, cauchy_quantile, signed_log1p


def test_formulas_match_float64():
    v = torch.tensor([-1e6, -2.5, -1e-3, 0.0, 1e-3, 2.5, 1e6], dtype=torch.float64)
    torch.testing.assert_close(signed_log1p(v), torch.tensor([math.copysign(math.log(1 + abs(x)), x) for x in v.tolist()],
                                                             dtype=torch.float64))
    y, loc, scale = torch.tensor([1.0, -4.0, 100.0]), torch.tensor([0.5, 2.0, -3.0]), torch.tensor([0.1, 3.0, 50.0])
    want = [math.log(math.pi * s) + math.log(1 + ((a - b) / s) ** 2) for a, b, s in zip(y.tolist(), loc.tolist(), scale.tolist())]
    torch.testing.assert_close(cauchy_nll(y, loc, scale), torch.tensor(want))


def test_the_cauchy_nll_of_a_far_target_is_finite_in_float32():
    """One target of 1e20 (z² overflows float32 past ≈ 1.8e19): the NLL and its gradients stay finite and match the
    float64 formula, from z = 0 through |z| = 1 (where the two forms meet) to 1e30."""
    targets = [0.0, 0.3, 1.0 - 1e-6, 1.0, 1.0 + 1e-6, 7.0, -2e3, 1e10, -1e20, 1e30]
    y = torch.tensor(targets, requires_grad=True)
    loc, scale = torch.zeros(len(targets), requires_grad=True), torch.full((len(targets),), 1.0, requires_grad=True)
    nll = cauchy_nll(y, loc, scale)
    want = [math.log(math.pi) + math.log1p(t * t) if abs(t) < 1e150 else 0.0 for t in targets]
    torch.testing.assert_close(nll.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    nll.sum().backward()
    for grad in (y.grad, loc.grad, scale.grad):
        assert torch.isfinite(grad).all()
    torch.testing.assert_close(y.grad.double(), torch.tensor([2 * t / (1 + t * t) for t in targets], dtype=torch.float64),
                               rtol=1e-5, atol=1e-12)


def naive_cauchy_cdf(x, loc, scale):
    return 0.5 + math.atan((x - loc) / scale) / math.pi


def naive_truncated_cauchy_quantile(loc, scale, p, low, high):
    """Bisection in float64 on (F(x) − F(low)) / (F(high) − F(low))."""
    f_low, f_high = naive_cauchy_cdf(low, loc, scale), naive_cauchy_cdf(high, loc, scale)
    lo, hi = low, high
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (naive_cauchy_cdf(mid, loc, scale) - f_low) / (f_high - f_low) < p else (lo, mid)
    return (lo + hi) / 2


def test_cauchy_quantiles_and_intervals_invert_the_cdf():
    # inside the range, at its edges, beyond it; narrow and wide laws
    loc = torch.tensor([0.3, -3.9, 3.5, 6.0, -5.0, 1.0], dtype=torch.float64)
    scale = torch.tensor([0.5, 1.0, 3.0, 2.0, 0.7, 40.0], dtype=torch.float64)
    for p in (0.025, 0.1, 0.5, 0.8, 0.975):
        plain = cauchy_quantile(loc, scale, p)
        assert all(naive_cauchy_cdf(q, a, s) == pytest.approx(p, abs=1e-12)
                   for q, a, s in zip(plain.tolist(), loc.tolist(), scale.tolist()))
        truncated = cauchy_quantile(loc, scale, p, support=(-4.0, 4.0))
        assert truncated.dtype == torch.float64 and ((truncated >= -4) & (truncated <= 4)).all()
        want = [naive_truncated_cauchy_quantile(a, s, p, -4.0, 4.0) for a, s in zip(loc.tolist(), scale.tolist())]
        torch.testing.assert_close(truncated, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-9)
    lower, upper = cauchy_interval(loc, scale, 0.9, support=(-4.0, 4.0))  # holds 90 % of the truncated law
    for lo, hi, a, s in zip(lower.tolist(), upper.tolist(), loc.tolist(), scale.tolist()):
        mass = (naive_cauchy_cdf(hi, a, s) - naive_cauchy_cdf(lo, a, s)) / (
            naive_cauchy_cdf(4.0, a, s) - naive_cauchy_cdf(-4.0, a, s))
        assert mass == pytest.approx(0.9, abs=1e-9)
    torch.testing.assert_close(cauchy_interval(loc, scale, 0.5)[1], cauchy_quantile(loc, scale, 0.75))


def test_cauchy_quantile_far_outside_the_range_and_in_low_precision():
    # 56 000 scales beyond the range the truncated density is ∝ 1/(60 − x)², whose median m solves
    # 1/(60 − m) = (1/56 + 1/64)/2
    got = cauchy_quantile(torch.tensor([60.0], dtype=torch.float64), torch.tensor([1e-3], dtype=torch.float64), 0.5,
                          support=(-4.0, 4.0))
    assert got.item() == pytest.approx(60 - 2 / (1 / 56 + 1 / 64), abs=1e-6)
    half = cauchy_quantile(torch.tensor([0.5], dtype=torch.bfloat16), torch.tensor([2.0], dtype=torch.bfloat16), 0.9)
    assert half.dtype == torch.float32 and half.item() == pytest.approx(0.5 + 2 * math.tan(0.4 * math.pi), rel=1e-6)


def test_cauchy_quantile_refuses_bad_levels_and_ranges():
    loc, scale = torch.zeros(2), torch.ones(2)
    for p in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="quantile level"):
            cauchy_quantile(loc, scale, p)
    with pytest.raises(ValueError, match="interval's level"):
        cauchy_interval(loc, scale, 1.0)
    with pytest.raises(ValueError, match="low < high"):
        cauchy_quantile(loc, scale, 0.5, support=(4.0, -4.0))
