"""`loss_plan.loss_plan` against what the loss allocates and launches: `chunked_lm_loss` through the Triton kernels
(the CUDA registration made for the CPU, the kernels under Triton's interpreter), its peak of live bytes tracked
storage by storage, and its launches per chunk counted as the torch operators dispatched plus the Triton calls'."""

import gc
import sys
import weakref

import pytest
import torch

pytest.importorskip("triton")

import test_cuda_operators  # noqa: E402
from test_cuda_operators import LaunchCount, kt  # noqa: E402
from test_losses import make_inputs  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from causalqwen_adapter.kernels.cuda import TRITON_MODULES  # noqa: E402
from causalqwen_adapter.lm_loss import chunked_lm_loss  # noqa: E402
from causalqwen_adapter.loss_plan import loss_plan  # noqa: E402
from causalqwen_adapter.losses import DecisionHead  # noqa: E402

triton_operators = test_cuda_operators.triton_operators  # the fixture, by name
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of storages created inside the mode and still alive (each freed storage subtracted).
    `inside` gives a mode counting into the same totals, for the torch calls an operator makes (a mode is off while
    it runs the operator it sees)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.counts = {}, 0, 0, self

    def inside(self):
        inner = LiveBytes()
        inner.counts = self
        return inner

    def _free(self, key):
        counts = self.counts
        counts.now -= counts.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not torch.is_tensor(t):
                continue
            storage, counts = t.untyped_storage(), self.counts
            key = storage.data_ptr()
            if key in inputs or key in counts.live or storage.nbytes() == 0:
                continue
            counts.live[key] = storage.nbytes()
            counts.now += storage.nbytes()
            counts.peak = max(counts.peak, counts.now)
            weakref.finalize(storage, counts._free, key)
        return out


TRITON_CALLS = ("loss_tile_triton", "block_logsumexp_triton", "abs_linear_triton", "abs_matmul_triton")


class _Launch:
    """A Triton kernel whose launches run with the modes off: the interpreter's own torch calls stand for the
    GPU's registers and shared memory, not for allocations. The interpreter leaves its arguments in reference cycles
    (a kernel's partial sums would outlive the function that freed them): collected after each launch."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _disable_current_modes():
                self.kernel[grid](*args, **kwargs)
            gc.collect()

        return launch


def seen_inside_the_kernels(monkeypatch, seen: LiveBytes):
    """The Triton functions' own allocations (their partial sums) counted into ``seen``, their launches not."""
    package = kt.available.__module__.rpartition(".")[0]  # the interpreted copy's
    for module in (sys.modules[f"{package}.{name}"] for name in TRITON_MODULES):
        for attr, value in vars(module).copy().items():
            if attr.endswith("_kernel"):
                monkeypatch.setattr(module, attr, _Launch(value))
    for name in TRITON_CALLS:
        def counted(*args, _fn=getattr(kt, name), **kwargs):
            with seen.inside():
                return _fn(*args, **kwargs)

        monkeypatch.setattr(kt, name, counted)


def run_loss(mode, dtype, n=32, width=16, vocab=600, chunk=8):
    tensors, labels = make_inputs(n, width, vocab, dtype=dtype, threshold="scalar_buffer")
    labels.clamp_(min=0)
    head = DecisionHead(*(tensors[k] for k in ("weight", "bias", "b_noise", "threshold")))
    scale_U = tensors["scale_U"] if mode == "vocabulary" else None
    return lambda: chunked_lm_loss(tensors["loc_U"], scale_U, head, labels, chunk_size=chunk,
                                   vocab_chunk_size=vocab, candidates=16 if mode == "candidates pass" else None)


# (tokens, C, V, chunk): tiles outweighing W_A's gradient; and the per-token [N × C] tensors and the tiles weighing
# against W_A's gradient as at the real shapes (N / V ≈ 0.11, two [chunk × V] tiles ≈ V × C / 2)
PEAK_SHAPES = {"tiles": (32, 16, 600, 8), "real-ish": (64, 64, 600, 16)}


