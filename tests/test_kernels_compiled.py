"""What Triton's interpreter does not see, checked without a GPU (tests/test_kernels_triton.py runs the kernels'
numbers): no float literal that Triton types float64, every launch on its tensors' device, every program id widened to
int64, and every launch the Triton functions make on a GPU compiled offline for sm_90 (Hopper) with the installed
Triton: no float64 arithmetic in its IR, and no register spill in ptxas's report (`ptxas -v`). A spill moves values
to local memory inside the kernels' loops; the figures are in BENCHMARKS.md (Registers).

Compiling every launch to a cubin takes minutes on two cores: that sweep is marked `extended`, left out by default
(`make test-extended` runs it); the default run compiles every launch to Triton's IR and the heaviest of each kernel's
compiled shapes (operand dtypes, precision, blocks, warps) to a cubin.
"""

import contextlib
import io
import math
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from test_kernels_triton import (  # noqa: E402
    ALL_FLAGS,
    DTYPES,
    ON_GPU,
    SCORE_DISTRIBUTIONS,
    TRITON_FILES,
    _linear_inputs,
    _package_copy,
    _tile_inputs,
    kt,
)


def test_float_literals_in_the_kernels_are_float32():
    """Triton types a float literal float64 unless 2⁻¹²⁶ ≤ |x| ≤ float32's max (or it is 0, ±inf or NaN). A float64
    literal makes the arithmetic around it float64 on a GPU (slow), and Triton 3.6 then refuses a loop-carried float32
    variable that turns float64 in the loop; the interpreter computes in numpy and shows neither."""
    import ast

    smallest, largest = 2.0**-126, (2 - 2**-23) * 2.0**127
    wide = [(path.name, node.lineno, node.value) for path in TRITON_FILES for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, float)
            and node.value != 0 and math.isfinite(node.value) and not smallest <= abs(node.value) <= largest]
    assert wide == [], f"float literals Triton types float64 (file, line, value): {wide}"


KERNELS = ("_loss_tile_kernel", "_lse_partial_kernel", "_lse_finish_kernel", "_scores_kernel", "_accept_once_kernel",
           "_cauchy_linear_kernel", "_abs_matmul_kernel", "_candidate_term_kernel")
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
                torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1"}


def _recording_copy(name, state=lambda: None):
    """(functions, modules, launches): a copy of the modules as a GPU imports them (GPU block sizes, no interpreter),
    told that they can run on any one device, whose kernels record their launches instead of running, as
    (kernel, args, kwargs, ``state()`` at the launch)."""
    module, modules = _package_copy(name, "0")
    assert not module.INTERPRETED
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs, state()))

    for each in modules:  # where each function looks these up: its own module's names
        for kernel in KERNELS:
            if kernel in vars(each):
                setattr(each, kernel, Recorder(getattr(each, kernel)))
        if "_runs_on" in vars(each):
            each.available = lambda: True
            each._runs_on = lambda *tensors: len({t.device for t in tensors if t is not None}) == 1
    return module, modules, launches


