/* The heads' decoding hot loops for x86 CPUs with AVX-512, called by the operators of ops.cpp (docs/design.md,
   Decoding cost):

   - cq_loc_scale: cauchy.cauchy_linear for decoding, loc_S = W x_loc + b and scale_S = |W| x_scale from one read
     of a bf16 (AVX512-BF16) or float32 W_A. Every vocabulary row of W_A is loaded once into registers, its sign bits
     cleared for |W|, and both fed to the dot-product instruction (vdpbf16ps for bf16, vfmadd for float32),
     accumulating in float32; the next rows are prefetched while the current ones are used;
   - cq_scores: cauchy.ovr_decision_scores, the OvR modes' logits of a decode step, in a few passes over the row.

   The training loss has no CPU kernel: its torch tiles measured within 5 % of C ones (BENCHMARKS.md, "The training
   loss"). cq_scores evaluates exp, log and atan as vector code of its own (range reduction and series, within a few
   float32 ulps, tested against float64). Plain C compiled as C++ in a translation unit of its own: only this file is
   built for AVX-512 (the target pragma below), so nothing of the operators' code runs AVX-512 instructions on a CPU
   without them. The work is split across PyTorch's own OpenMP pool (the libgomp it loaded): the threads of a second
   pool would compete with PyTorch's, which spin for a while after each of its ops. */

#include "kernels.h"

/* Before the target pragma: callable on any x86-64 CPU. Bit 0: the float32 kernel runs here (AVX-512F); bit 1: the
   bf16 one (AVX512-BF16). */
int cq_supported(void) {
    __builtin_cpu_init();
    int f32 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    return f32 | (f32 && __builtin_cpu_supports("avx512bf16")) << 1;
}

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>
#include <math.h>
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

/* ---- The OvR modes' decision scores (cauchy.ovr_decision_scores) over [N, V] rows of loc_S and scale_S. ----
   float32 math throughout, with vector exp, log and atan written here (range reduction and series, each within a
   few float32 ulps: the tests compare with float64): no library call per element, no torch.compile. */

static inline __m512 v_poly(__m512 x, const float *c, int n) { /* c[0] + x·(c[1] + x·(… c[n-1])) */
    __m512 p = _mm512_set1_ps(c[n - 1]);
    for (int i = n - 2; i >= 0; i--) p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(c[i]));
    return p;
}

/* e^y: y = n·ln2 + r, |r| ≤ ln2/2, e^r by its series to r⁷, times 2ⁿ; 0 below −88 (under the smallest normal) */
static inline __m512 v_exp(__m512 y) {
    static const float c[8] = {1.0f, 1.0f, 1 / 2.0f, 1 / 6.0f, 1 / 24.0f, 1 / 120.0f, 1 / 720.0f, 1 / 5040.0f};
    __m512 yc = _mm512_max_ps(_mm512_set1_ps(-88.0f), _mm512_min_ps(_mm512_set1_ps(88.7f), y)); /* NaN stays */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(yc, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), yc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 e = _mm512_scalef_ps(v_poly(r, c, 8), n);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(y, _mm512_set1_ps(-88.0f), _CMP_LT_OQ), e, _mm512_setzero_ps());
}

/* log(1 + f) for |f| ≤ ½: 2·atanh(s), s = f/(2 + f), |s| ≤ ⅓, by its series to s¹⁷ */
static inline __m512 v_log1p_small(__m512 f) {
    static const float c[9] = {1.0f, 1 / 3.0f, 1 / 5.0f, 1 / 7.0f, 1 / 9.0f, 1 / 11.0f, 1 / 13.0f, 1 / 15.0f, 1 / 17.0f};
    __m512 s = _mm512_div_ps(f, _mm512_add_ps(_mm512_set1_ps(2.0f), f));
    return _mm512_mul_ps(_mm512_add_ps(s, s), v_poly(_mm512_mul_ps(s, s), c, 9));
}

