"""The adapter folder on disk (docs/design.md, The adapter folder): the names a save writes, the checks of what a
folder holds (tensor names and shapes against its config, finite values, a folder that is not ours), and the atomic
install of a saved folder.

Shipped as remote code: imports only the standard library, torch, transformers, safetensors and huggingface_hub.
"""

import errno
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import GENERATION_CONFIG_NAME

from .configuration_causalqwen import CausalQwenConfig
from .model_card import CARD_NAME
from .tokenization_causalqwen import TOKENIZER_CONFIG_NAME, is_adapter_tokenizer_config

ADAPTER_WEIGHTS_NAME = "model.safetensors"
LORA_FOLDER = "lora"
LORA_WEIGHTS_NAME = "adapter_model.safetensors"  # PEFT's, inside lora/
BASE_PREFIXES = ("model.", "lm_head.")  # base tensors: never in an adapter


def check_keys(found: set, expected: set, where) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ValueError(
            f"{where} does not hold the adapter tensors this config describes: missing {missing}, unexpected "
            f"{unexpected}. An adapter stores only head tensors; check learnable_threshold/causal_size in config.json."
        )

def check_weights_header(weights_file: str, config, model_class) -> None:
    """The adapter file can be read and its header holds the tensors, with the shapes, that `config` describes:
    checked on shapes alone (a model on the meta device, the file's header), so a config.json that does not belong
    to the weights (a causal_size of 2**34) is refused before gigabytes are allocated or the base is loaded."""
    if not os.access(weights_file, os.R_OK):
        raise PermissionError(
            f"cannot read adapter weights {weights_file}: permission denied (mode {os.stat(weights_file).st_mode & 0o777:o}, "
            f"owner uid {os.stat(weights_file).st_uid}). Ask its owner to make it readable (chmod a+r), or load a copy."
        )
    try:
        with safe_open(weights_file, framework="pt") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise OSError(f"cannot read adapter weights {weights_file}: {err}. The file is corrupt; save the adapter "
                      "again.") from err
    expected = model_class.adapter_tensor_shapes(config)
    check_keys(set(found), set(expected), weights_file)
    wrong = {k: (found[k], expected[k]) for k in expected if found[k] != expected[k]}
    if wrong:
        key, (have, want) = next(iter(sorted(wrong.items())))
        raise ValueError(f"{weights_file}: {key} has shape {have} but config.json expects {want} (causal_size "
                         f"{config.causal_size}, vocabulary {config.text_config.vocab_size}): the adapter and its "
                         "config.json do not belong together. Save the adapter again.")


def non_finite_tensors(path) -> list[str]:
    """The names of the tensors of a safetensors file that hold NaN or ±inf (read one at a time)."""
    with safe_open(str(path), framework="pt") as f:
        return sorted(k for k in f.keys() if not all_finite(f.get_tensor(k)))

def install_folder(staging: Path, target: Path) -> None:
    """Move a fully written staging folder into place (see save_pretrained for the guarantees).

    Into an existing folder, each file it replaces is first moved aside (into a hidden `.old` folder where the staging
    folder is: beside the target or inside it, `staging_place`), `config.json` first (until the new one is in, the
    folder refuses to load) and last back in; if a move fails, everything is moved back as it was.
    """
    give_plain_modes(staging)
    if not target.exists():
        os.rename(staging, target)
        return
    # a stale backbone LoRA must not be re-applied to these heads
    swap_entries(staging, target, "config.json", [] if (staging / LORA_FOLDER).exists() else [LORA_FOLDER])


def swap_entries(staging: Path, target: Path, marker: str, out, aside_in: Path | None = None) -> None:
    """Move the entries of `staging` into the existing folder `target`, each one it replaces and each name of `out`
    first set aside in a hidden `.NAME.XXXXXXXX.old` folder in `aside_in` (default: where `staging` is); `marker`,
    the file without which the folder refuses to load, goes aside first and comes in last. A failure moves everything
    back; the set-aside folder is removed once the swap is over."""
    aside_in = staging.parent if aside_in is None else aside_in
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=aside_in))
    done: list[tuple[Path, Path | None]] = []  # (target entry, where its old version went)

    def put_aside(dest: Path) -> None:
        if dest.exists() or dest.is_symlink():
            os.replace(dest, aside / dest.name)
            done.append((dest, aside / dest.name))

    try:
        put_aside(target / marker)
        for name in out:
            if name != marker and not (staging / name).exists():
                put_aside(target / name)
        for item in sorted(staging.iterdir(), key=lambda p: p.name == marker):  # the marker last
            dest = target / item.name
            if item.name != marker:
                put_aside(dest)
            done.append((dest, None))
            os.replace(item, dest)
    except BaseException:
        for dest, old in reversed(done):  # undo: the new entries out, the old ones back
            if old is None and (dest.exists() or dest.is_symlink()):
                shutil.rmtree(dest) if dest.is_dir() and not dest.is_symlink() else dest.unlink()
            elif old is not None:
                os.replace(old, dest)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def replace_folder(new: Path, target: Path, marker: str) -> None:
    """Put the complete folder `new`, made inside a staging folder of `make_staging(target, ...)`, in place of
    `target` (an old one is removed only once the new one is whole), then remove what saves killed midway left beside
    it or inside it (`stale_save_folders`).

    Staged beside `target`: the old folder renamed aside, the new one renamed in. Staged inside it (its parent could
    not take the staging folder: `staging_place`): the entries swapped (`swap_entries`), `marker` out first and in
    last, so an interrupted swap leaves a folder without its marker."""
    target = Path(os.path.abspath(target))
    if target.exists() and new.parent.parent == target:
        ours = {p.name for p in stale_save_folders(target)}
        swap_entries(new, target, marker, [p.name for p in target.iterdir() if p.name not in ours], aside_in=target)
    elif target.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.rename(target, aside / target.name)
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(aside / target.name, target)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(new, target)
    for stale in stale_save_folders(target):
        shutil.rmtree(stale, ignore_errors=True)

