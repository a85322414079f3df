/* The AVX-512 kernels of kernels.cpp, called by the operators of ops.cpp. bf16 elements travel as uint16_t. */
#pragma once
#include <stdint.h>

/* Callable on any x86-64 CPU. Bit 0: the float32 kernels run here (AVX-512F and BW); bit 1: the bf16 ones (and
   AVX512-BF16). */
int cq_supported(void);

/* loc = xl Wᵀ + b and scale = xs |W|ᵀ: W [V, C], b [V] (NULL: none), xl, xs [N, C] -> loc, scale [N, V] */
void cq_loc_scale_BF16(const uint16_t *W, int64_t V, int64_t C, const uint16_t *xl, const uint16_t *xs, int64_t N,
                       const uint16_t *bias, uint16_t *loc, uint16_t *scale, int threads);
void cq_loc_scale_F32(const float *W, int64_t V, int64_t C, const float *xl, const float *xs, int64_t N,
                      const float *bias, float *loc, float *scale, int threads);

/* The OvR modes' decision scores of [N, V] rows (distribution: 0 normalize, 1 accept, 2 accept_once) */
void cq_scores_BF16(const uint16_t *loc, const uint16_t *scale, int64_t N, int64_t V, const float *thr,
                    int thr_per_token, int relative, int distribution, float *out, int threads);
void cq_scores_F32(const float *loc, const float *scale, int64_t N, int64_t V, const float *thr, int thr_per_token,
                   int relative, int distribution, float *out, int threads);
