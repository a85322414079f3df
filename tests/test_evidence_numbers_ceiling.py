"""bench/evidence_numbers_ceiling.py: the ridge and kernel-ridge fits against their closed-form solutions, the penalty
chosen on validation, the nonlinear Cauchy head through outliers."""

import math
import sys

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence_numbers as evidence  # noqa: E402
import evidence_numbers_ceiling as linear  # noqa: E402


def test_ridge_fit_is_the_penalised_least_squares_solution():
    """Against the same problem as an ordinary least-squares one: the design stacked over √λ·I rows (intercept
    column 0 there, so it is not penalised), solved by lstsq in float64."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g), torch.randn(40, generator=g) * 3 + 1
    for penalty in (0.0, 0.5, 100.0):
        design = torch.cat([x.double(), torch.ones(40, 1, dtype=torch.float64)], 1)
        prior = torch.cat([math.sqrt(penalty) * torch.eye(6, dtype=torch.float64), torch.zeros(6, 1, dtype=torch.float64)], 1)
        want = torch.linalg.lstsq(torch.cat([design, prior]), torch.cat([y.double(), torch.zeros(6, dtype=torch.float64)])).solution
        torch.testing.assert_close(linear.ridge_fit(x, y, penalty), want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(linear.ridge_predict(x, want), design @ want)


def test_linear_ceiling_picks_the_penalty_on_validation_and_scores_the_protocols_splits():
    """Targets exactly linear in z: the smallest penalty wins on validation and the test error is ~0; noise targets
    on as many features as training rows: a large penalty wins (the fit shrinks to the intercept). Rows per seed:
    clean, shuffled, shuffled_test, on evidence_numbers' own splits and shuffles."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(200, 5, generator=g)
    exact = z @ torch.tensor([0.5, -1.0, 2.0, 0.0, 0.3]) + 0.7
    rows = linear.linear_ceiling(z, exact, seeds=2, fraction=0.2, penalties=(1e-6, 1e3))
    assert [(r["seed"], r["condition"]) for r in rows] == [(s, c) for s in (0, 1)
                                                            for c in ("clean", "shuffled", "shuffled_test")]
    assert all(r["penalty"] == 1e-6 and r["median_abs_error"] < 1e-4 for r in rows if r["condition"] == "clean")
    # seed 0's shuffled rows, recomputed: the fit on shuffled training targets, scored on clean and shuffled tests
    (train, _, test), (shuffle_train, _, shuffle_test) = evidence.split_and_corrupt(200, 0, 0.2)
    coef = linear.ridge_fit(z[train], exact[train][shuffle_train], rows[1]["penalty"])
    prediction = linear.ridge_predict(z[test], coef)
    assert rows[1]["median_abs_error"] == evidence.median_absolute_error(prediction, exact[test])
    assert rows[2]["median_abs_error"] == evidence.median_absolute_error(prediction, exact[test][shuffle_test])
    wide = torch.randn(200, 120, generator=g)
    noise = torch.randn(200, generator=g)
    picked = linear.linear_ceiling(wide, noise, seeds=2, fraction=0.2, penalties=(1e-6, 1e3))
    assert [r["penalty"] for r in picked if r["condition"] == "clean"] == [1e3, 1e3]


def test_kernel_fit_is_the_kernel_ridge_solution():
    """With a vanishing penalty the fit interpolates its training targets; with a penalty its dual coefficients solve
    (K + λI) α = y − ȳ for the RBF kernel matrix K built by loops, and it predicts k(x, rows)·α + ȳ."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(30, 4, generator=g), torch.randn(30, generator=g)
    fit = linear.kernel_fit(x, y, bandwidth=1.5, penalty=1e-9)
    torch.testing.assert_close(linear.kernel_predict(x, fit), y.double(), rtol=0, atol=1e-5)
    gram = torch.tensor([[math.exp(-float(((a - b) ** 2).sum()) / (2 * 1.5**2)) for b in x.double()] for a in x.double()],
                        dtype=torch.float64)
    fit = linear.kernel_fit(x, y, bandwidth=1.5, penalty=0.3)
    want = torch.linalg.solve(gram + 0.3 * torch.eye(30, dtype=torch.float64), y.double() - y.double().mean())
    torch.testing.assert_close(fit[1], want, rtol=1e-9, atol=1e-9)
    new = torch.randn(5, 4, generator=g).double()
    cross = torch.tensor([[math.exp(-float(((a - b) ** 2).sum()) / (2 * 1.5**2)) for b in x.double()] for a in new],
                         dtype=torch.float64)
    torch.testing.assert_close(linear.kernel_predict(new, fit), cross @ want + y.double().mean())


def test_kernel_ceiling_finds_a_nonlinear_median_the_linear_one_cannot():
    """Targets that are a nonlinear function of z (|z₀| and a product): the kernel ceiling's test error is a fraction
    of ridge's on the same splits, and each row names what validation picked."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(300, 3, generator=g)
    target = 2 * z[:, 0].abs() + z[:, 1] * z[:, 2]
    kernel = linear.kernel_ceiling(z, target, seeds=1, fraction=0.2)
    ridge = linear.linear_ceiling(z, target, seeds=1, fraction=0.2)
    assert [r["condition"] for r in kernel] == ["clean", "shuffled", "shuffled_test"]
    assert kernel[0]["penalty"] in linear.KERNEL_PENALTIES and kernel[0]["bandwidth"] in linear.BANDWIDTHS
    assert kernel[0]["median_abs_error"] < 0.5 * ridge[0]["median_abs_error"]
    # the standardisation is the training rows': a dimension scaled by 1,000 (an outlier dimension) changes nothing
    scaled = z * torch.tensor([1000.0, 1.0, 1.0])
    again = linear.kernel_ceiling(scaled, target, seeds=1, fraction=0.2)
    assert again[0]["median_abs_error"] == pytest.approx(kernel[0]["median_abs_error"], rel=1e-4)


def test_the_nonlinear_cauchy_head_fits_a_nonlinear_median_through_outliers():
    """`cauchy_mlp` on targets nonlinear in z with heavy-tailed noise: its test MedAE is below ridge's on the same
    splits; each row carries the rates it kept and its interval metrics, raw and calibrated."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(400, 3, generator=g)
    cauchy_noise = torch.tan(math.pi * (torch.rand(400, generator=g) - 0.5))
    target = 2 * z[:, 0].abs() + z[:, 1] * z[:, 2] + 0.1 * cauchy_noise
    rows = linear.cauchy_mlp_rows(z, target, seeds=1, fraction=0.2, hidden=64, steps=400)
    ridge = linear.linear_ceiling(z, target, seeds=1, fraction=0.2)
    assert [r["condition"] for r in rows] == ["clean", "shuffled", "shuffled_test"]
    clean = rows[0]
    assert clean["lr"] in linear.MLP_LEARNING_RATES and clean["weight_decay"] in linear.MLP_WEIGHT_DECAYS
    assert clean["median_abs_error"] < 0.75 * ridge[0]["median_abs_error"]
    for level in linear.LEVELS:
        assert {f"winkler_{level}", f"calibrated_winkler_{level}", f"coverage_{level}"} <= set(clean)
    assert clean["calibrated_coverage_0.95"] >= 0.85
