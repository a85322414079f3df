"""Tests over seeds: paired differences per seed, a two-sided paired t-test on them, Holm's step-down adjustment over
a declared family, and the choice of a learning rate on validation. Plain Python (no scipy)."""

import math
import statistics


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for numerator in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            return h
    raise ArithmeticError(f"the incomplete beta function's continued fraction did not converge (a={a}, b={b}, x={x})")


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 ≤ x ≤ 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"I_x(a, b) needs 0 <= x <= 1, got {x}")
    if x in (0.0, 1.0):
        return x
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| ≥ |t|) for Student's t with `df` degrees of freedom: I_{df/(df + t²)}(df/2, ½)."""
    if df < 1:
        raise ValueError(f"a t-test needs at least one degree of freedom (two seeds), got {df}")
    if math.isnan(t):
        return float("nan")
    if math.isinf(t):
        return 0.0
    return regularized_beta(df / 2.0, 0.5, df / (df + t * t))


def t_critical(alpha: float, df: int) -> float:
    """The t with P(|T| ≥ t) = `alpha` for Student's t with `df` degrees of freedom (the half-width of a two-sided
    1 − alpha interval in standard errors), by bisection on `t_two_sided_p`."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    low, high = 0.0, 1.0
    while t_two_sided_p(high, df) > alpha:
        low, high = high, 2 * high
    for _ in range(200):
        middle = (low + high) / 2
        if t_two_sided_p(middle, df) > alpha:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


def paired_t(differences) -> dict:
    """The two-sided paired t-test of per-seed differences against 0: mean, standard error (sd/√n), t, degrees of
    freedom and p. Fewer than two differences are refused (no standard error). Differences all equal: p = 1 when they
    are 0, else 0 (t infinite)."""
    diffs = [float(d) for d in differences]
    if len(diffs) < 2:
        raise ValueError(f"a paired t-test needs two seeds or more (a standard error), got {len(diffs)}")
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    if se == 0.0:
        t = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    else:
        t = mean / se
    return {"n": len(diffs), "mean": mean, "se": se, "t": t, "df": len(diffs) - 1,
            "p": t_two_sided_p(t, len(diffs) - 1)}


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: sorted ascending p_(1) ≤ … ≤ p_(m), the adjusted
    p_(i) is max_{j ≤ i} min(1, (m − j + 1)·p_(j)); a hypothesis is rejected at level α when its adjusted p ≤ α.
    An undefined p (NaN) counts as 1: it stays in the family (the family's size is what was declared) and is never
    rejected."""
    values = [1.0 if math.isnan(p) else float(p) for p in pvalues]
    for p in values:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"a p-value must lie in [0, 1], got {p}")
    m = len(values)
    adjusted, running = [0.0] * m, 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: values[i])):
        running = max(running, min(1.0, (m - rank) * values[index]))
        adjusted[index] = running
    return adjusted


def choose_rate(validation: dict[float, float]) -> float:
    """The rate of best validation score ({rate: score}, higher better); a tie goes to the smaller rate. NaN scores
    are never chosen unless every score is NaN."""
    if not validation:
        raise ValueError("no rate to choose from")
    return max(sorted(validation), key=lambda lr: (not math.isnan(validation[lr]), validation[lr], -lr))


def mean_se(values: list[float]) -> tuple[float, float]:
    """(mean, standard error sd/√n); the s.e. of one value is NaN."""
    if len(values) < 2:
        return values[0], float("nan")
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def paired(arm: dict, baseline: dict, value=float) -> dict:
    """Per-seed differences arm − baseline ({seed: result}, `value` of each seed's result) over the seeds both ran:
    mean, standard error, n and wins."""
    seeds = sorted(set(arm) & set(baseline))
    diffs = [value(arm[s]) - value(baseline[s]) for s in seeds]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return {"seeds": seeds, "mean": statistics.fmean(diffs) if diffs else float("nan"), "se": se,
            "higher": sum(d > 0 for d in diffs)}
