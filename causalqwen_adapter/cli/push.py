r"""`causalqwen push`: upload a saved CausalQwen adapter folder to the Hugging Face Hub.

    causalqwen push --model_name_or_path runs/my-adapter --hub_model_id your-username/my-causal-adapter \
        --base_model_id Qwen/Qwen2.5-0.5B-Instruct [--hub_private_repo] [--create_pr]

The folder is uploaded as it is, after checking that it is an adapter folder (docs/design.md, The adapter folder):
nothing is loaded, so no base model is downloaded or held in memory, the tensors go up byte for byte, and the model
card keeps the training record the trainer wrote into it. Only the card's title and load snippet are changed to name
the repo. Files that are not part of the adapter (a trainer's checkpoints, logs) stay local. The token is
--hub_token, else HF_TOKEN, else the one `hf auth login` stored.
"""

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files

from causalqwen_adapter import CausalQwenConfig, CausalQwenForCausalLM
from causalqwen_adapter.adapter_io import (
    LORA_FOLDER,
    LORA_WEIGHTS_NAME,
    check_weights_header,
    interrupted_swap,
    non_finite_tensors,
)
from causalqwen_adapter.hub import check_base_for_push, check_push, link_files, upload_adapter_folder
from causalqwen_adapter.model_card import CARD_NAME, render_model_card
from causalqwen_adapter.tokenization_causalqwen import TOKENIZER_CONFIG_NAME, is_adapter_tokenizer_config

from .parsing import CliArgumentParser

# the old spellings (`hf upload`'s and the first recipe's), read as TrainingArguments' hub_* names
ALIASES = {"--token": "--hub_token", "--private": "--hub_private_repo", "--revision": "--hub_revision",
           "--hub_base_model_id": "--base_model_id"}

WEIGHTS = "model.safetensors"
OPTIONAL = ("generation_config.json", CARD_NAME)


def adapter_files(folder: Path) -> list[str]:
    """The files of the adapter in `folder`, relative to it; raises ValueError when it is not a complete adapter."""
    if not (folder / "config.json").is_file():
        aside = interrupted_swap(folder) if folder.is_dir() else None
        if aside is not None:  # as the loader says it
            raise ValueError(f"{folder} has no config.json: a save into it was interrupted while swapping its files. "
                             f"The previous adapter's config.json and the files already replaced are in {aside}: move "
                             f"them back into {folder} to restore that adapter, or save the adapter again")
        raise ValueError(f"{folder} has no config.json: it is not an adapter folder (write one with save_pretrained)")
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != CausalQwenConfig.model_type:
        raise ValueError(
            f"{folder} holds a {config.get('model_type')!r} checkpoint, not a CausalQwen adapter: causalqwen push uploads "
            "adapters only (an adapter references its base, it never carries it)"
        )
    if (folder / "adapter_config.json").exists():
        raise ValueError(
            f"{folder} has an adapter_config.json at its root, so transformers would load the repo as a PEFT adapter: "
            "a backbone LoRA belongs in lora/"
        )
    if not (folder / WEIGHTS).is_file():
        raise ValueError(f"{folder} has no {WEIGHTS}: the save was interrupted; save the adapter again")
    _check_adapter_tensors(folder / WEIGHTS, config)

    code = []
    for key, reference in (config.get("auto_map") or {}).items():
        # "module.Class" of a file in the folder itself; a path or "repo--module.Class" would load code from elsewhere
        if not isinstance(reference, str) or not re.fullmatch(r"[A-Za-z_]\w*\.[A-Za-z_]\w*", reference):
            raise ValueError(
                f"{folder}/config.json's auto_map names {reference!r} for {key}: the remote code must be a module of "
                "the folder itself ('module.Class', e.g. 'modeling_causalqwen.CausalQwenForCausalLM'). Save the "
                "adapter again with save_pretrained"
            )
        module = folder / (reference.rsplit(".", 1)[0] + ".py")
        if not module.is_file():
            raise ValueError(f"{folder} lacks {module.name}, named in config.json's auto_map: save the adapter again")
        try:
            code += [module] + [Path(p) for p in get_relative_import_files(module)]
        except FileNotFoundError as err:
            raise ValueError(f"{folder} lacks {Path(err.filename or '?').name}, which the remote code imports: save "
                             "the adapter again") from None
    if not code:
        raise ValueError(f"{folder}/config.json has no auto_map: the repo could not be loaded with trust_remote_code")
    for module in code:
        if not module.is_file():
            raise ValueError(f"{folder} lacks {module.name}, which the remote code imports: save the adapter again")

    files = ["config.json", WEIGHTS] + sorted({m.name for m in code})
    files += [name for name in OPTIONAL if (folder / name).is_file()]
    if is_adapter_tokenizer_config(folder / TOKENIZER_CONFIG_NAME):  # the pointer to the base's tokenizer, not a user's
        files.append(TOKENIZER_CONFIG_NAME)
    if (folder / LORA_FOLDER).is_dir() and not (folder / LORA_FOLDER).is_symlink():
        _check_lora(folder / LORA_FOLDER)
    if (folder / "lora").is_dir():
        files += sorted(p.relative_to(folder).as_posix() for p in (folder / "lora").rglob("*")
                        if p.is_file() or p.is_symlink())
    links = [name for name in ["lora", *files] if (folder / name).is_symlink()]
    if links:  # a link can point anywhere on this machine: only the folder's own files are uploaded
        raise ValueError(f"{folder}: {links} are symbolic links; causalqwen push uploads only regular files inside the "
                         "folder. Replace them with the files themselves")
    return files


