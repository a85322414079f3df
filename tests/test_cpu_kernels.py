"""The CPU kernels (kernels/cpu.py, kernels/csrc/): the causalqwen operators on x86 CPUs with AVX-512 against float64
references, what the C kernels' `_applies` queries decline and the compiled kernels take instead, and how the library
is built, cached, verified and given up."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from causalqwen_adapter import dispatch, kernels
from causalqwen_adapter.cauchy import ovr_decision_scores

from conftest import decision_scores_float64

DTYPES = [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not kernels.cpu.available(torch.bfloat16),
                                                          reason="needs an x86-64 CPU with AVX512-BF16, c++ and ninja")),
    pytest.param(torch.float32, marks=pytest.mark.skipif(not kernels.cpu.available(torch.float32),
                                                         reason="needs an x86-64 CPU with AVX-512, c++ and ninja")),
]
# one rounding to bf16 (relative step 2⁻⁸) / float32 sums of up to 100 products
TOLERANCE = {torch.bfloat16: (2**-8, 1e-3), torch.float32: (1e-6, 1e-4)}
ops = torch.ops.causalqwen


@pytest.fixture
def kernels_everywhere(monkeypatch):
    """The queries as on a CPU where the kernels run, whatever this one has: what they decline, they decline for the
    inputs alone."""
    monkeypatch.setattr(kernels.cpu, "available", lambda dtype=torch.bfloat16: dtype in kernels.cpu.MAX_ROWS)


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
        assert kernels.cpu.c_cauchy_linear_applies(loc_U, scale_U, weight, b)
        got = ops.cauchy_linear(loc_U, scale_U, weight, b)
        for value, want in zip(got, _reference(loc_U, scale_U, weight, b)):
            assert value.dtype == dtype and value.shape == (rows, 1, vocab)
            err = (value.double() - want).abs()
            assert (err <= want.abs() * relative + absolute).all(), f"max error {err.max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_takes_the_sign_off_for_the_scale(dtype):
    """scale_S uses |W|: a weight and its negation give the same scale_S and opposite loc_S."""
    weight = torch.randn(200, 40).to(dtype)
    loc_U, scale_U = torch.randn(3, 40).to(dtype), torch.rand(3, 40).to(dtype)
    loc, scale = ops.cauchy_linear(loc_U, scale_U, weight, None)
    neg_loc, neg_scale = ops.cauchy_linear(loc_U, scale_U, -weight, None)
    assert torch.equal(neg_scale, scale) and torch.equal(neg_loc, -loc)
    assert (scale > 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_declines_what_it_does_not_compute(dtype, kernels_everywhere):
    """The query says no (the caller's other paths run) for other dtypes, views, too many rows, other autocast
    dtypes; rows of another dtype are cast to the weight's."""
    weight = torch.randn(300, 64).to(dtype)
    x = torch.randn(2, 64).to(dtype)
    for other in (torch.float16, torch.float64):
        assert not kernels.cpu.c_cauchy_linear_applies(x, x.abs(), weight.to(other), None)
    assert not kernels.cpu.c_cauchy_linear_applies(x, x.abs(), weight.T.contiguous().T, None)
    many = torch.randn(kernels.cpu.MAX_ROWS[dtype] + 1, 64).to(dtype)
    assert not kernels.cpu.c_cauchy_linear_applies(many, many.abs(), weight, None)
    assert not kernels.cpu.c_cauchy_linear_applies(x[:0], x[:0], weight, None)
    assert not kernels.cpu.c_cauchy_linear_applies(x[:, :63], x[:, :63].abs(), weight, None)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not kernels.cpu.c_cauchy_linear_applies(x, x.abs(), weight, None)
    rows = x.double()
    assert kernels.cpu.c_cauchy_linear_applies(rows, rows.abs(), weight, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_casts_rows_to_the_weights_dtype(dtype):
    weight = torch.randn(300, 64).to(dtype)
    rows = torch.randn(2, 64, dtype=torch.float64)
    loc, scale = ops.cauchy_linear(rows, rows.abs(), weight, torch.zeros(300))
    want_loc, want_scale = ops.cauchy_linear(rows.to(dtype), rows.abs().to(dtype), weight, torch.zeros(300, dtype=dtype))
    assert loc.dtype == scale.dtype == dtype and torch.equal(loc, want_loc) and torch.equal(scale, want_scale)


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
            assert kernels.cpu.c_ovr_scores_applies(loc_S, scale_S, threshold, relative, distribution)
            got = ops.ovr_scores(loc_S, scale_S, threshold, relative, distribution)
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
    got = ops.ovr_scores(loc_S, scale_S, threshold, False, distribution).double()
    assert not got.isnan().any()
    want = decision_scores_float64(loc_S, scale_S, threshold, False, distribution)
    finite_scale = scale_S > 0
    torch.testing.assert_close(got[finite_scale], want[finite_scale], rtol=1e-5, atol=1e-5)
    torch_code = ovr_decision_scores(loc_S, scale_S, threshold, False, distribution).double()
    torch.testing.assert_close(got[~finite_scale], torch_code[~finite_scale], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scores_decline_what_they_do_not_compute(dtype, kernels_everywhere):
    loc_S, scale_S = _score_inputs(dtype, 2, 300, seed=0)
    threshold = torch.tensor(0.5)
    applies = kernels.cpu.c_ovr_scores_applies
    assert not applies(loc_S.half(), scale_S.half(), threshold, True, "accept_once")
    assert not applies(loc_S, scale_S.float() if dtype != torch.float32 else scale_S.bfloat16(), threshold, True,
                       "accept_once")
    assert not applies(loc_S, scale_S[:1], threshold, True, "accept_once")
    assert not applies(loc_S, scale_S, torch.zeros(3), True, "accept_once")
    assert not applies(loc_S, scale_S, threshold, True, "no-such-distribution")
    assert not applies(loc_S[:0], scale_S[:0], threshold, True, "accept_once")
    assert applies(loc_S, scale_S, threshold, True, "accept_once")
    assert applies(loc_S, scale_S, torch.zeros(300), False, "normalize")


def test_what_c_declines_runs_compiled(monkeypatch):
    """The operators' CPU kernels run the compiled torch functions (kernels/compiled.py) where the C kernels decline
    (here float16, which C never computes, and any input on a CPU without them): the head at 1 to `FUSED_MAX_ROWS`
    rows, the scores at any, equal to float64; beyond those rows the torch code of the caller runs."""
    weight, bias = torch.randn(300, 24).half(), torch.randn(300).half()
    for rows in (1, kernels.compiled.FUSED_MAX_ROWS):
        loc_U, scale_U = torch.randn(rows, 1, 24).half(), torch.rand(rows, 1, 24).half()
        assert not kernels.cpu.c_cauchy_linear_applies(loc_U, scale_U, weight, bias)
        assert dispatch.lookup_operator("cauchy_linear", loc_U, scale_U, weight, bias) is not None
        got = ops.cauchy_linear(loc_U, scale_U, weight, bias)
        assert not kernels.compiled._fused_matvec.given_up, "torch.compile is unavailable here"
        for value, want in zip(got, _reference(loc_U, scale_U, weight, bias)):
            assert value.dtype == torch.float16 and value.shape == (rows, 1, 300)
            torch.testing.assert_close(value.double(), want, rtol=2e-3, atol=2e-2)
    many = torch.randn(kernels.compiled.FUSED_MAX_ROWS + 1, 24).half()
    assert dispatch.lookup_operator("cauchy_linear", many, many.abs(), weight, bias) is None

    loc_S, scale_S = _score_inputs(torch.float16, 3, 300, seed=1)
    threshold = torch.tensor(-6.0)
    assert not kernels.cpu.c_ovr_scores_applies(loc_S, scale_S, threshold, True, "accept_once")
    got = dispatch.run_operator("ovr_scores", loc_S, scale_S, threshold, True, "accept_once")
    assert got is not None and not kernels.compiled._decision_scores.given_up
    want = decision_scores_float64(loc_S, scale_S, threshold, True, "accept_once")
    torch.testing.assert_close((got - got[..., :1]).double(), want - want[..., :1], rtol=1e-5, atol=1e-5)

    # where torch.compile cannot run, the queries say no once it has failed, and the call that failed still answers
    monkeypatch.setattr(kernels.compiled._decision_scores, "compiled", None)
    monkeypatch.setattr(kernels.compiled.torch, "compile", lambda fn, **options: 1 / 0)
    failed = ops.ovr_scores(loc_S, scale_S, threshold, True, "accept_once")
    torch.testing.assert_close(failed, ovr_decision_scores(loc_S, scale_S, threshold, True, "accept_once"))
    assert dispatch.lookup_operator("ovr_scores", loc_S, scale_S, threshold, True, "accept_once") is None


def test_the_training_loss_has_no_cpu_kernel(kernels_everywhere):
    """Only the decode operators have CPU kernels: the loss's tiles run their torch code on the CPU, wherever the
    decode kernels run."""
    for dtype in (torch.bfloat16, torch.float32):
        tile = torch.empty(0, dtype=dtype)
        assert dispatch.lookup_operator("loss_tile", tile) is None
        assert dispatch.lookup_operator("block_logsumexp", tile) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_operators_refuse_what_they_do_not_compute(dtype):
    """Called directly, past their queries, the C kernels raise on inputs they do not compute instead of reading past
    them."""
    weight = torch.randn(300, 64).to(dtype)
    x = torch.randn(2, 64).to(dtype)
    with pytest.raises(RuntimeError):
        torch.ops.causalqwen_cpu.cauchy_linear(x, x.abs(), weight.half(), None)
    with pytest.raises(RuntimeError):
        torch.ops.causalqwen_cpu.cauchy_linear(x[:, :63], x[:, :63].abs(), weight, None)
    with pytest.raises(RuntimeError):
        torch.ops.causalqwen_cpu.ovr_scores(x, x.abs(), torch.zeros(3), True, "accept_once")
    with pytest.raises(RuntimeError):
        torch.ops.causalqwen_cpu.ovr_scores(x, x.abs(), torch.zeros(1), True, "no-such-distribution")


# --------------------------------------------------------------------------------------- where the kernels run


def test_the_environment_switch_turns_the_kernels_off(monkeypatch, tmp_path, caplog):
    """CAUSALQWEN_CPU_KERNELS=0: nothing built or loaded, the torch code runs, on any CPU (this one's flags or not)."""
    monkeypatch.setenv("CAUSALQWEN_CPU_KERNELS", "0")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(kernels.cpu, "_state", {"dtypes": None, "tried": False})
    monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda: {"avx512f", "avx512bw", "avx512_bf16"})
    monkeypatch.setattr(kernels.cpu, "build", lambda: pytest.fail("built or loaded with the switch off"))
    with caplog.at_level("INFO", logger=kernels.cpu.__name__):
        assert not kernels.cpu.available(torch.bfloat16) and not kernels.cpu.available(torch.float32)
    assert "CAUSALQWEN_CPU_KERNELS=0" in caplog.text
    assert not (tmp_path / "extensions").exists()
    if sys.platform != "linux" or kernels.cpu.platform.machine().lower() not in ("x86_64", "amd64"):
        return  # the kernels are not tried here either way
    monkeypatch.setenv("CAUSALQWEN_CPU_KERNELS", "1")  # any other value leaves the decision to the machine
    monkeypatch.setattr(kernels.cpu, "_state", {"dtypes": None, "tried": False})
    monkeypatch.setattr(kernels.cpu, "build", lambda: (_ for _ in ()).throw(RuntimeError("the build was tried")))
    monkeypatch.setattr(kernels.cpu.shutil, "which", lambda name: "/usr/bin/c++")
    monkeypatch.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: True)
    with caplog.at_level("WARNING", logger=kernels.cpu.__name__):
        assert not kernels.cpu.available(torch.float32)
    assert "the build was tried" in caplog.text


def _c_declines_at_any_rows(x, weight):
    """Where C does not run: the compiled head serves 1 to 4 rows (tested in test_what_c_declines_runs_compiled), and
    beyond, the torch code of the caller runs."""
    assert not kernels.cpu.c_cauchy_linear_applies(x, x.abs(), weight, None)
    many = x.repeat(kernels.compiled.FUSED_MAX_ROWS, 1)
    assert dispatch.run_operator("cauchy_linear", many, many.abs(), weight, None) is None


def test_without_avx512_nothing_is_built_and_the_reference_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(kernels.cpu, "_state", {"dtypes": None, "tried": False})
    monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda: {"avx2", "fma"})
    with caplog.at_level("INFO", logger=kernels.cpu.__name__):
        assert not kernels.cpu.available(torch.float32)
    assert "no AVX-512" in caplog.text
    assert not (tmp_path / "extensions").exists()
    _c_declines_at_any_rows(torch.randn(2, 64), torch.randn(300, 64))


