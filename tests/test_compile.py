"""`torch.compile` of the model on the CPU: the decode head and the model's forward traced whole
(`fullgraph=True`) in every inference mode, through the `causalqwen` operators where they serve (dispatch.py decides
at trace time, from the arguments' shapes, dtypes and devices); the training loss compiled with few graph breaks,
loss and gradients those of eager; the trainer's `torch_compile=True`. The graphs are traced with dynamo and AOT
autograd (fake tensors, the operators' fake kernels) and run by the `aot_eager` backend: Inductor's code generation
is what takes minutes on two cores, and it is not what these tests are about.
"""

import math
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from causalqwen_adapter import CausalQwenForCausalLM, dispatch, heads, kernels
from causalqwen_adapter.cauchy import cauchy_linear_blocked, ovr_decision_scores

BACKEND = "aot_eager"
MODES = ("compatible", "standard", "causal", "sampling")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # no graph of another test reused, no recompilation limit reached
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from conftest import save_tiny_qwen2

    base = save_tiny_qwen2(tmp_path_factory.mktemp("compile-base"))
    model = CausalQwenForCausalLM.from_base(str(base)).eval()
    torch.manual_seed(5)
    with torch.no_grad():  # heads away from init: the modes' scores differ
        model.abduction.scale.weight.normal_(std=0.2)
        model.action.b_noise.uniform_(0.0, 2.0)
    return model


@pytest.fixture
def decode_operators(monkeypatch):
    """The tiny model asks for the decode operators; their CPU kernels (where the C ones do not run) count their calls
    and compute the torch functions they stand in for (their own numbers are tested in test_cpu_kernels.py, and
    Inductor would take tens of seconds to build them)."""
    monkeypatch.setattr(heads, "_FUSED_MIN_NUMEL", 0)
    monkeypatch.setattr(kernels.cpu, "c_cauchy_linear_applies", lambda *args: False)
    monkeypatch.setattr(kernels.cpu, "c_ovr_scores_applies", lambda *args: False)
    calls = {"cauchy_linear": 0, "ovr_scores": 0}
    for name, reference in (("cauchy_linear", cauchy_linear_blocked), ("ovr_scores", ovr_decision_scores)):
        def counted(*args, _name=name, _reference=reference):
            calls[_name] += 1
            return tuple(t.contiguous() for t in _reference(*args)) if _name == "cauchy_linear" else _reference(*args)

        monkeypatch.setattr(kernels.compiled, name, counted)
    return calls


# the operators a decoding step runs per mode: the fused linear law (not in `compatible`, which reads loc_S alone)
# and the OvR scores (not in `compatible`, whose logits are loc_S)
EXPECTED_CALLS = {"compatible": {"cauchy_linear": 0, "ovr_scores": 0}}


@pytest.mark.parametrize("mode", MODES)
def test_the_decode_head_traces_whole_through_the_operators(model, decode_operators, mode):
    """z ↦ logits of a decoding step in one graph, through causalqwen::cauchy_linear and ovr_scores as eager decoding
    is, the logits those of eager."""
    z = torch.randn(2, 1, model.config.text_config.hidden_size)
    noise = torch.randn(2, 1, model.config.causal_size) if mode == "sampling" else None

    def decode(z, noise):
        loc_U, scale_U, loc_S, scale_S = model.causal_heads(z, mode, 0.7, noise)
        return model.mode_scores(loc_S, scale_S, mode)

    with torch.no_grad():
        eager = decode(z, noise)
        eager_calls = dict(decode_operators)
        counter = CompileCounterWithBackend(BACKEND)
        compiled_decode = torch.compile(decode, fullgraph=True, backend=counter)
        compiled = compiled_decode(z, noise)
    assert counter.frame_count == 1
    want = EXPECTED_CALLS.get(mode, {"cauchy_linear": 1, "ovr_scores": 1})
    assert eager_calls == want
    assert decode_operators == {name: 2 * n for name, n in want.items()}, "the compiled graph skipped an operator"
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    if mode == "sampling":  # a non-finite ε is refused by the compiled graph too (eager: test_generation.py)
        with pytest.raises(RuntimeError, match="causal_noise holds a value that is not finite"):
            compiled_decode(z, torch.full_like(noise, float("inf")))


