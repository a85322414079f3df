"""Is the noise temperature a calibration knob? Next-token metrics of an adapter's OvR mode at several `causal_temperature`
values T, beside its compatible mode, on held-out text.

T scales the exogenous noise the OvR modes fuse into U (docs/design.md, the noise fusion table): in `standard`,
scale_U' = scale_U + T·|b_noise|, so a larger T flattens every P_k and the mode's next-token distribution moves toward
the compatible mode's softmax(loc_S). Temperature scaling is how a softmax model's confidence is usually calibrated
after training; this measures whether T does that for the OvR modes (top-1 NLL and calibration error) and what it
costs the OvR probabilities themselves (the calibration error of the 10 largest P_k). Held-out text: the docstrings of
the demo's held-out modules (recipes/demo.py), `pathlib` for picking T, `shutil` for the figures.

    python bench/noise_temperature.py --adapter build/demo-trained --base build/demo-base
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from demo import stdlib_docstrings  # noqa: E402

METRICS = ("top1_accuracy", "nll", "ece_top1", "ece_top10")


def held_out_rows(tokenizer, module: str):
    from datasets import Dataset

    from causalqwen_adapter.data import tokenize_for_evaluation

    texts = [t for t in stdlib_docstrings(limit=10_000) if t.split(".")[0] == module]
    return tokenize_for_evaluation(Dataset.from_dict({"text": texts}), tokenizer, max_length=160)


def measure(model, rows, pad_id: int, mode: str, temperatures) -> list[dict]:
    """One row per setting: the compatible mode, then `mode` at the config's T and at each of `temperatures`."""
    from causalqwen_adapter.data import batches
    from causalqwen_adapter.evaluation import evaluate

    out = []
    for label, modes, temperature in [("compatible", ("compatible",), None), (f"{mode}, config T", (mode,), None),
                                      *((f"{mode}, T = {t:g}", (mode,), t) for t in temperatures)]:
        torch.manual_seed(0)
        result = evaluate(model, batches(rows, 4, pad_id), modes, causal_temperature=temperature)
        metrics = result[modes[0]]
        out.append({"setting": label, "temperature": temperature, **{k: metrics[k] for k in METRICS}})
        print(f"  {label:>22}: " + ", ".join(f"{k} {metrics[k]:.4f}" for k in METRICS), flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| setting | top-1 | NLL | ECE top-1 | ECE top-10 P_k |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['setting']} | {r['top1_accuracy']:.4f} | {r['nll']:.4f} | {r['ece_top1']:.4f} | "
              f"{r['ece_top10']:.4f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default="build/demo-trained")
    parser.add_argument("--base", default="build/demo-base", help="its base (the tokenizer)")
    parser.add_argument("--mode", default="standard", choices=("standard", "causal", "sampling"))
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 2.0, 4.0, 8.0, 16.0, 64.0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="writes OUTPUT.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from causalqwen_adapter import CausalQwenForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = CausalQwenForCausalLM.from_pretrained(args.adapter, base_model=args.base, dtype=torch.float32).eval()
    began = time.perf_counter()
    results = {}
    for split, module in (("pick", "pathlib"), ("test", "shutil")):
        print(f"{split}: held-out docstrings of {module}")
        results[split] = measure(model, held_out_rows(tokenizer, module), tokenizer.pad_token_id or 0, args.mode,
                                 args.temperatures)
    ovr = [r for r in results["pick"] if r["setting"] != "compatible"]
    best = min(ovr, key=lambda r: r["nll"])["setting"]
    print(f"\nT with the lowest NLL on pathlib: {best}\n\nshutil (test):\n\n{markdown(results['test'])}")
    if args.output:
        meta = {"command": "python bench/noise_temperature.py " + " ".join(sys.argv[1:]), "picked_on_pathlib": best,
                "causal_temperature": model.config.causal_temperature, "seconds": round(time.perf_counter() - began)}
        Path(f"{args.output}.json").write_text(json.dumps({"meta": meta, **results}, indent=1))


if __name__ == "__main__":
    main()
