"""bench/evidence_numbers.py: the metric functions against naive float64 references (explicit loops; quantiles by
inverting a numerically integrated CDF), the VADER reader on a tiny synthetic archive, and the protocol's pieces."""

import importlib.util
import io
import json
import math
import random
import tarfile
from pathlib import Path

import pytest
import torch

SPEC = importlib.util.spec_from_file_location(
    "evidence_numbers", Path(__file__).resolve().parents[1] / "bench" / "evidence_numbers.py")
evidence = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(evidence)


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
    q = evidence.standard_quantile(family, p, df)
    assert naive_cdf(family, q, df) == pytest.approx(p, abs=1e-7)
    assert q == pytest.approx(naive_quantile(family, p, df), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("p", [0.6, 0.75, 0.9, 0.95, 0.975, 0.025])
def test_student_t_quantile_matches_closed_forms(p):
    # ν = 1 is the Cauchy law; ν = 2 and ν = 4 have closed-form quantiles
    assert evidence.student_t_quantile(p, 1.0) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert evidence.student_t_quantile(p, 2.0) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    alpha = 4 * p * (1 - p)
    q = math.cos(math.acos(math.sqrt(alpha)) / 3) / math.sqrt(alpha)
    assert evidence.student_t_quantile(p, 4.0) == pytest.approx(math.copysign(2 * math.sqrt(q - 1), p - 0.5), rel=1e-9)


def test_quantile_refuses_bad_levels_and_df():
    with pytest.raises(ValueError, match="level"):
        evidence.standard_quantile("gaussian", 1.0)
    with pytest.raises(ValueError, match="degrees of freedom"):
        evidence.standard_quantile("student_t", 0.9, 0.0)
    with pytest.raises(ValueError, match="family"):
        evidence.standard_quantile("laplace", 0.9)


@pytest.mark.parametrize("family, df", [("gaussian", None), ("cauchy", None), ("student_t", 3.0)])
def test_central_interval_is_the_two_tail_quantiles(family, df):
    loc = torch.tensor([0.0, -1.5, 2.0])
    scale = torch.tensor([1.0, 0.25, 3.0])
    for level in evidence.LEVELS:
        lower, upper = evidence.central_interval(family, loc, scale, level, df)
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
        got = evidence.truncated_quantile(family, loc, scale, p, (low, high), df)
        assert got.dtype == torch.float64 and ((low <= got) & (got <= high)).all()
        for i in range(len(loc)):
            ref = naive_truncated_quantile(family, loc[i].item(), scale[i].item(), p, low, high, df)
            assert got[i].item() == pytest.approx(ref, abs=2e-5), (i, p)


def test_truncated_quantile_of_a_law_far_outside_the_range():
    loc, scale = torch.tensor([60.0, -60.0]), torch.tensor([1e-3, 1e-3])
    # no float64 mass of the Gaussian law in the range: the nearer end itself
    assert evidence.truncated_quantile("gaussian", loc, scale, 0.5, (-4.05, 4.05)).tolist() == [4.05, -4.05]
    # the Cauchy tail keeps mass there, with density ∝ 1/(60 − x)² 56 000 scales out: median m solves
    # 1/(60 − m) = (1/55.95 + 1/64.05)/2
    got = evidence.truncated_quantile("cauchy", loc, scale, 0.5, (-4.05, 4.05))
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
    assert evidence.coverage(lower, upper, y) == pytest.approx(inside / len(ys), abs=1e-15)
    assert evidence.mean_width(lower, upper) == pytest.approx(sum(b - a for a, b in zip(lo, hi)) / len(lo), rel=1e-12)
    assert evidence.coverage(lower[:4], upper[:4], y[:4]) == 0.5  # bounds count as inside


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
    assert evidence.interval_score(lower, upper, y, level) == pytest.approx(total / len(y), rel=1e-12)


@pytest.mark.parametrize("level", [0.5, 0.8, 0.95])
def test_conformal_offset_is_the_rank_of_the_naive_conformity_scores(level):
    lower, upper, y = random_intervals(seed=3)
    scores = sorted(max(a - v, v - b) for a, b, v in
                    zip(lower.double().tolist(), upper.double().tolist(), y.double().tolist()))
    rank = math.ceil((len(scores) + 1) * level)  # the finite-sample rank of split conformal prediction
    assert evidence.conformal_offset(lower, upper, y, level) == scores[rank - 1]
    few = slice(0, 9)  # ⌈10 · 0.95⌉ = 10 > 9 rows: no finite offset guarantees the level
    assert evidence.conformal_offset(lower[few], upper[few], y[few], 0.95) == math.inf


def test_calibrated_intervals_reach_their_level_and_shrink_too_wide_ones():
    # Cauchy intervals on Gaussian residuals: far too wide at 95 %; calibrated on one half they cover the other
    # half at the level (exchangeable rows), and a negative offset stops at the interval's midpoint
    g = torch.Generator().manual_seed(5)
    loc, scale = torch.randn(4000, generator=g), 0.5 + torch.rand(4000, generator=g)
    y = loc + scale * torch.randn(4000, generator=g)
    levels = (0.5, 0.8, 0.95)
    intervals = {lv: evidence.central_interval("cauchy", loc, scale, lv) for lv in levels}
    half = lambda iv, part: {lv: (a[part], b[part]) for lv, (a, b) in iv.items()}  # noqa: E731
    calibrated = evidence.calibrated_intervals(half(intervals, slice(0, 2000)), y[:2000],
                                               half(intervals, slice(2000, None)))
    for lv in levels:
        lower, upper = calibrated[lv]
        assert abs(evidence.coverage(lower, upper, y[2000:]) - lv) < 0.03
        assert (lower <= upper).all()
    raw = intervals[0.95]
    assert evidence.mean_width(*calibrated[0.95]) < 0.5 * evidence.mean_width(raw[0][2000:], raw[1][2000:])
    lower, upper = evidence.widen(torch.tensor([0.0, -1.0]), torch.tensor([2.0, 5.0]), -2.0)
    assert lower.tolist() == [1.0, 1.0] and upper.tolist() == [1.0, 3.0]


def test_median_absolute_error_and_standard_error_match_loops():
    rng = random.Random(2)
    median = [rng.uniform(-4, 4) for _ in range(101)]
    y = [rng.uniform(-4, 4) for _ in range(101)]
    errors = sorted(abs(m - v) for m, v in zip(torch.tensor(median).double().tolist(), torch.tensor(y).double().tolist()))
    assert evidence.median_absolute_error(torch.tensor(median), torch.tensor(y)) == pytest.approx(errors[50], rel=1e-12)
    values = [1.0, 2.5, 4.0, 0.5, 3.0]
    mean = sum(values) / 5
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / 4) / math.sqrt(5)
    assert evidence.mean_and_standard_error(values) == pytest.approx((mean, se), rel=1e-12)


