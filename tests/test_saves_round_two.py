"""Nothing overwritten, nothing lost: a user's files beside a save, a file where a folder should be, heads that are not
finite, checkpoints a killed run left half written, and what a save killed mid-swap leaves beside the folder."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.features import extract_features
from causalqwen_adapter.trainer import CausalSFTTrainer

from conftest import kill_save_mid_swap
from trainer_helpers import _args, _prompt_completion

REPO_ROOT = Path(__file__).resolve().parents[1]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# --------------------------------------------------------------------------------------- a user's files


def test_save_never_replaces_a_users_files(tied_base, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in ("README.md", "generation_config.json", "losses.py", "heads.py"):
        (folder / name).write_text(f"the user's {name}\n")
    (folder / "notes.txt").write_text("keep me\n")
    before = _snapshot(folder)
    model = CausalQwenForCausalLM.from_base(tied_base)
    with pytest.raises(FileExistsError) as err:
        model.save_pretrained(folder)
    message = str(err.value)
    for name in ("README.md", "generation_config.json", "heads.py", "losses.py"):
        assert name in message
    assert "notes.txt" not in message and "save the adapter to a folder of its own" in message
    assert _snapshot(folder) == before and _hidden(tmp_path) == []

    # files that are not ours to write stay; the adapter then saves beside them, and saves again over itself
    for name in ("README.md", "generation_config.json", "losses.py", "heads.py"):
        (folder / name).unlink()
    model.save_pretrained(folder)
    model.save_pretrained(folder)
    assert (folder / "notes.txt").read_text() == "keep me\n"
    CausalQwenForCausalLM.from_pretrained(folder)


def test_a_trainer_refuses_an_output_dir_holding_a_users_files_before_training(sft_base, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my experiment log\n")
    (out / "training_args.bin").write_bytes(b"mine")
    before = _snapshot(out)
    with pytest.raises(FileExistsError, match=r"README.md.*training_args.bin"):
        CausalSFTTrainer(str(sft_base), args=_args(out), train_dataset=_prompt_completion())
    assert _snapshot(out) == before


def test_the_trainer_writes_its_card_into_output_dir_only_beside_its_adapter(sft_base, tmp_path):
    out = tmp_path / "out"
    trainer = CausalSFTTrainer(str(sft_base), args=_args(out, max_steps=2, save_strategy="steps", save_steps=1),
                               train_dataset=_prompt_completion())
    trainer.train()
    assert (out / "checkpoint-1" / "README.md").is_file()
    # a README.md in output_dir before the adapter is there would be taken for the user's by the final save
    assert not (out / "README.md").exists()
    trainer.save_model()
    assert (out / "README.md").is_file() and (out / "config.json").is_file()
    trainer.create_model_card()  # beside its adapter, the card is the trainer's to update
    assert "target_prob" in (out / "README.md").read_text()


# --------------------------------------------------------------------------------------- a file at output_dir


def test_feature_extraction_refuses_a_file_at_output_dir(sft_base, tmp_path):
    target = tmp_path / "features"
    target.write_text("not a folder\n")
    data = Dataset.from_dict({"text": ["the cat sat on the mat"]})
    with pytest.raises(FileExistsError, match="is a file, not a folder"):
        extract_features(str(sft_base), data, target, top_k=2, overwrite=True)
    assert target.read_text() == "not a folder\n" and _hidden(tmp_path) == []

    from causalqwen_adapter.cli import extract_features as recipe

    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
    args = recipe.ExtractArguments(model_name_or_path=str(sft_base), dataset_name=str(tmp_path / "data.jsonl"),
                                   output_dir=str(target), top_k=2, overwrite=True, device="cpu")
    with pytest.raises(FileExistsError, match="is a file, not a folder"):
        recipe.run(args)
    assert target.read_text() == "not a folder\n" and _hidden(tmp_path) == []


def test_a_trainer_refuses_a_file_at_output_dir(sft_base, tmp_path):
    (tmp_path / "out").write_text("mine\n")
    with pytest.raises(FileExistsError, match="is a file, not a folder"):
        CausalSFTTrainer(str(sft_base), args=_args(tmp_path / "out"), train_dataset=_prompt_completion())
    assert (tmp_path / "out").read_text() == "mine\n"


# --------------------------------------------------------------------------------------- non-finite heads


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_heads_are_never_saved(tied_base, tmp_path, value):
    good = CausalQwenForCausalLM.from_base(tied_base)
    good.save_pretrained(tmp_path / "adapter")
    before = _snapshot(tmp_path / "adapter")
    with torch.no_grad():
        good.abduction.scale.bias[1] = value
    with pytest.raises(ValueError, match=r"abduction.scale.bias.*(NaN|inf).*Nothing was written"):
        good.save_pretrained(tmp_path / "adapter")
    assert _snapshot(tmp_path / "adapter") == before and _hidden(tmp_path) == []
    with pytest.raises(ValueError, match="abduction.scale.bias"):
        good.save_pretrained(tmp_path / "new")
    assert not (tmp_path / "new").exists() and _hidden(tmp_path) == []
    CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")


class _Poison(TrainerCallback):
    """Sets a head tensor to `value` at the end of step `step`."""

    def __init__(self, step, name, value):
        self.step, self.name, self.value = step, name, value

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                dict(model.named_parameters())[self.name].view(-1)[0] = self.value


def test_a_head_gone_infinite_stops_training_before_its_checkpoint(sft_base, tmp_path):
    # the softmax objective never reads the scale path: the loss stays finite while b_noise is infinite
    out = tmp_path / "out"
    args = _args(out, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=1, objective="softmax")
    trainer = CausalSFTTrainer(str(sft_base), args=args, train_dataset=_prompt_completion(),
                               callbacks=[_Poison(2, "action.b_noise", math.inf)])
    with pytest.raises(FloatingPointError) as err:
        trainer.train()
    message = str(err.value)
    assert "step 2" in message and "action.b_noise" in message and str(out / "checkpoint-1") in message
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-1"]
    CausalQwenForCausalLM.from_pretrained(out / "checkpoint-1")
    assert _hidden(out) == []


def test_a_diverged_first_step_says_there_is_no_checkpoint(sft_base, tmp_path):
    out = tmp_path / "out"
    # a rate float32 holds (1e39 is refused up front) that overflows the heads in the first step
    args = _args(out, max_steps=3, save_strategy="steps", save_steps=1, learning_rate=3e38)
    trainer = CausalSFTTrainer(str(sft_base), args=args, train_dataset=_prompt_completion())
    with pytest.raises(FloatingPointError, match=r"step 1.*NaN or infinite.*no checkpoint to resume from"):
        trainer.train()
    assert not out.exists() or not [p for p in out.iterdir() if p.name.startswith("checkpoint")]


def test_a_non_finite_loss_names_the_last_good_checkpoint(sft_base, tmp_path):
    out = tmp_path / "out"
    args = _args(out, max_steps=5, save_strategy="steps", save_steps=2)
    trainer = CausalSFTTrainer(str(sft_base), args=args, train_dataset=_prompt_completion(),
                               callbacks=[_Poison(3, "abduction.loc.weight", math.nan)])
    with pytest.raises(FloatingPointError, match=rf"loss is nan at step 4.*resume from {out / 'checkpoint-2'}"):
        trainer.train()


# --------------------------------------------------------------------------------------- half-written checkpoints


@pytest.fixture
def killed_run(sft_base, tmp_path):
    """Four steps, checkpoints at 2 and 4; then checkpoint-4 as a run killed while writing it leaves it."""
    out = tmp_path / "out"
    full = CausalSFTTrainer(str(sft_base), args=_args(out, max_steps=4, save_strategy="steps", save_steps=2),
                            train_dataset=_prompt_completion())
    full.train()
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    return full, out


def test_resume_skips_a_checkpoint_left_half_written(sft_base, killed_run, caplog):
    full, out = killed_run
    resumed = CausalSFTTrainer(str(sft_base), args=_args(out, max_steps=4, save_strategy="steps", save_steps=2),
                               train_dataset=_prompt_completion())
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert f"{out / 'checkpoint-4'} is incomplete" in caplog.text and str(out / "checkpoint-2") in caplog.text
    losses = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    expected = {h["step"]: h["loss"] for h in full.state.log_history if "loss" in h}
    assert losses == expected  # steps 1-2 from checkpoint-2's state, 3-4 trained again, the same
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()  # rewritten whole


def test_resume_from_a_half_written_checkpoint_says_what_to_pass(sft_base, killed_run):
    _, out = killed_run
    resumed = CausalSFTTrainer(str(sft_base), args=_args(out, max_steps=4), train_dataset=_prompt_completion())
    with pytest.raises(ValueError, match=rf"{out / 'checkpoint-4'} is incomplete \(no trainer_state.json.*"
                                         rf"resume_from_checkpoint={out / 'checkpoint-2'}"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    (out / "checkpoint-2" / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match=r"no complete checkpoint in .*checkpoint-4 is incomplete"):
        resumed.train(resume_from_checkpoint=True)


# --------------------------------------------------------------------------------------- killed mid-swap


def test_a_save_killed_mid_swap_names_the_old_files_and_the_next_save_cleans_up(tied_base, tmp_path):
    folder = tmp_path / "adapter"
    model = CausalQwenForCausalLM.from_base(tied_base)
    model.save_pretrained(folder)
    old = _snapshot(folder)
    (tmp_path / ".adapter.notes").write_text("not ours\n")  # a name outside our naming stays
    (tmp_path / ".other.abcd1234.old").mkdir()  # another folder's: stays
    kill_save_mid_swap(tied_base, folder)
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith(".adapter.") and p.name.endswith(".old")]
    assert (aside / "config.json").is_file()

    with pytest.raises(OSError, match=rf"interrupted.*{aside}.*move them back"):
        CausalQwenForCausalLM.from_pretrained(folder)
    # the message is right: moving the old files back restores the old adapter exactly
    restored = tmp_path / "restored"
    restored.mkdir()
    for p in folder.iterdir():
        (restored / p.name).write_bytes(p.read_bytes())
    for p in aside.iterdir():
        (restored / p.name).write_bytes(p.read_bytes())
    assert _snapshot(restored) == old

    model.save_pretrained(folder)
    assert _hidden(tmp_path) == [".adapter.notes", ".other.abcd1234.old"]
    assert _snapshot(folder) == old
    CausalQwenForCausalLM.from_pretrained(folder)


def test_a_feature_store_is_never_lost_mid_replacement_and_stale_staging_goes(sft_base, tmp_path, monkeypatch):
    import causalqwen_adapter.features as features
    from causalqwen_adapter.features import load_features

    store = tmp_path / "features"
    data = Dataset.from_dict({"text": ["the cat sat on the mat"]})
    extract_features(str(sft_base), data, store, top_k=2)
    before = _snapshot(store)
    (tmp_path / ".features.k1ll3d00.tmp").mkdir()  # what an extraction killed while writing leaves
    real_rename, calls = features.os.rename, []

    def fail_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the old store aside, the new one not yet in
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(features.os, "rename", fail_second)
    with pytest.raises(KeyboardInterrupt):
        extract_features(str(sft_base), data, store, top_k=3, overwrite=True)
    monkeypatch.undo()
    assert _snapshot(store) == before

    # killed between the two renames: the load error says where the old store is
    aside = tmp_path / ".features.abcd1234.old"
    aside.mkdir()
    store.rename(aside / "features")
    with pytest.raises(FileNotFoundError, match=rf"interrupted.*{aside / 'features'}: move it back"):
        load_features(store)
    (aside / "features").rename(store)

    extract_features(str(sft_base), data, store, top_k=3, overwrite=True)
    assert _hidden(tmp_path) == [] and load_features(store)[0]["topk_ids"].shape == (3,)