def _gpu_launches():
    """Every kernel launch the functions make on a GPU, for float32 and bf16 operands and each flag, distribution,
    float32 precision (torch's IEEE or TF32) and shape class the tests use (`_recording_copy`, on these CPU tensors)."""
    module, modules, launches = _recording_copy("_kernels_recorded")
    matmul = next(each for each in modules if "cauchy_linear_triton" in vars(each))
    for dtype in DTYPES:
        for relative in (True, False):
            for per_token in (True, False):
                loc, bias, lse, thr, scale, col = _tile_inputs(dtype, 6, 300, relative, per_token, seed=1)
                degenerate = torch.zeros(300, dtype=torch.bool)
                degenerate[[0, 7]] = True
                for flags, degen in ((ALL_FLAGS, degenerate), (ALL_FLAGS, None), (kt.TILE_D, None),
                                     (kt.TILE_OVR, None), (kt.TILE_OVR | kt.TILE_OVR_GRADS | kt.TILE_COL_T, None)):
                    assert module.loss_tile_triton(loc, bias, lse, thr, relative, scale, col, degen, 0.5, 0.25,
                                                   flags) is not None
        loc = torch.randn(5, 3000).to(dtype)
        for b in (torch.randn(3000), None):
            for store in (True, False):
                assert module.block_logsumexp_triton(loc, b, store, torch.empty(5)) is not None
        for distribution in SCORE_DISTRIBUTIONS:
            for relative in (True, False):
                for threshold in (0.5, torch.randn(3000)):
                    assert module.ovr_scores_triton(loc, loc.abs(), threshold, relative, distribution) is not None
        for precision in ("ieee", "tf32") if dtype == torch.float32 else ("tf32",):
            matmul._precision = lambda _, chosen=precision: chosen
            for rows in (1, 17):  # the decode blocks and the wider ones
                weight, bias, loc_U, scale_U = _linear_inputs(dtype, rows, 70, 40, seed=rows)
                for b in (bias, None):
                    assert module.cauchy_linear_triton(loc_U, scale_U, weight, b) is not None
                assert module.abs_linear_triton(scale_U, weight) is not None
                a = torch.randn(rows, 70).to(dtype)
                assert module.abs_matmul_triton(a, weight) is not None
                assert module.abs_matmul_triton(a, weight, torch.zeros(rows, 40), segments=1) is not None
        for d_thr, grad_scale in ((True, True), (False, True), (False, False)):  # per-token thresholds, b_noise, none
            assert module.candidate_term_triton(*_candidate_term_inputs(dtype, 9, 17, 896, d_thr, grad_scale)) is not None
        for k1 in (65, 128):  # row blocks of 128 candidates, narrower column blocks
            assert module.candidate_term_triton(*_candidate_term_inputs(dtype, 3, k1, 896)) is not None
    return module, launches


def _candidate_term_inputs(dtype, n, k1, width, d_thr=True, grad_scale=True, device="cpu"):
    """The arguments of `candidate_term_triton` for n positions of k1 candidates at ``width``."""
    weight = torch.randn(50, width).to(dtype)
    terms = [torch.randn(n, k1) for _ in range(3)]
    return (torch.randn(n, width).to(dtype), torch.rand(n, width).to(dtype), torch.rand(width), weight,
            torch.randint(0, 50, (n, k1)), *terms, torch.empty(n, k1), torch.empty(n, k1) if d_thr else None,
            torch.empty(n, width) if grad_scale else None)