# --- the VADER reader ----------------------------------------------------------------------------------------------


def tar_bytes(files: dict) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def sdist(tmp_path, tweets: str, movies: str = "1\t-0.6\tEffective but too tepid biopic\r\n") -> Path:
    inner = tar_bytes({
        "hutto_ICWSM_2014/tweets_GroundTruth.txt": tweets.encode(),
        "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt": movies.encode(),
        "hutto_ICWSM_2014/tweets_anonDataRatings.txt": b"1\t2.7\t[3, 2]\r\n",  # raw ratings: not ground truth
    })
    path = tmp_path / "vaderSentiment-3.3.2.tar.gz"
    path.write_bytes(tar_bytes({"vaderSentiment-3.3.2/setup.py": b"",
                                "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz": inner}))
    return path


def test_reader_finds_the_ground_truth_inside_the_sdist(tmp_path):
    path = sdist(tmp_path, "1\t2.726315789\tSo lucky.\r\n2\t-1.5\tnot\tgood\r\n\r\n3\t0\tmeh")
    rows = evidence.read_vader_ratings(path)
    assert rows == [
        {"source": "movieReviewSnippets_GroundTruth.txt", "id": "1", "rating": -0.6,
         "text": "Effective but too tepid biopic"},
        {"source": "tweets_GroundTruth.txt", "id": "1", "rating": 2.726315789, "text": "So lucky."},
        {"source": "tweets_GroundTruth.txt", "id": "2", "rating": -1.5, "text": "not\tgood"},
        {"source": "tweets_GroundTruth.txt", "id": "3", "rating": 0.0, "text": "meh"},
    ]
    inner = tmp_path / "inner.tar.gz"
    with tarfile.open(path) as archive:
        inner.write_bytes(archive.extractfile("vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz").read())
    assert evidence.read_vader_ratings(inner) == rows


