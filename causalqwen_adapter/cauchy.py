"""Cauchy / one-vs-rest math of docs/design.md — the one place it lives.

Shipped as remote code: imports only torch. Every other module (the model, the chunked
training loss, generation) calls these functions instead of re-deriving the formulas.
"""

import math

import torch

INFERENCE_MODES = ("compatible", "standard", "sampling", "causal")

_LOG_PI = math.log(math.pi)


def softplus_inverse(y: float) -> float:
    """Exact softplus⁻¹(y) = log(expm1(y)), in the form that stays finite for large y."""
    if y <= 0:
        raise ValueError(f"softplus⁻¹ is defined for y > 0, got {y}")
    return y + math.log(-math.expm1(-y))


def fuse_noise(
    loc_U: torch.Tensor,
    scale_U: torch.Tensor,
    b_noise: torch.Tensor,
    mode: str = "standard",
    temperature: float = 1.0,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise fusion of docs/design.md, Action network; returns (loc_U', scale_U').

    training / ``standard``: the noise widens the scale,  scale_U + T·|b_noise|;
    ``sampling``: the noise shifts the location, loc_U + T·|b_noise|⊙ε with ε ~ Cauchy(0, 1)
    (``noise`` is ε; drawn here when not given);
    ``causal`` (and ``compatible``, whose score ignores the scale): no noise.
    """
    if mode in ("causal", "compatible") or temperature == 0:
        return loc_U, scale_U
    if mode == "standard":
        return loc_U, scale_U + temperature * b_noise.abs()
    if mode == "sampling":
        if noise is None:
            noise = sample_standard_cauchy(loc_U.shape, dtype=loc_U.dtype, device=loc_U.device)
        return loc_U + temperature * b_noise.abs() * noise, scale_U
    raise ValueError(f"unknown inference mode {mode!r}: choose one of {', '.join(INFERENCE_MODES)}")


def sample_standard_cauchy(shape, *, dtype=None, device=None, generator=None) -> torch.Tensor:
    """ε ~ Cauchy(0, 1) by inverse CDF: tan(π (u − ½)), u ~ U(0, 1)."""
    u = torch.rand(shape, dtype=torch.float32, device=device, generator=generator)
    return torch.tan(math.pi * (u - 0.5)).to(dtype or torch.float32)


def cauchy_linear(
    loc_U: torch.Tensor,
    scale_U: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cauchy linear stability: U ~ Cauchy(loc, scale) ⇒ W U + b ~ Cauchy(W loc + b, |W| scale)."""
    loc_S = torch.nn.functional.linear(loc_U, weight, bias)
    scale_S = torch.nn.functional.linear(scale_U, weight.abs())
    return loc_S, scale_S


def cauchy_linear_blocked(
    loc_U: torch.Tensor,
    scale_U: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    block_rows: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cauchy_linear` for inference (no gradient), over blocks of ``block_rows`` vocabulary rows.

    |W| exists for one block at a time (7 MiB for bf16 at C = 896, still in cache when the second product reads it),
    never as a second [V × C] tensor, and each block of W comes from memory once for both products, written straight
    into its columns of the [N, V] results. Under autocast the products run in its dtype, as ``F.linear`` would (each
    block cast on its own).
    """
    device = loc_U.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    shape = loc_U.shape
    loc_U = loc_U.reshape(-1, shape[-1]).to(dtype)
    scale_U = scale_U.reshape(-1, shape[-1]).to(dtype)
    vocab = weight.shape[0]
    loc_S = loc_U.new_empty(loc_U.shape[0], vocab)
    scale_S = loc_U.new_empty(loc_U.shape[0], vocab)
    abs_buf = loc_U.new_empty(min(block_rows, vocab), weight.shape[1])
    with torch.autocast(device, enabled=False):  # the out= products take the dtypes set here
        for v0 in range(0, vocab, block_rows):
            w = weight[v0 : v0 + block_rows].to(dtype)
            v1 = v0 + len(w)
            if bias is None:
                torch.mm(loc_U, w.T, out=loc_S[:, v0:v1])
            else:
                torch.addmm(bias[v0:v1].to(dtype), loc_U, w.T, out=loc_S[:, v0:v1])
            torch.mm(scale_U, torch.abs(w, out=abs_buf[: len(w)]).T, out=scale_S[:, v0:v1])
    return loc_S.reshape(*shape[:-1], vocab), scale_S.reshape(*shape[:-1], vocab)


SKINNY_ROWS = 128  # up to this many rows, x @ Wᵀ on the CPU is faster as (W @ xᵀ)ᵀ (BENCHMARKS.md, compare)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                    scratch: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weightᵀ, [N, V] for x [N, C] and weight [V, C], into ``out`` when given. On the CPU with N ≤ `SKINNY_ROWS`
    the product runs as weight @ xᵀ into [V, N] (``scratch``, at least N·V elements of x's dtype, or a new tensor)
    and is copied transposed: MKL runs the x @ Wᵀ layout up to 2× slower for a skinny x (on 2 threads; about 1.1–1.3×
    on one). The same sums, in another order: equal within rounding. ``out`` may be wider than x (the product runs
    in x's dtype, then is copied)."""
    n, v = x.shape[0], weight.shape[0]
    if x.device.type != "cpu" or n > SKINNY_ROWS:
        if out is None or out.dtype == x.dtype:
            return torch.mm(x, weight.T, out=out)
        return out.copy_(torch.mm(x, weight.T, out=None if scratch is None else scratch[: n * v].view(n, v)))
    product = torch.mm(weight, x.T, out=None if scratch is None else scratch[: n * v].view(v, n))
    return product.T.contiguous() if out is None else out.copy_(product.T)


def cauchy_linear_rows(
    loc_U: torch.Tensor,
    scale_U: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cauchy_linear` at a few output rows per position: ``rows`` [N, K] vocabulary ids, ``loc_U``,
    ``scale_U`` [N, C]; returns (loc_S, scale_S) [N, K] with loc_S[n, j] = W[rows[n, j]] · loc_U[n] + b.

    Reads K rows of W per position instead of all V (top-K distillation).
    """
    w = weight[rows]  # [N, K, C]
    loc_S = torch.bmm(w, loc_U.unsqueeze(-1)).squeeze(-1)
    scale_S = torch.bmm(w.abs(), scale_U.unsqueeze(-1)).squeeze(-1)
    if bias is not None:
        loc_S = loc_S + bias[rows]
    return loc_S, scale_S


def ovr_standardize(loc_S: torch.Tensor, scale_S: torch.Tensor, threshold) -> torch.Tensor:
    """x_k = (loc_S_k − C_k) / scale_S_k (relative thresholds pass log softmax(loc_S) as ``loc_S``).

    A vocabulary row of W_A that is all zeros (a padding embedding) gives scale_S_k = 0, a
    degenerate law for which x is 0/0. The scale is floored at the smallest normal float, which
    changes no other value and makes such a token sit exactly at its threshold (P = ½) or far
    on its side of it, never NaN.
    """
    return (loc_S - threshold) / scale_S.clamp_min(torch.finfo(scale_S.dtype).tiny)


def ovr_log_probs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log P_k, log(1 − P_k)) for the OvR probability P_k = ½ + atan(x_k)/π.

    Through the atan2 forms P = atan2(1, −x)/π and 1 − P = atan2(1, x)/π: neither side
    rounds to 0 for large |x| (atan2(1, x) ≈ 1/x), so no clamping is needed. Below the threshold (x < 0)
    log(1 − P) is log1p(−P): atan2(1, x)/π is within an ulp of 1 there and would lose the digits of a small P.
    """
    below = x < 0
    small_p = torch.where(below, ovr_probs(x), 0.0)  # 0 elsewhere: no log1p(−1) in the unused branch's gradient
    return ovr_log_prob(x), torch.where(below, torch.log1p(-small_p), ovr_log_prob(-x))  # 1 − P(x) = P(−x)


def ovr_log_prob(x: torch.Tensor) -> torch.Tensor:
    """log P_k alone: what the OvR modes score with at every decode step."""
    return torch.log(torch.atan2(torch.ones((), dtype=x.dtype, device=x.device), -x)) - _LOG_PI


def ovr_probs(x: torch.Tensor) -> torch.Tensor:
    """P_k = ½ + atan(x_k)/π, as atan2(1, −x)/π."""
    return torch.atan2(torch.ones((), dtype=x.dtype, device=x.device), -x) / math.pi


def ovr_decision_scores(loc_S, scale_S, threshold, relative: bool, distribution: str, log_P=None) -> torch.Tensor:
    """The logits an OvR mode decodes with (docs/design.md, Inference modes), float32 [..., V]: the log of the
    ``distribution`` up to a constant: loc_S + log P_k (``accept``), log P_k (``normalize``), or
    log softmax(loc_S)_k + log(1 − A + P_k) (``accept_once``). ``log_P`` may be passed when the caller has it.

    One function of whole rows, so that the installed package can compile it into one kernel (kernels/compiled.py);
    the remote code runs it eagerly.
    """
    loc = loc_S.float()
    log_r = torch.log_softmax(loc, -1) if relative or distribution == "accept_once" else None
    x = None if log_P is not None else ovr_standardize(log_r if relative else loc, scale_S.float(), threshold.float())
    if distribution in ("normalize", "accept"):
        log_P = ovr_log_prob(x) if log_P is None else log_P
        return log_P if distribution == "normalize" else loc + log_P
    # accept_once: q_k = r_k (1 − A + P_k) with r = softmax(loc_S). 1 − A = Σ_j r_j (1 − P_j) is a sum of non-negative
    # terms, each 1 − P_j = P(−x_j) taken directly (its digits kept when P_j is near 1); r stays in log space.
    P, rejected_each = (ovr_probs(x), ovr_probs(-x)) if x is not None else (log_P.exp(), -torch.expm1(log_P))
    rejected = (log_r.exp() * rejected_each).sum(-1, keepdim=True)
    return log_r + torch.log(rejected + P)


def ovr_token_losses(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position OvR binary cross-entropy summed over the vocabulary (docs/design.md, Training losses).

    ℓ = Σ_k −log(1 − P_k) + [−log P_y + log(1 − P_y)], with no one-hot tensor.
    ``x``: [..., V] standardized scores; ``targets``: [...] valid token ids. Returns [...].
    """
    log_p, log_not_p = ovr_log_probs(x)
    y = targets.unsqueeze(-1)
    return -log_not_p.sum(-1) - log_p.gather(-1, y).squeeze(-1) + log_not_p.gather(-1, y).squeeze(-1)


def ovr_loss(
    loc_S: torch.Tensor,
    scale_S: torch.Tensor,
    threshold,
    labels: torch.Tensor,
    num_items_in_batch=None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The OvR loss on already computed scores: float32 math, sum over the vocabulary,
    mean over valid targets (or sum / ``num_items_in_batch`` under gradient accumulation).

    ``labels`` are aligned with the scores (already shifted). This form materialises
    [tokens × V]; the trainer uses the chunked form in ``losses.py``.
    """
    vocab = loc_S.shape[-1]
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    check_labels(labels[valid], vocab)
    x = ovr_standardize(loc_S.reshape(-1, vocab)[valid].float(), scale_S.reshape(-1, vocab)[valid].float(),
                        threshold.float() if torch.is_tensor(threshold) else threshold)
    total = ovr_token_losses(x, labels[valid]).sum()
    if num_items_in_batch is None:
        num_items_in_batch = valid.sum()
    return total / num_items_in_batch


def signed_log1p(v: torch.Tensor) -> torch.Tensor:
    """φ(v) = sign(v)·ln(1 + |v|): how a number enters the input embedding (docs/design.md, Numbers); φ(0) = 0."""
    return torch.sign(v) * torch.log1p(v.abs())


def cauchy_regression(
    loc_U: torch.Tensor, scale_U: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, log_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The numeric head on the Cauchy path: loc_Y = w·loc_U' + b, scale_Y = |w|·scale_U' + exp(s).

    ``loc_U``, ``scale_U``: [..., C] after noise fusion; ``weight``: [C]; ``bias``, ``log_scale``: scalars.
    """
    loc_Y = loc_U @ weight + bias
    scale_Y = scale_U @ weight.abs() + log_scale.exp()
    return loc_Y, scale_Y


def cauchy_nll(y: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """−log density of Cauchy(loc, scale) at y: log(π·scale) + log1p(z²), z = (y − loc)/scale, elementwise.

    Beyond |z| = 1 as 2·log|z| + log1p(1/z²): z² overflows float32 from |z| ≈ 1.8e19 (one target of 1e20 made the loss
    inf), while the NLL itself is only ≈ 2·log|z|, a few dozen."""
    z = ((y - loc) / scale).abs()
    far = z > 1
    z_far, z_near = torch.where(far, z, 1.0), torch.where(far, 0.0, z)  # each branch finite, gradients included
    log_term = torch.where(far, 2 * torch.log(z_far) + torch.log1p(z_far.reciprocal().square()),
                           torch.log1p(z_near.square()))
    return _LOG_PI + torch.log(scale) + log_term


def cauchy_quantile(
    loc: torch.Tensor, scale: torch.Tensor, p: float, support: tuple[float, float] | None = None
) -> torch.Tensor:
    """The p-quantile of Cauchy(loc, scale), elementwise: loc + scale·tan(π(p − ½)).

    With ``support`` = (low, high), the quantile of the law restricted to that range, for a value known to lie in it
    (a rating on a fixed scale, a percentage): F⁻¹(F(low) + p·(F(high) − F(low))), written in angles since
    π(F(x) − ½) = atan((x − loc)/scale). Computed in float32 or the inputs' wider dtype.
    """
    if not 0 < p < 1:
        raise ValueError(f"a quantile level must lie in (0, 1), got {p}")
    dtype = torch.promote_types(torch.promote_types(loc.dtype, scale.dtype), torch.float32)
    loc, scale = loc.to(dtype), scale.to(dtype)
    if support is None:
        return loc + scale * math.tan(math.pi * (p - 0.5))
    low, high = support
    if not low < high:
        raise ValueError(f"support must be (low, high) with low < high, got {support}")
    a, b = torch.atan((low - loc) / scale), torch.atan((high - loc) / scale)
    return (loc + scale * torch.tan(a + p * (b - a))).clamp(low, high)


def cauchy_interval(
    loc: torch.Tensor, scale: torch.Tensor, level: float, support: tuple[float, float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper) of the central ``level`` interval of Cauchy(loc, scale), on ``support`` when given: the
    (1 ∓ level)/2 quantiles (`cauchy_quantile`). A numeric head's `loc_Y`, `scale_Y` give its number's interval."""
    if not 0 < level < 1:
        raise ValueError(f"an interval's level must lie in (0, 1), got {level}")
    return cauchy_quantile(loc, scale, (1 - level) / 2, support), cauchy_quantile(loc, scale, (1 + level) / 2, support)


def check_labels(valid_labels: torch.Tensor, vocab_size: int) -> None:
    """Labels other than −100 must index the vocabulary."""
    if torch.compiler.is_compiling():  # a traced graph cannot branch on values: the check stops the compiled call
        torch._assert_async(((valid_labels >= 0) & (valid_labels < vocab_size)).all(), "a label is outside the "
                            f"vocabulary [0, {vocab_size}); use -100 for positions that carry no target")
    elif valid_labels.numel() and (valid_labels.min() < 0 or valid_labels.max() >= vocab_size):
        bad = valid_labels[(valid_labels < 0) | (valid_labels >= vocab_size)][0].item()
        raise ValueError(
            f"label {bad} is outside the vocabulary [0, {vocab_size}); use -100 for positions "
            "that carry no target (prompt, padding)"
        )
