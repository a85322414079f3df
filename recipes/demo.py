"""`make demo`: CausalQwen end to end on the real demo base.

Attach fresh causal heads to the base, check them against the base (verify_initialization),
save the adapter, reload it the way any user would (`AutoModelForCausalLM` with
`trust_remote_code=True`), show what the adapter costs on disk beside the base, and generate in
every inference mode beside the base model. Then train the heads with `CausalSFTTrainer` and the
package's default recipe on text no one here wrote and that ships on every machine (docstrings of
Python's standard library), evaluate the base, the fresh and the trained heads on docstrings of
modules the training never saw, and generate with the trained adapter beside the base. Models run in bf16, or in
float32 on a CPU without bfloat16 instructions.

    python recipes/demo.py --base build/demo-base --out build/demo-adapter
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.devices import add_device_argument, resolve_device

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import numpy as np\n\n# compute the mean of a list",
]


TRAIN_STEPS = 30  # the demo's training: steps of TRAIN_BATCH_ROWS docstrings, TRAIN_MAX_LENGTH tokens each
TRAIN_BATCH_ROWS = 2
TRAIN_MAX_LENGTH = 128

CHAT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in one sentence.",
]


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def section(title: str) -> None:
    print(f"\n=== {title} ===")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base", help="base causal LM: local folder or Hub id")
    parser.add_argument("--out", default="build/demo-adapter", help="where to save the adapter")
    parser.add_argument("--train-steps", type=int, default=TRAIN_STEPS, help="0 skips the training part")
    add_device_argument(parser)
    args = parser.parse_args()
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    torch.manual_seed(0)

    section("attach causal heads")
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    tokenizer.padding_side = "left"
    dtype = model_dtype(device)
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=dtype).to(device).eval()
    model = CausalQwenForCausalLM.from_base(base).eval()  # the heads on the base's device
    n_heads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"base: {args.base} ({sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters, {dtype})")
    print(f"causal heads: {n_heads / 1e6:.1f}M trainable parameters; backbone frozen")

    section("verify initialization: loc_S against the base logits")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True).to(device)
    for name, value in model.verify_initialization(batch.input_ids, batch.attention_mask).items():
        print(f"  {name:>14}: {value:.6g}")

    section("save the adapter")
    start = time.perf_counter()
    model.save_pretrained(args.out)
    print(f"saved {args.out} in {time.perf_counter() - start:.1f}s: {sorted(p.name for p in Path(args.out).iterdir())}")

    section("reload with AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)")
    start = time.perf_counter()
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, trust_remote_code=True, dtype=dtype).to(device)
    print(f"loaded {type(reloaded).__module__}.{type(reloaded).__name__} in {time.perf_counter() - start:.1f}s")
    with torch.no_grad():
        a = model(**batch, inference_mode="standard")
        b = reloaded(**batch, inference_mode="standard")
    same = all(torch.equal(a[k], b[k]) for k in ("logits", "loc_S", "scale_S"))
    print(f"outputs identical to the in-memory model: {same}")
    if not same:
        raise SystemExit("reloaded adapter differs from the saved model")

    section("size on disk")
    adapter_bytes, base_bytes = folder_size(args.out), folder_size(args.base)
    print(f"  adapter folder: {adapter_bytes / 2**20:8.1f} MiB  (heads only: abduction, action W_A/b_A, b_noise)")
    print(f"  base folder:    {base_bytes / 2**20:8.1f} MiB")
    print(f"  ratio:          {adapter_bytes / base_bytes:8.3f}")

    section("generate: the base beside every inference mode (greedy, 40 new tokens)")
    generate_in_every_mode(reloaded, base, tokenizer)

    if args.train_steps > 0:
        section(f"train the heads: CausalSFTTrainer, {args.train_steps} steps on standard-library docstrings")
        trained_dir = train_heads(args.base, tokenizer, args.train_steps, Path(args.out).with_name("demo-trained"))
        trained = AutoModelForCausalLM.from_pretrained(trained_dir, trust_remote_code=True, dtype=dtype)
        trained = trained.to(device)
        section("held-out docstrings: the base, the fresh heads and the trained heads (causalqwen_adapter.evaluation)")
        print(held_out_table({"base": base, "fresh heads": reloaded, "trained heads": trained}, tokenizer))
        section("generate with the trained adapter beside the base")
        generate_in_every_mode(trained, base, tokenizer, fresh=False)


def model_dtype(device: torch.device) -> torch.dtype:
    """bfloat16, but float32 on a CPU without bfloat16 instructions (x86 flags avx512_bf16 / amx_bf16), where
    bfloat16 products run several times slower than float32 ones."""
    from causalqwen_adapter.kernels.cpu import cpu_flags

    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & cpu_flags() else torch.float32


def stdlib_docstrings(limit: int = 2000) -> list[str]:
    """Docstrings of the standard library's public functions and classes (text that ships everywhere)."""
    import importlib
    import inspect

    texts = []
    for name in ("json", "collections", "itertools", "functools", "pathlib", "argparse", "textwrap", "string",
                 "statistics", "fractions", "heapq", "bisect", "datetime", "calendar", "shutil", "csv", "re"):
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            obj = getattr(module, attr)
            doc = inspect.getdoc(obj) if not attr.startswith("_") else None
            if doc and len(doc) > 80 and getattr(obj, "__module__", name).split(".")[0] == name:
                texts.append(f"{name}.{attr}: {doc}")
    return texts[:limit]


