"""Sharing an adapter on the Hugging Face Hub: the checks before a push and the upload itself.

Installed package only: the adapter folder's remote code carries no upload code, and a remote-code model's
`push_to_hub` asks for this package (adapter_io.py). `recipes/push_to_hub.py` uses the same functions for a folder.
"""

import tempfile
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import RevisionNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id

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
REMOTE_CODE_MODULES = ("adapter_io", "cauchy", "configuration_causalqwen", "cpu_kernel", "dispatch", "generation",
                       "heads", "lm_loss", "losses", "model_card", "modeling_causalqwen", "numeric", "sharding",
                       "tokenization_causalqwen")
# Remote files of an earlier push that go when the new adapter lacks them (patterns of huggingface_hub's
# `upload_folder(delete_patterns=...)`, matched against whole repo paths with fnmatch: none reaches into a folder
# but lora/, so a trainer's `last-checkpoint/` keeps its files).
STALE_FILE_PATTERNS = [f"{LORA_FOLDER}/*", *(f"{name}.py" for name in REMOTE_CODE_MODULES)]


def upload_adapter_folder(folder, repo_id: str, *, token: str, private=None, revision=None, commit_message=None,
                          create_pr: bool = False, ignore_patterns: list[str] | None = None,
                          run_as_future: bool = False):
    """Create the repo if needed and upload the adapter folder `folder` in one commit; its card is retargeted to
    `repo_id` in place (the snippet loads the repo), nothing else in it is changed.

    The same commit deletes what an earlier push left that this adapter does not have: a `lora/` folder (the loader
    would apply a stale backbone LoRA to these heads) and the remote-code modules of earlier versions
    (`STALE_FILE_PATTERNS`). Other files in the repo (a tokenizer, results, code of the owner's) are kept: a
    `tokenizer_config.json` of the repo's own is not replaced by the adapter's (which only points AutoTokenizer at
    the base's tokenizer); an earlier push's pointer goes when this folder has none. `ignore_patterns` are files of
    `folder` not to upload (a trainer's `checkpoint-*`). Returns huggingface_hub's `CommitInfo`, or a `Future` of it
    with `run_as_future`. Run `check_push` first.
    """
    folder = Path(folder)
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id  # "name" → "user/name"
    card = folder / CARD_NAME
    if card.is_file():
        card.write_text(retarget_model_card(card.read_text(encoding="utf-8"), repo_id), encoding="utf-8")
    if revision is not None and not create_pr and not revision.startswith("refs/pr/"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    pointer, delete, ignore = folder / TOKENIZER_CONFIG_NAME, list(STALE_FILE_PATTERNS), list(ignore_patterns or [])
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
        run_as_future=run_as_future,
    )


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


__all__ = ["REMOTE_CODE_MODULES", "check_push", "remote_tokenizer_config", "upload_adapter_folder", "push_adapter"]
