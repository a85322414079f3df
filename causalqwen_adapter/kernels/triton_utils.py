"""What the Triton kernels share: Triton's import (optional), the float32 elementwise functions the kernels call
(the Cauchy CDF's small side, log1p, bf16 rounding), and the launch helpers (block sizes, devices, segments).

Float32 math throughout, with the Cauchy CDF's small side atan2(1, |x|)/π and log1p written here as series (the same
range reductions as the C decode kernels), so that a small P keeps its digits (`losses.ovr_tile`'s ``precise`` form) on
every backend; exp and log of values away from 1 are Triton's.
"""

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without it: every function here then returns None
    triton = None

    class tl:  # noqa: N801 - stands in for triton.language in the kernels' annotations only
        constexpr = None

if triton is not None:
    _jit = triton.jit
else:
    def _jit(fn=None, **_):
        return fn if fn is not None else (lambda f: f)

__all__ = ["DTYPES", "INTERPRETED", "TILE_COL_D", "TILE_COL_T", "TILE_D", "TILE_OVR", "TILE_OVR_GRADS", "TILE_OVR_LOCATES",
           "available"]

# the dtypes of the operands the kernels read (their math is float32 whatever these are)
DTYPES = (torch.bfloat16, torch.float32)

# the flags of causalqwen::loss_tile (dispatch.TILE_*), numbered as there (repeated: the Triton modules need
# nothing else of the package)
TILE_OVR, TILE_D, TILE_OVR_GRADS, TILE_OVR_LOCATES, TILE_COL_D, TILE_COL_T = 1, 2, 4, 8, 16, 32


# ---------------------------------------------------------------------------------------------------------------------
# Elementwise functions (float32)


@_jit
def _small_angle(t):
    """atan2(1, t)/π for t ≥ 0 (+inf included), in [0, ½]: the smaller of P and 1 − P, computed directly. With
    v = min(t, 1/t) ≤ 1, atan v by its odd series to v¹⁹ after atan v = π/4 + atan((v − 1)/(v + 1)) above tan(π/8)."""
    big = t > 1.0
    v = tl.where(big, 1.0 / tl.maximum(t, 1.0), t)
    red = v > 0.414213562
    w = tl.where(red, (v - 1.0) / (v + 1.0), v)
    w2 = w * w
    p = -1.0 / 19.0
    p = p * w2 + 1.0 / 17.0
    p = p * w2 - 1.0 / 15.0
    p = p * w2 + 1.0 / 13.0
    p = p * w2 - 1.0 / 11.0
    p = p * w2 + 1.0 / 9.0
    p = p * w2 - 1.0 / 7.0
    p = p * w2 + 1.0 / 5.0
    p = p * w2 - 1.0 / 3.0
    p = p * w2 + 1.0
    a = w * p
    a = tl.where(red, a + 0.785398163, a) * 0.318309886  # atan(v)/π
    return tl.where(big, a, 0.5 - a)


@_jit
def _log1p_small(f):
    """log(1 + f) for |f| ≤ ½: 2·atanh(s), s = f/(2 + f), |s| ≤ ⅓, by its series to s¹⁷."""
    s = f / (2.0 + f)
    s2 = s * s
    p = 1.0 / 17.0
    p = p * s2 + 1.0 / 15.0
    p = p * s2 + 1.0 / 13.0
    p = p * s2 + 1.0 / 11.0
    p = p * s2 + 1.0 / 9.0
    p = p * s2 + 1.0 / 7.0
    p = p * s2 + 1.0 / 5.0
    p = p * s2 + 1.0 / 3.0
    p = p * s2 + 1.0
    return 2.0 * s * p


@_jit
def _to_bf16(x):
    """float32 → bfloat16 rounded to nearest even (NaN stays NaN), as torch rounds; written out because Triton's
    interpreter truncates in its own cast (on a GPU this is what the cast does)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bits = tl.where(x != x, 0x7FC0, bits)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@_jit
def _store(ptrs, x, mask):
    """Stores float32 ``x`` in the pointers' dtype (bf16 rounded to nearest even)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, _to_bf16(x), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


