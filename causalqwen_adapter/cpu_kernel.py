"""`cauchy.cauchy_linear` for decoding on x86 CPUs with AVX-512: loc_S = W x_loc + b and scale_S = |W| x_scale from
one read of a bf16 (AVX512-BF16) or float32 W_A, for 1 to `MAX_ROWS` rows (docs/design.md, Decoding cost).

A decode step of an OvR mode is bound by reading W_A (V × C, 272 MB in bf16 for the demo base). Two matmuls read it
twice, or once and a |W_A| block from cache; `torch.compile` reaches one read but with float32 vector code. This
kernel takes every vocabulary row of W_A once into registers, clears the sign bits for |W| and feeds both to the
dot-product instruction (`vdpbf16ps` for bf16, `vfmadd` for float32), accumulating in float32; the next rows are
prefetched while the current ones are used. The vocabulary is split into one contiguous block per thread of
PyTorch's OpenMP pool (ctypes releases the GIL for the call).

The C source is compiled once per machine on first use (about half a second, with the system's C compiler, as
`torch.compile` needs one too) into a cache folder, written atomically. `cauchy_linear_cpu` returns None — and the
caller takes its other path — when it does not apply: no compiler, no AVX-512 (no AVX512-BF16 for bf16), a weight
that is not a contiguous bf16 or float32 CPU matrix, or more rows than `MAX_ROWS` (beyond, two matmuls are faster:
the kernel is then bound by its products, two per weight where a matmul does one).

Shipped as remote code: imports only the standard library and torch.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Rows served per weight dtype: beyond, two matmuls (oneDNN) beat the kernel, bound by its two products per weight
MAX_ROWS = {torch.bfloat16: 24, torch.float32: 64}

_SOURCE = r"""
#include <stdint.h>

/* Before the target pragma: callable on any x86-64 CPU. Bit 0: the float32 kernel runs here (AVX-512F); bit 1: the
   bf16 one (AVX512-BF16). */
int cq_supported(void) {
    __builtin_cpu_init();
    int f32 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    return f32 | (f32 && __builtin_cpu_supports("avx512bf16")) << 1;
}

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>
#include <omp.h>

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } b = {(uint32_t)h << 16};
    return b.f;
}

/* round to nearest even, as PyTorch's float → bfloat16 conversion (NaN stays a quiet NaN) */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } b = {f};
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b.u >> 16) | 0x40);
    return (uint16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

#define PREFETCH_ROWS 32 /* rows of W ahead: the hardware prefetcher alone leaves half the bandwidth unused */

/* lane j of the result = the sum of the 16 lanes of v[j] (a transpose-and-add tree) */
static inline __m512 reduce16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

/* The element types, one set of operations each, used by the macros below where they are expanded:
   T the element, VEC a register of LANES of them, LOAD/LOAD_TAIL a full/masked load, ABS |w|, DOT acc += w·x
   (float32 lanes), TAIL_MASK the mask of the last n < LANES elements, OUT the float32 sum as a T. */
#define BF16_T uint16_t
#define BF16_VEC __m512bh
#define BF16_LANES 32
#define BF16_LOAD(p) ((__m512bh)_mm512_loadu_si512(p))
#define BF16_LOAD_TAIL(p) ((__m512bh)_mm512_maskz_loadu_epi16(tail, p))
#define BF16_ABS(w) ((__m512bh)_mm512_and_si512((__m512i)(w), _mm512_set1_epi16(0x7fff))) /* the sign bit off */
#define BF16_DOT(acc, w, x) _mm512_dpbf16_ps(acc, w, x)
#define BF16_TAIL_MASK(n) ((__mmask32)((1ull << (n)) - 1))
#define BF16_IN(h) bf16_to_float(h)
#define BF16_OUT(f) float_to_bf16(f)

#define F32_T float
#define F32_VEC __m512
#define F32_LANES 16
#define F32_LOAD(p) _mm512_loadu_ps(p)
#define F32_LOAD_TAIL(p) _mm512_maskz_loadu_ps(tail, p)
#define F32_ABS(w) _mm512_abs_ps(w)
#define F32_DOT(acc, w, x) _mm512_fmadd_ps(w, x, acc)
#define F32_TAIL_MASK(n) ((__mmask16)((1u << (n)) - 1))
#define F32_IN(f) (f)
#define F32_OUT(f) (f)

/* One step of a tile over LANES columns: R rows of W, |W| from the same registers, against G rows of x. */
#define STEP(E, LOAD)                                                                                                 \
    {                                                                                                                 \
        E##_VEC w[R], wa[R];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                         \
            w[r] = E##_##LOAD(W + (v + r) * C + k);                                                                   \
            _mm_prefetch((const char *)(W + (v + r + ahead) * C + k), _MM_HINT_T0);                                   \
            wa[r] = E##_ABS(w[r]);                                                                                    \
        }                                                                                                             \
        _Pragma("GCC unroll 8") for (int i = 0; i < G; i++) {                                                         \
            E##_VEC l = E##_##LOAD(xl + (g + i) * C + k), s = E##_##LOAD(xs + (g + i) * C + k);                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                     \
                al[r][i] = E##_DOT(al[r][i], w[r], l);                                                                \
                as[r][i] = E##_DOT(as[r][i], wa[r], s);                                                               \
            }                                                                                                         \
        }                                                                                                             \
    }
