"""Faster kernels for the heads' hot loops, found as operators of the `causalqwen` namespace of torch.library, with
the torch code of the caller as the reference wherever none serves (docs/design.md, Decoding cost).

An operator `causalqwen::<name>` serves a call when it has a kernel for the device of the call's first tensor and,
where `causalqwen::<name>_applies` is registered for that device too, that query says yes to the arguments. The
namespace is process-wide: the operators one copy of this code finds (the installed package registers CPU kernels,
C on x86 CPUs with AVX-512 and `torch.compile`d torch elsewhere, and Triton kernels for CUDA) serve every other copy
too, the Hub's remote code included. Where none is registered the caller's torch code runs, eagerly, and says so once
in the log.

Shipped as remote code: imports only the standard library and torch, and loads nothing.
"""

import logging

import torch

logger = logging.getLogger(__name__)

# the flags of the `loss_tile` operator: what its tile computes
TILE_OVR, TILE_D, TILE_OVR_GRADS, TILE_OVR_LOCATES, TILE_COL_D, TILE_COL_T = 1, 2, 4, 8, 16, 32


def tile_thread_count(device: torch.device) -> int:
    """The `loss_tile` operator's ``threads``: rows of column sums the caller adds up, one per thread for a kernel
    registered for the CPU (the package registers none: the torch tiles measured as fast), one for a GPU kernel."""
    return torch.get_num_threads() if device.type == "cpu" else 1


_told = set()  # (name, device, dtype, backend) already logged
_serving = set()  # (name, device type) with a kernel: kernels are registered for the life of the process


def _operator(name: str):
    try:
        return getattr(torch.ops.causalqwen, name)
    except (AttributeError, RuntimeError):  # not registered in this process
        return None


def _serves(name: str, device: torch.device) -> bool:
    if (name, device.type) in _serving:
        return True
    key = "Meta" if device.type == "meta" else device.type.upper()  # CPU, CUDA, XPU, MPS...
    try:
        serves = torch._C._dispatch_has_kernel_for_dispatch_key(f"causalqwen::{name}", key)
    except RuntimeError:  # a device without a dispatch key of that name
        return False
    if serves:
        _serving.add((name, device.type))
    return serves


def lookup_operator(name: str, *args):
    """``torch.ops.causalqwen.<name>`` where it serves ``args`` (see the module docstring), else None: the caller runs
    its torch code. Under `torch.compile` the same decision is taken once, while tracing (`_serves_traced`)."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.causalqwen, name) if _serves_traced(name, _static_facts(args)) else None
    return _operator(name) if _serves_args(name, args) else None


def _serves_args(name: str, args) -> bool:
    tensor = next(a for a in args if torch.is_tensor(a))
    operator = _operator(name)
    applies = None if operator is None else _operator(f"{name}_applies")
    if operator is None:
        backend = f"the torch code (no causalqwen::{name} operator is registered)"
    elif applies is not None and _serves(f"{name}_applies", tensor.device) and not applies(*args):
        backend = f"the torch code (causalqwen::{name} does not apply to these inputs here)"
    elif not _serves(name, tensor.device):  # asked after the query, which may register the kernels
        backend = f"the torch code (no causalqwen::{name} kernel for {tensor.device.type})"
    else:
        backend = None
    told = (name, tensor.device.type, tensor.dtype, backend)
    if told not in _told:
        _told.add(told)
        logger.info("%s on %s %s tensors: %s", name, tensor.device.type, tensor.dtype,
                    backend or f"the registered causalqwen::{name} operator")
    return backend is None


def run_operator(name: str, *args):
    """The result of ``torch.ops.causalqwen.<name>(*args)`` (no gradient) where it serves them, else None: the caller
    runs its torch code."""
    operator = lookup_operator(name, *args)
    return None if operator is None else operator(*_detached(args))


def _detached(args):
    return [a.detach() if torch.is_tensor(a) else a for a in args]


# Under torch.compile the query cannot run as an operator (a bool is no graph value): the decision is taken at trace
# time from what the queries read, the arguments' shapes, strides, dtypes and devices, and is a constant of the graph.
_TENSOR = "tensor"


def _static_facts(args) -> tuple:
    # ints, not symbolic sizes: a decision per shape (tracing specialises on them), as every eager call decides
    return tuple((_TENSOR, tuple(int(n) for n in a.shape), tuple(int(n) for n in a.stride()), a.dtype, str(a.device))
                 if torch.is_tensor(a) else a for a in args)


@torch.compiler.assume_constant_result
def _serves_traced(name: str, facts: tuple) -> bool:
    """`lookup_operator`'s decision for arguments of these facts: the query asked on fake tensors of them (its fake
    kernel runs the device's query, which reads only those facts)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty_strided(fact[1], fact[2], dtype=fact[3], device=fact[4])
                if isinstance(fact, tuple) and fact[:1] == (_TENSOR,) else fact for fact in facts]
        return _serves_args(name, args)
