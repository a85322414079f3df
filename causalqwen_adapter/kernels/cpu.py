"""The decode operators of the `causalqwen` namespace (`cauchy_linear`, `ovr_scores`) on the CPU: on x86-64 CPUs
with AVX-512, C kernels (`csrc/`) built with PyTorch's extension mechanism on first use; elsewhere, and for what the
C kernels decline, the torch functions compiled by `torch.compile` (compiled.py: the head to 4 rows, the
scores). Installed package only: the adapter folder's remote code never imports this file; it runs these kernels
only in a process where the package has registered them (dispatch.py), the eager torch reference elsewhere.

Importing the package registers, cheaply, the operators' CPU kernels and `_applies` queries (`ops.py`); the first
query that C could serve builds the library (`torch.utils.cpp_extension.load`, with the C++ compiler and ninja, into
`TORCH_EXTENSIONS_DIR`) or loads it from there, and the library registers its C kernels (`causalqwen_cpu::<name>`),
which the operators' kernels call. C declines, and the compiled kernel or the reference runs, where it does not
apply: `CAUSALQWEN_CPU_KERNELS=0` in the environment, not x86-64 Linux, no AVX-512 (no AVX512-BF16 for bf16), no
compiler or ninja, a failed build, tensors of another dtype or device, and for the decode head a weight that is not
contiguous or more rows than `MAX_ROWS` (beyond, two matmuls are faster: the kernel is then bound by its products,
two per weight where a matmul does one).

The library is loaded only when its bytes are those the build wrote: the build records the library's sha256 beside
it, and a cached library that does not match its record (or has none) is deleted and built again, never loaded.
"""

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

from . import compiled, ops

logger = logging.getLogger(__name__)

# Rows served per weight dtype: beyond, two matmuls (oneDNN) beat the kernel, bound by its two products per weight
MAX_ROWS = {torch.bfloat16: 24, torch.float32: 64}
DISTRIBUTIONS = ("normalize", "accept", "accept_once")  # cauchy.ovr_decision_scores' distributions

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("kernels.cpp", "ops.cpp")
HEADERS = ("kernels.h",)
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_state = {"dtypes": None, "tried": False}  # the dtypes the loaded library serves on this CPU
_lock = threading.Lock()


def extension_name() -> str:
    """The library's name: a key of its sources, flags, compiler and PyTorch version, so that any change builds anew."""
    digest = hashlib.sha256()
    for part in (*SOURCES, *HEADERS):
        digest.update(part.encode() + b"\0" + (CSRC / part).read_bytes() + b"\0")
    digest.update("\0".join([*CFLAGS, *LDFLAGS, os.environ.get("CXX", ""), torch.__version__]).encode())
    return f"causalqwen_cpu_{digest.hexdigest()[:16]}"


def build_directory() -> Path:
    """Where PyTorch builds extensions of this name: `TORCH_EXTENSIONS_DIR/<name>`, by default under
    ~/.cache/torch_extensions/."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(extension_name(), verbose=False))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def build() -> Path:
    """The library, loaded into this process: from the cache when its bytes match the sha256 recorded at build time,
    else built anew (the build folder emptied first) and recorded. One process at a time per build folder."""
    import fcntl  # Linux only, as the kernels

    from torch.utils import cpp_extension

    name, folder = extension_name(), build_directory()
    library, record = folder / f"{name}.so", folder / f"{name}.so.sha256"
    with open(folder.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if library.exists() and record.exists() and record.read_text().strip() == _sha256(library):
            torch.ops.load_library(str(library))
            return library
        if library.exists():
            logger.warning("The cached CPU kernel library %s does not match what was built; building it again", library)
        for entry in folder.iterdir():  # objects, ninja's state and a stale lock of an interrupted build too
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        logger.info("Building the CPU kernels (once per machine) into %s", folder)
        # copies: `load` appends torch's own flags to the lists it is given, which would change extension_name()
        cpp_extension.load(name, [str(CSRC / s) for s in SOURCES], extra_cflags=list(CFLAGS),
                           extra_ldflags=list(LDFLAGS), build_directory=str(folder), is_python_module=False,
                           verbose=False)
        temporary = record.with_suffix(".tmp")
        temporary.write_text(_sha256(library) + "\n")
        os.replace(temporary, record)
        return library


def cpu_flags() -> set[str]:
    """The x86 feature flags of this CPU (/proc/cpuinfo); empty where unknown."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _load() -> frozenset:
    """The dtypes the kernels serve in this process (built or loaded on the first call; empty where none)."""
    if _state["tried"]:  # every decode step: no lock once settled
        return _state["dtypes"]
    with _lock:
        if not _state["tried"]:
            _state["dtypes"] = _try_load()
            _state["tried"] = True
    return _state["dtypes"]


