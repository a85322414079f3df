"""On a lent CUDA GPU (about 5 minutes in all on one H200; never run in CI): the GPU tests, one sharded training step
each way, and the speed and memory of decoding and of the training loss.

    python bench/gpu.py --base build/demo-base        # without --base: a random Qwen2.5-0.5B-shaped model

The project's own Python is not needed there, only its pins: on a machine whose Python has torch and Triton but an
older transformers (or no trl, datasets, peft, liger-kernel, deepspeed), install the wheels of `pip download --no-deps`
of the versions in pyproject.toml (deepspeed's as built by `pip wheel --no-deps`, with hjson and pydantic's four
wheels; datasets with dill and multiprocess) into a folder on PYTHONPATH, with the repository root after it.

1. tests: `make test-gpu`'s tests (`pytest -m gpu`: the cuda run of every test taking the `device` fixture, and the
   Triton kernels' tests compiled for the GPU), in a subprocess;
2. sharded: one step of `recipes/sft_ovr.py` under `accelerate launch --config_file recipes/configs/fsdp2.yaml` and,
   when `deepspeed` imports, `deepspeed_zero3.yaml`, on this one GPU (`--num_processes 1`: nccl, world size 1);
3. decode: tokens/s at batch 1, 8 and 64 in every inference mode against the base (bench/decode.py's measurement,
   synchronised with the GPU), then per variant at batch 1 the peak memory (`torch.cuda.max_memory_allocated`) and
   the CUDA kernels launched per decode step (`torch.profiler`: kernels of a 5-token generate minus a 1-token one,
   over 4);
4. loss: forward + backward at 8,192 and 32,768 target tokens in bf16 on the real head shape (bench/loss.py's
   steps): `forward(labels=...)`'s loss (d) against lm_head + cross-entropy (a) and Liger-Kernel's
   `LigerFusedLinearCrossEntropyLoss` (l, when `liger_kernel` imports), the loss over the vocabulary (v), and (d)
   through the torch code alone (r: the remote code's path without the package's Triton kernels), and (d) at
   `--chunk-factors` times its chunk (d×2, d×4: fewer launches per step, more memory); time (CUDA events,
   the fastest of --repeat steps per round), peak memory above the inputs, kernels per step. A variant that runs out
   of memory says so.

Every comparison runs its variants interleaved, --rounds rounds, and prints ratios as median (min–max) over the rounds
(bench/stats.py). `--parts` picks what runs. The whole run has one deadline (`--deadline`, 480 s by default, inside a
lent GPU's minutes): each part's subprocesses get at most what is left, a part or loss size that would start past it
is skipped, and everything skipped (past the deadline, Liger-Kernel or DeepSpeed missing or off CUDA) is printed with
its reason, in the run and again at the end. `pip install .[gpu]` installs Liger-Kernel and DeepSpeed with Triton.

`--device cpu` runs the same code on the CPU at whatever sizes are given, with the CUDA-only figures (peak memory,
kernels) left out and the launches under accelerate's `--cpu` (one process, where accelerate may not shard: they check
the command line, the step and the save; tests/test_fsdp.py and tests/test_zero3.py shard on 2 gloo processes): a
smoke run that catches a broken script before a GPU's minutes are spent on it (tests/test_gpu_script.py).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from causalqwen_adapter.loss_plan import loss_plan, plan_table

from decode import HEADER, PROMPTS, measure, print_rows, run_variant
from loss import VARIANTS as LOSS_VARIANTS
from loss import build_step
from stats import round_ratios, spread

REPO_ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "sharded", "decode", "loss")
CONFIGS = REPO_ROOT / "recipes" / "configs"
PROFILED_TOKENS = 5  # tokens of the generates whose kernels are counted


def qwen25_05b_config():
    """Qwen2.5-0.5B's shape (as its config.json), for the run without --base."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
                       eos_token_id=2, pad_token_id=None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_base(folder: Path, device: torch.device) -> Path:
    """A randomly initialised Qwen2.5-0.5B-shaped Qwen2 in bf16, with a word-level tokenizer of the bench prompts
    (ids beyond it are never fed), saved like a Hub base."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(PROMPTS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<|endoftext|>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<|endoftext|>")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen25_05b_config()).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    empty_cache(device)
    return folder


class Deadline:
    """The run's one deadline (seconds from now), and what was skipped, with why."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds
        self.seconds = seconds
        self.skipped = []

    def left(self) -> float:
        return max(0.0, self.end - time.perf_counter())

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        print(f"skipped {what}: {why}", flush=True)

    def allows(self, what: str) -> bool:
        """Whether ``what`` may start; if not, it is recorded as skipped."""
        if self.left() > 0:
            return True
        self.skip(what, f"the --deadline of {self.seconds:.0f} s is spent")
        return False

    def timeout(self, limit: float) -> float:
        """A subprocess's timeout: ``limit``, or what is left of the run if less."""
        return max(1.0, min(limit, self.left()))


