"""CausalSFTTrainer's pushes (`push_to_hub=True`, every hub_strategy): whole adapter folders uploaded during
training and at its end, in order, from snapshots later saves cannot change; nothing but the adapter's files
(no link, hidden or private file, no token) ever uploaded; failures reported.

Every test runs against FakeHub (tests/fake_hub.py), a fake Hub served on 127.0.0.1 that stores what was
committed, so the tests compare it byte for byte with the adapter folder.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

import causalqwen_adapter.model_card as model_card
from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.hub import (
    adapter_upload_files,
    checkpoint_upload_files,
    snapshot_for_upload,
)
from causalqwen_adapter.tokenization_causalqwen import TOKENIZER_CONFIG
from causalqwen_adapter.trainer import CausalSFTTrainer

from fake_hub import BASE_ID, TOKEN, _card, _files, _serve
from trainer_helpers import _args, _prompt_completion


def _push_trainer(sft_base, out, peft_config=None, **overrides):
    args = _args(out, **{"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "push_to_hub": True,
                         "hub_model_id": "user/tiny-causal", "hub_token": TOKEN, "hub_base_model_id": BASE_ID,
                         **overrides})
    return CausalSFTTrainer(str(sft_base), args=args, train_dataset=_prompt_completion(), peft_config=peft_config)


def _uploadable(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in adapter_upload_files(folder)}


@pytest.mark.parametrize("strategy, lora", [("every_save", False), ("checkpoint", True)])
def test_trainer_push_to_hub_uploads_loadable_adapters(hub, sft_base, tmp_path, strategy, lora):
    """`push_to_hub=True`: every push during training (the Trainer's copies only config and weights) and the one
    at the end upload a whole adapter folder (remote code, card, tokenizer pointer, backbone LoRA), and `output_dir`
    never gets the base's tokenizer files; with hub_strategy="checkpoint" the checkpoint pushed beside it keeps its
    code."""
    import peft

    out = tmp_path / "out"
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]) if lora \
        else None
    trainer = _push_trainer(sft_base, out, peft_config=peft_config, hub_strategy=strategy)
    trainer.train()
    trainer._finish_current_push()
    for job in trainer.push_in_progress.jobs if trainer.push_in_progress else []:
        job.result()  # a background push's error, raised
    main = hub.repos["user/tiny-causal"]["main"]
    in_training = [c for c in hub.commits if c["summary"].startswith("Training in progress")
                   and not c["summary"].endswith(", checkpoint")]
    assert in_training and in_training[0]["summary"] == "Training in progress, step 2"
    if strategy == "checkpoint":  # one queue: each save's commits land in the order they were made
        assert [c["summary"] for c in hub.commits[:2]] == ["Training in progress, step 2",
                                                           "Training in progress, step 2, checkpoint"]
    pushed = tmp_path / "pushed-in-training"  # what the repo held during training, as a folder
    for name, data in main.items():
        if not name.startswith("last-checkpoint/"):
            (pushed / name).parent.mkdir(parents=True, exist_ok=True)
            (pushed / name).write_bytes(data)
    step = int(in_training[-1]["summary"].rsplit(" ", 1)[1])
    assert json.loads(main["config.json"])["base_model_name_or_path"] == BASE_ID  # never the local folder
    assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == str(sft_base)
    loaded = CausalQwenForCausalLM.from_pretrained(pushed, base_model=sft_base)
    saved = load_safetensors((out / f"checkpoint-{step}" / "model.safetensors").read_bytes())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())
    lora_file = "lora/adapter_model.safetensors"
    assert (lora_file in main) == lora
    if lora:
        assert main[lora_file] == (out / f"checkpoint-{step}" / lora_file).read_bytes()
        assert getattr(loaded.model, "_hf_peft_config_loaded", False)
    assert json.loads(main["tokenizer_config.json"]) == TOKENIZER_CONFIG and "tokenization_causalqwen.py" in main

    commit = trainer.push_to_hub(dataset_name="tiny-pairs")
    assert hub.commits[-1]["summary"] == "End of training" and commit.oid == hub.commits[-1]["oid"]
    local = _uploadable(out)
    assert not {"tokenizer.json", "chat_template.jinja"} & set(_files(out))  # never the base's tokenizer
    assert json.loads(local["tokenizer_config.json"]) == TOKENIZER_CONFIG
    uploaded = {k: v for k, v in main.items() if not k.startswith("last-checkpoint/")}
    assert set(uploaded) == set(local)
    assert all(uploaded[k] == v for k, v in local.items() if k not in ("README.md", "config.json"))
    local_config = json.loads(local["config.json"])  # the base named by its Hub id, nothing else changed
    assert json.loads(uploaded["config.json"]) == {**local_config, "base_model_name_or_path": BASE_ID}
    card = main["README.md"].decode()
    local_card = local["README.md"].decode()  # output_dir's as it was, retargeted and naming the base's Hub id
    assert card == model_card.retarget_model_card(model_card.card_with_base(local_card, str(sft_base), BASE_ID),
                                                  "user/tiny-causal")
    assert model_card.LOCAL_BASE_NOTE in local_card and model_card.LOCAL_BASE_NOTE not in card
    assert str(sft_base) not in card and _card(card)[0]["base_model"] == BASE_ID
    assert 'AutoModelForCausalLM.from_pretrained("user/tiny-causal", trust_remote_code=True)' in card
    assert "tiny-pairs" in card
    assert not list(out.glob("_hub_push.*"))  # every snapshot removed once uploaded
    if strategy == "checkpoint":  # the main push's stale-file patterns never reach into the checkpoint
        assert "last-checkpoint/modeling_causalqwen.py" in main and "last-checkpoint/optimizer.pt" in main


def test_a_snapshot_for_upload_holds_what_the_trainer_uploads_whatever_saves_do_next(tmp_path):
    """The adapter's files of output_dir, frozen: a later save's swap, a rotated checkpoint or a staging folder
    appearing do not reach the snapshot a background upload reads, and the card it rewrites is its own. Nothing
    but the adapter's files goes in: not the Trainer's training_args.bin, a hidden file, a checkpoint."""
    out = tmp_path / "out"
    files = {"config.json": b"{}", "model.safetensors": b"heads v1", "README.md": b"card", "lora/adapter.bin": b"l"}
    skipped = {"checkpoint-2/model.safetensors": b"old", "_notes": b"x", ".out.abcdefgh.tmp/model.safetensors": b"s",
               ".gitattributes": b"*.safetensors lfs", "training_args.bin": b"args", ".env": b"HF_TOKEN=hf_x"}
    for name, data in {**files, **skipped}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    snapshot = snapshot_for_upload(out)
    assert snapshot.parent == out and snapshot.name.startswith("_hub_push.")
    (out / "model.new").write_bytes(b"heads v2")
    os.replace(out / "model.new", out / "model.safetensors")  # the next save swaps files in under the names
    shutil.rmtree(out / "checkpoint-2")  # rotation
    (snapshot / "README.md").write_text("retargeted")
    assert _files(snapshot) == {**files, "README.md": b"retargeted"}
    assert (out / "README.md").read_bytes() == b"card" and (out / "model.safetensors").read_bytes() == b"heads v2"
    # a killed process's snapshot goes with the next one; one still uploading in this process stays
    killed = out / "_hub_push.abcdefgh"
    (killed / "config.json").parent.mkdir()
    (killed / "config.json").write_bytes(b"{}")
    second = snapshot_for_upload(out)
    assert not killed.exists() and snapshot.is_dir() and second.is_dir()


def test_trainer_push_to_hub_lands_after_the_pushes_in_flight(hub, sft_base, tmp_path, monkeypatch):
    """push_to_hub while a save's push is still uploading (slowed here; training's end waits for them, a call from
    a callback mid-training does not): the end's commit lands last, so the repo holds the final heads, not the older
    ones of the push in flight."""
    import time

    import causalqwen_adapter.hub as hub_module

    upload = hub_module.upload_adapter_folder

    def slow_for_saves(folder, repo_id, **kwargs):
        if kwargs.get("commit_message", "").startswith("Training in progress"):
            time.sleep(1.5)
        return upload(folder, repo_id, **kwargs)

    monkeypatch.setattr(hub_module, "upload_adapter_folder", slow_for_saves)
    out = tmp_path / "out"
    trainer = _push_trainer(sft_base, out, max_steps=6, save_steps=3)
    trainer.train()
    trainer._push_from_checkpoint(str(out / "checkpoint-3"))  # older heads, in flight
    trainer.push_to_hub()
    trainer._finish_current_push()  # whatever was in flight has landed too
    assert [c["summary"] for c in hub.commits][-2:] == ["Training in progress, step 6", "End of training"]
    assert hub.repos["user/tiny-causal"]["main"]["model.safetensors"] == (out / "model.safetensors").read_bytes()


def test_trainer_push_to_hub_keeps_the_repos_own_tokenizer(hub, sft_base, tmp_path):
    """A repo whose owner uploaded a tokenizer: the trainer's pushes leave it, and keep the pointer in output_dir."""
    theirs = b'{"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 77}'
    hub.repos["user/tiny-causal"] = {"main": {"tokenizer_config.json": theirs}}
    trainer = _push_trainer(sft_base, tmp_path / "out", hub_strategy="end")
    trainer.train()
    trainer.push_to_hub()
    main = hub.repos["user/tiny-causal"]["main"]
    assert main["tokenizer_config.json"] == theirs and "model.safetensors" in main
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == TOKENIZER_CONFIG


