"""Adapter size on disk for each `action_weight`, beside the base checkpoint (target: "tied" and
"lora" with r = 16 ≤ 5% of the base), and what loading a "tied" adapter adds to memory.

    python bench/adapter_size.py --base build/demo-base
"""

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()

    base_bytes = sum(p.stat().st_size for p in Path(args.base).glob("*.safetensors"))
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16)
    print(f"base checkpoint weights: {base_bytes / 2**20:.1f} MiB")
    print(f"{'action_weight':<14}{'model.safetensors MiB':>22}{'× base':>9}{'trainable params':>18}")
    with tempfile.TemporaryDirectory() as tmp:
        for action_weight in ("full", "tied", "lora"):
            model = CausalQwenForCausalLM.from_base(base, action_weight=action_weight, action_lora_rank=args.lora_rank)
            folder = Path(tmp) / action_weight
            model.save_pretrained(folder)
            size = (folder / "model.safetensors").stat().st_size
            n = sum(p.numel() for p in model.parameters() if p.requires_grad)
            print(f"{action_weight:<14}{size / 2**20:>22.2f}{size / base_bytes:>9.4f}{n:>18,}")
            if action_weight == "tied":
                loaded = CausalQwenForCausalLM.from_pretrained(folder)
                shared = loaded.action.effective_weight().data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
                vocab_sized = [k for k, v in loaded.adapter_state_dict().items() if loaded.config.vocab_size in v.shape
                               and v.dim() == 2]
                print(f"  tied reload: W_A is the base embedding tensor: {shared}; "
                      f"vocabulary-sized matrices among the adapter tensors: {vocab_sized or 'none'}")


if __name__ == "__main__":
    main()
