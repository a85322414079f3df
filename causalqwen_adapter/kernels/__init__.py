"""The kernels of the `causalqwen` operators (`ops.py`: their schemas), one module per operation or backend, as
Liger-Kernel's `ops/`. Installed package only, never remote code: the adapter folder's modeling code finds these
kernels through the process-wide operator namespace (`dispatch.py`), never by importing this package.

- `cpu.py`: the decode operators' CPU kernels, C (`csrc/`, built on first use) on x86 CPUs with AVX-512, else
  `compiled.py`'s `torch.compile`d torch functions;
- `cuda.py`: the operators' CUDA kernels, the Triton functions below registered (Triton imported at first use).

The Triton functions, each with the contract of a torch or C function of this package:

- `loss_tile.loss_tile_triton`: the `causalqwen::loss_tile` operator (pass B of `lm_loss.chunked_lm_loss` on one tile,
  and the tiles of `losses.chunked_ovr_loss`), for tiles as wide as the whole vocabulary;
- `logsumexp.block_logsumexp_triton`: `causalqwen::block_logsumexp` (pass A's logsumexp, + b_A, optionally written
  back);
- `ovr_scores.ovr_scores_triton`: `cauchy.ovr_decision_scores` for decoding (no gradient);
- `abs_matmul.cauchy_linear_triton`: `cauchy.cauchy_linear` (no gradient) in one read of W_A;
  `abs_matmul.abs_linear_triton`, x @ |W|ᵀ (the loss's scale_S), and `abs_matmul.abs_matmul_triton`, a @ |W| (its
  scale gradient), without a |W| tensor;
- `candidate_term.candidate_term_triton`: `causalqwen::candidate_term`, the OvR loss over candidates
  (`candidate_loss.candidate_ovr_loss` without ``trains_location``) for every position in one launch;
- `triton_utils.py`: what they share (Triton's optional import, the float32 elementwise functions, launch helpers).

Each Triton function returns None, and the caller runs its torch path, where it does not apply: Triton not installed,
tensors on a device Triton does not run on (CUDA; or the CPU when ``TRITON_INTERPRET=1`` was set before these modules
were imported: the tests run the kernels that way), dtypes other than bfloat16 and float32, or shapes it does not
take. `triton_utils.available` says whether the Triton path can run at all.

Importing this package imports nothing: the package's `__init__` imports `cpu` and `cuda`, which register the kernels
(the tests import a copy of the Triton modules for Triton's interpreter, which must not register them twice).
"""