#define BIAS(E, row) (bias ? E##_IN(bias[row]) : 0.0f)

/* One tile: R rows of W (from row v) against G rows of x (from row g), 2·R·G float32 accumulators kept in registers,
   over C in steps of LANES elements (a masked step for the rest), then reduced, b added to loc, and stored. A macro,
   not a function: the sizes must be literals for the accumulator arrays to live in registers. */
#define DEFINE_TILE(E, R_, G_)                                                                                        \
    static void tile_##E##_##R_##_##G_(const E##_T *W, int64_t C, int64_t V, const E##_T *xl, const E##_T *xs,       \
                                       const E##_T *bias, E##_T *loc, E##_T *scale, int64_t v, int64_t g) {           \
        enum { R = R_, G = G_ };                                                                                      \
        const int64_t ahead = v + PREFETCH_ROWS + R <= V ? PREFETCH_ROWS : 0; /* never past the end of W */          \
        __m512 al[R][G], as[R][G];                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                           \
            _Pragma("GCC unroll 8") for (int i = 0; i < G; i++) al[r][i] = as[r][i] = _mm512_setzero_ps();            \
        int64_t k = 0;                                                                                                \
        for (; k + E##_LANES <= C; k += E##_LANES) STEP(E, LOAD)                                                      \
        if (k < C) {                                                                                                  \
            const __typeof__(E##_TAIL_MASK(1)) tail = E##_TAIL_MASK(C - k);                                           \
            STEP(E, LOAD_TAIL)                                                                                        \
        }                                                                                                             \
        if (R * G == 8) {                                                                                             \
            __m512 acc[16];                                                                                           \
            float out[16];                                                                                            \
            for (int r = 0; r < R; r++)                                                                               \
                for (int i = 0; i < G; i++) acc[r * G + i] = al[r][i], acc[8 + r * G + i] = as[r][i];                 \
            _mm512_storeu_ps(out, reduce16(acc));                                                                     \
            for (int r = 0; r < R; r++)                                                                               \
                for (int i = 0; i < G; i++) {                                                                         \
                    loc[(g + i) * V + v + r] = E##_OUT(out[r * G + i] + BIAS(E, v + r));                              \
                    scale[(g + i) * V + v + r] = E##_OUT(out[8 + r * G + i]);                                         \
                }                                                                                                     \
        } else {                                                                                                      \
            for (int r = 0; r < R; r++)                                                                               \
                for (int i = 0; i < G; i++) {                                                                         \
                    loc[(g + i) * V + v + r] = E##_OUT(_mm512_reduce_add_ps(al[r][i]) + BIAS(E, v + r));              \
                    scale[(g + i) * V + v + r] = E##_OUT(_mm512_reduce_add_ps(as[r][i]));                             \
                }                                                                                                     \
        }                                                                                                             \
    }

/* W [V, C] and b [V] (NULL: none) against xl, xs [N, C], all of one type: loc = xl Wᵀ + b and scale = xs |W|ᵀ,
   [N, V], summed in float32 (rounded once to bf16 for bf16). Up to 4 rows of x, one row of W at a time (one
   sequential stream, bound by memory); from 5 on, pairs of W rows against groups of 4 rows of x (each weight load
   feeds 8 dot products). W rows outer: each is read once. One contiguous block of W rows per thread, on the OpenMP
   pool PyTorch's CPU ops run on (the libgomp it loaded): threads of a second pool would compete with PyTorch's,
   which spin for a while after each of its ops. */
#define DEFINE_KERNEL(E)                                                                                              \
    DEFINE_TILE(E, 1, 1) DEFINE_TILE(E, 1, 2) DEFINE_TILE(E, 1, 3) DEFINE_TILE(E, 1, 4)                               \
    DEFINE_TILE(E, 2, 1) DEFINE_TILE(E, 2, 2) DEFINE_TILE(E, 2, 3) DEFINE_TILE(E, 2, 4)                               \
    typedef void (*tile_##E)(const E##_T *, int64_t, int64_t, const E##_T *, const E##_T *, const E##_T *, E##_T *,   \
                             E##_T *, int64_t, int64_t);                                                              \
    static void rows_##E(const E##_T *W, int64_t V, int64_t C, const E##_T *xl, const E##_T *xs, int64_t N,           \
                         const E##_T *bias, E##_T *loc, E##_T *scale, int64_t v0, int64_t v1) {                       \
        static const tile_##E one_row[5] = {0, tile_##E##_1_1, tile_##E##_1_2, tile_##E##_1_3, tile_##E##_1_4};       \
        static const tile_##E two_rows[5] = {0, tile_##E##_2_1, tile_##E##_2_2, tile_##E##_2_3, tile_##E##_2_4};      \
        int64_t v = v0;                                                                                               \
        if (N > 4)                                                                                                    \
            for (; v + 2 <= v1; v += 2)                                                                               \
                for (int64_t g = 0; g < N; g += 4)                                                                    \
                    two_rows[N - g < 4 ? N - g : 4](W, C, V, xl, xs, bias, loc, scale, v, g);                         \
        for (; v < v1; v++)                                                                                           \
            for (int64_t g = 0; g < N; g += 4)                                                                        \
                one_row[N - g < 4 ? N - g : 4](W, C, V, xl, xs, bias, loc, scale, v, g);                              \
    }                                                                                                                 \
    void cq_loc_scale_##E(const E##_T *W, int64_t V, int64_t C, const E##_T *xl, const E##_T *xs, int64_t N,          \
                          const E##_T *bias, E##_T *loc, E##_T *scale, int threads) {                                 \
        _Pragma("omp parallel num_threads(threads)") {                                                                \
            int64_t t = omp_get_thread_num(), T = omp_get_num_threads();                                              \
            rows_##E(W, V, C, xl, xs, N, bias, loc, scale, V * t / T, V * (t + 1) / T);                               \
        }                                                                                                             \
    }

