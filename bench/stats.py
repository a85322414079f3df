"""How the bench scripts report a comparison on a noisy machine: the variants run interleaved, round after round;
each round gives one ratio (the two ran moments apart, so a slow moment of the machine slows both), and the figure
is the median ratio with its min–max over the rounds. One round is not a figure."""

import statistics

from causalqwen_adapter.comparison.stats import holm, paired_t, regularized_beta, t_two_sided_p  # noqa: F401


def round_ratios(numerators, denominators) -> list[float]:
    """a_i / b_i for each round i."""
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def spread(values) -> str:
    """`median (min–max)`, two decimals."""
    values = list(values)
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


# ---------------------------------------------------------------------------------------------- tests over seeds
# The pre-registered comparison (docs/evidence.md, bench/evidence_preregistered.py): paired differences per seed, a
# two-sided paired t-test on them, Holm's step-down adjustment over the declared family: the package's
# (causalqwen_adapter.comparison.stats; causalqwen compare computes them with the same code).
