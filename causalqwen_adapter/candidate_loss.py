"""The OvR loss over each position's candidates (docs/design.md, Training losses): the binary cross-entropy of the k
tokens of largest loc_S and of the target, instead of over the whole vocabulary (config `ovr_candidates`). The
candidates come from the cross-entropy's fused pass (`lm_loss.chunked_lm_loss`) or from `candidate_rows`' own
no-grad pass; the loss reads only their rows of W_A, token chunk by token chunk.
"""

from typing import NamedTuple

import torch

from .cauchy import check_labels, few_rows_linear, fuse_noise, ovr_log_probs, ovr_standardize
from .losses import (
    LOGITS_BUDGET_BYTES,
    DecisionHead,
    check_head_inputs,
    chunk_tokens,
    liger_logits_bytes,
    saved_gradients,
)


class CandidateRows(NamedTuple):
    """The rows the OvR loss over candidates scores (`candidate_ovr_loss`), per position: ``ids`` [N, k + 1], the k
    tokens of largest loc_S then the target; ``counted`` [N, k + 1], False for the target's own column when the target
    is already among the k; ``log_partition`` [N], logsumexp of loc_S (float32), the reference of relative
    thresholds."""

    ids: torch.Tensor
    counted: torch.Tensor
    log_partition: torch.Tensor


def candidate_set(top: torch.Tensor, targets: torch.Tensor, log_partition: torch.Tensor) -> CandidateRows:
    """`CandidateRows` from the top-k ids [N, k] of loc_S, the targets [N] and the log-partition [N]."""
    ids = torch.cat([top, targets.unsqueeze(1)], 1)
    counted = torch.ones_like(ids, dtype=torch.bool)
    counted[:, -1] = ~(top == targets.unsqueeze(1)).any(1)
    return CandidateRows(ids, counted, log_partition)


@torch.no_grad()
def candidate_rows(loc_U: torch.Tensor, head: DecisionHead, targets: torch.Tensor, k: int,
                   chunk_size: int | None = None, matmul_dtype: torch.dtype | None = None):
    """(`CandidateRows`, −log softmax(loc_S)_y [N] in float32) from one no-grad pass over the vocabulary, token
    chunks of `chunk_tokens`' budget. The cross-entropy's fused pass finds the same rows from its own logits
    (`lm_loss.chunked_lm_loss` with ``candidates``); this pass serves the OvR loss without the cross-entropy."""
    weight, bias = head.weight, head.bias
    mm_dtype = matmul_dtype or weight.dtype
    w = weight if weight.dtype == mm_dtype else weight.to(mm_dtype)
    chunk_size = chunk_size or chunk_tokens(weight.shape[0])
    top, lse, nll = [], [], []
    for r0 in range(0, len(loc_U), chunk_size):
        logits = few_rows_linear(loc_U[r0 : r0 + chunk_size].to(mm_dtype), w).float()  # F.linear, CPU layout
        if bias is not None:
            logits += bias.float()
        tgt = targets[r0 : r0 + chunk_size]
        part = torch.logsumexp(logits, -1)
        lse.append(part)
        nll.append(part - logits.gather(1, tgt.unsqueeze(1)).squeeze(1))
        top.append(logits.topk(k, -1).indices)
    if not top:
        empty = loc_U.new_zeros(0, dtype=torch.float32)
        return candidate_set(targets.new_zeros(0, k), targets, empty), empty
    return candidate_set(torch.cat(top), targets, torch.cat(lse)), torch.cat(nll)


