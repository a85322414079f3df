"""How the bench scripts report a comparison on a noisy machine: the variants run interleaved, round after round;
each round gives one ratio (the two ran moments apart, so a slow moment of the machine slows both), and the figure
is the median ratio with its min–max over the rounds. One round is not a figure."""

import statistics


def round_ratios(numerators, denominators) -> list[float]:
    """a_i / b_i for each round i."""
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def spread(values) -> str:
    """`median (min–max)`, two decimals."""
    values = list(values)
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"
