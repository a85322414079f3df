"""Sharing an adapter on the Hugging Face Hub: the checks before a push and the upload itself.

Installed package only: the adapter folder's remote code carries no upload code, and a remote-code model's
`push_to_hub` asks for this package (adapter_io.py). `recipes/push_to_hub.py` uses the same functions for a folder.
"""

import os
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import RevisionNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .adapter_io import LORA_FOLDER
from .model_card import CARD_NAME, retarget_model_card
from .tokenization_causalqwen import TOKENIZER_CONFIG_NAME, is_adapter_tokenizer_config

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
REMOTE_CODE_MODULES = ("adapter_io", "candidate_loss", "cauchy", "configuration_causalqwen", "cpu_kernel", "dispatch",
                       "generation", "heads", "lm_loss", "losses", "model_card", "modeling_causalqwen", "numeric",
                       "sharding", "tokenization_causalqwen")
# Remote files of an earlier push that go when the new adapter lacks them (patterns of huggingface_hub's
# `upload_folder(delete_patterns=...)`, matched against whole repo paths with fnmatch: none reaches into a folder
# but lora/, so a trainer's `last-checkpoint/` keeps its files).
STALE_FILE_PATTERNS = [f"{LORA_FOLDER}/*", *(f"{name}.py" for name in REMOTE_CODE_MODULES)]


def upload_adapter_folder(folder, repo_id: str, *, token: str, private=None, revision=None, commit_message=None,
                          create_pr: bool = False):
    """Create the repo if needed and upload `folder` (a disposable copy: its card is retargeted) in one commit.

    The same commit deletes what an earlier push left that this adapter does not have: a `lora/` folder (the loader
    would apply a stale backbone LoRA to these heads) and the remote-code modules of earlier versions
    (`STALE_FILE_PATTERNS`). Other files in the repo (a tokenizer, results, code of the owner's) are kept: a
    `tokenizer_config.json` of the repo's own is not replaced by the adapter's (which only points AutoTokenizer at
    the base's tokenizer); an earlier push's pointer goes when this folder has none. Returns huggingface_hub's
    `CommitInfo`. Run `check_push` first.
    """
    folder = Path(folder)
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


def link_files(folder: Path, files, into: Path) -> None:
    """Lay `files` (paths relative to `folder`) out in `into`: hard links where the filesystem allows (a later save
    swaps new files in under the names, never into these), copies elsewhere and for the card, which an upload
    rewrites."""
    for name in files:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name == CARD_NAME:
            shutil.copyfile(folder / name, target)
            continue
        try:
            os.link(folder / name, target)
        except OSError:
            shutil.copyfile(folder / name, target)


def snapshot_for_upload(folder) -> Path:
    """What a Trainer uploads of its `output_dir` (everything but `checkpoint-*`, `_*` and hidden folders), laid out
    by `link_files` in a new `_hub_push.XXXXXXXX` folder inside it. A background upload reads the snapshot, while
    training goes on saving checkpoints into the folder: huggingface_hub lists a folder it uploads whole, and a
    folder a save creates or rotation deletes meanwhile fails that listing. Snapshots a killed process left (none of
    this process's uploads) are removed first."""
    folder = Path(folder)
    for stale in folder.glob(f"{SNAPSHOT_PREFIX}*"):
        if stale.is_dir() and not stale.is_symlink() and stale.resolve() not in _LIVE_SNAPSHOTS:
            shutil.rmtree(stale, ignore_errors=True)
    snapshot = Path(tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX, dir=folder)).resolve()
    _LIVE_SNAPSHOTS.add(snapshot)
    try:
        files = []
        for item in sorted(folder.iterdir()):
            if item.name.startswith(("_", f"{PREFIX_CHECKPOINT_DIR}-")) or item.name.startswith(".") and item.is_dir():
                continue  # as the Trainer's upload (and a save's hidden staging folders)
            paths = sorted(p for p in item.rglob("*") if p.is_file()) if item.is_dir() else [item]
            files += [p.relative_to(folder).as_posix() for p in paths]
        link_files(folder, files, snapshot)
        return snapshot
    except BaseException:
        _LIVE_SNAPSHOTS.discard(snapshot)
        shutil.rmtree(snapshot, ignore_errors=True)
        raise


def upload_snapshot(snapshot: Path, repo_id: str, **kwargs):
    """`upload_adapter_folder` of a `snapshot_for_upload`, which it removes once the upload ends, however it ends."""
    try:
        return upload_adapter_folder(snapshot, repo_id, **kwargs)
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
                 create_pr: bool = False):
    """`model.push_to_hub`: saves the adapter into a temporary folder and uploads that folder in one commit (see
    `CausalAdapterMixin.push_to_hub`)."""
    token = check_push(repo_id, token=token, revision=revision, create_pr=create_pr)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / repo_id.split("/")[-1]  # the card names the folder; the upload retargets it
        model.save_pretrained(folder)
        return upload_adapter_folder(folder, repo_id, token=token, private=private, revision=revision,
                                     commit_message=commit_message, create_pr=create_pr)


__all__ = ["REMOTE_CODE_MODULES", "check_push", "link_files", "push_adapter", "remote_tokenizer_config",
           "snapshot_for_upload", "upload_adapter_folder", "upload_snapshot"]