DEFINE_KERNEL(BF16)
DEFINE_KERNEL(F32)
"""

_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp"]
_state = {"lib": None, "tried": False}
_lock = threading.Lock()


def _cache_dir() -> Path:
    if os.environ.get("CAUSALQWEN_KERNEL_CACHE"):
        return Path(os.environ["CAUSALQWEN_KERNEL_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "causalqwen" / "kernels"
    try:
        return Path.home() / ".cache" / "causalqwen" / "kernels"
    except RuntimeError:  # no home folder: the temporary one
        return Path(tempfile.gettempdir()) / "causalqwen-kernels"


def _compile(compiler: str) -> Path:
    """The shared library for this source, compiler and flags: from the cache, or compiled into it atomically (a
    temporary folder beside it, then a rename), so that concurrent processes never load a half-written file."""
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS]).encode()).hexdigest()[:16]
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "causalqwen-kernels"):
        target = folder / f"cauchy_linear_{key}.so"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(dir=folder, prefix=".build-"))
        except OSError:  # a cache folder we cannot write: try the next one
            continue
        try:
            source = work / "cauchy_linear.c"
            source.write_text(_SOURCE)
            subprocess.run([compiler, *_FLAGS, "-o", str(work / target.name), str(source)], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(work / target.name, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return target
    raise OSError(f"no writable folder for the compiled kernel (tried {_cache_dir()} and the temporary folder)")


def _load():
    """The kernels by weight dtype, or None where none can run here (tried once per process)."""
    if _state["tried"]:  # every decode step: no lock once settled
        return _state["lib"]
    with _lock:
        if _state["tried"]:
            return _state["lib"]
        _state["tried"] = True
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        compiler = next(filter(None, map(shutil.which, [os.environ.get("CC") or "cc", "gcc", "clang"])), None)
        if compiler is None:
            logger.info("No C compiler found: decoding reads W_A through two matmuls instead of the C kernel")
            return None
        try:
            lib = ctypes.CDLL(str(_compile(compiler)))
        except subprocess.CalledProcessError as error:
            logger.warning("The decode kernel (cpu_kernel.py) did not compile with %s; decoding falls back to "
                           "matmuls:\n%s", compiler, error.stderr[-2000:])
            return None
        except (OSError, subprocess.SubprocessError) as error:
            logger.warning("The decode kernel (cpu_kernel.py) is unavailable; decoding falls back to matmuls: %s",
                           error)
            return None
        supported = lib.cq_supported()
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        kernels = {}
        for bit, dtype, name in ((1, torch.float32, "cq_loc_scale_F32"), (2, torch.bfloat16, "cq_loc_scale_BF16")):
            if supported & bit:
                kernels[dtype] = fn = getattr(lib, name)
                fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
                fn.restype = None
        _state["lib"] = kernels or None
        return _state["lib"]


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this machine runs the kernel for weights of ``dtype``: x86-64 with a C compiler, and AVX-512 (float32)
    or AVX512-BF16 (bfloat16)."""
    return dtype in (_load() or {})