/* log y for y ≥ 0 (log 0 = −inf): y = m·2ᵉ with m in [√½, √2), log m = log(1 + (m − 1)) */
static inline __m512 v_log(__m512 y) {
    __m512 m = _mm512_getmant_ps(y, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src), e = _mm512_getexp_ps(y);
    __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, high, e, _mm512_set1_ps(1.0f));
    __m512 l = _mm512_fmadd_ps(e, _mm512_set1_ps(1.428606765330187e-06f), v_log1p_small(_mm512_sub_ps(m, _mm512_set1_ps(1.0f))));
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693145751953125f), l); /* e = −inf at y = 0 */
}

/* atan2(1, t)/π for t ≥ 0 (t = +inf included), in [0, ½]: the smaller of P and 1 − P, computed directly. With
   v = min(t, 1/t) ≤ 1, atan v by its series to v¹⁹ after atan v = π/4 + atan((v − 1)/(v + 1)) above tan(π/8). */
static inline __m512 v_small_angle(__m512 t) {
    static const float c[10] = {1.0f, -1 / 3.0f, 1 / 5.0f, -1 / 7.0f, 1 / 9.0f, -1 / 11.0f, 1 / 13.0f, -1 / 15.0f,
                                1 / 17.0f, -1 / 19.0f};
    const __m512 one = _mm512_set1_ps(1.0f), inv_pi = _mm512_set1_ps(0.318309886f);
    __mmask16 big = _mm512_cmp_ps_mask(t, one, _CMP_GT_OQ);
    __m512 v = _mm512_mask_div_ps(t, big, one, t);
    __mmask16 red = _mm512_cmp_ps_mask(v, _mm512_set1_ps(0.414213562f), _CMP_GT_OQ);
    __m512 w = _mm512_mask_div_ps(v, red, _mm512_sub_ps(v, one), _mm512_add_ps(v, one));
    __m512 a = _mm512_mul_ps(w, v_poly(_mm512_mul_ps(w, w), c, 10));
    a = _mm512_mask_add_ps(a, red, a, _mm512_set1_ps(0.785398163f)); /* atan v */
    a = _mm512_mul_ps(a, inv_pi);
    return _mm512_mask_sub_ps(a, ~big, _mm512_set1_ps(0.5f), a); /* t ≤ 1: ½ − atan(t)/π */
}