def _uploaded_bytes(hub) -> dict[str, bytes]:
    return {f"{repo}@{rev}/{name}": data for repo, revs in hub.repos.items() for rev, files in revs.items()
            for name, data in files.items()}


def _plant_secrets(out: Path, tmp_path: Path) -> bytes:
    """What a user's output_dir may hold beside the adapter: links to a key and a private folder, a hidden .env, a
    private data file. Returns the secret bytes none of which may reach the Hub."""
    secret = b"-----BEGIN OPENSSH PRIVATE KEY----- not for the hub"
    private = tmp_path / "private"
    private.mkdir()
    (private / "id_rsa").write_bytes(secret)
    (private / "records.jsonl").write_bytes(secret)
    (out / "notes.txt").symlink_to(private / "id_rsa")
    (out / "data").symlink_to(private, target_is_directory=True)
    (out / ".env").write_bytes(secret)
    (out / "train-private.jsonl").write_bytes(secret)
    return secret


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint", "all_checkpoints", "end"])
def test_trainer_pushes_upload_the_adapter_and_nothing_else(hub, sft_base, tmp_path, strategy):
    """Links in output_dir (to a key, to a private folder), hidden and private files and the Trainer's
    training_args.bin (a pickle holding hub_token) never reach the Hub, at a save's push or the end's; the token is
    in no uploaded byte, checkpoints included."""
    out = tmp_path / "out"
    trainer = _push_trainer(sft_base, out, hub_strategy=strategy)
    trainer.train()
    secret = _plant_secrets(out, tmp_path)
    if strategy != "end":
        trainer._push_from_checkpoint(str(out / "checkpoint-4"))
        trainer._finish_current_push()
    trainer.push_to_hub()
    main = hub.repos["user/tiny-causal"]["main"]
    top = {name for name in main if "/" not in name or name.startswith("lora/")}
    assert top == set(adapter_upload_files(out)) and "training_args.bin" not in top
    assert {"config.json", "model.safetensors", "README.md", "modeling_causalqwen.py"} <= top
    for name, data in _uploaded_bytes(hub).items():
        assert secret not in data and TOKEN.encode() not in data, name
    if strategy in ("checkpoint", "all_checkpoints"):  # the checkpoint keeps what a resume needs, the token redacted
        prefix = "last-checkpoint/" if strategy == "checkpoint" else "checkpoint-4/"
        assert {prefix + n for n in ("optimizer.pt", "trainer_state.json", "training_args.bin")} <= set(main)
        assert torch.load(out / "checkpoint-4" / "training_args.bin", weights_only=False).hub_token is None
    assert trainer.args.hub_token == TOKEN  # the run's own arguments keep it
    assert not list(out.glob("_hub_push.*"))


