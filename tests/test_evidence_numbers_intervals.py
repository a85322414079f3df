"""bench/evidence_numbers_intervals.py: quantiles, intervals and their metrics against naive float64 references
(explicit loops; quantiles by inverting a numerically integrated CDF)."""

import math
import random
import sys

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence_numbers_intervals as intervals  # noqa: E402

# --- quantiles ---------------------------------------------------------------------------------------------------


def density(family, x, df=None):
    """The standard laws' densities, written out."""
    if family == "gaussian":
        return torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    if family == "cauchy":
        return 1 / (math.pi * (1 + x * x))
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    return c * (1 + x * x / df) ** (-(df + 1) / 2)


def naive_cdf(family, x, df=None, points=200_001):
    """½ + ∫₀ˣ density, trapezoid rule in float64 (the laws are symmetric)."""
    t = torch.linspace(0.0, abs(x), points, dtype=torch.float64)
    return 0.5 + math.copysign(torch.trapezoid(density(family, t, df), t).item(), x)


def naive_quantile(family, p, df=None):
    """Bisection on the numerically integrated CDF."""
    lo, hi = -100.0, 100.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if naive_cdf(family, mid, df, points=40_001) < p else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("p", [0.025, 0.3, 0.75, 0.9, 0.95, 0.975])
@pytest.mark.parametrize("family, df", [("gaussian", None), ("cauchy", None), ("student_t", 1.0), ("student_t", 2.5),
                                        ("student_t", 4.0), ("student_t", 30.0)])