def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)  # entries are added to a folder through both bits


def _uids(folder: Path) -> str:
    me = os.getuid() if hasattr(os, "getuid") else "?"
    return f"owner uid {folder.stat().st_uid}, this process runs as uid {me}"


def check_can_write(target: Path, what: str) -> None:
    """Refuse, before any work, a `target` this process cannot save `what` into, naming the folder at fault and what
    to do: an existing folder it cannot write, or, for a folder still to be created, the nearest existing folder
    above it (where it would be created) when that one cannot be written or is a file."""
    target = Path(os.path.abspath(target))
    if target.is_dir():
        if not _writable(target):
            raise PermissionError(
                f"cannot save {what} to {target}: this folder is not writable ({_uids(target)}; a read-only "
                "filesystem reads the same). Choose a folder you can write to, or have its owner make it writable "
                "(chmod u+w)."
            )
        return
    above = target.parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise NotADirectoryError(f"cannot save {what} to {target}: {above} is a file, so no folder can be created "
                                 "under it. Choose another folder.")
    if not _writable(above):
        raise PermissionError(
            f"cannot save {what} to {target}: it does not exist and {above}, where it would be created, is not "
            f"writable ({_uids(above)}). Create {target} writable for this user first, or choose a folder you can "
            "write to."
        )


def staging_place(target: Path) -> Path:
    """Where a save into `target` creates its hidden staging folders: beside it (a new folder appears by one
    rename), or inside the existing folder itself where its parent cannot take them: the parent is not writable
    (a user's folder inside a root-owned one), is on another filesystem than the folder (a symbolic link to another
    disk), or the folder is a mount point (a container's volume); a rename across those fails (EACCES, EXDEV,
    EBUSY). Decided up front, so a save never fails halfway for it."""
    parent = target.parent
    if not target.exists():
        return parent
    resolved = os.path.realpath(target)
    if not _writable(parent) or os.path.ismount(resolved) or not same_filesystem(parent, resolved):
        return target
    return parent


def same_filesystem(a, b) -> bool:
    """Whether two existing paths are on one filesystem (a rename between them can succeed)."""
    return os.stat(a).st_dev == os.stat(b).st_dev


def make_staging(target: Path, what: str) -> Path:
    """A new hidden `.NAME.XXXXXXXX.tmp` staging folder for a save of `what` into `target` (its parents created), in
    `staging_place(target)`; a target that cannot be written is refused first (`check_can_write`)."""
    check_can_write(target, what)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=staging_place(target)))


def save_failed(err: OSError, target: Path, what: str) -> OSError:
    """The error of a save of `what` into `target` that failed writing or moving files: it names the target and the
    cause, never only a hidden staging path (that one follows, as where it happened)."""
    where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
    advice = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space within your disk quota"}.get(
        err.errno, "fix the cause")
    message = (f"could not save {what} to {target}: {err.strerror or err}{f' (at {where})' if where else ''}. "
               f"{target} was left as it was: {advice} and save again.")
    return OSError(err.errno, message) if err.errno is not None else OSError(message)


@contextmanager
def staged_save(target: Path, what: str):
    """A staging folder (`make_staging`) for a save into `target`, removed at the end, however it ends; a file error
    while it is written or installed is raised naming `target` (`save_failed`)."""
    staging = make_staging(target, what)
    try:
        yield staging
    except OSError as err:
        raise save_failed(err, target, what) from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def give_plain_modes(folder: Path) -> None:
    """Give a folder we wrote through a staging copy, and everything in it, the modes a plain `mkdir` and `open()`
    would have: `tempfile.mkdtemp` makes its folder 0700 and safetensors (0.8) writes its files 0600, which would hide
    the weights of a folder that looks readable from every other user (a serving process, a container's user)."""
    mask = _umask()
    for path in (folder, *folder.rglob("*")):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def adapter_file_names() -> set[str]:
    """The names a save writes at the top of an adapter folder (docs/design.md, The adapter folder), but for
    `tokenizer_config.json`, which it writes only where no tokenizer of the user's is (`keeps_tokenizer_config`)."""
    modeling = Path(__file__).with_name("modeling_causalqwen.py")
    code = {Path(f).name for f in [modeling, *get_relative_import_files(modeling)]}
    return {"config.json", ADAPTER_WEIGHTS_NAME, GENERATION_CONFIG_NAME, CARD_NAME, LORA_FOLDER, *code}