def _try_load() -> frozenset:
    from torch.utils import cpp_extension

    if os.environ.get("CAUSALQWEN_CPU_KERNELS", "1") == "0":
        logger.info("CAUSALQWEN_CPU_KERNELS=0: the CPU kernels are not built and the torch code runs")
        return frozenset()
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        logger.info("Not x86-64 Linux: the CPU kernels are not built and the torch code runs")
        return frozenset()
    if not {"avx512f", "avx512bw"} <= cpu_flags():
        logger.info("This CPU has no AVX-512: the CPU kernels are not built and the torch code runs")
        return frozenset()
    compiler = shutil.which(os.environ.get("CXX") or "c++")
    if compiler is None or not cpp_extension.is_ninja_available():
        logger.info("No C++ compiler or no ninja (`pip install ninja`): the CPU kernels are not built and the torch "
                    "code runs")
        return frozenset()
    try:
        build()
    except Exception as error:  # a failed build or load: the reference runs
        logger.warning("The CPU kernels could not be built or loaded; the torch code runs instead: %s",
                       str(error)[-2000:])
        return frozenset()
    bits = torch.ops.causalqwen_cpu.supported(torch.empty(0))
    return frozenset(dtype for bit, dtype in ((1, torch.float32), (2, torch.bfloat16)) if bits & bit)


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernels run here for tensors of ``dtype``: x86-64 Linux with AVX-512 (AVX512-BF16 for bfloat16),
    and the library built (a C++ compiler and ninja) or cached."""
    return dtype in _load()


def _on_cpu(*tensors) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def c_cauchy_linear_applies(loc_U, scale_U, weight, bias) -> bool:
    """The C kernel's: a bf16 or float32 contiguous [V, C] weight, 1 to `MAX_ROWS` rows, and autocast off or in the
    weight's dtype."""
    dtype = weight.dtype
    rows = loc_U.numel() // loc_U.shape[-1] if loc_U.numel() else 0
    return (
        0 < rows <= MAX_ROWS.get(dtype, 0)
        and weight.dim() == 2
        and weight.is_contiguous()
        and loc_U.shape[-1] == weight.shape[1]
        and scale_U.shape == loc_U.shape
        and (bias is None or bias.numel() == weight.shape[0])
        and _on_cpu(loc_U, scale_U, weight, bias)
        and not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") != dtype)
        and available(dtype)
    )


def c_ovr_scores_applies(loc_S, scale_S, threshold, relative, distribution) -> bool:
    """The C kernel's: bf16 or float32 loc_S and scale_S of one shape and dtype, and one threshold or one per token."""
    vocab = loc_S.shape[-1] if loc_S.dim() else 0
    return (
        distribution in DISTRIBUTIONS
        and loc_S.numel() > 0
        and scale_S.shape == loc_S.shape
        and scale_S.dtype == loc_S.dtype
        and threshold.numel() in (1, vocab)
        and _on_cpu(loc_S, scale_S, threshold)
        and available(loc_S.dtype)
    )


# The operators' CPU kernels: the C kernel where it applies, else the compiled torch function (compiled.py),
# for what it takes. The C library registers its kernels as causalqwen_cpu::<name> when it loads.
def cauchy_linear_applies(*args) -> bool:
    return c_cauchy_linear_applies(*args) or compiled.cauchy_linear_applies(*args)


def cauchy_linear(*args):
    if c_cauchy_linear_applies(*args):
        return torch.ops.causalqwen_cpu.cauchy_linear(*args)
    return compiled.cauchy_linear(*args)


def ovr_scores_applies(*args) -> bool:
    return c_ovr_scores_applies(*args) or compiled.ovr_scores_applies(*args)


def ovr_scores(*args):
    if c_ovr_scores_applies(*args):
        return torch.ops.causalqwen_cpu.ovr_scores(*args)
    return compiled.ovr_scores(*args)


# The decode operators only: the training loss's torch tiles measured within 5 % of C ones (BENCHMARKS.md)
for _name, _kernel, _query in (("cauchy_linear", cauchy_linear, cauchy_linear_applies),
                               ("ovr_scores", ovr_scores, ovr_scores_applies)):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"causalqwen::{_name}_applies", "CPU"):
        ops.library.impl(f"{_name}_applies", _query, "CPU")
        ops.library.impl(_name, _kernel, "CPU")
        ops.add_query(_name, "cpu", _query)
