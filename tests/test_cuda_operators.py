"""The `causalqwen` operators as kernels/cuda.py registers them for CUDA (the Triton kernels), run here on the CPU:
the same registration made for the CPU dispatch key, for the length of a test, with the kernels decorated for
Triton's interpreter. The training loss then takes its accelerator shape (one block spanning the vocabulary, the
|W| products from W) and must equal the float64 reference, as the torch code does; decoding's operators must equal
the torch functions they stand in for.
"""

import math
import sys
import warnings

import pytest
import torch

pytest.importorskip("triton")

# kt: the interpreted copy of the Triton kernels
from test_kernels_triton import ALL_FLAGS, _cpu, _dev, _run_tile, _tile_inputs, kt  # noqa: E402
from test_lm_loss import check  # noqa: E402
from test_losses import check_against_reference, make_inputs  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from causalqwen_adapter import dispatch, kernels  # noqa: E402
from causalqwen_adapter.candidate_loss import (  # noqa: E402
    CANDIDATE_CHUNK_BYTES_PER_ROW,
    candidate_chunk_tokens,
    candidate_ovr_loss,
    candidate_rows,
)
from causalqwen_adapter.cauchy import cauchy_linear, ovr_decision_scores  # noqa: E402
from causalqwen_adapter.lm_loss import chunked_lm_loss  # noqa: E402
from causalqwen_adapter.losses import (  # noqa: E402
    DecisionHead,
    chunk_tokens,
    liger_logits_bytes,
    loss_shape,
    ovr_loss_shape,
)

from conftest import REPO_ROOT  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
if not kt.INTERPRETED:  # TRITON_INTERPRET=0 on a GPU: the real CUDA registration runs in the device-fixture tests
    pytest.skip("the Triton kernels are compiled for the GPU in this run", allow_module_level=True)

KERNELS = ("loss_tile_triton", "block_logsumexp_triton", "abs_linear_triton", "abs_matmul_triton",
           "ovr_scores_triton", "cauchy_linear_triton", "candidate_term_triton")