def section(title: str) -> float:
    print(f"\n=== {title}", flush=True)
    return time.perf_counter()


def done(start: float) -> None:
    print(f"--- {time.perf_counter() - start:.0f} s", flush=True)


def run_logged(cmd: list[str], timeout: float, env=None, keep: int = 3000) -> tuple[int | str, str]:
    """(return code or "timeout", the output's last ``keep`` characters) of a subprocess in the repository root; on
    timeout its whole process group (a launcher's workers too) is killed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", out[-keep:]
    return proc.returncode, out[-keep:]


# --------------------------------------------------------------------------------------- 1. tests


def gpu_tests(timeout: float) -> None:
    start = section("make test-gpu's tests (pytest -m gpu)")
    os.environ["TRITON_INTERPRET"] = "0"  # the Triton kernels' tests on the GPU too (tests/test_kernels_triton.py)
    # every failure's short traceback is printed: a lent GPU's minutes are too few to run the tests twice
    code, out = run_logged([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--tb=short",
                            "-W", "ignore::UserWarning"], timeout, keep=200_000)
    print(out if code != 0 else (out.strip().splitlines() or [""])[-1])
    print(f"pytest -m gpu: {'passed' if code == 0 else f'FAILED ({code})'}")
    done(start)


# --------------------------------------------------------------------------------------- 2. sharded steps


def sharded_steps(base: Path, work: Path, timeout: float, device: torch.device, deadline: Deadline | None = None) -> None:
    deadline = deadline or Deadline(float("inf"))
    start = section(f"one sft_ovr.py step per launch configuration, 1 process on {device.type}")
    data = work / "sharded.jsonl"
    data.write_text("".join(json.dumps({"text": p * 4}) + "\n" for p in PROMPTS * 2))
    configs = ["fsdp2.yaml"]
    try:
        import deepspeed  # noqa: F401

        configs.append("deepspeed_zero3.yaml")
    except Exception as err:  # ImportError, or a DeepSpeed that cannot build its ops here
        deadline.skip("deepspeed_zero3.yaml", f"deepspeed does not import ({type(err).__name__}: {err}); "
                      "pip install .[gpu]")
    cpu = ["--cpu", "--mixed_precision", "no"] if device.type == "cpu" else []  # no nccl, no bf16 autocast
    for config in configs:
        if not deadline.allows(config):
            continue
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
               "--num_processes", "1", *cpu, str(REPO_ROOT / "recipes" / "sft_ovr.py"),
               "--model_name_or_path", str(base), "--dataset_name", str(data), "--output_dir", str(work / config),
               "--max_steps", "1", "--per_device_train_batch_size", "2", "--max_length", "128", "--logging_steps", "1",
               "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
        code, tail = run_logged(cmd, deadline.timeout(timeout))
        saved = (work / config / "model.safetensors").is_file()
        losses = [line for line in tail.splitlines() if "'loss'" in line]
        status = "ok" if code == 0 and saved else f"FAILED (exit {code}, adapter saved: {saved})"
        print(f"{config}: {status}, {time.perf_counter() - t0:.0f} s; {losses[-1].strip() if losses else ''}")
        if status != "ok":
            print(tail)
    done(start)


# --------------------------------------------------------------------------------------- 3. decode


def kernel_launches(fn, device: torch.device) -> int | float:
    """CUDA kernels `fn()` launches (memory copies and sets left out); NaN off CUDA."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events()
               if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset", "[memory]")))


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory allocated on the device since the last reset (MiB); NaN off CUDA."""
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def memory_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def decode(base_path: Path, batches: list[int], new_tokens: int, rounds: int, device: torch.device,
           deadline: Deadline | None = None) -> None:
    deadline = deadline or Deadline(float("inf"))
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from causalqwen_adapter import CausalQwenForCausalLM

    start = section(f"decode, bf16, {new_tokens} new tokens, {rounds} interleaved rounds: median tokens/s and the "
                    "speed as a multiple of the base's, median (min–max) of the rounds")
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    tokenizer.padding_side = "left"
    base = Qwen2ForCausalLM.from_pretrained(base_path, dtype=torch.bfloat16).to(device).eval()
    model = CausalQwenForCausalLM.from_base(base).eval()
    print(HEADER)
    for batch_size in batches:
        if not deadline.allows(f"decode batch {batch_size}"):
            continue
        print_rows(batch_size, measure(base, model, tokenizer, batch_size, new_tokens, rounds,
                                       synchronize=lambda: synchronize(device)))
    print(f"\nbatch 1, per variant: peak memory of a {new_tokens}-token generate, CUDA kernels per decode step "
          f"(a {min(new_tokens, PROFILED_TOKENS)}-token generate's less a 1-token one's)")
    batch = tokenizer(PROMPTS[:1], return_tensors="pt").to(device)
    with torch.inference_mode():
        for variant in ("base", "compatible", "standard", "standard (eager)", "causal", "sampling"):
            if not deadline.allows(f"decode peak memory and kernels of {variant}"):
                continue
            empty_cache(device)
            reset_peak_memory(device)
            run_variant(base, model, variant, batch, new_tokens)
            peak = peak_memory_mib(device)
            # a few steps: the profiler's events of a long generate (about 1,000 kernels a step) take minutes to read
            steps = min(new_tokens, PROFILED_TOKENS)
            many = kernel_launches(lambda: run_variant(base, model, variant, batch, steps), device)
            one = kernel_launches(lambda: run_variant(base, model, variant, batch, 1), device)
            print(f"  {variant:<24} peak {peak:8.0f} MiB   kernels per step {(many - one) / max(steps - 1, 1):7.1f}")
    done(start)


# --------------------------------------------------------------------------------------- 4. loss


def loss(sizes: list[int], rounds: int, repeat: int, device: torch.device, dtype: str = "bfloat16",
         deadline: Deadline | None = None, chunk_factors=(2, 4)) -> None:
    """(a), (d), (v), (r), (l) as the docstring says, and (d) at each of `chunk_factors` × its chunk ("d×2"): fewer
    chunks, fewer launches, more memory (`loss_plan` at that chunk, printed), to read which chunk a GPU runs fastest."""
    deadline = deadline or Deadline(float("inf"))
    variants = ["a", "d", "v"]
    names = dict(LOSS_VARIANTS)
    if device.type == "cpu":
        deadline.skip("loss (r)", "on the CPU it is (d): no Triton kernels to leave out")
    else:
        variants.append("r")
    try:
        import liger_kernel  # noqa: F401
    except ImportError as err:
        deadline.skip("loss (l) Liger-Kernel", f"liger_kernel does not import ({err}); pip install .[gpu]")
    else:
        if device.type == "cuda":  # Triton kernels: a GPU
            variants.append("l")
        else:
            deadline.skip("loss (l) Liger-Kernel", f"its Triton kernels need a CUDA device, not {device.type}")
    section("the loss's allocation plan beside Liger's FLCE (loss_plan.py: computed, not measured)")
    for line in plan_table(dtype=getattr(torch, dtype)):
        print(line)
    start = section(f"loss forward + backward, {dtype} weights, V × C = 151936 × 896, {rounds} interleaved rounds, "
                    f"the fastest of {repeat} steps per round")
    for n in sizes:
        if not deadline.allows(f"loss N={n}"):
            continue
        # (d) is the default loss: the cross-entropy's pass, which finds the candidates, through the Triton kernels;
        # (r) the same pass through the torch code
        chunks = {}
        for v, operator in (("d", device.type == "cuda"), ("r", False)):
            if v in variants:
                plan = loss_plan(n, 151936, 896, getattr(torch, dtype), device.type, "candidates pass",
                                 operator=operator)
                chunks[v] = plan.chunk
                print(f"N={n}: ({v}) in chunks of {plan.chunk} tokens ({plan.chunks} chunks, loss_plan)")
        wider = {}  # (d) at a multiple of its chunk, while that is fewer chunks
        for factor in chunk_factors:
            if factor > 1 and chunks["d"] * factor // 2 < n:
                v = f"d×{factor}"
                wider[v] = chunks["d"] * factor
                plan = loss_plan(n, 151936, 896, getattr(torch, dtype), device.type, "candidates pass",
                                 chunk=wider[v], operator=device.type == "cuda")
                names[v] = f"(d), chunks of {wider[v]}"
                print(f"N={n}: ({v}) in chunks of {plan.chunk} tokens ({plan.chunks} chunks), planned peak "
                      f"{plan.peak_bytes / 2**20:.0f} MiB, {plan.launches_per_chunk * plan.chunks} launches of the pass (loss_plan; "
                      "the candidates' term is the same in every variant)")
        steps = {}
        for v in [*variants, *wider]:  # build_step sets `dtype` as the default dtype, as bench/loss.py's --dtype runs
            empty_cache(device)
            try:
                steps[v] = build_step(v[0], n, chunk_size=wider.get(v, 0), dtype=dtype, device=str(device))
            except torch.cuda.OutOfMemoryError:
                print(f"N={n} ({v}) {names[v]}: out of memory building its inputs")
        times = {v: [] for v in steps}
        peaks, kernels = {}, {}

        def clear(v):
            for p in steps[v][1]:
                p.grad = None

        def one_step(v):
            step, _, precision = steps[v]
            clear(v)
            with precision:
                value = step()
            value.backward()

        for r in range(rounds):
            if r > 0 and not deadline.allows(f"loss N={n} rounds {r + 1}-{rounds}"):
                break
            for v in list(steps):
                try:
                    if r == 0:  # warm-up (Triton/cuBLAS set-up), peak memory above the inputs, kernels per step
                        one_step(v)
                        clear(v)  # the peak is measured from the inputs alone
                        synchronize(device)
                        empty_cache(device)
                        base_mem = memory_allocated(device)
                        reset_peak_memory(device)
                        one_step(v)
                        synchronize(device)
                        peaks[v] = peak_memory_mib(device) - base_mem / 2**20
                        kernels[v] = kernel_launches(lambda: one_step(v), device)
                    best = float("inf")
                    for _ in range(repeat):
                        best = min(best, timed_step(lambda: one_step(v), device))
                    times[v].append(best)
                except torch.cuda.OutOfMemoryError:
                    print(f"N={n} ({v}) {names[v]}: out of memory")
                    del steps[v], times[v]
                    empty_cache(device)
        for v in times:
            print(f"N={n} ({v}) {names[v]:<24} {statistics.median(times[v]) * 1e3:8.1f} ms (median of rounds)  "
                  f"peak above inputs {peaks.get(v, float('nan')):8.0f} MiB  kernels per step {kernels.get(v, 0)}")
        pairs = [("d", "a"), ("d", "l"), ("v", "a"), ("v", "l"), ("l", "a"), ("r", "a"), ("r", "d")]
        for mine, other in pairs + [(v, other) for v in wider for other in ("d", "a", "l")]:
            if mine in times and other in times:
                print(f"N={n} {mine}/{other} time {spread(round_ratios(times[mine], times[other]))}×  "
                      f"peak memory {peaks[mine] / peaks[other]:.2f}×")
        steps.clear()
        empty_cache(device)
    torch.set_default_dtype(torch.float32)
    done(start)


def timed_step(fn, device: torch.device) -> float:
    """Seconds of `fn()`: CUDA events on the GPU (what the device spent), the wall clock elsewhere."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000