@pytest.mark.parametrize("line, message", [
    ("2\tnan\tbad", "line 2 \\(id '2'\\): rating 'nan' is not a finite number"),
    ("2\t-inf\tbad", "line 2 \\(id '2'\\): rating '-inf' is not a finite number"),
    ("2\t\tbad", "line 2 \\(id '2'\\): no rating"),
    ("2", "line 2 \\(id '2'\\): no rating"),
    ("2\tgood\tbad", "line 2 \\(id '2'\\): rating 'good' is not a number"),
])
def test_reader_refuses_missing_and_non_finite_ratings_naming_the_row(tmp_path, line, message):
    with pytest.raises(ValueError, match="tweets_GroundTruth.txt " + message):
        evidence.read_vader_ratings(sdist(tmp_path, f"1\t1.0\tfine\r\n{line}\r\n"))


def test_reader_refuses_an_archive_without_ground_truth(tmp_path):
    path = tmp_path / "other.tar.gz"
    path.write_bytes(tar_bytes({"README": b"nothing"}))
    with pytest.raises(ValueError, match="no \\*_GroundTruth.txt"):
        evidence.read_vader_ratings(path)


# --- arms and protocol -------------------------------------------------------------------------------------------


def test_package_cauchy_head_starts_at_the_data_law_and_scores_its_nll():
    from causalqwen_adapter.numeric import numeric_statistics

    torch.manual_seed(0)
    z, y = torch.randn(64, 16), torch.randn(64) * 2 + 0.5
    head = evidence.PackageCauchyHead(16, y)
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
    got = evidence.cauchy_log_mass(loc, scale, (-4.05, 4.05))
    assert got.dtype == torch.float64
    for i in range(len(loc)):
        ref = naive_cauchy_log_mass(loc[i].item(), scale[i].item(), -4.05, 4.05)
        assert got[i].item() == pytest.approx(ref, rel=1e-6, abs=1e-9), i
    naive = torch.log((torch.atan((4.05 - loc) / scale) - torch.atan((-4.05 - loc) / scale)) / math.pi)
    assert naive[-1].item() == float("-inf") and math.isfinite(got[-1].item())


def test_range_cauchy_head_is_a_density_on_the_range():
    torch.manual_seed(2)
    z, y = torch.randn(3, 8), torch.randn(64) * 2
    head = evidence.RangeCauchyHead(8, y)
    low, high = evidence.SUPPORT
    grid = torch.linspace(low, high, 40001, dtype=torch.float64)
    with torch.no_grad():
        for row in z:
            density = (-head.nll(row.expand(len(grid), -1), grid.float())).exp()
            assert torch.trapezoid(density, grid).item() == pytest.approx(1.0, abs=1e-4)
            # the package head's density, renormalised on the range
            loc, scale = head(row[None])
            plain = (-evidence.PackageCauchyHead.nll(head, row[None], y[:1])).exp().double()
            mass = math.exp(naive_cauchy_log_mass(loc.item(), scale.item(), low, high))
            assert (-head.nll(row[None], y[:1])).exp().item() == pytest.approx(plain.item() / mass, rel=1e-5)