def test_without_a_compiler_nothing_is_built_and_the_reference_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))  # nor c++, nor ninja
    monkeypatch.setattr(kernels.cpu, "_state", {"dtypes": None, "tried": False})
    monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda: {"avx512f", "avx512bw", "avx512_bf16"})
    with caplog.at_level("INFO", logger=kernels.cpu.__name__):
        assert not kernels.cpu.available(torch.bfloat16)
    assert "No C++ compiler or no ninja" in caplog.text
    assert not (tmp_path / "extensions").exists()
    _c_declines_at_any_rows(torch.randn(2, 64).bfloat16(), torch.randn(300, 64).bfloat16())


def test_a_failed_build_warns_and_the_reference_runs(monkeypatch, caplog):
    def failed_build():
        raise RuntimeError("Error building extension: kernels.cpp:1: error")

    monkeypatch.setattr(kernels.cpu, "build", failed_build)
    monkeypatch.setattr(kernels.cpu, "_state", {"dtypes": None, "tried": False})
    monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda: {"avx512f", "avx512bw", "avx512_bf16"})
    monkeypatch.setattr(kernels.cpu.shutil, "which", lambda name: "/usr/bin/c++")
    monkeypatch.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: True)
    if sys.platform != "linux" or kernels.cpu.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the kernels are not tried here")
    with caplog.at_level("WARNING", logger=kernels.cpu.__name__):
        assert not kernels.cpu.available(torch.float32)
    assert "the torch code runs instead" in caplog.text and "kernels.cpp:1: error" in caplog.text