# Sums and maxima go through tl.reduce with triton.language's own combine functions (tl.sum and tl.max do the same):
# tl.sum is itself a jit function, decorated when triton.language is imported, so that a kernel of a module
# decorated later for the interpreter could not call it, while the interpreter runs tl.reduce with these combine
# functions as numpy reductions.
if triton is not None:
    _add = getattr(tl.standard, "_sum_combine", None)
    _max = getattr(tl.standard, "_elementwise_max", None)
if triton is None or _add is None or _max is None:
    @_jit
    def _add(a, b):
        return a + b

    @_jit
    def _max(a, b):
        return tl.maximum(a, b)


# ---------------------------------------------------------------------------------------------------------------------
# Python side


def _interpreted() -> bool:
    """Whether the kernels were decorated for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return triton is not None and not isinstance(_small_angle, triton.runtime.JITFunction)


INTERPRETED = _interpreted()

# Block sizes: the GPU's, or small ones under the interpreter, whose cost is per block step and whose tests then
# cross several blocks and segments at small widths (the code paths are the same).
_ROW_BLOCK_N = 64 if INTERPRETED else 1024
_NUM_WARPS = 8


def available() -> bool:
    """Whether the Triton path can run here: Triton installed, and a CUDA device (or the CPU interpreter)."""
    return triton is not None and (INTERPRETED or torch.cuda.is_available())


def _runs_on(*tensors) -> bool:
    """The tensors (None skipped) are on one device the kernels run on."""
    if triton is None:
        return False
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        return False
    kind = next(iter(devices)).type
    return kind in ("cpu", "cuda") if INTERPRETED else kind == "cuda"


_SM_COUNT = {}


def _target_programs(device: torch.device) -> int:
    """Programs a launch should have to fill the device: a few per multiprocessor (a handful under the
    interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return 4 * _SM_COUNT[index]


def _segments(width: int, blocks_across: int, block: int, device, segments: int | None = None) -> tuple[int, int]:
    """(segment width, segment count) splitting ``width`` columns into whole blocks so that ``blocks_across`` row
    programs × segments reach the device's target."""
    n_blocks = max(1, -(-width // block))
    if segments is None:
        segments = -(-_target_programs(device) // max(1, blocks_across))
    segments = max(1, min(segments, n_blocks, 65535))
    seg = -(-n_blocks // segments) * block
    return seg, max(1, -(-width // seg))


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's precision for float32 operands: torch's for its CUDA matmuls (TF32 only where torch allows it), asked
    through torch's current API. Never `torch.backends.cuda.matmul.allow_tf32`: on torch ≥ 2.9 reading it raises
    ("mix of the legacy and new APIs") once `torch.backends.fp32_precision` or its CUDA matmul's is set, as
    transformers' `TrainingArguments(tf32=True)` does."""
    if dtype != torch.float32:
        return "tf32"  # bf16 operands: the precision is not used
    matmul = getattr(torch.backends.cuda.matmul, "fp32_precision", None)  # torch ≥ 2.9: "ieee", "tf32", "none"...
    if matmul is not None:
        # "none" (nothing set here) is the parent's, torch.backends.fp32_precision, whose "none" is torch's default
        # (IEEE); the legacy setters are reflected in these too
        if matmul == "none":
            matmul = getattr(torch.backends, "fp32_precision", "none")
        return "tf32" if matmul in ("tf32", "bf16") else "ieee"
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _on_tensors_device(fn):
    """Runs ``fn`` with its first tensor argument's CUDA device current: Triton launches on
    `torch.cuda.current_device()`, and an operator registered with torch.library from Python gets no DeviceGuard, so
    a kernel given tensors on cuda:1 while cuda:0 is current would launch on the wrong device. Entering
    `torch.cuda.device` costs a device query where it is already current; nothing off CUDA (the interpreter)."""

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        tensor = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
        if tensor is None or tensor.device.type != "cuda":
            return fn(*args, **kwargs)
        with torch.cuda.device(tensor.device):
            return fn(*args, **kwargs)

    return guarded


def _row_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)
