"""bench/evidence_numbers_arms.py: the heads' laws against the densities they claim (float64 integrals), their
starting points, a diverged head scored as a loss, the Student-t head's ν learning the noise's tail."""

import math
import sys

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence_numbers_arms as arms  # noqa: E402
from test_evidence_numbers_intervals import density  # noqa: E402

# --- arms -----------------------------------------------------------------------------------------------------


def test_package_cauchy_head_starts_at_the_data_law_and_scores_its_nll():
    from causalqwen_adapter.numeric import numeric_statistics

    torch.manual_seed(0)
    z, y = torch.randn(64, 16), torch.randn(64) * 2 + 0.5
    head = arms.PackageCauchyHead(16, y)
    trained = {name for name, p in head.named_parameters() if p.requires_grad}
    assert trained == {"numeric.weight", "numeric.bias", "numeric.log_scale", "abduction.scale.weight",
                       "abduction.scale.bias"}
    median, half_iqr = numeric_statistics(y)
    loc, scale = head(z)
    assert loc.double().sub(median).abs().max() < 0.05 and scale.double().sub(half_iqr).abs().max() < 1e-3 * half_iqr
    yd, ld, sd = y.double(), loc.double(), scale.double()
    naive = [math.log(math.pi * s) + math.log1p(((v - m) / s) ** 2) for v, m, s in zip(yd.tolist(), ld.tolist(), sd.tolist())]
    assert head.nll(z, y).double().tolist() == pytest.approx(naive, rel=1e-5)


def naive_cauchy_log_mass(loc, scale, low, high, points=200001):
    """log ∫_low^high of the Cauchy density by Simpson's rule in float64."""
    x = torch.linspace(low, high, points, dtype=torch.float64)
    f = scale / (math.pi * (scale**2 + (x - loc) ** 2))
    h = (high - low) / (points - 1)
    return math.log((h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())).item())


def test_cauchy_log_mass_is_the_integrated_density():
    # inside the range, across an edge, far outside on either side (where the two angles nearly cancel: the naive
    # difference of the angles gives 0 mass there, log −inf: in float32 at 10⁴, in float64 at 10⁷)
    loc = torch.tensor([0.3, -3.9, 3.5, 5.0, -4.5, 1.0, 60.0, -60.0, 1e4, -1e7])
    scale = torch.tensor([0.5, 1.0, 3.0, 2.0, 0.7, 20.0, 1e-3, 0.5, 1e-2, 1e-3])
    got = arms.cauchy_log_mass(loc, scale, (-4.05, 4.05))
    assert got.dtype == torch.float64
    for i in range(len(loc)):
        ref = naive_cauchy_log_mass(loc[i].item(), scale[i].item(), -4.05, 4.05)
        assert got[i].item() == pytest.approx(ref, rel=1e-6, abs=1e-9), i
    naive = torch.log((torch.atan((4.05 - loc) / scale) - torch.atan((-4.05 - loc) / scale)) / math.pi)
    assert naive[-1].item() == float("-inf") and math.isfinite(got[-1].item())


def test_range_cauchy_head_is_a_density_on_the_range():
    torch.manual_seed(2)
    z, y = torch.randn(3, 8), torch.randn(64) * 2
    head = arms.RangeCauchyHead(8, y)
    low, high = arms.SUPPORT
    grid = torch.linspace(low, high, 40001, dtype=torch.float64)
    with torch.no_grad():
        for row in z:
            density = (-head.nll(row.expand(len(grid), -1), grid.float())).exp()
            assert torch.trapezoid(density, grid).item() == pytest.approx(1.0, abs=1e-4)
            # the package head's density, renormalised on the range
            loc, scale = head(row[None])
            plain = (-arms.PackageCauchyHead.nll(head, row[None], y[:1])).exp().double()
            mass = math.exp(naive_cauchy_log_mass(loc.item(), scale.item(), low, high))
            assert (-head.nll(row[None], y[:1])).exp().item() == pytest.approx(plain.item() / mass, rel=1e-5)


def test_residual_cauchy_head_starts_as_the_package_head_and_bends():
    torch.manual_seed(3)
    z, y = torch.randn(256, 6), torch.randn(256)
    torch.manual_seed(4)
    plain = arms.PackageCauchyHead(6, y)
    torch.manual_seed(4)
    residual = arms.ResidualCauchyHead(6, y)
    with torch.no_grad():
        for got, want in zip(residual(z), plain(z)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a median that is not linear in z, z₀², which no line follows on any half of the rows (|z₀| would be: the
    # Cauchy fit of a line takes one branch and leaves the other as outliers, a median error near 0)
    target = z[:, 0].square()
    heads = {arm: arms.train_head(arm, z, target, lr=1e-2, steps=400, batch_size=64, seed=0)
             for arm in ("cauchy", "cauchy_residual")}
    with torch.no_grad():
        error = {arm: (head(z)[0] - target).abs().median().item() for arm, head in heads.items()}
    assert error["cauchy_residual"] < 0.5 * error["cauchy"], error


@pytest.mark.parametrize("family", ["gaussian", "student_t", "cauchy"])
def test_location_scale_head_nll_is_the_family_density(family):
    torch.manual_seed(1)
    z, y = torch.randn(32, 8), torch.randn(32) * 3
    head = arms.LocationScaleHead(8, y, family)
    loc, scale = (t.double().tolist() for t in head(z))
    df = head.law().get("df")
    naive = [-math.log(density(family, torch.tensor((v - m) / s, dtype=torch.float64), df).item() / s)
             for v, m, s in zip(y.double().tolist(), loc, scale)]
    assert head.nll(z, y).double().tolist() == pytest.approx(naive, rel=1e-5)


def test_a_diverged_head_scores_inf_instead_of_raising():
    torch.manual_seed(0)
    z, y = torch.randn(16, 8), torch.randn(16)
    head = arms.LocationScaleHead(8, y, "gaussian")
    with torch.no_grad():
        head.log_scale.bias.fill_(float("nan"))
    assert arms.score_head(head, z, y) == {"diverged": True, "score": float("inf")}


def test_student_t_head_learns_the_tail_of_its_noise():
    # ν starts at 4: it must leave it within the budget, down for Cauchy noise, up for Gaussian noise
    torch.manual_seed(0)
    z = torch.randn(2000, 8)
    noise = {"cauchy": torch.distributions.Cauchy(0.0, 0.3).sample((2000,)), "gaussian": 0.3 * torch.randn(2000)}
    df = {}
    for name, eps in noise.items():
        head = arms.train_head("student_t", z, z[:, 0] + eps, lr=1e-3, steps=200, batch_size=256, seed=0)
        df[name] = head.law()["df"]
    assert df["cauchy"] < 2.0 and df["gaussian"] > 8.0, df