HELD_OUT_MODULES = ("pathlib", "shutil")  # documents the demo never trains on


def train_heads(base: str, tokenizer, steps: int, out: Path, seed: int = 0) -> Path:
    """The default recipe, as `recipes/sft_ovr.py` runs it with only model, data, output and step flags; `seed` draws
    the data order and the trainer's seed (bench/evidence_next_token.py trains one adapter per seed)."""
    from datasets import Dataset

    from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

    texts = [t for t in stdlib_docstrings() if t.split(".")[0] not in HELD_OUT_MODULES]
    dataset = Dataset.from_dict({"text": texts}).shuffle(seed=seed)
    print(f"{len(texts)} docstrings (not from {', '.join(HELD_OUT_MODULES)}); the package's default recipe")
    args = CausalSFTConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=TRAIN_BATCH_ROWS, max_length=TRAIN_MAX_LENGTH,
        logging_steps=max(1, steps // 10), save_strategy="no", report_to="none", seed=seed, disable_tqdm=True,
    )
    trainer = CausalSFTTrainer(base, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    # ΣP: over the candidates the loss scores (ovr_candidates), or over the vocabulary
    print("step  loss     P_y     ΣP  scale_U")
    for log in trainer.state.log_history:
        if "loss" in log:
            prob_sum = log.get("candidate_prob_sum", log.get("ovr_prob_sum", float("nan")))
            print(f"{log['step']:>4}  {log['loss']:7.3f}  {log.get('target_prob', float('nan')):.3f}  "
                  f"{prob_sum:8.2f}  {log.get('units_mean_scale', float('nan')):.3g}")
    trainer.save_model(str(out))
    return out


HELD_OUT_TOKENS = 160  # tokens per held-out docstring scored
HELD_OUT_BATCH = 4


def held_out_texts() -> list[str]:
    """The docstrings of HELD_OUT_MODULES: the text every trained adapter is evaluated on."""
    return [t for t in stdlib_docstrings(limit=10_000) if t.split(".")[0] in HELD_OUT_MODULES]


def held_out_rows(tokenizer):
    """`held_out_texts`, tokenized for `causalqwen_adapter.evaluation` (the first HELD_OUT_TOKENS tokens of each)."""
    from datasets import Dataset

    from causalqwen_adapter.data import tokenize_for_evaluation

    return tokenize_for_evaluation(Dataset.from_dict({"text": held_out_texts()}), tokenizer, max_length=HELD_OUT_TOKENS)


def held_out_table(models: dict, tokenizer) -> str:
    """Held-out next-token metrics (causalqwen_adapter.evaluation) of each model, on docstrings it never trained on."""
    from causalqwen_adapter.data import batches
    from causalqwen_adapter.evaluation import confidence_table, evaluate, markdown_table

    rows = held_out_rows(tokenizer)
    results = {}
    for name, model in models.items():
        torch.manual_seed(0)
        out = evaluate(model, batches(rows, HELD_OUT_BATCH, tokenizer.pad_token_id or 0), ("compatible", "standard", "causal"))
        out.pop("accumulators")
        results[name] = out
    return (markdown_table(results) + "\n\nHow well each confidence signal tells a right top-1 from a wrong one "
            "(AUROC; 0.5: no information):\n\n" + confidence_table(results))


def generate_in_every_mode(model, base, tokenizer, max_new_tokens: int = 40, fresh: bool = True) -> None:
    chats = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(base.device)
    runs = {"base model": lambda **kw: base.generate(**kw)}
    for mode in ("compatible", "standard", "causal", "sampling"):
        runs[f"causalqwen {mode}"] = lambda mode=mode, **kw: model.generate(**kw, inference_mode=mode)
    results = {}
    for name, run in runs.items():
        torch.manual_seed(0)  # the sampling mode's noise is reproducible
        start = time.perf_counter()
        out = run(**batch, max_new_tokens=max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
        results[name] = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
        print(f"[{name}] {seconds:.1f}s")
    for i, prompt in enumerate(CHAT_PROMPTS):
        print(f"\n>>> {prompt}")
        for name, answers in results.items():
            print(f"  [{name}] {answers[i]!r}")
    same = results["causalqwen compatible"] == results["base model"]
    if fresh:
        print(f"\ncompatible mode reproduces the base token for token: {same}")


if __name__ == "__main__":
    main()