def test_residual_cauchy_head_starts_as_the_package_head_and_bends():
    torch.manual_seed(3)
    z, y = torch.randn(256, 6), torch.randn(256)
    torch.manual_seed(4)
    plain = evidence.PackageCauchyHead(6, y)
    torch.manual_seed(4)
    residual = evidence.ResidualCauchyHead(6, y)
    with torch.no_grad():
        for got, want in zip(residual(z), plain(z)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a median that is not linear in z, z₀², which no line follows on any half of the rows (|z₀| would be: the
    # Cauchy fit of a line takes one branch and leaves the other as outliers, a median error near 0)
    target = z[:, 0].square()
    heads = {arm: evidence.train_head(arm, z, target, lr=1e-2, steps=400, batch_size=64, seed=0)
             for arm in ("cauchy", "cauchy_residual")}
    with torch.no_grad():
        error = {arm: (head(z)[0] - target).abs().median().item() for arm, head in heads.items()}
    assert error["cauchy_residual"] < 0.5 * error["cauchy"], error


@pytest.mark.parametrize("family", ["gaussian", "student_t", "cauchy"])
def test_location_scale_head_nll_is_the_family_density(family):
    torch.manual_seed(1)
    z, y = torch.randn(32, 8), torch.randn(32) * 3
    head = evidence.LocationScaleHead(8, y, family)
    loc, scale = (t.double().tolist() for t in head(z))
    df = head.law().get("df")
    naive = [-math.log(density(family, torch.tensor((v - m) / s, dtype=torch.float64), df).item() / s)
             for v, m, s in zip(y.double().tolist(), loc, scale)]
    assert head.nll(z, y).double().tolist() == pytest.approx(naive, rel=1e-5)


def test_split_is_a_partition_and_the_shuffle_permutes_a_fraction_of_rows():
    (train, val, test), shuffles = evidence.split_and_corrupt(100, seed=3, fraction=0.2)
    assert sorted(torch.cat([train, val, test]).tolist()) == list(range(100))
    assert (len(train), len(val), len(test)) == (60, 20, 20)
    assert len(shuffles) == 3
    for part, mapping in zip((train, val, test), shuffles):
        assert sorted(mapping.tolist()) == list(range(len(part)))  # a permutation: the targets' multiset is kept
        assert (mapping != torch.arange(len(part))).sum().item() == round(0.2 * len(part))


def test_protocol_runs_every_arm_and_condition_on_a_learnable_task():
    torch.manual_seed(0)
    z = torch.randn(200, 8)
    ratings = (z[:, 0] * 1.5 + 0.1 * torch.randn(200)).clamp(-4, 4)
    regression = [arm for arm in evidence.ARMS if arm not in evidence.DIGIT_ARMS]  # the digits arms: test_evidence_digits
    results = evidence.run_protocol(z, ratings, seeds=1, steps=150, batch_size=32, learning_rates=[1e-2],
                                    fraction=0.2, arms=regression, log=lambda *_: None)
    assert {(r["condition"], r["arm"]) for r in results} == {
        (c, a) for c in ("clean", "shuffled", "shuffled_test") for a in ["constant", *regression]}
    by = {(r["condition"], r["arm"]): r for r in results}
    for arm in regression:  # every head reads the signal in z: it beats the constant predictor's error
        assert by["clean", arm]["median_abs_error"] < 0.6 * by["clean", "constant"]["median_abs_error"]
    for row in results:  # every arm's intervals are also scored calibrated on the validation rows
        assert 0.0 <= row["calibrated_coverage_0.9"] <= 1.0 and row["calibrated_score"] > 0
    for row in results:  # and read on the ratings' range: the constant's quantiles lie inside it, nothing changes
        assert 0.0 <= row["truncated_calibrated_coverage_0.9"] <= 1.0 and row["truncated_score"] > 0
        if row["arm"] == "constant":
            assert all(row["truncated_" + k] == pytest.approx(v, abs=1e-9) for k, v in row.items()
                       if "truncated_" + k in row)
    summary = evidence.summarize(results)
    table = evidence.markdown(summary)
    assert table.count("| cauchy |") == 9 and "Winkler 95%" in table and "calibrated on the validation rows" in table
    assert "restricted to the digits LM's range" in table


@pytest.mark.parametrize("select", ["score", "nll"])
def test_protocol_reports_the_rate_with_the_best_validation_metric(select):
    torch.manual_seed(0)
    z = torch.randn(120, 4)
    ratings = z[:, 0] + 0.2 * torch.randn(120)
    results = evidence.run_protocol(z, ratings, seeds=1, steps=20, batch_size=16, learning_rates=[1e-4, 1e-2, 1e-1],
                                    fraction=0.2, arms=["cauchy", "gaussian"], select=select, log=lambda *_: None)
    for row in (r for r in results if r["arm"] != "constant"):
        scores = [c["validation"][select] for c in row["candidates"]]
        best = row["candidates"][scores.index(min(scores))]
        assert row["lr"] == best["lr"] and row["median_abs_error"] == best["test"]["median_abs_error"]


def test_a_diverged_head_scores_inf_instead_of_raising():
    torch.manual_seed(0)
    z, y = torch.randn(16, 8), torch.randn(16)
    head = evidence.LocationScaleHead(8, y, "gaussian")
    with torch.no_grad():
        head.log_scale.bias.fill_(float("nan"))
    assert evidence.score_head(head, z, y) == {"diverged": True, "score": float("inf")}


def test_student_t_head_learns_the_tail_of_its_noise():
    # ν starts at 4: it must leave it within the budget, down for Cauchy noise, up for Gaussian noise
    torch.manual_seed(0)
    z = torch.randn(2000, 8)
    noise = {"cauchy": torch.distributions.Cauchy(0.0, 0.3).sample((2000,)), "gaussian": 0.3 * torch.randn(2000)}
    df = {}
    for name, eps in noise.items():
        head = evidence.train_head("student_t", z, z[:, 0] + eps, lr=1e-3, steps=200, batch_size=256, seed=0)
        df[name] = head.law()["df"]
    assert df["cauchy"] < 2.0 and df["gaussian"] > 8.0, df


def test_paired_differences_match_a_loop():
    rng = random.Random(4)
    results = [{"seed": seed, "condition": condition, "arm": arm, **{m: rng.uniform(0, 5) for m in evidence.PAIRED_METRICS}}
               for seed in range(5) for condition in ("clean", "shuffled") for arm in ("cauchy", "gaussian")]
    results.append({"seed": 5, "condition": "clean", "arm": "gaussian", "diverged": True, "score": float("inf")})
    results.append({"seed": 5, "condition": "clean", "arm": "cauchy", **{m: 1.0 for m in evidence.PAIRED_METRICS}})
    (clean,) = [e for e in evidence.paired_differences(results) if e["condition"] == "clean"]
    for metric in evidence.PAIRED_METRICS:
        diffs = []
        for seed in range(5):  # seed 5 diverged for gaussian: left out
            a = [r[metric] for r in results if (r["seed"], r["condition"], r["arm"]) == (seed, "clean", "gaussian")][0]
            b = [r[metric] for r in results if (r["seed"], r["condition"], r["arm"]) == (seed, "clean", "cauchy")][0]
            diffs.append(a - b)
        mean = sum(diffs) / 5
        se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4 / 5)
        assert clean[metric] == pytest.approx((mean, se), rel=1e-12)


def test_extraction_is_each_prompt_alone_and_resumes(sft_base, tmp_path):
    # left padding in a batch and a resumed cache must give what one unpadded forward of each prompt gives
    from transformers import AutoTokenizer, Qwen2Model

    words = "user assistant system".split()
    rows = [{"source": "tweets_GroundTruth.txt", "id": str(i), "rating": i / 4 - 1.0,
             "text": " ".join(words[j % 3] for j in range(1 + 3 * i % 7))} for i in range(10)]
    cache = tmp_path / "not" / "yet"  # the cache folder is made where missing (the default one is, on a fresh machine)
    first = evidence.extract_features(str(sft_base), rows, 6, cache, batch_size=2)
    assert len(first["keys"]) == 6
    store = evidence.extract_features(str(sft_base), rows, 10, cache, batch_size=2)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
    assert store["keys"] == [f"tweets_GroundTruth.txt:{i}" for i in order]
    assert store["rating"] == [rows[i]["rating"] for i in order]
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    model = Qwen2Model.from_pretrained(sft_base, dtype=torch.float32).eval()
    with torch.no_grad():
        for k, i in enumerate(order):
            ids = tokenizer(evidence.PROMPT.format(text=rows[i]["text"]), return_tensors="pt").input_ids
            torch.testing.assert_close(store["z"][k], model(ids).last_hidden_state[0, -1], atol=1e-5, rtol=1e-5)


def test_mean_and_standard_error_of_infinite_scores():
    # 18 validation rows give no finite 95 % conformal offset: such scores are inf, and the summary must not raise
    mean, se = evidence.mean_and_standard_error([float("inf"), 2.0, 3.0])
    assert mean == float("inf") and math.isnan(se)
    mean, se = evidence.mean_and_standard_error([1.0, 2.0, 4.0])
    assert (mean, se) == pytest.approx((7 / 3, math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2 / 3)))


