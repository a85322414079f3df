"""Benchmark: the training loss of ``forward(labels=...)`` against lm_head + cross-entropy and the naive OvR loss.

Forward + backward (float32 by default) on the real head shape (V = 151936, C = 896) at N tokens:
  (a) ``F.linear`` lm_head + ``F.cross_entropy`` on float32 logits, as transformers' causal-LM loss upcasts them
  (b) naive OvR: ``cauchy_linear`` + ``ovr_loss``   full [N × V] loc_S / scale_S, autograd
  (c) ``chunked_ovr_loss``: the OvR loss alone, every head tensor trained by it (distillation's kernel)
  (d) the loss ``forward(labels=...)`` computes with the config's defaults: the cross-entropy of loc_S (weight
      ``softmax_loss_weight``) in ``chunked_lm_loss``'s fused pass, which also finds each position's candidates,
      + the OvR loss over them (``candidate_ovr_loss``) on the scale path, relative thresholds
  (v) the same with the OvR loss over the whole vocabulary (``ovr_candidates=None``): one fused pass, five products
  (r) (d) through the torch code alone, as an adapter folder's remote code runs it where the package's operators
      are not registered (on a GPU: without the Triton kernels, and in its chunks); on the CPU the same as (d)
  (p) the three N × V × C products of (a) alone (logits, ∂hidden, ∂W), operands in the products' dtype
  (q) the five N × V × C products of (v) alone (loc_S, scale_S, ∂scale_U, ∂loc_U, ∂W) on the rows (v) scores (the
      labelled 7/8), with (v)'s chunks, blocks, |W| block and accumulation (`lm_loss._product`), on random tiles:
      q/a is the floor the design's math sets for v/a (its products alone against the reference's whole work),
      q/p the two sides' products alone, v/q what (v) spends beyond its products
  (l) Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (needs ``liger_kernel`` and a GPU: bench/gpu.py runs it)

``--dtype bfloat16`` stores the weight and the activations in bfloat16 (a bfloat16 model: lm_head's product in
bfloat16, the losses' own math in float32); ``--autocast`` keeps them float32 and runs every variant under bfloat16
autocast (TRL's default mixed precision; (d) then multiplies in bfloat16, as ``forward(labels=...)`` does).

Each (variant, N) runs in its own subprocess so that peak memory is per variant. Memory is
the child's whole-process peak RSS (``ru_maxrss``); "extra" is that peak minus the peak just
after the inputs (W [V × C], biases, activations, labels) were allocated and touched, i.e.
what the loss and its gradients (grad_W included) add on top of the inputs. Time is the
fastest of ``--repeat`` forward + backward steps after one warm-up step (the minimum, as
timeit does, because other jobs on a shared machine only ever add time); the process CPU
time of the fastest-CPU step is printed beside it, a second view when the machine is busy.

The whole comparison runs --runs times with the variants interleaved; ratios are per run, reported as median
(min–max) (bench/stats.py).

    python bench/loss.py --n 1024 4096 --variants a c d
"""

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time

from stats import round_ratios, spread

V, C = 151936, 896
VARIANTS = {"a": "lm_head + cross_entropy", "b": "naive OvR (materialised)", "c": "chunked_ovr_loss",
            "d": "forward(labels) loss", "v": "loss over the vocabulary", "p": "(a)'s 3 products alone",
            "r": "(d) in torch code (remote)",
            "q": "(v)'s 5 products alone",
            "l": "Liger fused linear CE"}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def build_step(variant: str, n: int, chunk_size: int = 0, vocab_chunk_size: int = 0, dtype: str = "float32",
               autocast: bool = False, device: str = "cpu"):
    """(step, params, precision) of `variant` at `n` tokens: `step()` returns the loss (its backward is the rest of the
    step), `params` the leaves whose `.grad` to clear between steps, `precision` the context to run it in. Tensors on
    `device` (variants a, b, c, d, l, r; p and q measure the CPU's products and stay there). Sets the default dtype."""
    import torch

    if variant in "pq" and torch.device(device).type != "cpu":
        raise ValueError(f"variant {variant} measures the CPU's products: run it with device='cpu'")
    torch.manual_seed(0)
    torch.set_default_dtype(getattr(torch, dtype))
    precision = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.device(device):  # every tensor made here, inputs and the variants' constants
        step, params = _variant(variant, n, chunk_size, vocab_chunk_size, autocast)
    return step, params, precision