def _signature(kernel, args, kwargs):
    """(signature, constexprs, options) of one launch, as Triton's launcher would build them (no specialisation)."""
    names = kernel.arg_names
    values = dict(zip(names, args))
    values.update((k, v) for k, v in kwargs.items() if k in names)
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif torch.is_tensor(value):
            signature[param.name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {param.name} of type {type(value).__name__}")
    return signature, constexprs, options


def _offline_target():
    """Triton's CUDA target for sm_90 where this Triton can compile offline (its CUDA backend and ptxas), else
    pytest skips and says why."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    if "nvidia" not in backends:
        pytest.skip("this Triton has no CUDA backend: nothing to compile for sm_90")
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90).path
    except Exception as error:  # noqa: BLE001 - a missing or broken ptxas, however this Triton reports it
        pytest.skip(f"no ptxas for sm_90 with this Triton: {error}")
    return GPUTarget("cuda", 90, 32)


def _variants(launches):
    """{(kernel, signature, constexprs, options): the launch's arguments} of the distinct compiled variants."""
    variants = {}
    for kernel, args, kwargs, _ in launches:
        signature, constexprs, options = _signature(kernel, args, kwargs)
        key = (kernel.fn.__name__, tuple(signature.items()), tuple(constexprs.items()), tuple(options.items()))
        variants.setdefault(key, (kernel, signature, constexprs, options))
    return variants


def _shape(key):
    """A variant's compiled shape: its kernel, operand dtype (its first argument's), precision, blocks and warps."""
    name, signature, constexprs, options = key
    return (name, signature[0][1], tuple((k, v) for k, v in constexprs if k == "PRECISION" or k.startswith("BLOCK")),
            options)


def _heaviest(variants):
    """The variant of each compiled shape with the most flags on (the most code: the most registers, as a rule)."""
    chosen = {}
    for key in variants:
        flags = sum(1 for k, v in key[2] if v and not (k == "PRECISION" or k.startswith("BLOCK")))
        if _shape(key) not in chosen or flags > chosen[_shape(key)][0]:
            chosen[_shape(key)] = (flags, key)
    return [key for _, key in chosen.values()]


def _compile(kernel, signature, constexprs, options, target, monkeypatch):
    """(Triton IR, ptxas's report) of one variant compiled to a cubin."""
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_DUMP_PTXAS_LOG", "1")  # Triton prints ptxas -v's report as it compiles
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target,
                                  options=options)
    return compiled.asm["ttir"], report.getvalue()


def _registers(report):
    """(registers, spill store bytes, spill load bytes) from ptxas's report."""
    used = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if used is None or spills is None:
        pytest.skip(f"this Triton printed no ptxas report with TRITON_DUMP_PTXAS_LOG=1: {report[-300:]!r}")
    return int(used.group(1)), int(spills.group(1)), int(spills.group(2))


def _check_compiled(variants, to_cubin, monkeypatch, tmp_path):
    """Compiles ``variants`` for sm_90, those in ``to_cubin`` to a cubin (ptxas included), the others to Triton IR:
    none with float64 arithmetic, none of the cubins with a register spill. Prints each cubin's registers."""
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = _offline_target()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled afresh, ptxas's report with it, in the test's folder
    backend = make_backend(target)
    wide, spilled = [], []
    for key, (kernel, signature, constexprs, options) in variants.items():
        flags = {k: v for k, v in constexprs.items() if v is not False and k != "UPCAST"}
        if key in to_cubin:
            ir, report = _compile(kernel, signature, constexprs, options, target, monkeypatch)
            registers, stores, loads = _registers(report)
            print(f"{key[0]} {_shape(key)[1]} {flags} {options}: {registers} registers, spills {stores}/{loads} B")
            if stores or loads:
                spilled.append((key[0], _shape(key)[1], flags, options, registers, stores, loads))
        else:
            opts = backend.parse_options(options)
            context = triton._C.libtriton.ir.context()
            triton._C.libtriton.ir.load_dialects(context)
            backend.load_dialects(context)
            ir = ASTSource(fn=kernel, signature=signature, constexprs=constexprs).make_ir(
                target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
        if "f64" in str(ir):
            wide.append((key[0], flags))
    assert wide == [], f"float64 arithmetic on the GPU: {wide}"
    assert spilled == [], f"register spills on sm_90 (kernel, operands, flags, options, registers, bytes): {spilled}"


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests compile and run every kernel")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_every_launch_compiles_for_a_hopper_gpu_and_the_heaviest_do_not_spill(monkeypatch, tmp_path):
    """The interpreter runs the kernels' Python, not Triton's compiler: a kernel it runs may not compile (float64
    typing, a loop-carried variable that changes type, an op the GPU lowering lacks) or may need more registers than
    a thread has. Every launch the functions make on a GPU (`_gpu_launches`) compiles to Triton IR for sm_90 without
    float64, and the heaviest of each compiled shape all the way to a cubin, without a register spill."""
    _, launches = _gpu_launches()
    assert {kernel.fn.__name__ for kernel, _, _, _ in launches} == set(KERNELS)
    variants = _variants(launches)
    assert len(variants) > 90, len(variants)
    heaviest = _heaviest(variants)
    assert {key[0] for key in heaviest} == set(KERNELS) and len(heaviest) >= 20, len(heaviest)
    _check_compiled(variants, set(heaviest), monkeypatch, tmp_path)


@pytest.mark.extended
@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests compile and run every kernel")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_no_launch_spills_registers_on_a_hopper_gpu(monkeypatch, tmp_path):
    """Every launch variant, bf16 and float32 (IEEE and TF32), compiled to a cubin for sm_90: no register spill.
    `pytest -m extended -s -k spills tests/test_kernels_compiled.py` prints every variant's registers (BENCHMARKS.md)."""
    _, launches = _gpu_launches()
    variants = _variants(launches)
    _check_compiled(variants, set(variants), monkeypatch, tmp_path)


def test_every_launch_runs_on_its_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device, and an operator registered from Python gets no DeviceGuard: each
    function makes its tensors' device current around its launches (`torch.cuda.device`), so that tensors on cuda:1
    while cuda:0 is current are computed on cuda:1. No GPU here: fake tensors claiming cuda:1, `torch.cuda.device`
    recorded, every kernel's launch recorded with the device current then."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    current = [torch.device("cuda", 0)]

    class Device:  # torch.cuda.device, without a GPU
        def __init__(self, device):
            self.device = torch.device(device)

        def __enter__(self):
            current.append(self.device)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", Device)
    module, modules, launches = _recording_copy("_kernels_guarded", state=lambda: current[-1])
    monkeypatch.setattr(modules[0], "_target_programs", lambda device: 132)  # triton_utils: no device to ask
    loc, bias, lse, thr, scale, col = _tile_inputs(torch.bfloat16, 6, 300, True, True, seed=1)
    weight, b, loc_U, scale_U = _linear_inputs(torch.bfloat16, 3, 300, 40, seed=3)
    with FakeTensorMode(allow_non_fake_inputs=True):
        loc, bias, lse, thr, scale, col, weight, b, loc_U, scale_U = (
            t.to("cuda:1") for t in (loc, bias, lse, thr, scale, col, weight, b, loc_U, scale_U))
        assert module.loss_tile_triton(loc, bias, lse, thr, True, scale, col, None, 0.5, 0.25, ALL_FLAGS) is not None
        assert module.block_logsumexp_triton(loc, bias, True, torch.empty(6, device="cuda:1")) is not None
        assert module.ovr_scores_triton(loc, scale, thr, True, "accept_once") is not None
        assert module.cauchy_linear_triton(loc_U, scale_U, weight, b) is not None
        assert module.abs_linear_triton(scale_U, weight) is not None
        assert module.abs_matmul_triton(torch.randn(3, 300, device="cuda:1").bfloat16(), weight, segments=1) is not None
        term = [t.to("cuda:1") if torch.is_tensor(t) else t for t in _candidate_term_inputs(torch.bfloat16, 3, 5, 40)]
        assert module.candidate_term_triton(*term) is not None
    assert {kernel.fn.__name__ for kernel, _, _, _ in launches} == set(KERNELS)
    assert [where for _, _, _, where in launches] == [torch.device("cuda", 1)] * len(launches)
    assert current == [torch.device("cuda", 0)]  # restored after each


def test_every_program_id_is_widened_to_int64():
    """A program id times a stride passes 2³¹ on real shapes (a row block's column sums of the loss tile at
    pid_r · V: from 56,537 rows at V = 151,936), where int32 arithmetic wraps into another row's memory; the numeric
    tests cannot reach such sizes, so every `tl.program_id(i)` of every kernel is cast to int64 where it is read
    (alongside them: the cast changes no number)."""
    import ast

    narrow = []
    for path in TRITON_FILES:
        tree = ast.parse(path.read_text())
        widened = {id(node.func.value) for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                   and ast.unparse(node.args[0]) == "tl.int64"}
        narrow += [(path.name, node.lineno) for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.program_id" and id(node) not in widened]
    assert narrow == [], f"program ids used in int32 (file, line): {narrow}"