def test_runs_of_other_arms_merge_into_the_run_of_all_of_them():
    torch.manual_seed(0)
    z = torch.randn(200, 4)  # 40 validation rows: enough for a finite conformal offset at 95 %
    ratings = z[:, 0] + 0.2 * torch.randn(200)
    protocol = dict(seeds=2, steps=10, batch_size=16, learning_rates=[1e-2], fraction=0.2, log=lambda *_: None)
    meta = {"texts": 200, "seeds": 2, "steps": 10, "batch_size": 16, "learning_rates": [1e-2], "shuffle_fraction": 0.2,
            "prompt": evidence.PROMPT}

    def saved(arms):
        return {"meta": meta, "runs": json.loads(json.dumps(evidence.run_protocol(z, ratings, arms=arms, **protocol)))}

    together = saved(["cauchy", "gaussian", "cauchy_range"])["runs"]
    _, merged = evidence.merge_runs([saved(["cauchy", "gaussian"]), saved(["cauchy_range"])])
    key = lambda r: (r["seed"], r["condition"], r["arm"])  # noqa: E731
    assert sorted(merged, key=key) == sorted(together, key=key)
    assert evidence.all_paired_differences(merged) == evidence.all_paired_differences(together)
    other = {**saved(["cauchy_range"]), "meta": {**meta, "steps": 20}}
    with pytest.raises(ValueError, match="steps differ"):
        evidence.merge_runs([saved(["cauchy"]), other])
    with pytest.raises(ValueError, match="'cauchy' ran in two"):
        evidence.merge_runs([saved(["cauchy"]), saved(["cauchy", "gaussian"])])


