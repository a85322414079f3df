"""`make demo`: CausalQwen end to end on the real demo base.

Attach fresh causal heads to the base, check them against the base (seed 001's verification),
save the adapter, reload it the way any user would (`AutoModelForCausalLM` with
`trust_remote_code=True`) and show what the adapter costs on disk beside the base.

    python recipes/demo.py --base build/demo-base --out build/demo-adapter
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import numpy as np\n\n# compute the mean of a list",
]


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def section(title: str) -> None:
    print(f"\n=== {title} ===")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base", help="Qwen2 base: local folder or Hub id")
    parser.add_argument("--out", default="build/demo-adapter", help="where to save the adapter")
    args = parser.parse_args()
    torch.manual_seed(0)

    section("attach causal heads")
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    tokenizer.padding_side = "left"
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16).eval()
    model = CausalQwenForCausalLM.from_base(base).eval()
    n_heads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"base: {args.base} ({sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters, bf16)")
    print(f"causal heads: {n_heads / 1e6:.1f}M trainable parameters; backbone frozen")

    section("verify initialization (seed 001)")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    for name, value in model.verify_initialization(batch.input_ids, batch.attention_mask).items():
        print(f"  {name:>14}: {value:.6g}")

    section("save the adapter")
    start = time.perf_counter()
    model.save_pretrained(args.out)
    print(f"saved {args.out} in {time.perf_counter() - start:.1f}s: {sorted(p.name for p in Path(args.out).iterdir())}")

    section("reload with AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)")
    start = time.perf_counter()
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, trust_remote_code=True, dtype=torch.bfloat16)
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


if __name__ == "__main__":
    main()