@pytest.mark.parametrize("link", ["tokenizer_config.json", "lora"])
def test_a_link_among_the_adapters_files_is_refused_before_any_request(hub, sft_base, tmp_path, link):
    out = tmp_path / "out"
    trainer = _push_trainer(sft_base, out, hub_strategy="end")
    trainer.train()
    trainer.save_model()
    private = tmp_path / "private"
    private.mkdir()
    (private / "id_rsa").write_bytes(b"secret")
    if link == "lora":
        (out / "lora").symlink_to(private, target_is_directory=True)
    else:
        (out / link).unlink()
        (out / link).symlink_to(private / "id_rsa")
    commits = len(hub.commits)
    with pytest.raises(ValueError, match="symbolic link.*Nothing was uploaded"):
        snapshot_for_upload(out)
    if link == "tokenizer_config.json":  # kept by the save as the user's own, refused by the push
        with pytest.raises(ValueError, match="symbolic link.*Nothing was uploaded"):
            trainer.push_to_hub()
    assert len(hub.commits) == commits and not list(out.glob("_hub_push.*"))


def test_a_checkpoints_links_are_left_out(tmp_path, caplog):
    checkpoint = tmp_path / "out" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"heads")
    (checkpoint / "notes.txt").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(b"secret")
    assert checkpoint_upload_files(checkpoint) == ["model.safetensors"]
    assert "notes.txt is a symbolic link: not uploaded" in caplog.text