def test_reselect_picks_what_a_run_with_that_rule_picks():
    torch.manual_seed(0)
    z = torch.randn(120, 4)
    ratings = z[:, 0] + 0.2 * torch.randn(120)
    kwargs = dict(seeds=1, steps=20, batch_size=16, learning_rates=[1e-4, 1e-2, 1e-1], fraction=0.2,
                  arms=["cauchy", "gaussian"], log=lambda *_: None)
    by_score = evidence.run_protocol(z, ratings, select="score", **kwargs)
    by_nll = evidence.run_protocol(z, ratings, select="nll", **kwargs)
    assert evidence.reselect(by_score, "nll") == by_nll
    assert evidence.reselect(by_nll, "score") == by_score
    table = evidence.markdown(evidence.summarize(by_nll), evidence.all_paired_differences(by_nll))
    # two per condition (as read, and with the laws restricted to the range); no digits run
    assert table.count("arm − cauchy (") == 3 and table.count("arm − cauchy, laws restricted to the range") == 3
    assert "arm − digits" not in table


# --- the linear ceiling (bench/evidence_numbers_ceiling.py) --------------------------------------------------------

LINEAR_SPEC = importlib.util.spec_from_file_location(
    "evidence_numbers_ceiling", Path(__file__).resolve().parents[1] / "bench" / "evidence_numbers_ceiling.py")
linear = importlib.util.module_from_spec(LINEAR_SPEC)
LINEAR_SPEC.loader.exec_module(linear)


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
