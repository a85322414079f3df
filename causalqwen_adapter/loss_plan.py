"""The training loss's memory and launches on an accelerator, computed without one: `loss_plan` counts the buffers
`lm_loss.chunked_lm_loss` allocates (from `lm_loss.lm_loss_buffers`, the function the loss allocates them with),
the copies and per-chunk tensors around them and the Triton kernels' own scratch (from the kernels' sizing code),
for any token count, vocabulary and width; `liger_flce_plan` counts Liger-Kernel's fused linear cross-entropy the
same way from its chunking rule. bench/gpu.py prints both; tests/test_loss_plan.py checks the plan against what the
loss allocates and launches under Triton's interpreter.

Installed package only (it reads the Triton kernels' sizes), never remote code.
"""

from typing import NamedTuple

import torch

from .dispatch import TILE_COL_D, TILE_COL_T, TILE_D, TILE_OVR, TILE_OVR_GRADS, tile_thread_count
from .lm_loss import LossUses, buffer_bytes, chunk_tile_bytes, equal_chunk_size, lm_loss_buffers, logits_dtype
from .losses import loss_shape

MODES = ("softmax", "candidates pass", "vocabulary")
H200_MULTIPROCESSORS = 132


class LossPlan(NamedTuple):
    """Tokens per chunk and chunks; bytes by buffer (those alive at the loss's peak, and the largest per-chunk
    scratch); their sum, the peak extra memory beyond the inputs; kernel launches per chunk."""

    chunk: int
    chunks: int
    buffers: dict
    peak_bytes: int
    launches_per_chunk: int


