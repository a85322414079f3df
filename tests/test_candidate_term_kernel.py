"""The candidates' term on a GPU's path (`causalqwen::candidate_term`, kernels/candidate_term.py): the Triton kernel,
run here in Triton's interpreter through the CUDA registration made for the CPU, against the float64 references of
tests/test_candidate_loss.py and against the torch code it stands in for; one launch for every position."""

import pytest
import torch

pytest.importorskip("triton")

import test_candidate_loss as references  # noqa: E402 - its tests, run with the kernel serving
from test_cuda_operators import LaunchCount, triton_operators  # noqa: E402, F401 - the fixture
from test_kernels_triton import kt  # noqa: E402
from test_losses import make_inputs  # noqa: E402

from causalqwen_adapter.candidate_loss import candidate_ovr_loss, candidate_rows  # noqa: E402
from causalqwen_adapter.losses import DecisionHead  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
if not kt.INTERPRETED:
    pytest.skip("the Triton kernels are compiled for the GPU in this run", allow_module_level=True)


@pytest.mark.parametrize("threshold", ["vector", "scalar"])
@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("k", [1, 4])
def test_the_kernel_matches_the_float64_reference(triton_operators, threshold, relative, k):  # noqa: F811
    """test_candidate_loss's float64 reference (every input's gradient, the statistics), the term computed by the
    kernel: one call for the seven positions, whatever the chunk size asked for."""
    references.test_matches_float64_reference(threshold, False, relative, k)
    assert triton_operators["candidate_term_triton"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_at_real_shapes(triton_operators, dtype):  # noqa: F811
    """C = 896 (14 column blocks), k = 16 (17 rows in a block of 32), 150 positions, bf16 rows read as such; learnt
    per-token thresholds (their gradient from the kernel's ∂ℓ/∂C)."""
    references.test_real_shapes_match_a_float64_reference(dtype, False, "vector")
    assert triton_operators["candidate_term_triton"] == 1


def _term(dtype=torch.float32, n=40, width=24, vocab=90, k=6, threshold="scalar_buffer", **kwargs):
    tensors, labels = make_inputs(n, width, vocab, dtype=dtype, threshold=threshold)
    labels.clamp_(min=0)
    head = DecisionHead(*(tensors[key] for key in ("weight", "bias", "b_noise", "threshold")))
    rows, _ = candidate_rows(tensors["loc_U"].detach(), head, labels, k)
    return lambda: candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, labels, k, rows=rows, **kwargs), \
        tensors


@pytest.mark.parametrize("threshold", ["scalar_buffer", "vector"])
def test_the_kernel_equals_the_torch_code(triton_operators, monkeypatch, threshold):  # noqa: F811
    """The same term through the kernel and through the torch code (the operator's query answering no): the loss,
    its statistics and the gradients of scale_U, b_noise and a learnt per-token threshold, within float32 rounding."""
    loss, tensors = _term(threshold=threshold, temperature=0.6, relative_threshold=threshold == "vector")
    trained = [tensors[name] for name in ("scale_U", "b_noise", "threshold") if tensors[name].requires_grad]

    def run():
        value, stats = loss()
        return (value, stats["target_prob"], stats["candidate_prob_sum"],
                *torch.autograd.grad(value, trained))

    kernel = run()
    assert triton_operators["candidate_term_triton"] == 1
    monkeypatch.setattr("causalqwen_adapter.candidate_loss.lookup_operator", lambda *args: None)
    torch_code = run()
    assert triton_operators["candidate_term_triton"] == 1
    assert len(kernel) == 3 + len(trained) >= 5
    for got, want in zip(kernel, torch_code):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)


def test_the_locations_training_runs_the_torch_code(triton_operators):  # noqa: F811
    """With trains_location the gradient reaches loc_U and W_A's rows: the kernel does not compute those, the torch
    code does."""
    loss, _ = _term(trains_location=True)
    loss()[0].backward()
    assert triton_operators["candidate_term_triton"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_whatever_the_positions(triton_operators, dtype):  # noqa: F811
    """The launches of the term (the torch operators dispatched, three for the Triton call) do not grow with the
    positions or the chunk size asked for: the kernel takes every position at once, as `loss_plan.candidate_plan`
    counts on a GPU (`candidate_call_launches`)."""
    from causalqwen_adapter.loss_plan import candidate_plan

    def launches(n, chunk):
        loss, _ = _term(dtype, n=n, chunk_size=chunk)
        calls = triton_operators["candidate_term_triton"]
        with LaunchCount() as count:
            loss()
        assert triton_operators["candidate_term_triton"] == calls + 1
        return count.count + 3

    counts = {launches(n, chunk) for n, chunk in ((40, 4), (80, 4), (80, 80))}
    plan = candidate_plan(80, 90, 24, dtype, 6, "cuda")
    assert counts == {plan.launches_per_chunk} and plan.chunks == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, width", [(64, 256), (512, 16)])
def test_the_kernels_plan_is_what_it_holds(triton_operators, monkeypatch, dtype, n, width):  # noqa: F811
    """`candidate_plan` on a GPU against the live bytes of the term through the kernel: no [chunk, k + 1, C] tensor,
    the [N, k + 1] terms and the scale's [N × C] gradient."""
    import gc

    from test_loss_plan import LiveBytes

    from causalqwen_adapter.loss_plan import candidate_plan

    def collected(*args, _fn=kt.candidate_term_triton):
        try:
            return _fn(*args)
        finally:  # the interpreter's reference cycles hold its arguments until a collection (a GPU launch does not)
            gc.collect()

    monkeypatch.setattr(kt, "candidate_term_triton", collected)

    loss, _ = _term(dtype, n=n, width=width, vocab=600, k=16)
    with LiveBytes() as seen:
        result = loss()
    del result
    assert triton_operators["candidate_term_triton"] == 1
    plan = candidate_plan(n, 600, width, dtype, 16, "cuda")
    assert seen.peak <= plan.peak_bytes <= 1.1 * seen.peak, (seen.peak, plan.peak_bytes)


def test_layouts_the_kernel_does_not_take_run_the_torch_code_or_a_copy(triton_operators):  # noqa: F811
    """loc_U and scale_U of column stride 2 (copied for the kernel), a transposed W_A, more candidates than the kernel
    takes: the loss computes, through the kernel or the torch code, never an error from the operator."""
    tensors, labels = make_inputs(12, 8, 300, threshold="scalar_buffer")
    labels.clamp_(min=0)
    head = DecisionHead(*(tensors[key] for key in ("weight", "bias", "b_noise", "threshold")))
    wide = {name: torch.stack([tensors[name].detach()] * 2, -1).flatten(1)[:, ::2].requires_grad_()
            for name in ("loc_U", "scale_U")}
    rows, _ = candidate_rows(tensors["loc_U"].detach(), head, labels, 6)
    want = candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, labels, 6, rows=rows)[0]
    assert wide["loc_U"].stride(-1) == 2
    got = candidate_ovr_loss(wide["loc_U"], wide["scale_U"], head, labels, 6, rows=rows)[0]
    torch.testing.assert_close(got, want)
    assert triton_operators["candidate_term_triton"] == 2
    transposed = DecisionHead(tensors["weight"].detach().T.contiguous().T, *head[1:])
    torch.testing.assert_close(candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], transposed, labels, 6,
                                                  rows=rows)[0], want)
    many = candidate_rows(tensors["loc_U"].detach(), head, labels, 130)[0]
    candidate_ovr_loss(tensors["loc_U"], tensors["scale_U"], head, labels, 130, rows=many)
    assert triton_operators["candidate_term_triton"] == 2  # neither of the last two through the kernel
