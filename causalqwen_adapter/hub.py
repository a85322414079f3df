"""Sharing an adapter on the Hugging Face Hub: the checks before a push and the upload itself.

Installed package only: the adapter folder's remote code carries no upload code, and a remote-code model's
`push_to_hub` asks for this package (adapter_io.py). `causalqwen push` (cli/push.py) uses the same functions for a folder.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import RevisionNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.utils import logging

from .adapter_io import LORA_FOLDER, adapter_file_names, keeps_tokenizer_config
from .model_card import CARD_NAME, card_with_base, is_hub_id, retarget_model_card
from .tokenization_causalqwen import TOKENIZER_CONFIG_NAME, is_adapter_tokenizer_config

logger = logging.get_logger(__name__)

DEFAULT_COMMIT_MESSAGE = "Upload CausalQwen adapter"


def check_push(repo_id: str, *, token=None, revision: str | None = None, create_pr: bool = False) -> str:
    """Validate a push before anything is written or sent; returns the token to use.

    The token is the one passed, else `HF_TOKEN`, else the one `hf auth login` stored.
    """
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(
            f"{repo_id!r} is not a valid Hub repo id: use 'name' or 'namespace/name' (letters, digits, '-', '_', '.'), "
            f"e.g. 'your-username/my-causal-adapter'. ({err})"
        ) from None
    if token is None or token is True:
        token = get_token()
    if not token:
        raise ValueError(
            f"no Hugging Face token to push {repo_id!r} with: pass token=..., set HF_TOKEN, or run `hf auth login`. "
            "Nothing was uploaded."
        )
    if create_pr and revision not in (None, "main"):
        raise ValueError(
            f"create_pr=True opens the pull request against main; drop revision={revision!r} (huggingface_hub's "
            "upload_folder does not open pull requests against other branches)"
        )
    return token


# The remote-code modules adapters of this package have shipped, from the first release on (the `modeling_causalqwen`
# import closure of every version; `cpu_kernel` compiled C and is gone). A push deletes those of an earlier push that
# the new adapter lacks, and never another `.py` file: a repo's `handler.py` or `scripts/` are its owner's.
REMOTE_CODE_MODULES = ("adapter_folder", "adapter_io", "base_loading", "candidate_loss", "cauchy",
                       "configuration_causalqwen", "cpu_kernel", "dispatch", "generation", "heads", "lm_loss", "losses",
                       "model_card", "modeling_causalqwen", "numeric", "sharding", "tokenization_causalqwen")
# Remote files of an earlier push that go when the new adapter lacks them (patterns of huggingface_hub's
# `upload_folder(delete_patterns=...)`, matched against whole repo paths with fnmatch: none reaches into a folder
# but lora/, so a trainer's `last-checkpoint/` keeps its files).
STALE_FILE_PATTERNS = [f"{LORA_FOLDER}/*", *(f"{name}.py" for name in REMOTE_CODE_MODULES)]


BASE_FLAGS = {  # how each way of pushing takes the base's Hub id, for the refusal to name
    "model": 'model.push_to_hub(repo_id, base_model_id="Qwen/Qwen2.5-0.5B-Instruct")',
    "trainer": '--hub_base_model_id Qwen/Qwen2.5-0.5B-Instruct (CausalSFTConfig(hub_base_model_id=...))',
    "cli": "causalqwen push --model_name_or_path ADAPTER_FOLDER --hub_model_id REPO_ID --base_model_id "
           "Qwen/Qwen2.5-0.5B-Instruct",
}


def check_base_for_push(base_name: str | None, base_model_id: str | None, *, via: str = "model") -> str | None:
    """The base id a push writes into the uploaded config and card: `base_model_id` when given (a Hub id), None to
    keep the adapter's own (already a Hub id). An adapter naming a local folder is refused: nobody else can load it.
    Raises ValueError, before anything is written or sent."""
    if base_model_id is not None:
        if not is_hub_id(base_model_id):
            where = "a folder on this machine" if os.path.exists(str(base_model_id)) else "not a valid Hub repo id"
            raise ValueError(f"base_model_id={base_model_id!r} is {where}: pass the Hub id of the base the adapter "
                             "was trained on, e.g. 'Qwen/Qwen2.5-0.5B-Instruct'. Nothing was uploaded.")
        return None if base_model_id == base_name else base_model_id
    if is_hub_id(base_name):
        return None
    raise ValueError(
        f"the adapter's base {base_name!r} is a folder on this machine: an adapter pushed as is names it, and nobody "
        f"else can load it. Pass the Hub id of that base, which the pushed config.json and model card will name "
        f"instead: {BASE_FLAGS[via]}. Nothing was uploaded."
    )


def point_at_hub_base(folder, base_model_id: str) -> None:
    """In a folder about to be uploaded, name the base by its Hub id: `config.json`'s `base_model_name_or_path`
    (the local folder's revision dropped) and the card's metadata, text and load note. The files are replaced, not
    written into: a snapshot's files are hard links to `output_dir`'s, which keeps naming the local base."""
    folder = Path(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    old = config.get("base_model_name_or_path") or ""
    config["base_model_name_or_path"] = base_model_id
    if not is_hub_id(old) and config.get("base_model_revision") is not None:
        config["base_model_revision"] = None  # a local folder's has no meaning on the Hub
    _replace_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    card = folder / CARD_NAME
    if card.is_file():
        _replace_text(card, card_with_base(card.read_text(encoding="utf-8"), old, base_model_id))


def _replace_text(path: Path, text: str) -> None:
    fresh = path.with_name(f".{path.name}.new")
    fresh.write_text(text, encoding="utf-8")
    os.replace(fresh, path)


def upload_adapter_folder(folder, repo_id: str, *, token: str, private=None, revision=None, commit_message=None,
                          create_pr: bool = False, base_model_id: str | None = None, via: str = "model"):
    """Create the repo if needed and upload `folder` (a disposable copy: its card is retargeted) in one commit.

    The same commit deletes what an earlier push left that this adapter does not have: a `lora/` folder (the loader
    would apply a stale backbone LoRA to these heads) and the remote-code modules of earlier versions
    (`STALE_FILE_PATTERNS`). Other files in the repo (a tokenizer, results, code of the owner's) are kept: a
    `tokenizer_config.json` of the repo's own is not replaced by the adapter's (which only points AutoTokenizer at
    the base's tokenizer); an earlier push's pointer goes when this folder has none. Returns huggingface_hub's
    `CommitInfo`. Run `check_push` first. The base is named by its Hub id (`check_base_for_push`: `base_model_id`,
    or the adapter's own; a local base is refused before any request).
    """
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    new_base = check_base_for_push(config.get("base_model_name_or_path"), base_model_id, via=via)
    if new_base is not None:
        point_at_hub_base(folder, new_base)
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id  # "name" → "user/name"
    card = folder / CARD_NAME
    if card.is_file():
        card.write_text(retarget_model_card(card.read_text(encoding="utf-8"), repo_id), encoding="utf-8")
    if revision is not None and not create_pr and not revision.startswith("refs/pr/"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    pointer, delete, ignore = folder / TOKENIZER_CONFIG_NAME, list(STALE_FILE_PATTERNS), []
    remote = remote_tokenizer_config(api, repo_id, revision)
    if remote == "own" and is_adapter_tokenizer_config(pointer):
        ignore.append(TOKENIZER_CONFIG_NAME)  # the repo's tokenizer stays the one AutoTokenizer reads
    elif remote == "adapter" and not pointer.exists():
        delete.append(TOKENIZER_CONFIG_NAME)  # an earlier push's pointer, to a module this push removes
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        revision=revision,
        commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
        create_pr=create_pr,
        ignore_patterns=ignore or None,
        delete_patterns=delete,  # files this folder uploads are overwritten, never deleted
    )


SNAPSHOT_PREFIX = "_hub_push."  # a Trainer's upload of output_dir skips `_*`
_LIVE_SNAPSHOTS: set[Path] = set()  # this process's snapshots still being uploaded
# The files of a tokenizer saved by its owner into an adapter folder (`keeps_tokenizer_config`): AutoTokenizer reads
# that tokenizer from the repo instead of the base's, so a push uploads them with the adapter.
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt",
                        "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def _link_error(path: Path, folder: Path) -> ValueError:
    return ValueError(
        f"{path} is a symbolic link: a push uploads only the regular files a save wrote into {folder}, never what a "
        "link points to (it could be anything on this machine). Replace the link with the file it stands for, or "
        "remove it, and push again. Nothing was uploaded."
    )


def _files_under(folder: Path, item: Path, *, links: str) -> list[str]:
    """The regular files at or under `item` (relative to `folder`), never following a link: one is refused
    (`links="refuse"`, a ValueError) or left out with a warning (`links="skip"`)."""
    found = []
    for path in [item] if not item.is_dir() or item.is_symlink() else sorted(item.rglob("*")):
        if path.is_symlink():  # rglob never descends through a linked folder; the link itself is listed here
            if links == "refuse":
                raise _link_error(path, folder)
            logger.warning(f"{path} is a symbolic link: not uploaded (a push uploads only regular files)")
        elif path.is_file():
            found.append(path.relative_to(folder).as_posix())
    return found


def adapter_upload_files(folder) -> list[str]:
    """What a push uploads of an adapter folder (relative paths): the files a save writes (`adapter_file_names`:
    config, weights, generation config, card, remote code, `lora/`), the tokenizer pointer, and the tokenizer of the
    user's own where the folder keeps one. Nothing else: a trainer's `training_args.bin` and logs, a hidden `.env`,
    the user's other files stay local. A symbolic link among them is refused (ValueError) before anything is sent."""
    folder = Path(folder)
    names = adapter_file_names() | {TOKENIZER_CONFIG_NAME}
    if keeps_tokenizer_config(folder):
        names |= set(TOKENIZER_FILE_NAMES)
    files = []
    for name in sorted(names):
        item = folder / name
        if item.is_symlink() or item.exists():
            files += _files_under(folder, item, links="refuse")
    return files


def checkpoint_upload_files(checkpoint) -> list[str]:
    """What a push uploads of a Trainer checkpoint (`hub_strategy` checkpoint or all_checkpoints): its regular files,
    a symbolic link left out (a save never writes one)."""
    checkpoint = Path(checkpoint)
    return _files_under(checkpoint, checkpoint, links="skip")


def link_files(folder: Path, files, into: Path) -> None:
    """Lay `files` (paths relative to `folder`) out in `into`: hard links where the filesystem allows (a later save
    swaps new files in under the names, never into these), copies elsewhere and for the card, which an upload
    rewrites."""
    for name in files:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name == CARD_NAME:
            shutil.copyfile(folder / name, target, follow_symlinks=False)
            continue
        try:
            os.link(folder / name, target, follow_symlinks=False)
        except OSError:
            shutil.copyfile(folder / name, target, follow_symlinks=False)


def snapshot_for_upload(folder, files=None, *, into=None) -> Path:
    """`files` of `folder` (default: `adapter_upload_files(folder)`), laid out by `link_files` in a new
    `_hub_push.XXXXXXXX` folder inside `into` (default: `folder`). A background upload reads the snapshot while
    training goes on saving into the folder: huggingface_hub lists a folder it uploads whole, and a folder a save
    creates or rotation deletes meanwhile fails that listing (a rotated checkpoint's files live on in their hard
    links). Snapshots a killed process left there (none of this process's uploads) are removed first."""
    folder = Path(folder)
    into = Path(into) if into is not None else folder
    files = adapter_upload_files(folder) if files is None else files
    for stale in into.glob(f"{SNAPSHOT_PREFIX}*"):
        if stale.is_dir() and not stale.is_symlink() and stale.resolve() not in _LIVE_SNAPSHOTS:
            shutil.rmtree(stale, ignore_errors=True)
    snapshot = Path(tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX, dir=into)).resolve()
    _LIVE_SNAPSHOTS.add(snapshot)
    try:
        link_files(folder, files, snapshot)
        return snapshot
    except BaseException:
        _LIVE_SNAPSHOTS.discard(snapshot)
        shutil.rmtree(snapshot, ignore_errors=True)
        raise


def upload_snapshot(snapshot: Path, repo_id: str, *, path_in_repo: str | None = None, **kwargs):
    """`upload_adapter_folder` of a `snapshot_for_upload` (with `path_in_repo`, huggingface_hub's `upload_folder` of
    a checkpoint's snapshot into that folder of the repo), which it removes once the upload ends, however it ends."""
    try:
        if path_in_repo is None:
            return upload_adapter_folder(snapshot, repo_id, **kwargs)
        return HfApi(token=kwargs.pop("token")).upload_folder(repo_id=repo_id, folder_path=snapshot,
                                                              path_in_repo=path_in_repo, **kwargs)
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)
        _LIVE_SNAPSHOTS.discard(Path(snapshot).resolve())


def remote_tokenizer_config(api: HfApi, repo_id: str, revision: str | None) -> str:
    """What `tokenizer_config.json` the repo holds at `revision` (its default branch when None): "none", "adapter"
    (the pointer an adapter save writes) or "own" (a tokenizer its owner uploaded)."""
    try:
        if TOKENIZER_CONFIG_NAME not in api.list_repo_files(repo_id, revision=revision):
            return "none"
    except RevisionNotFoundError:  # a new branch or an empty repo: nothing there yet
        return "none"
    with tempfile.TemporaryDirectory() as tmp:
        path = api.hf_hub_download(repo_id, TOKENIZER_CONFIG_NAME, revision=revision, local_dir=tmp)
        return "adapter" if is_adapter_tokenizer_config(Path(path)) else "own"


def push_adapter(model, repo_id: str, *, private=None, token=None, revision=None, commit_message=None,
                 create_pr: bool = False, base_model_id: str | None = None):
    """`model.push_to_hub`: saves the adapter into a temporary folder and uploads that folder in one commit (see
    `CausalAdapterMixin.push_to_hub`)."""
    token = check_push(repo_id, token=token, revision=revision, create_pr=create_pr)
    check_base_for_push(model.config.base_model_name_or_path, base_model_id)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / repo_id.split("/")[-1]  # the card names the folder; the upload retargets it
        model.save_pretrained(folder)
        return upload_adapter_folder(folder, repo_id, token=token, private=private, revision=revision,
                                     commit_message=commit_message, create_pr=create_pr, base_model_id=base_model_id)


__all__ = ["REMOTE_CODE_MODULES", "adapter_upload_files", "check_base_for_push", "check_push", "checkpoint_upload_files", "is_hub_id",
           "link_files", "point_at_hub_base", "push_adapter", "remote_tokenizer_config", "snapshot_for_upload", "upload_adapter_folder", "upload_snapshot"]