def keeps_tokenizer_config(target: Path) -> bool:
    """Whether `target` holds a `tokenizer_config.json` that an adapter save did not write (a tokenizer the user
    saved there): the save leaves it, and AutoTokenizer reads that tokenizer instead of the base's."""
    path = target / TOKENIZER_CONFIG_NAME
    return (path.exists() or path.is_symlink()) and not is_adapter_tokenizer_config(path)


def stale_save_folders(target: Path) -> list[Path]:
    """The hidden folders saves into `target` create beside it, or inside it where its parent cannot take them
    (`staging_place`), named as `tempfile.mkdtemp` names them: `.NAME.XXXXXXXX.tmp` (a save's new files) and
    `.NAME.XXXXXXXX.old` (the files a swap moved out), oldest first. A save removes its own; any left were left by a
    process killed while saving."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.[a-z0-9_]{{8}}\.(tmp|old)")
    found = []
    for place in (target.parent, target):
        try:
            found += [p for p in place.iterdir() if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
        except OSError:  # missing, not a folder, or not readable: nothing of ours can be found there
            pass
    return sorted(found, key=lambda p: p.stat().st_mtime)


def interrupted_swap(target: Path) -> Path | None:
    """The hidden folder (beside `target` or inside it) holding the previous adapter's `config.json` when a save into
    `target` was killed while swapping files in (config.json goes aside first and comes back last), else None."""
    if (target / "config.json").exists():
        return None
    asides = [p for p in stale_save_folders(target) if p.suffix == ".old" and _is_adapter_config(p / "config.json")]
    return asides[-1] if asides else None


def is_adapter_folder(target: Path) -> bool:
    """Whether saves of ours wrote `target`: it holds a CausalQwen config.json, or a save into it was interrupted."""
    return _is_adapter_config(target / "config.json") or interrupted_swap(target) is not None


def _is_adapter_config(path: Path) -> bool:
    return _model_type(path) == CausalQwenConfig.model_type


def _model_type(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "unreadable"


def check_not_foreign(target: Path, other_names: tuple[str, ...] = ()) -> None:
    """Never write over a file that is not ours: a base checkpoint, a dataset, another model, a user's own files.

    A folder saves of ours wrote (`is_adapter_folder`) is the adapter's: a save replaces its adapter files. In any
    other folder a save only adds files: one of the names it writes (`adapter_file_names()` and `other_names`, the
    trainer's `training_args.bin`) already there is refused, naming them.
    """
    config = target / "config.json"
    if config.is_file() and (model_type := _model_type(config)) != CausalQwenConfig.model_type:
        raise FileExistsError(
            f"{target} holds a {model_type!r} checkpoint (its config.json), not a CausalQwen adapter: saving here "
            "would replace its files. Save the adapter to a folder of its own."
        )
    weights = target / ADAPTER_WEIGHTS_NAME
    if weights.is_file() and not config.is_file():
        try:
            with safe_open(weights, "pt") as f:
                foreign = [k for k in f.keys() if k.startswith(BASE_PREFIXES)]
        except Exception:  # unreadable: not ours to overwrite either
            foreign = ["(unreadable)"]
        if foreign:
            raise FileExistsError(
                f"{weights} holds model weights that are not an adapter's ({foreign[0]}, ...): saving here would "
                "replace them. Save the adapter to a folder of its own."
            )
    if is_adapter_folder(target):
        return
    clash = sorted(n for n in adapter_file_names() | set(other_names) if (target / n).exists() or (target / n).is_symlink())
    if clash:
        raise FileExistsError(
            f"{target} is not an adapter folder (it has no CausalQwen config.json) and holds {clash}: a save would "
            "replace them, and they were not written by a save of this adapter. Move them out of the folder, or "
            "save the adapter to a folder of its own."
        )

def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or ±inf in a tensor, in one pass and no allocation: min and max propagate NaN, and an infinity is one
    of them (`isfinite(...).all()` would build a boolean copy, 136 MiB for a bf16 W_A, and take 40× longer).

    bfloat16 is first summed: NaN and ±inf propagate through a sum too (inf − inf is NaN), so a finite sum proves every
    value finite, and it reads a bf16 tensor in 0.6× the time of min and max (whose per-element conversion costs more
    than the read). A sum that is not finite (finite values can overflow it only near 3.4e38) is settled by min and
    max."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.dtype == torch.bfloat16 and torch.isfinite(tensor.sum()):
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))