def test_all_checkpoints_reach_the_hub_though_rotation_deletes_them_first(hub, sft_base, tmp_path, monkeypatch):
    """hub_strategy="all_checkpoints", save_total_limit=1, hub_always_push: each checkpoint's upload is queued
    behind slow ones and rotation deletes the folder before it runs; the snapshot taken at the save still holds it."""
    import time

    import causalqwen_adapter.hub as hub_module

    upload = hub_module.upload_snapshot

    def slow(snapshot, repo_id, **kwargs):
        time.sleep(0.5)
        return upload(snapshot, repo_id, **kwargs)

    monkeypatch.setattr(hub_module, "upload_snapshot", slow)
    out = tmp_path / "out"
    trainer = _push_trainer(sft_base, out, max_steps=6, hub_strategy="all_checkpoints", save_total_limit=1,
                            hub_always_push=True)
    trainer.train()
    assert not trainer._failed_pushes
    main = hub.repos["user/tiny-causal"]["main"]
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-6"]
    for step in (2, 4, 6):
        assert f"checkpoint-{step}/model.safetensors" in main and f"checkpoint-{step}/optimizer.pt" in main


def test_a_failed_background_push_warns_at_once_and_at_the_end_of_training(monkeypatch, no_token, sft_base, tmp_path,
                                                                           caplog):
    with _serve(monkeypatch, xet=False, fail_commit=True):
        trainer = _push_trainer(sft_base, tmp_path / "out", hub_strategy="every_save", hub_always_push=True)
        trainer.train()
    failures = trainer._failed_pushes
    assert len(failures) == 2 and all("Training in progress" in f and "500" in f for f in failures)
    assert caplog.text.count("pushing to the Hub failed") == 2
    assert "2 of this run's pushes to the Hub failed" in caplog.text and "trainer.push_to_hub()" in caplog.text


def test_a_trainer_on_a_local_base_refuses_push_to_hub_before_training(hub, sft_base, tmp_path):
    with pytest.raises(ValueError, match="is a folder on this machine.*--hub_base_model_id"):
        _push_trainer(sft_base, tmp_path / "out", hub_base_model_id=None)
    assert hub.requests == [] and not (tmp_path / "out").exists()