@pytest.fixture
def triton_operators(monkeypatch):
    """The CUDA registration, made for the CPU until the test ends; counts the Triton calls by kernel."""
    calls = dict.fromkeys(KERNELS, 0)
    for name in KERNELS:
        def counted(*args, _fn=getattr(kt, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(kt, name, counted)
    monkeypatch.setattr(dispatch, "_serving", set())  # what this process has seen served ends with the test
    monkeypatch.setattr(dispatch, "_told", set())
    monkeypatch.setattr(kernels.ops, "QUERIES", dict(kernels.ops.QUERIES))  # the fake queries' too
    with warnings.catch_warnings(), torch.library._scoped_library("causalqwen", "IMPL") as library:
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the CPU's, restored after
        kernels.cuda.register("CPU", kernels=kt, library=library)
        yield calls


def test_the_accelerator_shape_is_one_vocabulary_block_in_liger_kernels_budget():
    """One block spans the vocabulary; a chunk's [chunk × V] buffers, tile_bytes per element, are the most that fit
    the bytes of Liger-Kernel's logits at its chunk (next_power_of_2(⌈N / ⌈V / C⌉⌉) tokens, itemsize 2)."""
    cuda = torch.device("cuda")

    def pow2_ceil(x):
        return 2 ** math.ceil(math.log2(max(1, x)))

    cases = [(16384, 151936, 896, 2.01), (8192, 151936, 896, 12), (32768, 151936, 3584, 3), (131072, 32000, 4096, 2),
             (100, 49152, 576, 12), (1, 1000, 64, 2), (0, 10, 4, 4), (4096, 262144, 640, 12), (10**6, 10**9, 8, 4),
             (10**6, 151936, 896, 32)]
    for n, vocab, width, tile_bytes in cases:
        liger_bytes = pow2_ceil(math.ceil(max(n, 1) / math.ceil(vocab / width))) * vocab * 2
        chunk, block = loss_shape(cuda, n, vocab, width, 2, tile_bytes)
        assert block == vocab and chunk >= 1, (n, vocab, width, tile_bytes)
        assert chunk == 1 or chunk * vocab * tile_bytes <= liger_bytes < (chunk + 1) * vocab * tile_bytes
    assert loss_shape(cuda, 16384, 151936, 896, 2, 2.01)[0] == 127  # Liger: 128 tokens of bf16 logits alone
    assert loss_shape(torch.device("cpu"), 16384, 151936, 896, 4, 32) == (chunk_tokens(151936, 4), 4096)
    # the distillation tail's loss: float32 tiles on an accelerator, three with the operator and five without; its
    # own cache-sized shape here
    assert ovr_loss_shape(cuda, 16384, 151936, 896, True) == loss_shape(cuda, 16384, 151936, 896, 4, 12) == (42, 151936)
    assert ovr_loss_shape(cuda, 16384, 151936, 896, False) == (25, 151936)
    assert ovr_loss_shape(torch.device("cpu"), 16384, 151936, 896, True) == (1024, 2048)


@pytest.mark.parametrize("options", [
    dict(),
    dict(relative_threshold=False, threshold="scalar_learnable"),
    dict(ovr_trains_location=True, softmax_weight=0.5),
    dict(ovr=False),
    dict(bias=False, num_items_in_batch=20),
], ids=["default", "absolute-threshold", "trains-location", "softmax", "no-bias"])
def test_loss_with_the_gpu_operators_matches_float64(triton_operators, options):
    options = dict(options)
    tensors, labels = make_inputs(13, 8, 37, threshold=options.pop("threshold", "vector"),
                                  bias=options.pop("bias", True))
    check(tensors, labels, chunk_size=4, vocab_chunk_size=37, **options)  # the accelerator's shape: V whole
    chunks = math.ceil(int((labels != -100).sum()) / 4)  # one call of each kernel per chunk
    assert triton_operators["loss_tile_triton"] == chunks and triton_operators["block_logsumexp_triton"] == chunks
    if options.get("ovr", True):  # scale_S and its gradient from W itself
        assert triton_operators["abs_linear_triton"] == chunks and triton_operators["abs_matmul_triton"] == chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_tile_writes_d_over_loc_and_g_over_scale(dtype):
    """The loss writes d over the logits and g over scale_S they come from: in place, every output is what separate
    buffers get (several row blocks and segments: each element read, then written, by one program)."""
    r, w = 9, 150
    loc, bias, lse, thr, scale, col = _tile_inputs(dtype, r, w, True, True, seed=11)
    apart = _run_tile(loc, bias, lse, thr, True, scale, col, None, 1.0, 0.5, ALL_FLAGS, segments=3)
    loc_d, scale_g = _dev(loc.clone(), scale.clone())
    args = _dev(bias, lse, thr, col)
    over = kt.loss_tile_triton(loc_d, args[0], args[1], args[2], True, scale_g, args[3], None, 1.0, 0.5, ALL_FLAGS,
                               d=loc_d, g=scale_g, segments=3)
    assert over.d is loc_d and over.g is scale_g
    for name in ("rows", "d", "g", "col_d", "col_t"):
        torch.testing.assert_close(_cpu(getattr(over, name)), _cpu(getattr(apart, name)), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gpus_single_column_sum_row_adds_into_the_gradients(triton_operators, monkeypatch, dtype):
    """With a GPU's one row of column sums the tile kernel adds Σ_rows d and π ∂ℓ/∂C straight into b_A's and the
    thresholds' gradients (nothing zero-filled per chunk): the same results, several row groups per chunk."""
    from causalqwen_adapter import lm_loss

    monkeypatch.setattr(lm_loss, "tile_thread_count", lambda device: 1)
    tensors, labels = make_inputs(13, 8, 37, dtype=dtype)
    tol = dict(rtol=1e-5, grad_rtol=1e-5) if dtype == torch.float32 else dict(rtol=4e-3, grad_rtol=3e-2)
    check(tensors, labels, ovr_trains_location=True, chunk_size=12, vocab_chunk_size=37, **tol)
    assert triton_operators["loss_tile_triton"]


def test_loss_with_the_gpu_operators_in_bfloat16(triton_operators):
    """bfloat16 products (a bf16 model, or autocast) through the Triton tile: the bf16 tolerance of test_lm_loss."""
    tensors, labels = make_inputs(13, 8, 37, dtype=torch.bfloat16)
    check(tensors, labels, rtol=4e-3, grad_rtol=3e-2, ovr_trains_location=True, chunk_size=4, vocab_chunk_size=37)
    tensors, labels = make_inputs(13, 8, 37)
    check(tensors, labels, rtol=4e-3, grad_rtol=3e-2, chunk_size=4, vocab_chunk_size=37, matmul_dtype=torch.bfloat16)
    assert triton_operators["loss_tile_triton"] and triton_operators["abs_linear_triton"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vocabulary_loss_at_a_real_ish_vocabulary(triton_operators, dtype):
    """The OvR loss over the vocabulary with the cross-entropy through the Triton operators at V = 5,003 (a prime: a
    last partial column block in every kernel, several column segments), positions without a target and three chunks
    against the float64 reference: loc_U's and the scale's gradients, written chunk by chunk into their
    rows, and b_noise's, summed chunk by chunk."""
    tensors, labels = make_inputs(23, 16, 5003, dtype=dtype, threshold="vector")
    tol = dict(rtol=1e-5, grad_rtol=1e-5) if dtype == torch.float32 else dict(rtol=4e-3, grad_rtol=3e-2)
    check(tensors, labels, ovr_trains_location=True, chunk_size=7, vocab_chunk_size=5003, **tol)
    assert triton_operators["loss_tile_triton"] == 3 and triton_operators["abs_matmul_triton"] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidates_from_the_gpu_operators_pass(triton_operators, dtype):
    """The cross-entropy's pass through the Triton operators (float32 logits with b_A added by the logsumexp
    kernel, bf16 ones too, rounded: the top-k reads them in place) finds the same candidates as
    `candidate_loss.candidate_rows`."""
    tensors, labels = make_inputs(13, 8, 37)
    head = DecisionHead(tensors["weight"].detach().to(dtype), tensors["bias"].detach().to(dtype),
                        tensors["b_noise"].detach(), tensors["threshold"].detach())
    loc_U = tensors["loc_U"].detach()
    _, stats = chunked_lm_loss(loc_U, None, head, labels, candidates=6, chunk_size=4, vocab_chunk_size=37)
    assert triton_operators["block_logsumexp_triton"]
    valid = labels != -100
    want, _ = candidate_rows(loc_U[valid], head, labels[valid], 6)
    got = stats["candidate_rows"]
    assert torch.equal(got.ids.sort(1).values, want.ids.sort(1).values) and torch.equal(got.counted[:, -1],
                                                                                        want.counted[:, -1])
    # bf16 logits + b_A rounded to bf16 (one rounding more than the reference's): test_lm_loss's bf16 tolerance
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.log_partition, want.log_partition, rtol=tol, atol=tol)


class LaunchCount(TorchDispatchMode):
    """Counts the aten operators that run a kernel (views, allocations and the `_applies` queries left out)."""

    FREE = {"view", "slice", "as_strided", "select", "unsqueeze", "squeeze", "t", "transpose", "detach", "alias",
            "reshape", "expand", "_unsafe_view", "permute", "empty", "empty_strided", "new_empty", "lift_fresh",
            "promote_types", "_local_scalar_dense"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "causalqwen" and func.__name__.split(".")[0] not in self.FREE:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loss", ["candidates pass", "candidates", "vocabulary"])
def test_launches_per_chunk_are_few_and_do_not_grow_with_the_vocabulary(triton_operators, monkeypatch, loss):
    """The loss's launches per token chunk, counted as the torch operators dispatched plus up to three per Triton
    call (a kernel, its partial sums), at two chunk counts: the difference is per chunk, and it is the same at two
    vocabulary sizes (no loop over the vocabulary). The default loss is the cross-entropy's pass, which finds the
    candidates, then the candidates' term, one kernel for every position (no launch per chunk:
    tests/test_candidate_term_kernel.py counts its launches per call)."""
    for name in ("loss_tile_triton", "block_logsumexp_triton", "abs_linear_triton", "abs_matmul_triton"):
        counted = getattr(kt, name)

        def quiet(*args, _fn=counted, **kwargs):  # the interpreter's own torch calls are not GPU launches
            with _disable_current_modes():
                return _fn(*args, **kwargs)

        monkeypatch.setattr(kt, name, quiet)

    def launches(vocab, chunks):
        tensors, labels = make_inputs(48, 8, vocab)
        labels.clamp_(min=0)
        head = DecisionHead(*(tensors[k] for k in ("weight", "bias", "b_noise", "threshold")))
        triton_operators.update(dict.fromkeys(triton_operators, 0))
        if loss == "candidates":
            _, stats = chunked_lm_loss(tensors["loc_U"].detach(), None, head, labels, candidates=16)
        with LaunchCount() as mode:
            if loss == "vocabulary":
                chunked_lm_loss(tensors["loc_U"], tensors["scale_U"], head, labels, chunk_size=48 // chunks,
                                vocab_chunk_size=vocab)
            elif loss == "candidates pass":
                chunked_lm_loss(tensors["loc_U"], None, head, labels, chunk_size=48 // chunks,
                                vocab_chunk_size=vocab, candidates=16)
            else:
                candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, labels, 16,
                                   rows=stats["candidate_rows"], chunk_size=48 // chunks)
        return mode.count + 3 * sum(triton_operators.values())

    per_chunk = [(launches(vocab, 6) - launches(vocab, 2)) / 4 for vocab in (37, 150)]
    assert per_chunk[0] == per_chunk[1] <= 50
    if loss == "candidates":
        assert per_chunk == [0, 0] and triton_operators["candidate_term_triton"] == 1
        # the torch code's chunks (the CPU's, and where no kernel serves) within Liger's logits budget
        chunk, per_row = candidate_chunk_tokens(16, 896, "cuda", 16384, 151936), 17 * 896 * CANDIDATE_CHUNK_BYTES_PER_ROW
        assert chunk * per_row <= liger_logits_bytes(16384, 151936, 896) < (chunk + 1) * per_row


def test_distillation_loss_tiles_run_on_the_gpu_operator(triton_operators):
    tensors, labels = make_inputs(13, 8, 37)
    check_against_reference(tensors, labels, 1e-5, 1e-5, chunk_size=5, vocab_chunk_size=37)
    assert triton_operators["loss_tile_triton"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("distribution", ["normalize", "accept", "accept_once"])
def test_decode_operators_equal_the_torch_functions(triton_operators, dtype, distribution):
    g = torch.Generator().manual_seed(1)
    loc_U, scale_U = torch.randn(3, 16, generator=g).to(dtype), torch.rand(3, 16, generator=g).to(dtype) + 0.1
    weight, bias = torch.randn(70, 16, generator=g).to(dtype), torch.randn(70, generator=g).to(dtype)
    loc_S, scale_S = dispatch.run_operator("cauchy_linear", loc_U, scale_U, weight, bias)
    ref_loc, ref_scale = cauchy_linear(loc_U.float(), scale_U.float(), weight.float(), bias.float())
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loc_S.float(), ref_loc, **tol)
    torch.testing.assert_close(scale_S.float(), ref_scale, **tol)
    threshold = torch.randn(70, generator=g)
    for relative in (False, True):
        scores = dispatch.run_operator("ovr_scores", loc_S, scale_S, threshold, relative, distribution)
        expected = ovr_decision_scores(loc_S, scale_S, threshold, relative, distribution)
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)
    assert triton_operators["cauchy_linear_triton"] == 1 and triton_operators["ovr_scores_triton"] == 2


def test_a_prefill_beyond_the_decode_rows_runs_the_torch_code(triton_operators):
    rows = kernels.cuda.CAUCHY_LINEAR_MAX_ROWS + 1
    x = torch.randn(rows, 8)
    assert dispatch.run_operator("cauchy_linear", x, x.abs(), torch.randn(30, 8), None) is None
    assert triton_operators["cauchy_linear_triton"] == 0


def test_the_loss_bench_runs_the_torch_code_for_the_remote_code_variant(triton_operators, monkeypatch):
    """bench/loss.py's (r) is (d) with no operator serving: the same loss and gradients, no Triton call."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    import loss as loss_bench

    monkeypatch.setattr(loss_bench, "V", 160)
    monkeypatch.setattr(loss_bench, "C", 16)
    results = {}
    for variant in ("d", "r"):
        triton_operators.update(dict.fromkeys(triton_operators, 0))
        step, params, _ = loss_bench.build_step(variant, 64)
        value = step()
        value.backward()
        results[variant] = (value.detach(), [p.grad.clone() for p in params], sum(triton_operators.values()))
    assert results["d"][2] > 0 and results["r"][2] == 0
    torch.testing.assert_close(results["r"][0], results["d"][0], rtol=1e-5, atol=1e-6)
    for got, want in zip(results["r"][1], results["d"][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.fixture
def fp32_precision():
    """Sets torch's float32 precision through its new API (torch ≥ 2.9) as the test asks, restored after: "none"
    everywhere is also what clears the state where reading the legacy `allow_tf32` raises."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision API")
    saved = torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision

    def set_precision(generic, matmul="none"):
        torch.backends.fp32_precision = generic
        torch.backends.cuda.matmul.fp32_precision = matmul

    yield set_precision
    torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = saved


@pytest.mark.parametrize("setting, expected", [
    (("tf32",), "tf32"),  # transformers' TrainingArguments(tf32=True) on torch ≥ 2.9
    (("none", "tf32"), "tf32"),
    (("tf32", "ieee"), "ieee"),
    (("none", "none"), "ieee"),
])
def test_products_under_the_new_tf32_api_pick_torchs_precision(triton_operators, fp32_precision, monkeypatch,
                                                               setting, expected):
    """Once torch.backends' new fp32_precision API is set, reading the legacy `allow_tf32` raises ("mix of the legacy
    and new APIs"): the float32 products ask the new API, run (the operators through dispatch), give float64's numbers
    and launch with torch's precision for CUDA matmuls."""
    matmul = sys.modules["causalqwen_adapter._kernels_interpreted.abs_matmul"]
    chosen = []

    def recorded(dtype, _precision=matmul._precision):
        chosen.append(_precision(dtype))
        return chosen[-1]

    monkeypatch.setattr(matmul, "_precision", recorded)
    fp32_precision(*setting)
    g = torch.Generator().manual_seed(3)
    loc_U, scale_U = torch.randn(2, 16, generator=g), torch.rand(2, 16, generator=g)
    weight, bias = torch.randn(70, 16, generator=g), torch.randn(70, generator=g)
    loc_S, scale_S = dispatch.run_operator("cauchy_linear", loc_U, scale_U, weight, bias)
    out = torch.empty(2, 70)
    dispatch.lookup_operator("abs_linear", out)(scale_U, weight, out)  # as lm_loss looks it up
    w64 = weight.double()
    # tf32 has 10 bits of mantissa: the interpreter computes float32 either way, a GPU within tf32's rounding
    tol = dict(rtol=2e-3, atol=2e-3) if expected == "tf32" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loc_S.double(), loc_U.double() @ w64.T + bias.double(), **tol)
    torch.testing.assert_close(scale_S.double(), scale_U.double() @ w64.abs().T, **tol)
    torch.testing.assert_close(out.double(), scale_U.double() @ w64.abs().T, **tol)
    assert chosen == [expected, expected]
    assert triton_operators["cauchy_linear_triton"] == triton_operators["abs_linear_triton"] == 1


def _operator_calls():
    """(name, args) of every causalqwen operator, as lm_loss, losses and heads call them (small shapes)."""
    g = torch.Generator().manual_seed(4)
    r, w, c = 5, 37, 16
    loc = torch.randn(r, w, generator=g)
    scale = torch.rand(r, w, generator=g) + 0.1
    lse = torch.logsumexp(loc, 1)
    col = torch.randint(-1, w, (r,), generator=g)
    flags = (dispatch.TILE_OVR | dispatch.TILE_D | dispatch.TILE_OVR_GRADS | dispatch.TILE_OVR_LOCATES
             | dispatch.TILE_COL_D | dispatch.TILE_COL_T)
    weight = torch.randn(w, c, generator=g)
    loc_U, scale_U = torch.randn(2, 3, c, generator=g), torch.rand(2, 3, c, generator=g)
    return [
        ("cauchy_linear", (loc_U, scale_U, weight, torch.randn(w, generator=g))),
        ("cauchy_linear", (loc_U.bfloat16(), scale_U.bfloat16(), weight.bfloat16(), None)),
        ("ovr_scores", (loc.bfloat16(), scale.bfloat16(), torch.tensor(0.5), True, "accept_once")),
        ("loss_tile", (loc, torch.randn(w, generator=g), lse, torch.randn(w, generator=g), True, scale, col, None,
                       0.5, 0.25, flags, torch.empty(r, w), torch.empty(r, w), torch.empty(4 * r), torch.zeros(1, w),
                       torch.zeros(1, w), 1)),
        ("block_logsumexp", (loc.clone(), torch.randn(w, generator=g), True, torch.empty(r), 1)),
        ("abs_linear", (scale_U[0], weight, torch.empty(3, w))),
        ("abs_matmul_add", (loc, weight, torch.zeros(r, c))),
        ("candidate_term", (loc_U[0], scale_U[0], torch.rand(c, generator=g), weight.bfloat16(),
                            torch.randint(0, w, (3, 4), generator=g), torch.randn(3, 4, generator=g),
                            torch.ones(3, 4), -torch.ones(3, 4), torch.empty(3, 4), torch.empty(3, 4),
                            torch.empty(3, c))),
    ]


def _meta(value):
    return [(t.shape, t.dtype, t.stride()) for t in (value if isinstance(value, tuple) else (value,))
            if torch.is_tensor(t)] if value is not None else None


def test_every_operator_has_a_fake_kernel_matching_the_real_one(triton_operators):
    """FakeTensorMode (what torch.compile traces with) runs every operator: its outputs have the shapes, dtypes and
    strides of the real kernel's (the Triton kernels in the interpreter), and the in-place operators return none as
    they do. torch.library.opcheck: the schema (only the arguments marked mutable are written), the fake kernel, and
    the operator under AOT dispatch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, args in _operator_calls():
        op = getattr(torch.ops.causalqwen, name)
        real = op(*[a.clone() if torch.is_tensor(a) else a for a in args])
        mode = FakeTensorMode()
        fake_args = [mode.from_tensor(a) if torch.is_tensor(a) else a for a in args]
        with mode:
            fake = op(*fake_args)
        assert _meta(fake) == _meta(real), name
        assert all(torch.is_tensor(t) and t.device.type == "cpu" for t in (fake if isinstance(fake, tuple) else ()))
        torch.library.opcheck(op, [a.clone() if torch.is_tensor(a) else a for a in args],
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert all(triton_operators.values())  # every kernel ran


def test_fake_queries_answer_as_the_devices_own(monkeypatch):
    """`<name>_applies` on fake tensors answers what the device's query answers on real ones (the package's CPU
    registration here), and False for a device no query is registered for."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from causalqwen_adapter.kernels import ops

    asked, queries = [], dict(ops.QUERIES)
    for (name, device), query in queries.items():
        monkeypatch.setitem(ops.QUERIES, (name, device), lambda *a, _q=query: asked.append(a) or _q(*a))
    for name, args in _operator_calls():
        query = queries.get((name, "cpu"))
        if query is None:  # the loss's operators: no CPU kernel, and a query of the products alone
            query, args = (lambda *a: False), args[:1]
        want = bool(query(*args))
        mode = FakeTensorMode()
        with mode:
            fake_args = [mode.from_tensor(a) if torch.is_tensor(a) else a for a in args]
            assert getattr(torch.ops.causalqwen, f"{name}_applies")(*fake_args) is want, name
        meta = [a.to("meta") if torch.is_tensor(a) else a for a in args]  # no query for the meta device
        assert getattr(torch.ops.causalqwen, f"{name}_applies")(*meta) is False
    # the decode operators' CPU queries, asked with the fake tensors
    assert len(asked) == 3 and all(isinstance(a[0], FakeTensor) for a in asked)