def test_standard_quantile_inverts_the_numerical_cdf(family, df, p):
    q = intervals.standard_quantile(family, p, df)
    assert naive_cdf(family, q, df) == pytest.approx(p, abs=1e-7)
    assert q == pytest.approx(naive_quantile(family, p, df), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("p", [0.6, 0.75, 0.9, 0.95, 0.975, 0.025])
def test_student_t_quantile_matches_closed_forms(p):
    # ν = 1 is the Cauchy law; ν = 2 and ν = 4 have closed-form quantiles
    assert intervals.student_t_quantile(p, 1.0) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert intervals.student_t_quantile(p, 2.0) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    alpha = 4 * p * (1 - p)
    q = math.cos(math.acos(math.sqrt(alpha)) / 3) / math.sqrt(alpha)
    assert intervals.student_t_quantile(p, 4.0) == pytest.approx(math.copysign(2 * math.sqrt(q - 1), p - 0.5), rel=1e-9)


def test_quantile_refuses_bad_levels_and_df():
    with pytest.raises(ValueError, match="level"):
        intervals.standard_quantile("gaussian", 1.0)
    with pytest.raises(ValueError, match="degrees of freedom"):
        intervals.standard_quantile("student_t", 0.9, 0.0)
    with pytest.raises(ValueError, match="family"):
        intervals.standard_quantile("laplace", 0.9)


@pytest.mark.parametrize("family, df", [("gaussian", None), ("cauchy", None), ("student_t", 3.0)])
def test_central_interval_is_the_two_tail_quantiles(family, df):
    loc = torch.tensor([0.0, -1.5, 2.0])
    scale = torch.tensor([1.0, 0.25, 3.0])
    for level in intervals.LEVELS:
        lower, upper = intervals.central_interval(family, loc, scale, level, df)
        q_lo, q_hi = naive_quantile(family, (1 - level) / 2, df), naive_quantile(family, (1 + level) / 2, df)
        for i in range(3):
            lo_ref = loc[i].item() + scale[i].item() * q_lo
            hi_ref = loc[i].item() + scale[i].item() * q_hi
            assert lower[i].item() == pytest.approx(lo_ref, rel=1e-5, abs=1e-6)
            assert upper[i].item() == pytest.approx(hi_ref, rel=1e-5, abs=1e-6)


def naive_truncated_quantile(family, loc, scale, p, low, high, df=None):
    """Bisection on the truncated law's CDF (F(x) − F(a)) / (F(b) − F(a)), F the numerically integrated one."""
    a, b = (low - loc) / scale, (high - loc) / scale
    f_a, f_b = naive_cdf(family, a, df, points=40_001), naive_cdf(family, b, df, points=40_001)
    lo, hi = a, b
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (naive_cdf(family, mid, df, points=40_001) - f_a) / (f_b - f_a) < p else (lo, mid)
    return loc + scale * (lo + hi) / 2


@pytest.mark.parametrize("family, df", [("gaussian", None), ("cauchy", None), ("student_t", 3.0),
                                        ("student_t", 14.0)])
def test_truncated_quantile_inverts_the_truncated_cdf(family, df):
    # inside the range, at its edge, beyond it; narrow and wide laws
    loc = torch.tensor([0.3, -3.9, 3.5, 5.0, -4.5, 1.0])
    scale = torch.tensor([0.5, 1.0, 3.0, 2.0, 0.7, 20.0])
    low, high = -4.05, 4.05
    for p in (0.025, 0.25, 0.5, 0.9, 0.975):
        got = intervals.truncated_quantile(family, loc, scale, p, (low, high), df)
        assert got.dtype == torch.float64 and ((low <= got) & (got <= high)).all()
        for i in range(len(loc)):
            ref = naive_truncated_quantile(family, loc[i].item(), scale[i].item(), p, low, high, df)
            assert got[i].item() == pytest.approx(ref, abs=2e-5), (i, p)


def test_truncated_quantile_of_a_law_far_outside_the_range():
    loc, scale = torch.tensor([60.0, -60.0]), torch.tensor([1e-3, 1e-3])
    # no float64 mass of the Gaussian law in the range: the nearer end itself
    assert intervals.truncated_quantile("gaussian", loc, scale, 0.5, (-4.05, 4.05)).tolist() == [4.05, -4.05]
    # the Cauchy tail keeps mass there, with density ∝ 1/(60 − x)² 56 000 scales out: median m solves
    # 1/(60 − m) = (1/55.95 + 1/64.05)/2
    got = intervals.truncated_quantile("cauchy", loc, scale, 0.5, (-4.05, 4.05))
    m = 60 - 2 / (1 / 55.95 + 1 / 64.05)
    assert got.tolist() == pytest.approx([m, -m], abs=1e-6)


# --- interval metrics ----------------------------------------------------------------------------------------------


def random_intervals(n=257, seed=0):
    rng = random.Random(seed)
    centre = [rng.gauss(0, 2) for _ in range(n)]
    half = [abs(rng.gauss(0, 1)) for _ in range(n)]
    lower = [c - h for c, h in zip(centre, half)]
    upper = [c + h for c, h in zip(centre, half)]
    y = [rng.gauss(0, 2.5) for _ in range(n)]
    y[:4] = [lower[0], upper[1], lower[2] - 1e-3, upper[3] + 1e-3]  # on and just beyond the bounds
    return (torch.tensor(lower, dtype=torch.float32), torch.tensor(upper, dtype=torch.float32),
            torch.tensor(y, dtype=torch.float32))


def test_coverage_and_width_match_loops():
    lower, upper, y = random_intervals()
    lo, hi, ys = lower.double().tolist(), upper.double().tolist(), y.double().tolist()
    inside = 0
    for a, b, v in zip(lo, hi, ys):
        if a <= v <= b:
            inside += 1
    assert intervals.coverage(lower, upper, y) == pytest.approx(inside / len(ys), abs=1e-15)
    assert intervals.mean_width(lower, upper) == pytest.approx(sum(b - a for a, b in zip(lo, hi)) / len(lo), rel=1e-12)
    assert intervals.coverage(lower[:4], upper[:4], y[:4]) == 0.5  # bounds count as inside


@pytest.mark.parametrize("level", [0.5, 0.8, 0.9, 0.95])
def test_interval_score_matches_loop(level):
    lower, upper, y = random_intervals(seed=1)
    alpha = 1 - level
    total = 0.0
    for a, b, v in zip(lower.double().tolist(), upper.double().tolist(), y.double().tolist()):
        score = b - a
        if v < a:
            score += 2 / alpha * (a - v)
        elif v > b:
            score += 2 / alpha * (v - b)
        total += score
    assert intervals.interval_score(lower, upper, y, level) == pytest.approx(total / len(y), rel=1e-12)


@pytest.mark.parametrize("level", [0.5, 0.8, 0.95])
def test_conformal_offset_is_the_rank_of_the_naive_conformity_scores(level):
    lower, upper, y = random_intervals(seed=3)
    scores = sorted(max(a - v, v - b) for a, b, v in
                    zip(lower.double().tolist(), upper.double().tolist(), y.double().tolist()))
    rank = math.ceil((len(scores) + 1) * level)  # the finite-sample rank of split conformal prediction
    assert intervals.conformal_offset(lower, upper, y, level) == scores[rank - 1]
    few = slice(0, 9)  # ⌈10 · 0.95⌉ = 10 > 9 rows: no finite offset guarantees the level
    assert intervals.conformal_offset(lower[few], upper[few], y[few], 0.95) == math.inf


def test_calibrated_intervals_reach_their_level_and_shrink_too_wide_ones():
    # Cauchy intervals on Gaussian residuals: far too wide at 95 %; calibrated on one half they cover the other
    # half at the level (exchangeable rows), and a negative offset stops at the interval's midpoint
    g = torch.Generator().manual_seed(5)
    loc, scale = torch.randn(4000, generator=g), 0.5 + torch.rand(4000, generator=g)
    y = loc + scale * torch.randn(4000, generator=g)
    levels = (0.5, 0.8, 0.95)
    wide = {lv: intervals.central_interval("cauchy", loc, scale, lv) for lv in levels}
    half = lambda iv, part: {lv: (a[part], b[part]) for lv, (a, b) in iv.items()}  # noqa: E731
    calibrated = intervals.calibrated_intervals(half(wide, slice(0, 2000)), y[:2000],
                                               half(wide, slice(2000, None)))
    for lv in levels:
        lower, upper = calibrated[lv]
        assert abs(intervals.coverage(lower, upper, y[2000:]) - lv) < 0.03
        assert (lower <= upper).all()
    raw = wide[0.95]
    assert intervals.mean_width(*calibrated[0.95]) < 0.5 * intervals.mean_width(raw[0][2000:], raw[1][2000:])
    lower, upper = intervals.widen(torch.tensor([0.0, -1.0]), torch.tensor([2.0, 5.0]), -2.0)
    assert lower.tolist() == [1.0, 1.0] and upper.tolist() == [1.0, 3.0]


def test_median_absolute_error_and_standard_error_match_loops():
    rng = random.Random(2)
    median = [rng.uniform(-4, 4) for _ in range(101)]
    y = [rng.uniform(-4, 4) for _ in range(101)]
    errors = sorted(abs(m - v) for m, v in zip(torch.tensor(median).double().tolist(), torch.tensor(y).double().tolist()))
    assert intervals.median_absolute_error(torch.tensor(median), torch.tensor(y)) == pytest.approx(errors[50], rel=1e-12)
    values = [1.0, 2.5, 4.0, 0.5, 3.0]
    mean = sum(values) / 5
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / 4) / math.sqrt(5)
    assert intervals.mean_and_standard_error(values) == pytest.approx((mean, se), rel=1e-12)


def test_mean_and_standard_error_of_infinite_scores():
    # 18 validation rows give no finite 95 % conformal offset: such scores are inf, and the summary must not raise
    mean, se = intervals.mean_and_standard_error([float("inf"), 2.0, 3.0])
    assert mean == float("inf") and math.isnan(se)
    mean, se = intervals.mean_and_standard_error([1.0, 2.0, 4.0])
    assert (mean, se) == pytest.approx((7 / 3, math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2 / 3)))
