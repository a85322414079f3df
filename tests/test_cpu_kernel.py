"""The decode kernels (cpu_kernel.py): one read of W_A for loc_S and scale_S, and the OvR modes' scores, against
float64 references."""

import pytest
import torch

from causalqwen_adapter import cpu_kernel
from causalqwen_adapter.cauchy import ovr_decision_scores

from conftest import decision_scores_float64

DTYPES = [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not cpu_kernel.available(torch.bfloat16),
                                                          reason="needs an x86-64 CPU with AVX512-BF16 and cc")),
    pytest.param(torch.float32, marks=pytest.mark.skipif(not cpu_kernel.available(torch.float32),
                                                         reason="needs an x86-64 CPU with AVX-512 and cc")),
]
# one rounding to bf16 (relative step 2⁻⁸) / float32 sums of up to 100 products
TOLERANCE = {torch.bfloat16: (2**-8, 1e-3), torch.float32: (1e-6, 1e-4)}


def _reference(loc_U, scale_U, weight, bias):
    """docs/design.md's linear law in float64 on the same inputs: W x + b and |W| s."""
    w = weight.double()
    loc = loc_U.double() @ w.T + (0 if bias is None else bias.double())
    return loc, scale_U.double() @ w.abs().T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab, size", [(1031, 64), (4099, 100), (517, 33), (96, 7)])  # C: 2·32, 3·32 + 4, 33, < 32
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 11, 16, 23, 24])  # ≤ 4: one W row a step; then pairs × 4 rows
def test_kernel_matches_float64_reference(dtype, vocab, size, rows):
    generator = torch.Generator().manual_seed(rows * 1000 + size)
    weight = torch.randn(vocab, size, generator=generator).to(dtype)
    bias = torch.randn(vocab, generator=generator).to(dtype)
    loc_U = torch.randn(rows, 1, size, generator=generator).to(dtype)
    scale_U = torch.rand(rows, 1, size, generator=generator).to(dtype)
    relative, absolute = TOLERANCE[dtype]
    for b in (bias, None):
        got = cpu_kernel.cauchy_linear_cpu(loc_U, scale_U, weight, b)
        assert got is not None
        for value, want in zip(got, _reference(loc_U, scale_U, weight, b)):
            assert value.dtype == dtype and value.shape == (rows, 1, vocab)
            err = (value.double() - want).abs()
            assert (err <= want.abs() * relative + absolute).all(), f"max error {err.max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_takes_the_sign_off_for_the_scale(dtype):
    """scale_S uses |W|: a weight and its negation give the same scale_S and opposite loc_S."""
    weight = torch.randn(200, 40).to(dtype)
    loc_U, scale_U = torch.randn(3, 40).to(dtype), torch.rand(3, 40).to(dtype)
    loc, scale = cpu_kernel.cauchy_linear_cpu(loc_U, scale_U, weight, None)
    neg_loc, neg_scale = cpu_kernel.cauchy_linear_cpu(loc_U, scale_U, -weight, None)
    assert torch.equal(neg_scale, scale) and torch.equal(neg_loc, -loc)
    assert (scale > 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_declines_what_it_does_not_compute(dtype):
    """None (the caller's other paths run) for other dtypes, views, too many rows, other autocast dtypes."""
    weight = torch.randn(300, 64).to(dtype)
    x = torch.randn(2, 64).to(dtype)
    for other in (torch.float16, torch.float64):
        assert cpu_kernel.cauchy_linear_cpu(x, x.abs(), weight.to(other), None) is None
    assert cpu_kernel.cauchy_linear_cpu(x, x.abs(), weight.T.contiguous().T, None) is None
    many = torch.randn(cpu_kernel.MAX_ROWS[dtype] + 1, 64).to(dtype)
    assert cpu_kernel.cauchy_linear_cpu(many, many.abs(), weight, None) is None
    assert cpu_kernel.cauchy_linear_cpu(x[:0], x[:0], weight, None) is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert cpu_kernel.cauchy_linear_cpu(x, x.abs(), weight, None) is None
    rows = x.double()  # rows of another dtype are cast to the weight's
    assert cpu_kernel.cauchy_linear_cpu(rows, rows.abs(), weight, None)[0].dtype == dtype


def test_kernel_compiles_into_its_cache_atomically(tmp_path, monkeypatch):
    """A fresh cache folder gets the one library and nothing half-written; a second process state reuses it."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv("CAUSALQWEN_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(cpu_kernel, "_state", {"lib": None, "tried": False})
    loaded = cpu_kernel.available()
    if not loaded and not cache.exists():
        pytest.skip("no C compiler or not x86-64 here")
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 1 and files[0].startswith("cauchy_linear_") and files[0].endswith(".so"), files
    built = (cache / files[0]).stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernel, "_state", {"lib": None, "tried": False})
    assert cpu_kernel.available() == loaded
    assert (cache / files[0]).stat().st_mtime_ns == built  # read from the cache, not compiled again


def test_without_a_compiler_decoding_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CAUSALQWEN_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))  # nor cc, gcc or clang
    monkeypatch.setattr(cpu_kernel, "_state", {"lib": None, "tried": False})
    weight = torch.randn(300, 64).bfloat16()
    x = torch.randn(2, 64).bfloat16()
    assert cpu_kernel.cauchy_linear_cpu(x, x.abs(), weight, None) is None
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


def test_an_unloadable_library_warns_and_decoding_falls_back(monkeypatch, tmp_path, caplog):
    """A cached file that is not a loadable library (disk full mid-copy, another machine's): a warning that says what
    happens, and decoding takes the matmuls."""
    broken = tmp_path / "cauchy_linear_broken.so"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setattr(cpu_kernel, "_compile", lambda compiler: broken)
    monkeypatch.setattr(cpu_kernel, "_state", {"lib": None, "tried": False})
    if cpu_kernel.platform.machine().lower() not in ("x86_64", "amd64") or cpu_kernel.shutil.which("cc") is None:
        pytest.skip("the kernel is not tried here")
    weight = torch.randn(300, 64).bfloat16()
    x = torch.randn(2, 64).bfloat16()
    with caplog.at_level("WARNING", logger=cpu_kernel.__name__):
        assert cpu_kernel.cauchy_linear_cpu(x, x.abs(), weight, None) is None
    assert "falls back to matmuls" in caplog.text and "cauchy_linear_broken.so" in caplog.text


# --------------------------------------------------------------------------------------- the decision scores

SCORE_DISTRIBUTIONS = ["accept_once", "accept", "normalize"]


def _score_inputs(dtype, rows, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    loc_S = (torch.randn(rows, 1, vocab, generator=generator) * 3).to(dtype)
    scale_S = (torch.rand(rows, 1, vocab, generator=generator) + 0.05).to(dtype)
    return loc_S, scale_S


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("distribution", SCORE_DISTRIBUTIONS)
@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("vocab", [4099, 16, 5])  # a masked last vector, exactly one, less than one
def test_scores_match_float64_reference(dtype, distribution, relative, vocab):
    """cauchy.ovr_decision_scores in C: each mode's logits within float32's rounding of docs/design.md's formulas,
    with one threshold or one per token, at 1 and 3 rows."""
    for rows in (1, 3):
        loc_S, scale_S = _score_inputs(dtype, rows, vocab, seed=vocab + rows)
        shift = -8.0 if relative else 0.0  # near log-probabilities under relative thresholds
        for threshold in (torch.tensor(shift + 0.5), torch.randn(vocab) + shift):
            got = cpu_kernel.ovr_scores_cpu(loc_S, scale_S, threshold, relative, distribution)
            want = decision_scores_float64(loc_S, scale_S, threshold, relative, distribution)
            assert got.dtype == torch.float32 and got.shape == want.shape
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("distribution", SCORE_DISTRIBUTIONS)
def test_scores_in_the_tails(dtype, distribution):
    """|x| from 0 to 10³⁰: a P of 10⁻³¹ keeps its digits. And the zero rows of W_A (scale 0, floored at float32's
    smallest normal by ovr_standardize, so x may overflow to ±inf and P be exactly 0): the same as the float32 torch
    code, −inf where it gives −inf, never NaN."""
    gaps = torch.tensor([0.0, 1e-3, -1e-3, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 1e3, -1e3, 1e6, -1e6])
    scales = torch.tensor([1.0, 1e-3, 1e-24, 0.0])
    loc_S = (gaps.repeat(len(scales)) + 7.0).to(dtype)  # x = gap / scale against a threshold of 7
    scale_S = scales.repeat_interleave(len(gaps)).to(dtype)
    threshold = torch.tensor(7.0)
    got = cpu_kernel.ovr_scores_cpu(loc_S, scale_S, threshold, False, distribution).double()
    assert not got.isnan().any()
    want = decision_scores_float64(loc_S, scale_S, threshold, False, distribution)
    finite_scale = scale_S > 0
    torch.testing.assert_close(got[finite_scale], want[finite_scale], rtol=1e-5, atol=1e-5)
    torch_code = ovr_decision_scores(loc_S, scale_S, threshold, False, distribution).double()
    torch.testing.assert_close(got[~finite_scale], torch_code[~finite_scale], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_decline_what_they_do_not_compute(dtype):
    loc_S, scale_S = _score_inputs(dtype, 2, 300, seed=0)
    threshold = torch.tensor(0.5)
    assert cpu_kernel.ovr_scores_cpu(loc_S.half(), scale_S.half(), threshold, True, "accept_once") is None
    assert cpu_kernel.ovr_scores_cpu(loc_S, scale_S.float() if dtype != torch.float32 else scale_S.bfloat16(),
                                     threshold, True, "accept_once") is None
    assert cpu_kernel.ovr_scores_cpu(loc_S, scale_S[:1], threshold, True, "accept_once") is None
    assert cpu_kernel.ovr_scores_cpu(loc_S, scale_S, torch.zeros(3), True, "accept_once") is None
    assert cpu_kernel.ovr_scores_cpu(loc_S, scale_S, threshold, True, "no-such-distribution") is None
    assert cpu_kernel.ovr_scores_cpu(loc_S[:0], scale_S[:0], threshold, True, "accept_once") is None
    assert cpu_kernel.ovr_scores_cpu(loc_S, scale_S, threshold, True, "accept_once") is not None
