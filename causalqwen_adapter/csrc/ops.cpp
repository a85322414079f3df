// The CPU kernels of the causalqwen operators (their schemas: causalqwen_adapter/ops.py), over the AVX-512 code of
// kernels.cpp. Each checks what it is given and raises on what it does not compute; which inputs it serves is the
// answer of the operator's `_applies` query (causalqwen_adapter/cpu_kernels.py), asked first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

#include "kernels.h"

namespace {

int supported() {
    static const int bits = cq_supported();
    return bits;
}

bool is_bf16(const at::Tensor &t) {
    const auto dtype = t.scalar_type();
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "causalqwen: bfloat16 or float32 tensors, got ", dtype);
    TORCH_CHECK(supported() & (dtype == at::kBFloat16 ? 2 : 1), "causalqwen: this CPU has no AVX-512",
                dtype == at::kBFloat16 ? " BF16" : "", " instructions for ", dtype, " tensors");
    return dtype == at::kBFloat16;
}

// Threads for `work` blocks of work: at most PyTorch's own count
int threads_for(int64_t work) {
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work)));
}

void check(const at::Tensor &t, at::ScalarType dtype, const char *name) {
    TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(), "causalqwen: ", name,
                " must be a contiguous CPU tensor of ", dtype, ", got ", t.scalar_type());
}

void check(const std::optional<at::Tensor> &t, at::ScalarType dtype, const char *name) {
    if (t) check(*t, dtype, name);
}

template <typename T> T *ptr(const at::Tensor &t) { return static_cast<T *>(t.data_ptr()); }

template <typename T> T *ptr(const std::optional<at::Tensor> &t) {
    return t ? static_cast<T *>(t->data_ptr()) : nullptr;
}

// cauchy_linear(Tensor loc_U, Tensor scale_U, Tensor weight, Tensor? bias) -> (Tensor, Tensor)
std::tuple<at::Tensor, at::Tensor> cauchy_linear(const at::Tensor &loc_U, const at::Tensor &scale_U,
                                                 const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    const bool bf16 = is_bf16(weight);
    const auto dtype = weight.scalar_type();
    TORCH_CHECK(weight.dim() == 2, "causalqwen::cauchy_linear: a [V, C] weight");
    check(weight, dtype, "weight");
    const int64_t vocab = weight.size(0), size = weight.size(1);
    TORCH_CHECK(loc_U.dim() >= 1 && loc_U.size(-1) == size && scale_U.sizes() == loc_U.sizes() && loc_U.numel() > 0,
                "causalqwen::cauchy_linear: loc_U and scale_U [..., C] with C = ", size);
    const int64_t rows = loc_U.numel() / size;
    const at::Tensor x_loc = loc_U.reshape({rows, size}).to(dtype).contiguous();
    const at::Tensor x_scale = scale_U.reshape({rows, size}).to(dtype).contiguous();
    std::optional<at::Tensor> b;
    if (bias) {
        TORCH_CHECK(bias->numel() == vocab, "causalqwen::cauchy_linear: a bias of V = ", vocab, " values");
        b = bias->reshape({vocab}).to(dtype).contiguous();
    }
    at::Tensor loc = at::empty({rows, vocab}, weight.options());
    at::Tensor scale = at::empty({rows, vocab}, weight.options());
    const int threads = threads_for(vocab / 1024);
    if (bf16)
        cq_loc_scale_BF16(ptr<const uint16_t>(weight), vocab, size, ptr<const uint16_t>(x_loc),
                          ptr<const uint16_t>(x_scale), rows, ptr<const uint16_t>(b), ptr<uint16_t>(loc),
                          ptr<uint16_t>(scale), threads);
    else
        cq_loc_scale_F32(ptr<const float>(weight), vocab, size, ptr<const float>(x_loc), ptr<const float>(x_scale),
                         rows, ptr<const float>(b), ptr<float>(loc), ptr<float>(scale), threads);
    auto shape = loc_U.sizes().vec();
    shape.back() = vocab;
    return {loc.view(shape), scale.view(shape)};
}

