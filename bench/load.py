"""Benchmark: loading an adapter (base + heads) vs loading the base alone, on the demo base or any --base folder (its
class API timed as the class its config.json names).

Each load runs in a fresh subprocess (nothing cached in-process), alternating base / adapter,
after one untimed warm-up of each so both read from a warm page cache. Prints the median times,
the per-round ratio adapter / base as median (min–max) (target ≤ 1.2×) and the sizes of the adapter file and the base
checkpoint.

    python bench/load.py --base build/demo-base [--adapter build/demo-adapter] [--repeats 5]
    python bench/load.py --base build/smollm2-135m

On a machine other jobs share, `--clock cpu` times each load by its process's CPU time (`time.process_time`, all its
threads) instead of the wall clock: waiting for a core no longer counts.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from stats import round_ratios, spread

# (import, load). The class API is timed without its imports, the base architecture's module included on both sides
# (the adapter loads its base through AutoModelForCausalLM, which would otherwise import that module on its clock
# only: 0.1 s for Gemma 3); the Auto API is timed as a user meets it, resolving and importing the model's module
# inside the call (transformers' own lazy import for the base, the adapter folder's remote code for the adapter).
LOADERS = {
    "base: {arch}": ("from transformers import {arch} as C", "C.from_pretrained({path!r}, dtype='auto')"),
    "adapter: CausalQwenForCausalLM": (
        "from transformers import {arch}\nfrom causalqwen_adapter import CausalQwenForCausalLM as C",
        "C.from_pretrained({path!r}, dtype='auto')"),
    "base: AutoModelForCausalLM": ("from transformers import AutoModelForCausalLM as C", "C.from_pretrained({path!r}, dtype='auto')"),
    "adapter: AutoModelForCausalLM, remote code": (
        "from transformers import AutoModelForCausalLM as C",
        "C.from_pretrained({path!r}, dtype='auto', trust_remote_code=True)",
    ),
}
REFERENCE = {"adapter: CausalQwenForCausalLM": "base: {arch}",
             "adapter: AutoModelForCausalLM, remote code": "base: AutoModelForCausalLM"}
# safetensors maps files lazily; "resident" also reads one element per 2 KiB of every tensor, so
# every page of the weights is in memory when the clock stops.
TIMED = """import time, torch
{imp}
clock = time.{clock}
t = clock()
m = {load}
loaded = clock() - t
touched = sum(float(p.detach().reshape(-1)[::1024].float().sum()) for p in m.parameters())
print(loaded, clock() - t)"""
CLOCKS = {"wall": "perf_counter", "cpu": "process_time"}


def time_load(kind: str, path: str, arch: str, clock: str = "wall") -> tuple[float, float]:
    imp, load = LOADERS[kind]
    code = TIMED.format(imp=imp.format(arch=arch), load=load.format(path=path), clock=CLOCKS[clock])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, resident = out.stdout.strip().splitlines()[-1].split()
    return float(loaded), float(resident)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="build/demo-base")
    parser.add_argument("--adapter", help="adapter folder; built from --base with fresh heads when omitted")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", default="wall", choices=tuple(CLOCKS),
                        help="wall: what a user waits for; cpu: the loading process's CPU time, for a shared machine")
    args = parser.parse_args()

    adapter = args.adapter
    if adapter is None:
        adapter = str(Path(tempfile.mkdtemp()) / "adapter")
        subprocess.run([sys.executable, "-c", (
            "from causalqwen_adapter import CausalQwenForCausalLM as C; "
            f"C.from_base({args.base!r}).save_pretrained({adapter!r})")], check=True, capture_output=True)
    paths = {kind: (args.base if kind.startswith("base") else adapter) for kind in LOADERS}
    arch = json.loads((Path(args.base) / "config.json").read_text())["architectures"][0]

    for kind in LOADERS:  # warm-up: page cache and the remote-code module cache
        time_load(kind, paths[kind], arch, args.clock)
    times = {kind: [] for kind in LOADERS}
    for _ in range(args.repeats):
        for kind in LOADERS:
            times[kind].append(time_load(kind, paths[kind], arch, args.clock))

    print(f"{'load':<44}{'returns s':>10}{'resident s':>11}  {'ratio returns':<18}{'ratio resident':<18}"
          f"(medians and ratio min–max over {args.repeats} rounds, {args.clock} clock)")
    for kind, runs in times.items():
        ref = times[REFERENCE.get(kind, kind)]
        loaded, resident = ([t[i] for t in runs] for i in (0, 1))
        ratios = [spread(round_ratios(loaded if i == 0 else resident, [t[i] for t in ref])) for i in (0, 1)]
        print(f"{kind.format(arch=arch):<44}{statistics.median(loaded):>10.3f}{statistics.median(resident):>11.3f}  "
              f"{ratios[0]:<18}{ratios[1]:<18}")
    weights = Path(adapter) / "model.safetensors"
    base_bytes = sum(p.stat().st_size for p in Path(args.base).glob("*.safetensors"))
    print(f"adapter model.safetensors: {weights.stat().st_size / 2**20:.1f} MiB; "
          f"base weights: {base_bytes / 2**20:.1f} MiB ({weights.stat().st_size / base_bytes:.3f}×)")


if __name__ == "__main__":
    main()
