"""bench/evidence_numbers.py, its predictive laws and interval metrics: quantiles of the Cauchy, Gaussian and
Student-t laws (truncated to a range too), central intervals, coverage, width, the interval (Winkler) score,
split-conformal calibration, the median absolute error, mean ± standard error over seeds."""

import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_digits as digits  # noqa: E402

LEVELS = (0.5, 0.8, 0.9, 0.95)
# the range of the ratings the digits LM can write (its histogram's support, −4.05 … 4.05): every arm's law is also
# read restricted to it (the `truncated_*` metrics), the knowledge of the scale that the LM's answers have
SUPPORT = (digits.GRID[0] - digits.bin_width(digits.GRID) / 2, digits.GRID[-1] + digits.bin_width(digits.GRID) / 2)


# --- predictive laws: quantiles and metrics ---------------------------------------------------------------------


def standard_quantile(family: str, p: float, df: float | None = None) -> float:
    """The p-quantile of the standard law (location 0, scale 1) of `family`, in float64."""
    if not 0 < p < 1:
        raise ValueError(f"a quantile level must lie in (0, 1), got {p}")
    if family == "cauchy":
        return math.tan(math.pi * (p - 0.5))
    if family == "gaussian":
        return math.sqrt(2.0) * torch.special.erfinv(torch.tensor(2 * p - 1, dtype=torch.float64)).item()
    if family == "student_t":
        return student_t_quantile(p, df)
    raise ValueError(f"unknown family {family!r}: choose cauchy, gaussian or student_t")


def student_t_quantile(p: float, df: float, points: int = 4001) -> float:
    """Quantile of Student's t with `df` degrees of freedom (no closed form for a general ν, no scipy here)."""
    if not df > 0:
        raise ValueError(f"Student-t degrees of freedom must be > 0, got {df}")
    return student_t_quantiles(torch.tensor([p], dtype=torch.float64), df, points).item()


def student_t_quantiles(p: torch.Tensor, df: float, points: int = 201) -> torch.Tensor:
    """The quantile at each level p: θ with √ν·tan θ the quantile, found by bisection on the CDF's integral
    (`student_t_half_mass`) for |p − ½| and signed after (exactly 0 at p = ½), float64."""
    target = (p.double() - 0.5).abs()
    lo, hi = torch.zeros_like(target), torch.full_like(target, math.pi / 2)
    for _ in range(60):
        mid = (lo + hi) / 2
        below = student_t_half_mass(mid, df, points) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return torch.sign(p.double() - 0.5) * math.sqrt(df) * torch.tan((lo + hi) / 2)