// ovr_scores(Tensor loc_S, Tensor scale_S, Tensor threshold, bool relative, str distribution) -> Tensor
at::Tensor ovr_scores(const at::Tensor &loc_S, const at::Tensor &scale_S, const at::Tensor &threshold, bool relative,
                      c10::string_view distribution) {
    const std::string name(distribution.data(), distribution.size());
    const int code = name == "normalize" ? 0 : name == "accept" ? 1 : name == "accept_once" ? 2 : -1;
    TORCH_CHECK(code >= 0, "causalqwen::ovr_scores: no distribution ", name);
    const bool bf16 = is_bf16(loc_S);
    TORCH_CHECK(loc_S.dim() >= 1 && loc_S.numel() > 0 && scale_S.sizes() == loc_S.sizes() &&
                    scale_S.scalar_type() == loc_S.scalar_type(),
                "causalqwen::ovr_scores: loc_S and scale_S of one shape [..., V] and dtype");
    const int64_t vocab = loc_S.size(-1);
    const at::Tensor loc = loc_S.reshape({-1, vocab}).contiguous(), scale = scale_S.reshape({-1, vocab}).contiguous();
    const at::Tensor thr = threshold.reshape({-1}).to(at::kFloat).contiguous();
    TORCH_CHECK(thr.numel() == 1 || thr.numel() == vocab, "causalqwen::ovr_scores: one threshold or V = ", vocab);
    check(loc, loc.scalar_type(), "loc_S");
    check(scale, loc.scalar_type(), "scale_S");
    check(thr, at::kFloat, "threshold");
    at::Tensor scores = at::empty(loc.sizes(), loc.options().dtype(at::kFloat));
    const int per_token = thr.numel() > 1, threads = threads_for(vocab / 8192);
    if (bf16)
        cq_scores_BF16(ptr<const uint16_t>(loc), ptr<const uint16_t>(scale), loc.size(0), vocab, ptr<const float>(thr),
                       per_token, relative, code, ptr<float>(scores), threads);
    else
        cq_scores_F32(ptr<const float>(loc), ptr<const float>(scale), loc.size(0), vocab, ptr<const float>(thr),
                      per_token, relative, code, ptr<float>(scores), threads);
    return scores.view(loc_S.sizes());
}