def _variant(variant: str, n: int, chunk_size: int, vocab_chunk_size: int, autocast: bool):
    import torch
    import torch.nn.functional as F

    from causalqwen_adapter.cauchy import cauchy_linear, fuse_noise, ovr_loss
    from causalqwen_adapter.configuration_causalqwen import CausalQwenConfig
    from causalqwen_adapter.lm_loss import _product, equal_chunk_size, logits_dtype, training_loss
    from causalqwen_adapter.losses import DecisionHead, chunk_tokens, chunked_ovr_loss

    # In place, so that no temporary [V × C] copy raises the baseline peak.
    weight = torch.randn(V, C).mul_(0.02).requires_grad_()
    labels = torch.randint(0, V, (n,))
    labels[: n // 8] = -100  # a prompt part, as in SFT
    # the products' dtype: the weights', or bfloat16 under autocast (lm_head's and (d)'s both)
    mm = torch.bfloat16 if autocast else weight.dtype
    if variant in "pq":  # products only: operands cast before the clock starts, outputs as (a) and (d) keep them
        w_mm = weight.detach().to(mm)
        a_mm = torch.randn(n, C, dtype=mm)
        params = ()
    if variant == "p":
        grad = torch.randn(n, V, dtype=mm)

        def step():  # fresh outputs, as autograd's
            logits, _, _ = a_mm @ w_mm.T, grad @ w_mm, grad.T @ a_mm
            return logits[0, 0]
    elif variant == "q":
        dtype = torch.promote_types(weight.dtype, torch.float32)
        rows = int((labels != -100).sum())  # (d) drops the unlabelled positions before its products
        chunk = equal_chunk_size(rows, chunk_size or chunk_tokens(V, logits_dtype(mm, dtype).itemsize))
        b_mm = torch.rand(rows, C, dtype=mm)
        block = vocab_chunk_size or 4096
        tile = torch.randn(chunk * block, dtype=mm)  # stands for the tile's ∂ℓ/∂scale_S and D
        scratch = torch.empty(max(chunk * block, block * C), dtype=mm)
        logits = torch.empty(chunk * V, dtype=logits_dtype(mm, dtype))
        s_out, abs_w = torch.empty(chunk * block, dtype=dtype), torch.empty(block, C, dtype=mm)

        def step():
            g_loc, g_scale = torch.zeros(rows, C, dtype=dtype), torch.zeros(rows, C, dtype=dtype)
            grad_W = torch.empty(V, C, dtype=weight.dtype if weight.dtype == mm else dtype)
            for r0 in range(0, rows, chunk):
                r1 = min(r0 + chunk, rows)
                r = r1 - r0
                for v0 in range(0, V, block):  # pass A
                    v1 = min(v0 + block, V)
                    _product(logits[r * v0 : r * v1].view(r, v1 - v0), a_mm[r0:r1], w_mm[v0:v1].T, True, scratch)
                for v0 in range(0, V, block):  # pass B
                    v1 = min(v0 + block, V)
                    t, w_abs = tile[: r * (v1 - v0)].view(r, v1 - v0), torch.abs(w_mm[v0:v1], out=abs_w[: v1 - v0])
                    _product(s_out[: r * (v1 - v0)].view(r, v1 - v0), b_mm[r0:r1], w_abs.T, True, scratch)
                    _product(g_scale[r0:r1], t, w_abs, False, scratch)
                    _product(g_loc[r0:r1], t, w_mm[v0:v1], False, scratch)
                    _product(grad_W[v0:v1], t.T, a_mm[r0:r1], r0 == 0, scratch)
            return g_loc[0, 0] + g_scale[0, 0] + grad_W[0, 0]
    elif variant == "a":
        hidden = torch.randn(n, C).requires_grad_()
        params = (hidden, weight)

        def step():
            return F.cross_entropy(F.linear(hidden, weight).float(), labels)
    elif variant == "l":  # Triton kernels: a GPU
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        hidden = torch.randn(n, C).requires_grad_()
        params = (hidden, weight)
        liger = LigerFusedLinearCrossEntropyLoss()

        def step():
            return liger(weight, hidden, labels)
    else:
        loc_U = torch.randn(n, C).requires_grad_()
        scale_U = torch.rand(n, C).add_(0.5).requires_grad_()
        bias = torch.zeros(V).requires_grad_()
        b_noise = torch.full((C,), 0.1).requires_grad_()
        params = (loc_U, scale_U, weight, bias, b_noise)

        if variant == "b":
            def step():
                loc, scale = fuse_noise(loc_U, scale_U, b_noise)
                return ovr_loss(*cauchy_linear(loc, scale, weight, bias), 0.0, labels)
        elif variant == "c":
            def step():
                return chunked_ovr_loss(loc_U, scale_U, DecisionHead(weight, bias, b_noise, 0.0), labels,
                                        chunk_size=chunk_size or None,
                                        vocab_chunk_size=vocab_chunk_size or None)[0]  # None: ovr_loss_shape
        else:
            config = CausalQwenConfig(ovr_candidates=None) if variant == "v" else CausalQwenConfig()
            threshold = torch.full((), config.ovr_threshold_init)  # a buffer, as with learnable_threshold=False
            valid = labels != -100

            def step():  # heads_loss's: the labelled positions, then the model's training loss
                with torch_code_only() if variant == "r" else contextlib.nullcontext():
                    return training_loss(loc_U[valid], scale_U[valid], DecisionHead(weight, bias, b_noise, threshold),
                                         labels[valid], config, chunk_size=chunk_size or None,
                                         vocab_chunk_size=vocab_chunk_size or None,  # None: loss_shape
                                         matmul_dtype=torch.bfloat16 if autocast else None)[0]

    return step, params


def torch_code_only():
    """No `causalqwen` operator serves the loss while it lasts: the torch code runs, as in the remote code of an
    adapter folder loaded without this package."""
    from unittest import mock

    from causalqwen_adapter import candidate_loss, lm_loss, losses

    stack = contextlib.ExitStack()
    for module in (lm_loss, losses, candidate_loss):
        stack.enter_context(mock.patch.object(module, "lookup_operator", lambda *args: None))
    return stack


def _child(variant: str, n: int, repeat: int, chunk_size: int, vocab_chunk_size: int, dtype: str,
           autocast: bool) -> dict:
    import torch

    torch.set_num_threads(2)
    step, params, precision = build_step(variant, n, chunk_size, vocab_chunk_size, dtype, autocast)
    base = _peak_rss_mib()
    times, cpu_times = [], []
    for _ in range(repeat + 1):
        for p in params:
            p.grad = None
        start, cpu_start = time.perf_counter(), time.process_time()
        with precision:
            loss = step()
        if loss.requires_grad:
            loss.backward()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return {"variant": variant, "n": n, "time_s": min(times[1:]), "first_s": times[0], "cpu_s": min(cpu_times[1:]),
            "extra_mib": _peak_rss_mib() - base, "peak_mib": _peak_rss_mib(), "inputs_mib": base}


def _mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[1024], help="token counts, run in ascending order")
    parser.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v not in "lr"], choices=list(VARIANTS),
                        help="(l) needs liger_kernel and a GPU")
    parser.add_argument("--repeat", type=int, default=3, help="timed steps after one warm-up step, per process")
    parser.add_argument("--runs", type=int, default=3, help="times the whole comparison runs, variants interleaved")
    parser.add_argument("--chunk-size", type=int, default=0, help="tokens per chunk; 0: each loss's default")
    parser.add_argument("--vocab-chunk-size", type=int, default=0, help="vocabulary rows per block; 0: defaults")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and inputs")
    parser.add_argument("--autocast", action="store_true", help="float32 weights, bfloat16 autocast")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.n[0], args.repeat, args.chunk_size, args.vocab_chunk_size, args.dtype,
                                args.autocast)))
        return

    last = {}  # each variant's latest measurement, to foresee the memory of the next N
    for n in sorted(args.n):
        results = {v: [] for v in args.variants}
        for run in range(args.runs):  # the whole comparison, variants interleaved, --runs times
            for v in args.variants:
                r = _run_child(v, n, args, last.get(v))
                if r is None:
                    continue
                results[v].append(r)
                last[v] = r
                print(f"N={n} run {run + 1} ({v}) {VARIANTS[v]:<26} time {r['time_s']:7.2f} s (first {r['first_s']:.2f} s, "
                      f"cpu {r['cpu_s']:.2f} s)  extra peak {r['extra_mib']:8.0f} MiB  whole-process peak "
                      f"{r['peak_mib']:8.0f} MiB", flush=True)
        for mine, other in (("c", "a"), ("c", "b"), ("d", "a"), ("v", "a"), ("q", "p"), ("q", "a"), ("v", "q")):
            c, o = results.get(mine, []), results.get(other, [])
            if len(c) == len(o) and c:
                print(f"N={n} {mine}/{other}, median (min–max) over {len(c)} runs: "
                      f"time {spread(round_ratios([r['time_s'] for r in c], [r['time_s'] for r in o]))}× "
                      f"(cpu {spread(round_ratios([r['cpu_s'] for r in c], [r['cpu_s'] for r in o]))}×)  "
                      f"extra memory {spread(round_ratios([r['extra_mib'] for r in c], [r['extra_mib'] for r in o]))}×  "
                      f"whole-process peak {spread(round_ratios([r['peak_mib'] for r in c], [r['peak_mib'] for r in o]))}×")


def _run_child(v: str, n: int, args, previous: dict | None) -> dict | None:
    """One variant at N tokens in its own process; None when it would not fit in memory or failed."""
    # The naive loss grows linearly in N: skip it where the last measurement says it would not fit.
    if previous:
        estimate = previous["inputs_mib"] + previous["extra_mib"] * n / previous["n"]
        if estimate > 0.9 * _mem_available_mib():
            print(f"N={n} ({v}) {VARIANTS[v]}: skipped, needs ~{estimate / 1024:.1f} GiB "
                  f"(extrapolated from N={previous['n']}), {_mem_available_mib() / 1024:.1f} GiB available")
            return None
    cmd = [sys.executable, __file__, "--child", v, "--n", str(n), "--repeat", str(args.repeat),
           "--chunk-size", str(args.chunk_size), "--vocab-chunk-size", str(args.vocab_chunk_size), "--dtype", args.dtype]
    cmd += ["--autocast"] if args.autocast else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        print(f"N={n} ({v}) {VARIANTS[v]}: failed with exit code {proc.returncode}\n{proc.stderr[-2000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])

if __name__ == "__main__":
    main()