# --------------------------------------------------------------------------------------- the library's cache

BUILD_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, logging, sys, time
    import torch
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from causalqwen_adapter import kernels
    loaded, load_library = [], torch.ops.load_library
    def spy(path):  # the sha256 of every file this process loads as a library
        loaded.append(hashlib.sha256(open(path, "rb").read()).hexdigest())
        return load_library(path)
    torch.ops.load_library = spy
    names = [kernels.cpu.extension_name()]
    start = time.perf_counter()
    library = kernels.cpu.build()
    seconds = time.perf_counter() - start
    names.append(kernels.cpu.extension_name())  # the same after a build: the next call finds the same library
    bits = torch.ops.causalqwen_cpu.supported(torch.empty(0))
    print(json.dumps({"library": str(library), "loaded": loaded, "seconds": seconds, "bits": bits, "names": names}))
    """
)
can_build = pytest.mark.skipif(
    sys.platform != "linux" or kernels.cpu.platform.machine().lower() not in ("x86_64", "amd64")
    or shutil.which(os.environ.get("CXX") or "c++") is None or shutil.which("ninja") is None,
    reason="builds on x86-64 Linux with c++ and ninja")


def _build_in_a_process(extensions: Path) -> tuple[dict, str]:
    """kernels.cpu.build() in a fresh process (a process loads one build of the library) with the extensions
    folder ``extensions``: its report and its log."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", BUILD_SCRIPT], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The library built once into a fresh extensions folder: (folder, report of the build)."""
    extensions = tmp_path_factory.mktemp("torch-extensions")
    report, log = _build_in_a_process(extensions)
    assert "Building the CPU kernels" in log
    return extensions, report


@can_build
@pytest.mark.slow
def test_the_library_builds_where_torch_puts_extensions_and_loads_from_there(built):
    """Built into TORCH_EXTENSIONS_DIR with its sha256 recorded beside it; a second process loads it from there,
    unchanged, without building."""
    extensions, report = built
    library = Path(report["library"])
    assert library.parent.parent == extensions and library.name == f"{kernels.cpu.extension_name()}.so"
    assert report["names"] == [library.stem] * 2
    record = library.with_name(library.name + ".sha256")
    assert record.read_text().strip() == _sha256(library) == report["loaded"][-1]
    flags = kernels.cpu.cpu_flags()
    f32 = {"avx512f", "avx512bw"} <= flags
    assert report["bits"] == f32 | (f32 and "avx512_bf16" in flags) << 1  # what the library finds, /proc/cpuinfo says
    built_at = library.stat().st_mtime_ns
    again, log = _build_in_a_process(extensions)
    assert "Building" not in log
    assert again["loaded"] == [_sha256(library)] and library.stat().st_mtime_ns == built_at


@can_build
@pytest.mark.slow
def test_a_corrupted_cached_library_is_rebuilt_not_loaded(built, tmp_path):
    extensions, report = built
    copy = tmp_path / "extensions"
    shutil.copytree(extensions, copy)
    library = copy / Path(report["library"]).relative_to(extensions)
    with open(library, "r+b") as f:  # a few bytes changed inside: still a file of the same size and later mtime
        f.seek(4096)
        f.write(b"\x00\xff" * 8)
    bad = _sha256(library)
    again, log = _build_in_a_process(copy)
    assert "does not match what was built" in log and "Building the CPU kernels" in log
    assert bad not in again["loaded"] and again["loaded"] == [_sha256(library)]  # one library loaded: the one built
    assert library.with_name(library.name + ".sha256").read_text().strip() == _sha256(library)


def test_the_cache_loads_only_what_its_record_names(monkeypatch, tmp_path):
    """build()'s decisions with the compiler and the loader stubbed: a library is loaded only when its bytes match the
    sha256 recorded at build time; one without a record, or with other bytes, is built again, the folder emptied
    first (a stale lock of an interrupted build included)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds, loaded = [], []

    def compile_and_load(name, sources, build_directory, **options):
        assert not any(Path(build_directory).iterdir())
        library = Path(build_directory) / f"{name}.so"
        library.write_bytes(b"library %d" % len(builds))
        builds.append(name)
        torch.ops.load_library(str(library))

    monkeypatch.setattr("torch.utils.cpp_extension.load", compile_and_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(Path(path).read_bytes()))
    library = kernels.cpu.build()
    record = library.with_name(library.name + ".sha256")
    assert builds and loaded == [b"library 0"] and record.read_text().strip() == _sha256(library)
    kernels.cpu.build()
    assert len(builds) == 1 and loaded == [b"library 0"] * 2  # from the cache
    record.unlink()
    (library.parent / "lock").write_text("")
    kernels.cpu.build()
    assert len(builds) == 2 and loaded[-1] == b"library 1" and record.read_text().strip() == _sha256(library)
    library.write_bytes(b"something else")
    kernels.cpu.build()
    assert len(builds) == 3 and b"something else" not in loaded and loaded[-1] == b"library 2"