def _check_lora(lora: Path) -> None:
    """A backbone LoRA the loader can apply: PEFT's config and weights both there, every tensor finite."""
    missing = [name for name in ("adapter_config.json", LORA_WEIGHTS_NAME) if not (lora / name).is_file()]
    if missing:
        raise ValueError(f"{lora} lacks {missing}: the pushed repo could not be loaded (the loader applies lora/ "
                         "whenever it has an adapter_config.json). Save the adapter again, or remove lora/")
    try:
        bad = non_finite_tensors(lora / LORA_WEIGHTS_NAME)
    except Exception as err:  # truncated, corrupt header
        raise ValueError(f"{lora / LORA_WEIGHTS_NAME} cannot be read ({err}): save the adapter again") from err
    if bad:
        raise ValueError(f"{lora / LORA_WEIGHTS_NAME}: {bad[:5]} hold NaN or infinite values; save a healthy adapter "
                         "before sharing it")


def _check_adapter_tensors(weights: Path, config: dict) -> None:
    """The whole file reads, every tensor finite (`non_finite_tensors`), and its header holds exactly the tensors,
    with the shapes, this config's heads have (`check_weights_header`, as the loader checks it): never a base
    tensor, nothing missing, nothing a stranger could not load. Before any network call."""
    try:
        bad = non_finite_tensors(weights)  # reads every tensor: a truncated file fails here
    except Exception as err:  # truncated, corrupt header, bytes missing: safetensors says which
        raise ValueError(f"{weights} cannot be read ({err}): the file is truncated or corrupt; save the adapter again") from err
    if bad:
        raise ValueError(f"{weights}: {bad} hold NaN or infinite values; save a healthy adapter before sharing it")
    check_weights_header(str(weights), CausalQwenConfig.from_dict(config), CausalQwenForCausalLM)


def make_parser(prog: str | None = None) -> CliArgumentParser:
    parser = CliArgumentParser(prog=prog, description=__doc__, aliases=ALIASES,
                               usage="%(prog)s --model_name_or_path FOLDER --hub_model_id REPO_ID [options]")
    # the first recipe's positionals, hidden: `push FOLDER REPO_ID`
    parser.add_argument("adapter", nargs="?", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("repo_id", nargs="?", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model_name_or_path", type=Path, default=None,
                        help="the adapter folder save_pretrained (or the trainer) wrote (required)")
    parser.add_argument("--hub_model_id", default=None,
                        help="'namespace/name', or 'name' for your own namespace (required)")
    parser.add_argument("--base_model_id", default=None,
                        help="the Hub id of the adapter's base (e.g. Qwen/Qwen2.5-0.5B-Instruct), written into the "
                        "pushed config.json and card; required when the adapter names a local base folder")
    parser.add_argument("--hub_private_repo", action="store_true", help="create the repo private (ignored if it exists)")
    parser.add_argument("--hub_token", default=None, help="default: HF_TOKEN, else the token `hf auth login` stored")
    parser.add_argument("--hub_revision", default=None, help="branch to commit to (created from main if missing)")
    parser.add_argument("--commit_message", default=None)
    parser.add_argument("--create_pr", action="store_true", help="open a pull request against main instead")
    return parser


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    for old, new in (("adapter", "model_name_or_path"), ("repo_id", "hub_model_id")):
        given, positional = getattr(args, new), getattr(args, old)
        if given is not None and positional is not None:
            parser.error(f"--{new} is given twice ({str(positional)!r} and {str(given)!r}): give --{new} alone")
        setattr(args, new, given if given is not None else positional)
        delattr(args, old)
        if getattr(args, new) is None:
            parser.error(f"the following arguments are required: --{new}")
    args.prog = parser.prog
    return args


def main(argv: list[str] | None = None, prog: str | None = None):
    return run(parse_args(argv, prog))


def run(args: argparse.Namespace):
    """Check the folder and the push, then upload (what `main` does once the flags are read)."""
    folder = args.model_name_or_path
    try:
        token = check_push(args.hub_model_id, token=args.hub_token, revision=args.hub_revision,
                           create_pr=args.create_pr)
        files = adapter_files(folder)
        config = json.loads((folder / "config.json").read_text())
        check_base_for_push(config.get("base_model_name_or_path"), args.base_model_id, via="cli")
    except ValueError as err:  # as argparse reports a bad argument
        sys.stderr.write(f"{args.prog}: error: {err}\n")
        raise SystemExit(2) from None
    left_out = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                      if p.is_file() and p.relative_to(folder).as_posix() not in files)
    if left_out:
        print(f"not part of the adapter, left out: {', '.join(left_out)}", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / folder.resolve().name
        link_files(folder, files, staged)
        if CARD_NAME not in files:  # an adapter saved before cards existed: render one from the folder itself
            card = render_model_card(staged, config, model_id=args.hub_model_id)
            (staged / CARD_NAME).write_text(card, encoding="utf-8")
        commit = upload_adapter_folder(staged, args.hub_model_id, token=token, private=args.hub_private_repo or None,
                                       revision=args.hub_revision, commit_message=args.commit_message,
                                       create_pr=args.create_pr, base_model_id=args.base_model_id, via="cli")
    print(f"pushed {folder} to {commit.pr_url or commit.commit_url}")
    return commit


if __name__ == "__main__":
    main()