static inline __m512 bf16x16_to_ps(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#define LOAD16_BF16(p, m, fill) _mm512_mask_blend_ps(m, _mm512_set1_ps(fill), bf16x16_to_ps(_mm256_maskz_loadu_epi16(m, p)))
#define LOAD16_F32(p, m, fill) _mm512_mask_loadu_ps(_mm512_set1_ps(fill), m, p)
#define MASK16(j, V) ((j) + 16 <= (V) ? (__mmask16)0xffff : (__mmask16)((1u << ((V) - (j))) - 1))

enum { SCORES_NORMALIZE = 0, SCORES_ACCEPT = 1, SCORES_ACCEPT_ONCE = 2 };

/* Per row: the log-partition lse of loc (when relative thresholds or accept_once need it), x = (loc [− lse] − C) /
   max(scale, tiny), P = ½ + atan(x)/π; then log P (normalize), loc + log P (accept), or log r + log(Σ_j r_j (1 − P_j)
   + P) with r = softmax(loc) (accept_once). thr: one value (thr_per_token 0) or V. Vocabulary-parallel, each
   reduction across the threads by OpenMP. */
#define DEFINE_SCORES(E)                                                                                              \
    void cq_scores_##E(const E##_T *loc, const E##_T *scale, int64_t N, int64_t V, const float *thr,                  \
                       int thr_per_token, int relative, int distribution, float *out, int threads) {                 \
        const __m512 tiny = _mm512_set1_ps(1.17549435e-38f), one = _mm512_set1_ps(1.0f);                              \
        for (int64_t n = 0; n < N; n++) {                                                                             \
            const E##_T *l = loc + n * V, *s = scale + n * V;                                                          \
            float *o = out + n * V;                                                                                   \
            float top = 0.0f, log_total = 0.0f, rejected = 0.0f;                                                      \
            if (relative || distribution == SCORES_ACCEPT_ONCE) {                                                     \
                float total = 0.0f;                                                                                   \
                top = -__builtin_inff();                                                                              \
                _Pragma("omp parallel for num_threads(threads) schedule(static) reduction(max:top)")                 \
                for (int64_t j = 0; j < V; j += 16)                                                                   \
                    top = fmaxf(top, _mm512_reduce_max_ps(LOAD16_##E(l + j, MASK16(j, V), -__builtin_inff())));    \
                const __m512 top_max = _mm512_set1_ps(top);                                                           \
                _Pragma("omp parallel for num_threads(threads) schedule(static) reduction(+:total)")                 \
                for (int64_t j = 0; j < V; j += 16)                                                                   \
                    total += _mm512_reduce_add_ps(v_exp(_mm512_sub_ps(LOAD16_##E(l + j, MASK16(j, V), -__builtin_inff()), top_max))); \
                log_total = logf(total); /* lse = top + log_total, kept apart: their float sum would round */         \
            }                                                                                                         \
            const __m512 top_v = _mm512_set1_ps(top), log_total_v = _mm512_set1_ps(log_total);                      \
            _Pragma("omp parallel for num_threads(threads) schedule(static) reduction(+:rejected)")                  \
            for (int64_t j = 0; j < V; j += 16) {                                                                     \
                const __mmask16 m = MASK16(j, V);                                                                     \
                __m512 lv = LOAD16_##E(l + j, m, 0.0f), sv = LOAD16_##E(s + j, m, 1.0f);                              \
                __m512 c = thr_per_token ? _mm512_maskz_loadu_ps(m, thr + j) : _mm512_set1_ps(thr[0]);                \
                __m512 log_r = _mm512_sub_ps(_mm512_sub_ps(lv, top_v), log_total_v);                                  \
                __m512 x = _mm512_div_ps(_mm512_sub_ps(relative ? log_r : lv, c), _mm512_max_ps(sv, tiny));          \
                __m512 small = v_small_angle(_mm512_abs_ps(x));                                                        \
                __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);                                 \
                __m512 big = _mm512_sub_ps(one, small);                                                               \
                __m512 p = _mm512_mask_blend_ps(pos, small, big), q = _mm512_mask_blend_ps(pos, big, small);           \
                if (distribution == SCORES_ACCEPT_ONCE) {                                                             \
                    __m512 r = _mm512_maskz_mov_ps(m, v_exp(log_r));                                                  \
                    rejected += _mm512_reduce_add_ps(_mm512_mul_ps(r, q));                                            \
                    _mm512_mask_storeu_ps(o + j, m, p);                                                               \
                } else {                                                                                              \
                    __m512 lp = v_log(p);                                                                             \
                    _mm512_mask_storeu_ps(o + j, m, distribution == SCORES_ACCEPT ? _mm512_add_ps(lv, lp) : lp);       \
                }                                                                                                     \
            }                                                                                                         \
            if (distribution == SCORES_ACCEPT_ONCE) {                                                                 \
                const __m512 rej_v = _mm512_set1_ps(rejected);                                                        \
                _Pragma("omp parallel for num_threads(threads) schedule(static)")                                     \
                for (int64_t j = 0; j < V; j += 16) {                                                                 \
                    const __mmask16 m = MASK16(j, V);                                                                 \
                    __m512 lv = LOAD16_##E(l + j, m, 0.0f), p = _mm512_maskz_loadu_ps(m, o + j);                     \
                    __m512 log_r = _mm512_sub_ps(_mm512_sub_ps(lv, top_v), log_total_v);                              \
                    _mm512_mask_storeu_ps(o + j, m, _mm512_add_ps(log_r, v_log(_mm512_add_ps(rej_v, p))));           \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
    }

DEFINE_SCORES(BF16)
DEFINE_SCORES(F32)