# --------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="a Qwen2 folder (e.g. build/demo-base); default: a random "
                        "Qwen2.5-0.5B-shaped model")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode batch sizes")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode: tokens per generate")
    parser.add_argument("--n", type=int, nargs="+", default=[8192, 32768], help="loss: target tokens")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every comparison")
    parser.add_argument("--repeat", type=int, default=2, help="loss: timed steps per round (the fastest counts)")
    parser.add_argument("--deadline", type=float, default=480, help="seconds for the whole run: what would start "
                        "after it is skipped (and said so), subprocesses get at most what is left")
    parser.add_argument("--tests-timeout", type=float, default=240, help="seconds for pytest -m gpu")
    parser.add_argument("--launch-timeout", type=float, default=150, help="seconds per accelerate launch")
    parser.add_argument("--chunk-factors", type=int, nargs="*", default=[2, 4],
                        help="loss: also time (d) at these multiples of its chunk (fewer launches, more memory)")
    parser.add_argument("--loss-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="loss: the weights' and activations' dtype")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke run of the same code (no GPU figures), e.g. at tiny sizes")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device: torch.cuda.is_available() is False on this machine (--device cpu "
                 "runs the script's code on the CPU, without its GPU figures)")
    if device.type == "cpu" and "tests" in args.parts:
        sys.exit("--device cpu: leave out the tests part (--parts sharded decode loss); `make test` runs them here")

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    begin = time.perf_counter()
    deadline = Deadline(args.deadline)
    with tempfile.TemporaryDirectory(prefix="causalqwen-gpu-bench-") as tmp:
        work = Path(tmp)
        base = Path(args.base) if args.base else None
        if base is None and {"sharded", "decode"} & set(args.parts):
            base = random_base(work / "random-qwen2.5-0.5b", device)
            print(f"base: a random Qwen2.5-0.5B-shaped model ({base})")
        if "tests" in args.parts and deadline.allows("tests"):
            gpu_tests(deadline.timeout(args.tests_timeout))
        if "sharded" in args.parts and deadline.allows("sharded"):
            sharded_steps(base, work, args.launch_timeout, device, deadline)
        if "decode" in args.parts and deadline.allows("decode"):
            decode(base, args.batch, args.new_tokens, args.rounds, device, deadline)
            empty_cache(device)  # the decode models are gone
        if "loss" in args.parts and deadline.allows("loss"):
            loss(args.n, args.rounds, args.repeat, device, args.loss_dtype, deadline, args.chunk_factors)
    print(f"\nall parts: {time.perf_counter() - begin:.0f} s (deadline {args.deadline:.0f} s)")
    print("skipped: " + ("; ".join(deadline.skipped) if deadline.skipped else "nothing"))


if __name__ == "__main__":
    main()