def training_uses(mode: str, operator: bool, bias: bool = True, candidates: int = 16,
                  threads: int = 1) -> LossUses:
    """`LossUses` of a training step (every input wanting its gradient) in ``mode``: the cross-entropy alone, its
    pass finding ``candidates`` (the default loss's first part) or the cross-entropy with the OvR loss over the
    vocabulary (absolute thresholds learnt per token are not counted: ``thr`` False)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ovr = mode == "vocabulary"
    return LossUses(ovr=ovr, operator=operator, abs_operator=ovr and operator, loc=True, scale=ovr, W=True,
                    bias=bias, thr=False, D=True, ovr_grads=ovr, scale_path_W=False,
                    candidates=candidates if mode == "candidates pass" else 0, threads=threads * operator)


def _kernel_scratch(uses: LossUses, chunk: int, vocab: int, width: int, mm_dtype, programs: int | None):
    """Bytes of the Triton kernels' own temporaries per chunk (the largest is alive at once): the logsumexp's and
    the loss tile's partial sums, the |W| product's split-vocabulary partials."""
    from .kernels import abs_matmul, logsumexp, loss_tile, triton_utils

    def segments(across):
        return None if programs is None else -(-programs // max(1, across))

    device = torch.device("cpu" if programs is None else "cuda")
    seg = triton_utils._segments(vocab, chunk, triton_utils._ROW_BLOCK_N, device, segments(chunk))[1]
    scratch = {"lse partials": logsumexp.lse_partials_numel(chunk, seg) * 4}
    flags = (TILE_OVR * uses.ovr | TILE_D * uses.D | TILE_OVR_GRADS * uses.ovr_grads
             | TILE_COL_D * (uses.D and uses.bias) | TILE_COL_T * (uses.thr and uses.ovr_grads))
    groups = loss_tile.loss_tile_row_groups(chunk)[0]
    block_n = loss_tile._LOSS_BLOCK_N[mm_dtype if mm_dtype in loss_tile._LOSS_BLOCK_N else torch.float32]
    seg = triton_utils._segments(vocab, groups, block_n, device, segments(groups))[1]
    rows, *cols = loss_tile.loss_tile_scratch_numel(chunk, vocab, flags, seg)
    # with several row groups, each column partial's sum over them, [w], before it is added
    scratch["loss tile partials"] = (rows + sum(cols) + vocab * sum(map(bool, cols))) * 4
    if uses.abs_operator and uses.scale:
        bm, bv, bk, _ = abs_matmul._matmul_blocks(chunk, triton_utils._precision(mm_dtype), reduced="V")
        across = -(-chunk // bm) * -(-width // bk)
        seg = triton_utils._segments(vocab, across, bv, device, segments(across))[1]
        scratch["|W| product partials"] = (seg + 1) * chunk * width * 4 * (seg > 1)  # and their sum
    return scratch


def loss_plan(n_tokens: int, vocab: int, width: int, dtype: torch.dtype = torch.bfloat16, device_type: str = "cuda",
              mode: str = "candidates pass", *, chunk: int | None = None, vblock: int | None = None,
              multiprocessors: int | None = H200_MULTIPROCESSORS, bias: bool = True, candidates: int = 16,
              operator: bool | None = None) -> LossPlan:
    """The plan of `chunked_lm_loss` for ``n_tokens`` targets of a model of ``dtype`` (its products in that dtype)
    with a [vocab × width] head, on a device of ``device_type`` ("cuda": the Triton kernels, ``multiprocessors`` of
    them; "cpu": the torch code, or the kernels under Triton's interpreter with ``multiprocessors=None``), in
    ``mode`` (`MODES`). ``chunk``, ``vblock``: as the loss's ``chunk_size`` and ``vocab_chunk_size``; ``operator=False``: the torch
    code on that device (the remote code's)."""
    if operator is None:
        operator = device_type != "cpu" or multiprocessors is None
    uses = training_uses(mode, operator, bias, candidates, tile_thread_count(torch.device(device_type)))
    math_dtype = torch.promote_types(dtype, torch.float32)
    if chunk is None or vblock is None:
        shape = loss_shape(torch.device(device_type), n_tokens, vocab, width,
                           logits_dtype(dtype, math_dtype).itemsize, chunk_tile_bytes(dtype, dtype, uses, vocab, width))
        chunk, vblock = chunk or shape[0], vblock or shape[1]
    chunk, vblock = equal_chunk_size(n_tokens, chunk), min(vblock, vocab)
    specs = lm_loss_buffers(n_tokens, chunk, vblock, vocab, width, dtype, dtype, uses)
    held = {name: buffer_bytes({name: spec}) for name, spec in specs.items() if buffer_bytes({name: spec})}
    # the inputs' gradients in their dtype, written chunk by chunk; the chunk's rows of the inputs, gathered, in the
    # products' dtype (loc_U's in its own, the fused scale's from a float32 sum)
    held["grad_loc out"] = n_tokens * width * dtype.itemsize
    held["rows, targets"] = 2 * n_tokens * 8  # the positions with a target, their labels
    held["loc, chunk operand"] = chunk * width * dtype.itemsize
    if uses.ovr:
        held["grad_scale out"] = held["grad_loc out"]
        held["scale, chunk operand"] = chunk * width * dtype.itemsize
        held["noise width"] = width * math_dtype.itemsize  # T·|b_noise|
    held["pass A logsumexp"] = 2 * chunk * 4
    # b_A in float32 for the kernels, and a chunk's column sums of D
    held["bias, float32"] = vocab * 4 * (bias and operator and dtype != torch.float32)
    held["column sums"] = vblock * 4 * (bias and operator)
    if uses.candidates:  # the block's top-k values and ids, then their merge (float32 values), alive to the next chunk
        held["top-k"] = chunk * uses.candidates * (dtype.itemsize + 8 + 4 + 8)
    held["target columns, sums"] = chunk * 8 + 2 * 8  # the chunk's target columns; the loss's two float64 sums
    scratch = _kernel_scratch(uses, chunk, vocab, width, dtype, multiprocessors) if operator else {}
    if scratch:  # the kernels run one after another: their largest scratch
        held.update([max(scratch.items(), key=lambda kv: kv[1])])
    launches = loss_launches(uses, dtype)
    return LossPlan(chunk, -(-n_tokens // chunk), held, sum(held.values()), launches)


def loss_launches(uses: LossUses, dtype: torch.dtype) -> int:
    """Kernel launches per token chunk of the Triton kernels' path (one vocabulary block, b_A present), as
    tests/test_loss_plan.py counts them under the interpreter (torch operators dispatched, three per Triton call):
    18 for the cross-entropy (the chunk's rows of loc_U gathered, the product, the logsumexp, the tile, the
    gradients' products, loc_U's gradient rows written, each row's loss term kept; with one vocabulary block the
    targets are their own columns and the block's logsumexp the chunk's), 3 for the candidates (the top-k on the stored
    logits, the block's k largest being the chunk's, and their log-partition kept), 19 for the OvR term over the vocabulary (the scale's rows gathered and widened, the |W|
    products, its sums, the scale's gradient zeroed, summed over rows for b_noise's, scaled and written; 2 more casts
    in bfloat16); 4 fewer with a GPU's one row of column sums (the kernel adds them into b_A's gradient: no
    zero-fill, sum, add and its write-back)."""
    low = dtype != torch.float32
    return (18 - 4 * (uses.threads == 1 and uses.bias and uses.D) + bool(uses.candidates) * 3
            + uses.ovr * (19 + 2 * low))


def candidate_launches(dtype: torch.dtype = torch.bfloat16, trains_location: bool = False) -> dict:
    """Kernel launches per token chunk of `candidate_loss.candidate_ovr_loss` by what launches them (the torch
    operators `_CandidateOvRLoss.forward` dispatches per chunk; tests/test_loss_plan.py counts them), for a head and
    inputs in ``dtype``: W_A's rows gathered (and cast from a narrower dtype), their |·|, loc_U's chunk cast, the fused
    scale; x from two batched products, the floor and a division; the gradient's elementwise work
    (`candidate_loss._score_gradients`) and the scale's gradient product; with ``trains_location`` loc_U's gradient
    product and W_A's rows' gradient (written over the rows, then added into [V × C]). Per call, not per chunk: the
    [N, k + 1] terms' values, the sums and b_A's, the thresholds' and b_noise's gradients."""
    low = int(dtype != torch.float32)
    launches = {"W_A rows: gather, cast, |rows|": 2 + low, "loc_U cast": low, "fused scale": 1,
                "x: 2 batched products, floor, divide": 4, "gradient's elementwise": 9, "grad scale_U product": 1}
    if trains_location:
        launches.update({"grad loc_U product": 1, "grad W_A rows and their index_add": 5})
    return launches


def candidate_call_launches(dtype: torch.dtype = torch.bfloat16) -> int:
    """Kernel launches of one call of `candidate_loss.candidate_ovr_loss` through the package's kernel
    (`causalqwen::candidate_term`: a GPU, ``trains_location`` off), every position at once: 3 for the kernel (a Triton
    call, as `loss_launches` counts one) and 50 torch operators around it, per call whatever N (the candidate rows'
    checks; the per-position sign, weights and shift; the losses, probabilities and sums from x; b_noise's gradient;
    the gradients' casts), 4 casts more from bfloat16 inputs. tests/test_candidate_term_kernel.py counts them."""
    return 3 + 50 + 4 * (dtype != torch.float32)


def candidate_plan(n_tokens: int, vocab: int, width: int, dtype: torch.dtype = torch.bfloat16, k: int = 16,
                   device_type: str = "cuda", *, chunk: int | None = None, operator: bool | None = None) -> LossPlan:
    """The plan of `candidate_loss.candidate_ovr_loss` (the default loss's second part, ``trains_location`` off: the
    gradient reaches scale_U and b_noise; the threshold a buffer) for ``n_tokens`` positions. Its peak is the larger of
    two phases. Over the chunks: the [chunk, k + 1, C] float32 tensors `candidate_loss.CANDIDATE_CHUNK_BYTES_PER_ROW`
    counts, the chunk's [chunk × C] float32 operands (the fused scale; loc_U's copy from a narrower dtype), its
    [chunk, k + 1] terms (x, scale_S, the gradient's: 29 bytes per element at the peak), the per-position [N, k + 1]
    terms (sign, weight, shift, the x kept, the target mask: 25 bytes) and the scale's float32 gradient [N × C]. At the
    end: that gradient with the [N, k + 1] terms' values (x, its loss terms, P: 34 bytes per element) or, after them,
    its copy returned in ``dtype``. Launches per chunk: `candidate_launches`.

    With the package's kernel (``operator``, by default on any device but the CPU) one "chunk" spans every position,
    no [chunk, k + 1, C] tensor exists, x [N, k + 1] is written whole, and the call makes `candidate_call_launches`."""
    from .candidate_loss import CANDIDATE_CHUNK_BYTES_PER_ROW, candidate_chunk_tokens

    if operator is None:
        operator = device_type != "cpu"
    if operator:
        chunk = max(n_tokens, 1)
    chunk = equal_chunk_size(n_tokens, chunk or candidate_chunk_tokens(k, width, device_type, n_tokens, vocab))
    low = dtype != torch.float32
    per_position = n_tokens * (k + 1)
    fixed = {"grad_scale, float32": n_tokens * width * 4, "vectors": vocab * 4 + width * 12 + n_tokens * 4 + 64}  # and 0-dim ones
    over_chunks = {"candidate rows": chunk * (k + 1) * width * CANDIDATE_CHUNK_BYTES_PER_ROW,
                   "chunk operands": chunk * width * 4 * (1 + low), "chunk terms": chunk * (k + 1) * 29,
                   "position terms": per_position * 25, **fixed}
    if operator:  # the terms and x, written by the kernel
        over_chunks = {"position terms": per_position * (25 + 4), **fixed}
    # the values' [N, k + 1] terms, freed before the gradient's copy in dtype
    at_end = {**fixed, "position values": per_position * 34}
    if n_tokens * width * dtype.itemsize * low > per_position * 34:
        at_end = {**fixed, "grad_scale out": n_tokens * width * dtype.itemsize}
    buffers = max(over_chunks, at_end, key=lambda d: sum(d.values()))
    launches = candidate_call_launches(dtype) if operator else sum(candidate_launches(dtype).values())
    return LossPlan(chunk, -(-n_tokens // chunk), buffers, sum(buffers.values()), launches)


def liger_flce_plan(n_tokens: int, vocab: int, width: int, dtype: torch.dtype = torch.bfloat16,
                    bias: bool = False) -> LossPlan:
    """Liger-Kernel's fused linear cross-entropy (0.8.5, its default budget) counted the same way: chunks of
    next_power_of_2(⌈N / ⌈V / H⌉⌉) tokens (at most N), one [chunk × V] logits buffer in the input's dtype whose
    gradient its cross-entropy kernel writes in place, the input's and W's gradients (in their dtypes) and a float32
    loss per token; per chunk the logits' product, the kernel, the input's and W's gradient products (and b's)."""
    inc_factor = -(-vocab // width)
    chunk = min(1 << max(0, (-(-n_tokens // inc_factor) - 1).bit_length()), max(n_tokens, 1))
    buffers = {"logits": chunk * vocab * dtype.itemsize, "grad_input": n_tokens * width * dtype.itemsize,
               "grad_weight": vocab * width * dtype.itemsize, "loss_1d": n_tokens * 4}
    if bias:
        buffers["grad_bias"] = vocab * dtype.itemsize
    return LossPlan(chunk, -(-n_tokens // chunk), buffers, sum(buffers.values()), 4 + 2 * bias)


def plan_table(n_tokens: int = 16384, vocab: int = 151936, widths=(896, 3584), dtype=torch.bfloat16) -> list[str]:
    """Lines comparing `loss_plan` (each mode) with `liger_flce_plan` at each width: chunk, peak, launches."""
    lines = []
    for width in widths:
        liger = liger_flce_plan(n_tokens, vocab, width, dtype)
        lines.append(f"N={n_tokens} V={vocab} H={width} {str(dtype)[6:]}: Liger FLCE chunk {liger.chunk} "
                     f"({liger.chunks} chunks), peak {liger.peak_bytes / 1e9:.3f} GB, "
                     f"{liger.launches_per_chunk} launches/chunk (computed)")
        for mode in MODES:
            plan = loss_plan(n_tokens, vocab, width, dtype, "cuda", mode)
            top = sorted(plan.buffers.items(), key=lambda kv: -kv[1])[:4]
            lines.append(f"  {mode}: chunk {plan.chunk} ({plan.chunks} chunks), peak {plan.peak_bytes / 1e9:.3f} GB "
                         f"= {plan.peak_bytes / liger.peak_bytes:.2f}x Liger, {plan.launches_per_chunk} launches/chunk"
                         f" (computed; largest: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in top) + ")")
        term, total = default_loss_plan(n_tokens, vocab, width, dtype)
        pass_plan = loss_plan(n_tokens, vocab, width, dtype)
        launches = pass_plan.chunks * pass_plan.launches_per_chunk + term.chunks * term.launches_per_chunk
        lines.append(f"  candidates term: {term.chunks} call over every position, peak {term.peak_bytes / 1e9:.3f} GB, "
                     f"{term.launches_per_chunk} launches; default loss (pass, then term): peak "
                     f"{total / 1e9:.3f} GB = {total / liger.peak_bytes:.2f}x Liger, {launches:,} launches against "
                     f"Liger's {liger.chunks * liger.launches_per_chunk:,} (computed)")
    return lines


def default_loss_plan(n_tokens: int, vocab: int, width: int, dtype: torch.dtype = torch.bfloat16, k: int = 16):
    """(`candidate_plan`, the default loss's peak bytes): the candidates pass, then the candidates' term while the
    pass's gradients (W_A's, loc_U's, b_A's, in ``dtype``) wait for backward."""
    term = candidate_plan(n_tokens, vocab, width, dtype, k)
    kept = vocab * width * dtype.itemsize + n_tokens * width * dtype.itemsize + vocab * dtype.itemsize
    return term, max(loss_plan(n_tokens, vocab, width, dtype).peak_bytes, kept + term.peak_bytes)


__all__ = ["LossPlan", "MODES", "candidate_call_launches", "candidate_launches", "candidate_plan", "default_loss_plan", "liger_flce_plan", "loss_launches", "loss_plan", "plan_table", "training_uses"]