def cauchy_linear_cpu(loc_U, scale_U, weight, bias):
    """`cauchy.cauchy_linear` (no gradient) in one read of a bf16 or float32 ``weight``: (loc_S, scale_S) in the
    weight's dtype, or None where the kernel does not apply and the caller should take another path."""
    rows = loc_U.numel() // loc_U.shape[-1] if loc_U.numel() else 0
    dtype = weight.dtype
    if (
        not 0 < rows <= MAX_ROWS.get(dtype, 0)
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or not weight.is_contiguous()
        or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") != dtype)
    ):
        return None
    kernel = (_load() or {}).get(dtype)
    if kernel is None:
        return None
    shape = loc_U.shape
    vocab, size = weight.shape
    x_loc = loc_U.detach().reshape(rows, size).to(dtype).contiguous()
    x_scale = scale_U.detach().reshape(rows, size).to(dtype).contiguous()
    bias = None if bias is None else bias.detach().to(dtype).contiguous()
    loc_S = torch.empty(rows, vocab, dtype=dtype)
    scale_S = torch.empty(rows, vocab, dtype=dtype)
    kernel(weight.data_ptr(), vocab, size, x_loc.data_ptr(), x_scale.data_ptr(), rows,
           None if bias is None else bias.data_ptr(), loc_S.data_ptr(), scale_S.data_ptr(),
           max(1, min(torch.get_num_threads(), vocab // 1024)))
    return loc_S.reshape(*shape[:-1], vocab), scale_S.reshape(*shape[:-1], vocab)
