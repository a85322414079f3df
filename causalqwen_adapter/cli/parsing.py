"""What every subcommand's parser shares: one vocabulary of flags (TRL's and TrainingArguments' names), the old
spellings accepted but hidden, close matches for a misspelt flag, a `--help` whose head is the subcommand's own
options, and the install line of a missing extra."""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import sys
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path

from transformers import HfArgumentParser

# The optional dependencies of pyproject.toml, by extra: what a subcommand names when one of them is missing
EXTRAS = {
    "train": ("trl", "datasets", "peft", "accelerate"),
    "plots": ("matplotlib",),
    "demo": ("gguf",),
}
# distribution name -> import name, where they differ
IMPORT_NAMES = {"liger-kernel": "liger_kernel"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its example keeps its line breaks), each option with its default."""


def install_hint(extra: str) -> str:
    """The install line that works for `extra`: the packages themselves, or the extra from a clone (no package index
    serves causalqwen-adapter)."""
    return (f'pip install {" ".join(EXTRAS[extra])}  (the [{extra}] extra; from a clone of causalqwen-adapter: '
            f'pip install ".[{extra}]")')


def missing_modules(modules: Iterable[str]) -> list[str]:
    """The modules of `modules` that cannot be imported (None in sys.modules counts as missing, as `import` does)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent missing, or a module whose __spec__ is None
            found = False
        if not found or (name in sys.modules and sys.modules[name] is None):
            missing.append(name)
    return missing


def require(command: str, modules: Iterable[str], extra: str) -> None:
    """Exit with the install line when one of `modules` (of the extra `extra`) is missing; before any import."""
    missing = missing_modules(modules)
    if missing:
        sys.exit(f"causalqwen {command} needs {', '.join(missing)}, not installed here. Install the [{extra}] "
                 f"extra: {install_hint(extra)}")


def close_matches(parser: argparse.ArgumentParser, flag: str) -> list[str]:
    """The parser's shown flags closest to `flag` (`--modle_name_or_path` -> `--model_name_or_path`)."""
    name = flag.split("=", 1)[0]
    shown = {option for action in parser._actions if action.help is not argparse.SUPPRESS
             for option in action.option_strings if option.startswith("--")}
    # HfArgumentParser lists `--dashed-names` beside `--underscored_names`: suggest the one spelling
    shown = sorted(o for o in shown if "--" + o[2:].replace("-", "_") not in shown or "-" not in o[2:])
    return difflib.get_close_matches(name, shown, n=3, cutoff=0.6)


@contextmanager
def usage_errors(parser: argparse.ArgumentParser):
    """A ValueError or OSError raised while the arguments are read or checked, before any work (a dataclass's own
    checks: --deepspeed, a number out of range; a file the flags name): argparse's usage, `prog: error: message` and
    exit 2, as for a misspelt flag, never a traceback."""
    try:
        yield
    except (ValueError, OSError) as err:
        parser.error(str(err))


def check_output_folder(output_dir: str, outputs: Sequence[str], overwrite: bool) -> None:
    """Refuse, before any work, an --output_dir that is a file, or one holding an earlier run's ``outputs`` unless
    --overwrite: a command's results never silently replace another's."""
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"output_dir {str(folder)!r} is a file, not a folder: choose another --output_dir")
    found = [name for name in outputs if (folder / name).exists()]
    if found and not overwrite:
        raise FileExistsError(f"{folder} already holds {', '.join(found)} (an earlier run's?): pass overwrite=True "
                              "(--overwrite) to replace them, or choose another folder")


class SuggestingParser:
    """Mixin for an ArgumentParser: 'unrecognized arguments' says which flags were probably meant (argparse in
    Python 3.11 suggests none), and old spellings (`aliases`, and `--dashed-names` of `--underscored_names`) are
    read as the current ones without being listed in --help."""

    aliases: dict[str, str] = {}

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            hints = []
            for token in message.removeprefix("unrecognized arguments: ").split():
                if token.startswith("-") and (matches := close_matches(self, token)):
                    hints.append(f"{token.split('=', 1)[0]}: did you mean {' or '.join(matches)}?")
            if hints:
                message += "\n  " + "\n  ".join(hints)
            message += f"\n  ({self.prog} --help lists every option)"
        super().error(message)

    extra_flags: tuple[str, ...] = ()  # flags read before argparse sees the arguments (TrlParser's --config)

    def canonical_args(self, args: Sequence[str] | None) -> list[str]:
        """`args` (default sys.argv[1:]) with every old spelling replaced by the current one, `--old=value` too;
        an unknown flag is an error at once (argparse would first complain of a required flag it hides)."""
        args = list(sys.argv[1:] if args is None else args)
        known = self._option_string_actions
        out, unknown = [], []
        for i, token in enumerate(args):
            if token == "--":  # what follows is positional
                out += args[i:]
                break
            if token.startswith("--"):
                name, eq, value = token.partition("=")
                new = self.aliases.get(name)
                if new is None and name not in known and "-" in name[2:]:
                    underscored = "--" + name[2:].replace("-", "_")
                    new = underscored if underscored in known else None
                token = (new or name) + eq + value
            out.append(token)
            # argparse's own reading of a flag: None for a value, (None, ...) for an unknown flag (prefixes resolved)
            if token.startswith("-") and token.split("=", 1)[0] not in self.extra_flags:
                parsed = self._parse_optional(token)
                if parsed is not None and parsed[0] is None:
                    unknown.append(token)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return out


class CliArgumentParser(SuggestingParser, argparse.ArgumentParser):
    """argparse for the subcommands whose flags are not dataclass fields (generate, push, prepare-base)."""

    def __init__(self, *args, aliases: dict[str, str] | None = None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.aliases = dict(aliases or {})

    def parse_args(self, args=None, namespace=None):
        return super().parse_args(self.canonical_args(args), namespace)


class CliHfArgumentParser(SuggestingParser, HfArgumentParser):
    """HfArgumentParser whose unknown flags are an argparse error with close matches, not a ValueError traceback."""

    def __init__(self, dataclass_types, *, aliases: dict[str, str] | None = None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(dataclass_types, **kwargs)
        self.aliases = dict(aliases or {})

    def parse(self, args: Sequence[str] | None = None) -> tuple:
        with usage_errors(self):  # the dataclasses' own checks of their values
            *outputs, remaining = self.parse_args_into_dataclasses(
                self.canonical_args(args), return_remaining_strings=True, look_for_args_file=False)
        if remaining:
            self.error(f"unrecognized arguments: {' '.join(remaining)}")
        return tuple(outputs)


def lead_with(parser: argparse.ArgumentParser, groups: Sequence[tuple[str, Iterable[str]]], rest: str) -> None:
    """Move the options whose dests are listed into titled groups shown first in --help, in this order, and title
    the options left `rest` (a dataclass parser lists fields in declaration order, which puts a subclass's own
    options after its parent's hundreds)."""
    new_groups = []
    for title, dests in groups:
        group = parser.add_argument_group(title)
        parser._action_groups.remove(group)
        for dest in dests:
            for old in parser._action_groups:
                for action in [a for a in old._group_actions if a.dest == dest]:
                    old._group_actions.remove(action)
                    group._group_actions.append(action)
        new_groups.append(group)
    parser._optionals.title = rest
    parser._action_groups[1:1] = new_groups  # after the positionals, before the rest