def candidate_ovr_loss(
    loc_U: torch.Tensor,
    scale_U: torch.Tensor,
    head: DecisionHead,
    targets: torch.Tensor,
    k: int,
    *,
    relative_threshold: bool = True,
    trains_location: bool = False,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    matmul_dtype: torch.dtype | None = None,
    rows: CandidateRows | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The OvR loss over each position's candidates (docs/design.md, Training losses): the binary cross-entropy of
    the k tokens the compatible model ranks highest (largest loc_S) and of the target,

        ℓ = Σ_{j ∈ top-k, j ≠ y} −log(1 − P_j)  −  log P_y,

    instead of over the whole vocabulary. Returns the SUM over positions (the caller divides) and detached means per
    position: ``target_prob`` (P_y), ``candidate_prob_sum`` (Σ over the candidates of P_j) and, when this function
    finds the candidates itself, ``softmax_nll``.

    ``loc_U``, ``scale_U``: [N, C]; ``targets``: [N] valid token ids. P uses the training noise fusion
    (scale_U + T·|b_noise|) and, with ``relative_threshold``, log softmax(loc_S) as the threshold's reference (the
    log-partition is a reference point: no gradient). The gradient reaches the locations (loc_U, W_A and b_A rows)
    only with ``trains_location``. ``rows``: the candidates when the caller has them (the cross-entropy's pass finds
    them, `lm_loss.chunked_lm_loss`); otherwise one no-grad product finds them (`candidate_rows`).

    Memory is flat in N: token chunks of ``chunk_size`` (default `candidate_chunk_tokens`) read their k + 1 rows of
    W_A each in float32, and each chunk's gradients are computed in the forward and summed (W_A's and b_A's rows
    into [V]-row tensors), so that no [N, k + 1, C] tensor outlives its chunk.
    """
    vocab = head.weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < vocab:
        raise ValueError(f"the number of OvR candidates must be an integer in [1, {vocab}), got {k!r}")
    check_head_inputs(loc_U, scale_U, head.weight, targets)
    check_labels(targets, vocab)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    nll = None
    if rows is None:
        rows, nll = candidate_rows(loc_U.detach(), head, targets, k, matmul_dtype=matmul_dtype)
    fits = rows.ids.shape == (len(targets), k + 1)
    if fits and torch.compiler.is_compiling():  # no branch on values in a traced graph: the check stops the call
        torch._assert_async(torch.eq(rows.ids[:, -1], targets).all(), "the candidate rows' last column is not the "
                            "targets: pass the rows found for these positions and targets")
    elif not fits or not torch.equal(rows.ids[:, -1], targets):
        raise ValueError(f"candidate rows of shape {tuple(rows.ids.shape)} for {len(targets)} positions and k = {k}: "
                         "pass the rows found for these positions and targets (their last column is the target)")
    options = (relative_threshold, trains_location, temperature,
               chunk_size or candidate_chunk_tokens(k, loc_U.shape[1], loc_U.device, len(targets), vocab))
    loss, target_prob, prob_sum = _CandidateOvRLoss.apply(loc_U, scale_U, *head, rows, options,
                                                           torch.is_grad_enabled())
    stats = {"target_prob": target_prob, "candidate_prob_sum": prob_sum}
    if nll is not None:
        stats["softmax_nll"] = nll.sum() / max(len(targets), 1)
    return loss, stats


CANDIDATE_CHUNK_BYTES_PER_ROW = 12  # per element of [chunk, k + 1, C]: W_A's rows and |W_A's| in float32, and the
# copy of |W_A's| rows transposed that the scale's gradient (bmm's backward) makes on the CPU (loss_plan counts them)


def candidate_chunk_tokens(k: int, width: int, device: torch.device | str = "cpu", n_tokens: int = 16384,
                           vocab: int = 151936) -> int:
    """Tokens per chunk of `candidate_ovr_loss`: its [chunk, k + 1, C] tensors, `CANDIDATE_CHUNK_BYTES_PER_ROW` per
    element, within a budget: the cross-entropy's logits budget on the CPU (a chunk's tensors stay small next to its
    tiles), the cross-entropy's on an accelerator (Liger-Kernel's logits for ``n_tokens`` at ``vocab``,
    `losses.liger_logits_bytes`: 190 tokens at k = 16, C = 896, V = 151,936, 16k targets), where each chunk costs
    about 120 kernel launches whatever its size."""
    cpu = torch.device(device).type == "cpu"
    budget = LOGITS_BUDGET_BYTES if cpu else liger_logits_bytes(n_tokens, vocab, width)
    per_element = 16 if cpu else CANDIDATE_CHUNK_BYTES_PER_ROW  # the CPU's chunks as they were timed
    return max(1, budget // (per_element * (k + 1) * max(width, 1)))


def _candidate_terms(loc, scale, weight_rows, bias_rows, threshold, rows: CandidateRows, targets):
    """Σ of the candidates' BCE terms and their P [r, k + 1] on one token chunk: the loss's formula, written once.
    ``loc``, ``scale``: the chunk's fused individual law [r, C]; ``weight_rows`` [r, k + 1, C]; ``bias_rows``
    [r, k + 1] or None; ``threshold``: a float, a 0-dim tensor or the chunk's per-candidate thresholds."""
    loc_S = torch.bmm(weight_rows, loc.unsqueeze(-1)).squeeze(-1)
    scale_S = torch.bmm(weight_rows.abs(), scale.unsqueeze(-1)).squeeze(-1)
    if bias_rows is not None:
        loc_S = loc_S + bias_rows
    if rows.log_partition is not None:
        loc_S = loc_S - rows.log_partition.unsqueeze(1)
    log_p, log_not_p = ovr_log_probs(ovr_standardize(loc_S, scale_S, threshold))
    is_target = rows.ids == targets.unsqueeze(1)
    loss = -torch.where(is_target, log_p, log_not_p).masked_fill(~rows.counted, 0.0).sum()
    return loss, log_p.detach().exp().masked_fill(~rows.counted, 0.0), is_target