def test_the_model_forward_traces_whole(model, decode_operators):
    """The causal LM's forward (backbone, heads, ε drawn inside the graph, scores) in one graph, its logits those of
    eager."""
    ids = torch.randint(1, 120, (2, 1), generator=torch.Generator().manual_seed(1))

    def forward(ids):
        out = model(input_ids=ids, inference_mode="sampling", use_cache=False)
        return out.logits, out.causal_noise

    with torch.no_grad():
        torch.manual_seed(3)
        want, want_noise = forward(ids)
        torch.manual_seed(3)
        got, got_noise = torch.compile(forward, fullgraph=True, backend=BACKEND)(ids)
    torch.testing.assert_close(got_noise, want_noise)  # aot_eager draws as eager does
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert decode_operators == {"cauchy_linear": 2, "ovr_scores": 2}


# --------------------------------------------------------------------------------------- training


# Graphs the default compile splits the heads' training loss into (graph breaks + 1), as counted here with torch 2.13:
# the target rows' nonzero() (a shape that depends on the data) in the loss's autograd.Function and at the candidates
# (candidate_loss's term has no torch.autograd.grad since its gradient is written by hand: 11 before). The bound is
# what was seen: more is a regression.
LOSS_GRAPHS = 10


def test_the_training_loss_compiles_with_few_graph_breaks(model):
    """`torch.compile` (breaks allowed) of the heads' training loss: loss and gradients those of eager, in at most
    `LOSS_GRAPHS` graphs."""
    z = torch.randn(12, model.config.text_config.hidden_size, generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_of(z, targets):
        return model.heads_loss(z, targets).loss

    eager = loss_of(z, targets)
    eager_grads = torch.autograd.grad(eager, params)
    counter = CompileCounterWithBackend(BACKEND)
    compiled = torch.compile(loss_of, backend=counter)(z, targets)
    grads = torch.autograd.grad(compiled, params)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert counter.frame_count <= LOSS_GRAPHS, f"{counter.frame_count} graphs: a new graph break"


# --------------------------------------------------------------------------------------- the CUDA registration


def test_a_compiled_decode_reaches_the_triton_kernels(model, monkeypatch):
    """kernels/cuda.py's registration (the Triton kernels, run by Triton's interpreter on CPU tensors: registered for
    the CPU for the test, as test_cuda_operators.py does) serves the compiled graph: its queries decide at trace time,
    the graph calls the operators, they run the Triton kernels, and the logits are the torch code's."""
    pytest.importorskip("triton")
    from test_kernels_triton import kt

    if not kt.INTERPRETED:
        pytest.skip("the Triton kernels are compiled for the GPU in this run (test_cuda_operators.py covers it)")
    calls = {"cauchy_linear_triton": 0, "ovr_scores_triton": 0}
    for name in calls:
        def counted(*args, _fn=getattr(kt, name), _name=name):
            calls[_name] += 1
            return _fn(*args)

        monkeypatch.setattr(kt, name, counted)
    monkeypatch.setattr(dispatch, "_serving", set())
    monkeypatch.setattr(dispatch, "_told", set())
    monkeypatch.setattr(kernels.ops, "QUERIES", dict(kernels.ops.QUERIES))
    z = torch.randn(2, 1, model.config.text_config.hidden_size)

    def decode(z):
        return model.mode_scores(*model.causal_heads(z, "standard")[2:], "standard")

    with torch.no_grad():
        monkeypatch.setattr(heads, "_FUSED_DECODE", False)
        want = decode(z)  # the torch code
        monkeypatch.setattr(heads, "_FUSED_DECODE", True)
        monkeypatch.setattr(heads, "_FUSED_MIN_NUMEL", 0)
        with warnings.catch_warnings(), torch.library._scoped_library("causalqwen", "IMPL") as library:
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the CPU's, restored after
            kernels.cuda.register("CPU", kernels=kt, library=library)
            got = torch.compile(decode, fullgraph=True, backend=BACKEND)(z)
    assert calls == {"cauchy_linear_triton": 1, "ovr_scores_triton": 1}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_trainer_trains_with_torch_compile(sft_base, tmp_path):
    """`torch_compile=True`: the trainer runs the compiled model (dynamo's graphs run eagerly here: the `eager`
    backend, Inductor's build would take minutes), and its first step's loss is eager's."""
    from causalqwen_adapter.trainer import CausalSFTTrainer

    from trainer_helpers import _args, _losses, _prompt_completion

    losses = {}
    for compiled in (False, True):
        options = {"torch_compile": True, "torch_compile_backend": "eager"} if compiled else {}
        trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path / str(compiled), max_steps=1, **options),
                                   train_dataset=_prompt_completion())
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule) is compiled
        losses[compiled] = _losses(trainer)
    assert list(losses[True]) == [1] and math.isfinite(losses[True][1])
    assert losses[True][1] == pytest.approx(losses[False][1], rel=1e-5)