@pytest.mark.parametrize("shape", PEAK_SHAPES)
@pytest.mark.parametrize("mode", ["softmax", "candidates pass", "vocabulary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plans_peak_is_the_bytes_the_loss_holds(triton_operators, monkeypatch, shape, mode, dtype):
    """The peak of live bytes, the Triton functions' own partial sums included."""
    n, width, vocab, chunk = PEAK_SHAPES[shape]
    loss = run_loss(mode, dtype, n=n, width=width, vocab=vocab, chunk=chunk)
    seen = LiveBytes()
    seen_inside_the_kernels(monkeypatch, seen)
    with seen:
        result = loss()
    del result
    plan = loss_plan(n, vocab, width, dtype, "cpu", mode, chunk=chunk, vblock=vocab, multiprocessors=None)
    # every buffer counted, and the small per-chunk tensors modelled by their largest: never fewer bytes than held
    assert seen.peak <= plan.peak_bytes <= 1.06 * seen.peak


@pytest.mark.parametrize("mode", ["softmax", "candidates pass", "vocabulary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plans_launches_per_chunk_are_the_loss_launches(triton_operators, monkeypatch, mode, dtype):
    """Launches per chunk: torch operators dispatched plus three per Triton call (a kernel and its partials), the
    difference between 4 and 2 chunks over 2."""
    check_launches(triton_operators, monkeypatch, mode, dtype)


@pytest.mark.parametrize("mode", ["softmax", "vocabulary"])
def test_the_plans_launches_with_a_gpus_one_row_of_column_sums(triton_operators, monkeypatch, mode):
    """The GPU's path (one row of column sums, added into b_A's gradient by the kernel): 4 launches fewer."""
    from causalqwen_adapter import lm_loss
    from causalqwen_adapter import loss_plan as plan_module

    for module in (lm_loss, plan_module):
        monkeypatch.setattr(module, "tile_thread_count", lambda device: 1)
    check_launches(triton_operators, monkeypatch, mode, torch.bfloat16)


def check_launches(triton_operators, monkeypatch, mode, dtype):
    for name in ("loss_tile_triton", "block_logsumexp_triton", "abs_linear_triton", "abs_matmul_triton"):
        def quiet(*args, _fn=getattr(kt, name), **kwargs):  # the interpreter's own torch calls are not launches
            with _disable_current_modes():
                return _fn(*args, **kwargs)

        monkeypatch.setattr(kt, name, quiet)

    def launches(chunk):
        loss = run_loss(mode, dtype, chunk=chunk)
        triton_operators.update(dict.fromkeys(triton_operators, 0))
        with LaunchCount() as mode_count:
            loss()
        return mode_count.count + 3 * sum(triton_operators.values())

    per_chunk = (launches(8) - launches(16)) / 2
    plan = loss_plan(32, 600, 16, dtype, "cpu", mode, chunk=8, vblock=600, multiprocessors=None)
    assert per_chunk == plan.launches_per_chunk, (per_chunk, plan.launches_per_chunk)


def candidate_term(dtype, chunk, n=64, width=256, vocab=600, k=16, trains_location=False):
    from causalqwen_adapter.candidate_loss import candidate_ovr_loss, candidate_rows

    tensors, labels = make_inputs(n, width, vocab, dtype=dtype, threshold="scalar_buffer")
    labels.clamp_(min=0)
    head = DecisionHead(*(tensors[key] for key in ("weight", "bias", "b_noise", "threshold")))
    rows, _ = candidate_rows(tensors["loc_U"].detach(), head, labels, k)
    return lambda: candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, labels, k, rows=rows,
                                      chunk_size=chunk, trains_location=trains_location)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk, n, width", [(32, 64, 256), (2, 2048, 64)])
def test_the_candidate_terms_plan_is_what_it_holds(dtype, chunk, n, width):
    """`candidate_plan`'s peak against the candidates' term's live bytes in each of its phases: over the chunks (the
    [chunk, k + 1, C] rows dominate at C = 256) and at the end (many positions, small chunks: the [N × C] gradient
    and the [N, k + 1] terms)."""
    from causalqwen_adapter.loss_plan import candidate_plan

    loss = candidate_term(dtype, chunk, n, width)
    with LiveBytes() as seen:
        result = loss()
    del result
    plan = candidate_plan(n, 600, width, dtype, 16, "cpu", chunk=chunk)
    assert seen.peak <= plan.peak_bytes <= 1.1 * seen.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trains_location", [False, True])
def test_the_candidate_terms_launches_per_chunk_are_what_it_launches(dtype, trains_location):
    """`candidate_launches` against the candidates' term in plain torch (as on every device): the operators it
    dispatches, 4 chunks against 2; within issue 50's 50 per chunk."""
    from causalqwen_adapter.loss_plan import candidate_launches, candidate_plan

    def launches(chunk):
        term = candidate_term(dtype, chunk, trains_location=trains_location)
        with LaunchCount() as count:
            term()
        return count.count

    planned = sum(candidate_launches(dtype, trains_location).values())
    assert (launches(16) - launches(32)) / 2 == planned <= 50
    if not trains_location:
        assert candidate_plan(64, 600, 256, dtype, 16, "cpu", chunk=32).launches_per_chunk == planned