// loss_tile(Tensor loc, Tensor? bias, Tensor lse, Tensor threshold, bool relative, Tensor? scale, Tensor col,
//           Tensor? degenerate, float ce, float of, int flags, Tensor(a!)? d, Tensor(b!)? g, Tensor(c!) rows_out,
//           Tensor(d!) col_d, Tensor(e!) col_t, int threads) -> ()
void loss_tile(const at::Tensor &loc, const std::optional<at::Tensor> &bias, const at::Tensor &lse,
               const at::Tensor &threshold, bool relative, const std::optional<at::Tensor> &scale,
               const at::Tensor &col, const std::optional<at::Tensor> &degenerate, double ce, double of,
               int64_t flags, const std::optional<at::Tensor> &d, const std::optional<at::Tensor> &g,
               const at::Tensor &rows_out, const at::Tensor &col_d, const at::Tensor &col_t, int64_t threads) {
    const bool bf16 = is_bf16(loc);
    const auto dtype = loc.scalar_type();
    TORCH_CHECK(loc.dim() == 2, "causalqwen::loss_tile: an [r, w] tile");
    const int64_t r = loc.size(0), w = loc.size(1);
    check(loc, dtype, "loc");
    check(scale, dtype, "scale");
    check(d, dtype, "d");
    check(g, dtype, "g");
    check(bias, at::kFloat, "bias");
    check(lse, at::kFloat, "lse");
    check(threshold, at::kFloat, "threshold");
    check(col, at::kLong, "col");
    check(degenerate, at::kBool, "degenerate");
    check(rows_out, at::kFloat, "rows_out");
    check(col_d, at::kFloat, "col_d");
    check(col_t, at::kFloat, "col_t");
    TORCH_CHECK(lse.numel() >= r && col.numel() >= r && rows_out.numel() >= 4 * r &&
                    col_d.numel() >= threads * w && col_t.numel() >= threads * w &&
                    (!scale || scale->numel() >= r * w) && (!d || d->numel() >= r * w) &&
                    (!g || g->numel() >= r * w) && (!bias || bias->numel() >= w) &&
                    (!degenerate || degenerate->numel() >= w) && (threshold.numel() == 1 || threshold.numel() >= w),
                "causalqwen::loss_tile: operands smaller than the tile");
    const int per_token = threshold.numel() > 1;
    if (bf16)
        cq_loss_tile_BF16(ptr<const uint16_t>(loc), ptr<const float>(bias), ptr<const float>(lse),
                          ptr<const float>(threshold), per_token, relative, ptr<const uint16_t>(scale),
                          ptr<const int64_t>(col), ptr<const uint8_t>(degenerate), r, w, static_cast<float>(ce),
                          static_cast<float>(of), static_cast<int>(flags), ptr<uint16_t>(d), ptr<uint16_t>(g),
                          ptr<float>(rows_out), ptr<float>(col_d), ptr<float>(col_t), static_cast<int>(threads));
    else
        cq_loss_tile_F32(ptr<const float>(loc), ptr<const float>(bias), ptr<const float>(lse),
                         ptr<const float>(threshold), per_token, relative, ptr<const float>(scale),
                         ptr<const int64_t>(col), ptr<const uint8_t>(degenerate), r, w, static_cast<float>(ce),
                         static_cast<float>(of), static_cast<int>(flags), ptr<float>(d), ptr<float>(g),
                         ptr<float>(rows_out), ptr<float>(col_d), ptr<float>(col_t), static_cast<int>(threads));
}

// block_logsumexp(Tensor(a!) loc, Tensor? bias, bool store_bias, Tensor(b!) lse, int threads) -> ()
void block_logsumexp(const at::Tensor &loc, const std::optional<at::Tensor> &bias, bool store_bias,
                     const at::Tensor &lse, int64_t threads) {
    const bool bf16 = is_bf16(loc);
    TORCH_CHECK(loc.dim() == 2 && lse.dim() == 1, "causalqwen::block_logsumexp: an [r, w] block and an [r] column");
    const int64_t r = loc.size(0), w = loc.size(1);
    check(loc, loc.scalar_type(), "loc");
    check(bias, at::kFloat, "bias");
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.device().is_cpu() && lse.size(0) == r && (!bias || bias->numel() == w),
                "causalqwen::block_logsumexp: a float32 column of r = ", r, " rows and a bias of w = ", w);
    if (bf16)
        cq_block_lse_BF16(ptr<uint16_t>(loc), ptr<const float>(bias), store_bias, r, w, ptr<float>(lse),
                          lse.stride(0), static_cast<int>(threads));
    else
        cq_block_lse_F32(ptr<float>(loc), ptr<const float>(bias), store_bias, r, w, ptr<float>(lse), lse.stride(0),
                         static_cast<int>(threads));
}

}  // namespace

// What this CPU runs, asked by causalqwen_adapter/cpu_kernels.py once the library is loaded: cq_supported's bits.
TORCH_LIBRARY(causalqwen_cpu, m) {
    m.def("supported(Tensor like) -> int", [](const at::Tensor &) { return static_cast<int64_t>(supported()); });
}

TORCH_LIBRARY_IMPL(causalqwen, CPU, m) {
    m.impl("cauchy_linear", &cauchy_linear);
    m.impl("ovr_scores", &ovr_scores);
    m.impl("loss_tile", &loss_tile);
    m.impl("block_logsumexp", &block_logsumexp);
}
