// The C kernels of the causalqwen decode operators (their schemas: kernels/ops.py), over the AVX-512 code
// of kernels.cpp, registered as causalqwen_cpu::<name>. Each checks what it is given and raises on what it does not
// compute; the operators' CPU kernels (kernels/cpu.py) call them where `c_<name>_applies` says so.

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

}  // namespace

// What this CPU runs, asked by kernels/cpu.py once the library is loaded: cq_supported's bits; and
// the kernels, which the causalqwen operators' CPU kernels (cpu.py) call where they apply.
TORCH_LIBRARY(causalqwen_cpu, m) {
    m.def("supported(Tensor like) -> int", [](const at::Tensor &) { return static_cast<int64_t>(supported()); });
    m.def("cauchy_linear(Tensor loc_U, Tensor scale_U, Tensor weight, Tensor? bias) -> (Tensor, Tensor)");
    m.def("ovr_scores(Tensor loc_S, Tensor scale_S, Tensor threshold, bool relative, str distribution) -> Tensor");
}

TORCH_LIBRARY_IMPL(causalqwen_cpu, CPU, m) {
    m.impl("cauchy_linear", &cauchy_linear);
    m.impl("ovr_scores", &ovr_scores);
}
