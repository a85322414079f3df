"""`cauchy.cauchy_linear` for decoding on x86 CPUs with AVX512-BF16: loc_S = W x_loc + b and scale_S = |W| x_scale
from one read of a bf16 W_A, for 1 to `MAX_ROWS` rows (docs/design.md, Decoding cost).

A decode step of an OvR mode is bound by reading W_A (V × C, 272 MB for the demo base). Two matmuls read it twice,
or once and a |W_A| block from cache; `torch.compile` reaches one read but with float32 vector code. This kernel
takes every vocabulary row of W_A once into registers, masks the sign bits for |W| (bf16 |w| is `w & 0x7fff`) and
feeds both to the `vdpbf16ps` dot-product instruction, accumulating in float32; the next rows are prefetched while
the current ones are used. The vocabulary is split into one contiguous block per thread of PyTorch's OpenMP pool
(ctypes releases the GIL for the call).

The C source is compiled once per machine on first use (about half a second, with the system's C compiler, as
`torch.compile` needs one too) into a cache folder, written atomically. `cauchy_linear_cpu` returns None — and the
caller takes its other path — when it does not apply: no compiler, no AVX512-BF16, a weight that is not a
contiguous bf16 CPU matrix, or more rows than `MAX_ROWS` (beyond 24 rows two matmuls are faster: the kernel is then
bound by the dot products, two per weight where a matmul does one).

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

MAX_ROWS = 24  # beyond, two bf16 matmuls (oneDNN) beat the kernel: it is bound by its two dot products per weight

_SOURCE = r"""
#include <stdint.h>

/* Before the target pragma: callable on any x86-64 CPU. */
int cq_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
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

/* One tile: R rows of W (from row v) against G rows of x (from row g), 2·R·G float32 accumulators kept in registers,
   over C in steps of 32 bf16 (a masked step for the rest). A macro, not a function: the sizes must be literals for
   the accumulator arrays to live in registers. */
#define STEP(LOAD_W, LOAD_X)                                                                                          \
    {                                                                                                                 \
        __m512bh w[R], wa[R];                                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                         \
            __m512i x = LOAD_W(W + (v + r) * C + k);                                                                  \
            _mm_prefetch((const char *)(W + (v + r + ahead) * C + k), _MM_HINT_T0);                                   \
            w[r] = (__m512bh)x;                                                                                       \
            wa[r] = (__m512bh)_mm512_and_si512(x, sign_off);                                                          \
        }                                                                                                             \
        _Pragma("GCC unroll 8") for (int i = 0; i < G; i++) {                                                         \
            __m512bh l = (__m512bh)LOAD_X(xl + (g + i) * C + k);                                                      \
            __m512bh s = (__m512bh)LOAD_X(xs + (g + i) * C + k);                                                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                     \
                al[r][i] = _mm512_dpbf16_ps(al[r][i], w[r], l);                                                       \
                as[r][i] = _mm512_dpbf16_ps(as[r][i], wa[r], s);                                                      \
            }                                                                                                         \
        }                                                                                                             \
    }
#define LOAD_FULL(p) _mm512_loadu_si512(p)
#define LOAD_TAIL(p) _mm512_maskz_loadu_epi16(tail, p)
#define BIAS(row) (bias ? bf16_to_float(bias[row]) : 0.0f)

#define DEFINE_TILE(R_, G_)                                                                                           \
    static void tile_##R_##_##G_(const uint16_t *W, int64_t C, int64_t V, const uint16_t *xl, const uint16_t *xs,     \
                                 const uint16_t *bias, uint16_t *loc, uint16_t *scale, int64_t v, int64_t g) {      \
        enum { R = R_, G = G_ };                                                                                      \
        const __m512i sign_off = _mm512_set1_epi16(0x7fff);                                                           \
        const int64_t ahead = v + PREFETCH_ROWS + R <= V ? PREFETCH_ROWS : 0; /* never past the end of W */          \
        __m512 al[R][G], as[R][G];                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                           \
            _Pragma("GCC unroll 8") for (int i = 0; i < G; i++) al[r][i] = as[r][i] = _mm512_setzero_ps();            \
        int64_t k = 0;                                                                                                \
        for (; k + 32 <= C; k += 32) STEP(LOAD_FULL, LOAD_FULL)                                                       \
        if (k < C) {                                                                                                  \
            const __mmask32 tail = (__mmask32)((1ull << (C - k)) - 1);                                                \
            STEP(LOAD_TAIL, LOAD_TAIL)                                                                                \
        }                                                                                                             \
        if (R * G == 8) {                                                                                             \
            __m512 acc[16];                                                                                           \
            float out[16];                                                                                            \
            for (int r = 0; r < R; r++)                                                                               \
                for (int i = 0; i < G; i++) acc[r * G + i] = al[r][i], acc[8 + r * G + i] = as[r][i];                 \
            _mm512_storeu_ps(out, reduce16(acc));                                                                     \
            for (int r = 0; r < R; r++)                                                                               \
                for (int i = 0; i < G; i++) {                                                                         \
                    loc[(g + i) * V + v + r] = float_to_bf16(out[r * G + i] + BIAS(v + r));                          \
                    scale[(g + i) * V + v + r] = float_to_bf16(out[8 + r * G + i]);                                   \
                }                                                                                                     \
        } else {                                                                                                      \
            for (int r = 0; r < R; r++)                                                                               \
                for (int i = 0; i < G; i++) {                                                                         \
                    loc[(g + i) * V + v + r] = float_to_bf16(_mm512_reduce_add_ps(al[r][i]) + BIAS(v + r));           \
                    scale[(g + i) * V + v + r] = float_to_bf16(_mm512_reduce_add_ps(as[r][i]));                       \
                }                                                                                                     \
        }                                                                                                             \
    }