def student_t_half_mass(theta: torch.Tensor, df: float, points: int = 4001) -> torch.Tensor:
    """P(0 < T < √ν·tan θ) for each θ in (−π/2, π/2) (negative where θ is): with t = √ν·tan θ the CDF is
    ½ + c_ν ∫₀^θ cos^(ν−1) φ dφ, c_ν = Γ((ν+1)/2) / (√π Γ(ν/2)), a bounded integrand on a finite range for ν ≥ 1,
    integrated by Simpson's rule (`points` odd), float64."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    theta = theta.double()
    phi = theta[..., None] * torch.linspace(0.0, 1.0, points, dtype=torch.float64)
    f = torch.cos(phi) ** (df - 1)
    simpson = f[..., 0] + f[..., -1] + 4 * f[..., 1:-1:2].sum(-1) + 2 * f[..., 2:-1:2].sum(-1)
    return c * theta / (points - 1) / 3 * simpson


def standard_cdf(family: str, x: torch.Tensor, df: float | None = None) -> torch.Tensor:
    """The CDF of the Gaussian or Student-t standard law at each x, float64 (the Cauchy law's truncated quantiles are
    the package's, `cauchy_quantile`)."""
    x = x.double()
    if family == "gaussian":
        return torch.special.ndtr(x)
    if family == "student_t":
        return 0.5 + student_t_half_mass(torch.atan(x / math.sqrt(df)), df, points=201)
    raise ValueError(f"unknown family {family!r}: choose gaussian or student_t")


def standard_quantiles(family: str, p: torch.Tensor, df: float | None = None) -> torch.Tensor:
    """The quantile of the Gaussian or Student-t standard law at each level p in (0, 1), float64."""
    p = p.double()
    if family == "gaussian":
        return torch.special.ndtri(p)
    if family == "student_t":
        return student_t_quantiles(p, df)
    raise ValueError(f"unknown family {family!r}: choose gaussian or student_t")


def truncated_quantile(family: str, loc: torch.Tensor, scale: torch.Tensor, p: float, support: tuple[float, float],
                       df: float | None = None) -> torch.Tensor:
    """The p-quantile of loc + scale·X given that it lies in `support` = (low, high), X `family`'s standard law:
    loc + scale·F⁻¹(F(a) + p·(F(b) − F(a))) with a, b the standardised ends. The law a head would give if told the
    target's range, as the digits LM's answers know it. A row whose law puts no float64 mass on the range gets the
    nearer end. The Cauchy law's is the package's reading (`causalqwen_adapter.cauchy.cauchy_quantile`)."""
    loc, scale = loc.double(), scale.double()
    if family == "cauchy":
        from causalqwen_adapter.cauchy import cauchy_quantile

        return cauchy_quantile(loc, scale, p, support)
    low, high = support
    f_low = standard_cdf(family, (low - loc) / scale, df)
    f_high = standard_cdf(family, (high - loc) / scale, df)
    inside = f_high > f_low
    level = torch.where(inside, f_low + p * (f_high - f_low), torch.full_like(loc, 0.5)).clamp(1e-300, 1 - 1e-16)
    value = loc + scale * standard_quantiles(family, level, df)
    nearer = torch.where(loc < low, torch.full_like(loc, low), torch.full_like(loc, high))
    return torch.where(inside, value, nearer).clamp(low, high)


def central_interval(family: str, loc: torch.Tensor, scale: torch.Tensor, level: float, df: float | None = None):
    """(lower, upper) of the central `level` interval of loc + scale·X, X the standard law: its (1 ∓ level)/2
    quantiles."""
    q = standard_quantile(family, (1 + level) / 2, df)
    loc, scale = loc.double(), scale.double()
    return loc - scale * q, loc + scale * q


def coverage(lower: torch.Tensor, upper: torch.Tensor, y: torch.Tensor) -> float:
    """Share of targets inside [lower, upper]."""
    y = y.double()
    return ((lower <= y) & (y <= upper)).double().mean().item()


def mean_width(lower: torch.Tensor, upper: torch.Tensor) -> float:
    return (upper.double() - lower.double()).mean().item()


def interval_score(lower: torch.Tensor, upper: torch.Tensor, y: torch.Tensor, level: float) -> float:
    """Mean Winkler score of central `level` intervals: width + (2/α)·distance outside, α = 1 − level (lower is better;
    a proper score for the (α/2, 1 − α/2) quantiles)."""
    alpha = 1 - level
    lower, upper, y = lower.double(), upper.double(), y.double()
    below = (lower - y).clamp_min(0)
    above = (y - upper).clamp_min(0)
    return (upper - lower + 2 / alpha * (below + above)).mean().item()


def conformal_offset(lower: torch.Tensor, upper: torch.Tensor, y: torch.Tensor, level: float) -> float:
    """Split-conformal offset of central `level` intervals (conformalized quantile regression, Romano, Patterson and
    Candès 2019): the ⌈(n + 1)·level⌉-th smallest of max(lower − y, y − upper) over n calibration rows, inf where
    that rank exceeds n. Widening every interval by it (narrowing, when negative) covers a new exchangeable row with
    probability ≥ level, whatever the head's law."""
    conformity = torch.maximum(lower.double() - y.double(), y.double() - upper.double())
    rank = math.ceil((len(y) + 1) * level)
    return math.inf if rank > len(y) else conformity.sort().values[rank - 1].item()


def widen(lower: torch.Tensor, upper: torch.Tensor, offset: float):
    """[lower − offset, upper + offset], a negative offset stopping at the interval's midpoint (never inverted)."""
    lower, upper = lower.double(), upper.double()
    middle = (lower + upper) / 2
    return torch.minimum(lower - offset, middle), torch.maximum(upper + offset, middle)


def calibrated_intervals(validation: dict, y_validation: torch.Tensor, test: dict) -> dict:
    """Each level's test intervals widened by the conformal offset of the same head's validation intervals."""
    return {level: widen(*test[level], conformal_offset(*validation[level], y_validation, level)) for level in test}


def median_absolute_error(median: torch.Tensor, y: torch.Tensor) -> float:
    return (median.double() - y.double()).abs().median().item()


def mean_and_standard_error(values) -> tuple[float, float]:
    values = [float(v) for v in values]
    if len(values) < 2 or not all(map(math.isfinite, values)):  # an infinite score (no finite conformal offset on
        return statistics.fmean(values), float("nan")  # a small validation set) has no spread; stdev would raise
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def interval_metrics(intervals: dict, y, prefix: str = "") -> dict:
    """Coverage, mean width and Winkler score of each level's (lower, upper); `score`, their mean Winkler score, is
    what the learning rate is picked by."""
    out = {}
    for level, (lower, upper) in intervals.items():
        out[f"{prefix}coverage_{level}"] = coverage(lower, upper, y)
        out[f"{prefix}width_{level}"] = mean_width(lower, upper)
        out[f"{prefix}winkler_{level}"] = interval_score(lower, upper, y, level)
    out[f"{prefix}score"] = statistics.fmean(out[f"{prefix}winkler_{level}"] for level in intervals)
    return out