class _CandidateOvRLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loc_U, scale_U, weight, bias, b_noise, threshold, rows, options, grad_enabled):
        relative, trains_location, temperature, chunk = options
        need_loc, need_scale, need_W, need_bias, need_noise, need_thr = (
            grad_enabled and n for n in ctx.needs_input_grad[:6])
        # Without trains_location the locations are constants of this loss (the gradient reaches the scale path and
        # the thresholds only).
        need_loc, need_W, need_bias = (need and trains_location for need in (need_loc, need_W, need_bias))
        dtype = torch.promote_types(weight.dtype, torch.float32)
        n, vocab = len(rows.ids), weight.shape[0]
        targets = rows.ids[:, -1]
        thr_is_tensor = torch.is_tensor(threshold)
        thr_vector = thr_is_tensor and threshold.dim() == 1
        noise = b_noise.detach().to(dtype).requires_grad_(need_noise)
        thr = threshold.detach().to(dtype).requires_grad_(need_thr) if thr_is_tensor else threshold
        grads = {
            "loc": torch.zeros_like(loc_U, dtype=dtype) if need_loc else None,
            "scale": torch.zeros_like(scale_U, dtype=dtype) if need_scale else None,
            "W": weight.new_zeros(vocab, weight.shape[1], dtype=dtype) if need_W else None,
            "bias": bias.new_zeros(vocab, dtype=dtype) if need_bias else None,
            "noise": torch.zeros_like(noise) if need_noise else None,
            "thr": torch.zeros_like(thr) if thr_is_tensor and need_thr else None,
        }
        loss = torch.zeros((), dtype=torch.float64, device=weight.device)
        p_target = torch.zeros((), dtype=torch.float64, device=weight.device)
        p_sum = torch.zeros((), dtype=torch.float64, device=weight.device)
        for r0 in range(0, n, chunk):
            r1 = min(r0 + chunk, n)
            part = CandidateRows(rows.ids[r0:r1], rows.counted[r0:r1],
                                 rows.log_partition[r0:r1].to(dtype) if relative else None)
            flat = part.ids.reshape(-1)
            with torch.enable_grad():
                loc = loc_U[r0:r1].detach().to(dtype).requires_grad_(need_loc)
                scale = scale_U[r0:r1].detach().to(dtype).requires_grad_(need_scale)
                w_rows = weight.detach()[flat].to(dtype).view(r1 - r0, -1, weight.shape[1]).requires_grad_(need_W)
                b_rows = None if bias is None else (
                    bias.detach()[flat].to(dtype).view(r1 - r0, -1).requires_grad_(need_bias))
                fused_loc, fused_scale = fuse_noise(loc, scale, noise, "standard", temperature)
                t = thr[part.ids] if thr_vector else thr
                chunk_loss, probs, is_target = _candidate_terms(fused_loc, fused_scale, w_rows, b_rows, t, part,
                                                                targets[r0:r1])
                leaves = {"loc": loc, "scale": scale, "W": w_rows, "bias": b_rows, "noise": noise,
                          "thr": thr if thr_is_tensor else None}
                wanted = [name for name, g in grads.items() if g is not None]
                if wanted:
                    found = torch.autograd.grad(chunk_loss, [leaves[name] for name in wanted])
                    for name, g in zip(wanted, found):
                        if name in ("loc", "scale"):
                            grads[name][r0:r1] = g
                        elif name == "W":
                            grads["W"].index_add_(0, flat, g.reshape(-1, g.shape[-1]))
                        elif name == "bias":
                            grads["bias"].index_add_(0, flat, g.reshape(-1))
                        else:
                            grads[name] += g
            loss += chunk_loss.detach().double()
            p_target += (probs * is_target).sum(dtype=torch.float64)
            p_sum += probs.sum(dtype=torch.float64)
        n_pos = max(n, 1)
        stats = ((p_target / n_pos).to(torch.float32), (p_sum / n_pos).to(torch.float32))
        ctx.mark_non_differentiable(*stats)
        dtypes = {"loc": loc_U.dtype, "scale": scale_U.dtype, "W": weight.dtype,
                  "bias": None if bias is None else bias.dtype, "noise": b_noise.dtype,
                  "thr": threshold.dtype if thr_is_tensor else None}
        ctx.save_for_backward(*(None if g is None else g.to(dtypes[name]) for name, g in grads.items()))
        return (loss.to(torch.float32), *stats)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        return (*saved_gradients(ctx, grad_loss), None, None, None)