DEFINE_TILE(1, 1) DEFINE_TILE(1, 2) DEFINE_TILE(1, 3) DEFINE_TILE(1, 4)
DEFINE_TILE(2, 1) DEFINE_TILE(2, 2) DEFINE_TILE(2, 3) DEFINE_TILE(2, 4)

typedef void (*tile_fn)(const uint16_t *, int64_t, int64_t, const uint16_t *, const uint16_t *, const uint16_t *,
                        uint16_t *, uint16_t *, int64_t, int64_t);

/* W [V, C] and b [V] (NULL: none) against xl, xs [N, C], all bf16: loc = xl Wᵀ + b and scale = xs |W|ᵀ, [N, V],
   summed in float32 and rounded once to bf16.
   Up to 4 rows of x, one row of W at a time (one sequential stream, bound by memory); from 5 on, pairs of W rows
   against groups of 4 rows of x (each weight load feeds 8 dot products). W rows outer: each is read once. */
static void loc_scale_rows(const uint16_t *W, int64_t V, int64_t C, const uint16_t *xl, const uint16_t *xs, int64_t N,
                           const uint16_t *bias, uint16_t *loc, uint16_t *scale, int64_t v0, int64_t v1) {
    static const tile_fn one_row[5] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4};
    static const tile_fn two_rows[5] = {0, tile_2_1, tile_2_2, tile_2_3, tile_2_4};
    int64_t v = v0;
    if (N > 4)
        for (; v + 2 <= v1; v += 2)
            for (int64_t g = 0; g < N; g += 4) two_rows[N - g < 4 ? N - g : 4](W, C, V, xl, xs, bias, loc, scale, v, g);
    for (; v < v1; v++)
        for (int64_t g = 0; g < N; g += 4) one_row[N - g < 4 ? N - g : 4](W, C, V, xl, xs, bias, loc, scale, v, g);
}

/* One contiguous block of W rows per thread, on the OpenMP pool PyTorch's CPU ops run on (the libgomp it loaded):
   threads of a second pool would compete with PyTorch's, which spin for a while after each of its ops. */
void cq_loc_scale(const uint16_t *W, int64_t V, int64_t C, const uint16_t *xl, const uint16_t *xs, int64_t N,
                  const uint16_t *bias, uint16_t *loc, uint16_t *scale, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        loc_scale_rows(W, V, C, xl, xs, N, bias, loc, scale, V * t / T, V * (t + 1) / T);
    }
}
"""

_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp"]
_state = {"lib": None, "tried": False}
_lock = threading.Lock()


def _cache_dir() -> Path:
    if os.environ.get("CAUSALQWEN_KERNEL_CACHE"):
        return Path(os.environ["CAUSALQWEN_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "causalqwen" / "kernels"


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
    """The loaded library, or None where the kernel cannot run here (tried once per process)."""
    with _lock:
        if _state["tried"]:
            return _state["lib"]
        _state["tried"] = True
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        compiler = next(filter(None, map(shutil.which, [os.environ.get("CC") or "cc", "gcc", "clang"])), None)
        if compiler is None:
            logger.info("No C compiler found: decoding reads W_A through two matmuls instead of the bf16 kernel")
            return None
        try:
            lib = ctypes.CDLL(str(_compile(compiler)))
        except subprocess.CalledProcessError as error:
            logger.warning("The bf16 decode kernel did not compile with %s (decoding falls back to matmuls):\n%s",
                           compiler, error.stderr[-2000:])
            return None
        except (OSError, subprocess.SubprocessError) as error:
            logger.warning("The bf16 decode kernel is unavailable (decoding falls back to matmuls): %s", error)
            return None
        if not lib.cq_supported():
            return None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.cq_loc_scale.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
        lib.cq_loc_scale.restype = None
        _state["lib"] = lib
        return lib


def available() -> bool:
    """Whether this machine runs the kernel (x86-64 with AVX512-BF16 and a C compiler)."""
    return _load() is not None


def cauchy_linear_cpu(loc_U, scale_U, weight, bias):
    """`cauchy.cauchy_linear` (no gradient) in one read of a bf16 ``weight``: (loc_S, scale_S) in bf16, or None
    where the kernel does not apply and the caller should take another path."""
    rows = loc_U.numel() // loc_U.shape[-1] if loc_U.numel() else 0
    if (
        not 0 < rows <= MAX_ROWS
        or weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or not weight.is_contiguous()
        or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") != torch.bfloat16)
    ):
        return None
    lib = _load()
    if lib is None:
        return None
    shape = loc_U.shape
    vocab, size = weight.shape
    x_loc = loc_U.detach().reshape(rows, size).to(torch.bfloat16).contiguous()
    x_scale = scale_U.detach().reshape(rows, size).to(torch.bfloat16).contiguous()
    bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()
    loc_S = torch.empty(rows, vocab, dtype=torch.bfloat16)
    scale_S = torch.empty(rows, vocab, dtype=torch.bfloat16)
    lib.cq_loc_scale(weight.data_ptr(), vocab, size, x_loc.data_ptr(), x_scale.data_ptr(), rows,
                     None if bias is None else bias.data_ptr(), loc_S.data_ptr(), scale_S.data_ptr(),
                     max(1, min(torch.get_num_threads(), vocab // 1024)))
    return loc_S.reshape(*shape[:-1], vocab), scale_S.reshape(*shape[:-1], vocab)
