"""What a run resumes from (causalqwen_adapter/training/resume.py): a checkpoint without its optimizer and schedule
(refused unless `resume_only_model`), the run's final adapter folder (not a checkpoint), a damaged
`trainer_state.json`; and the `deepspeed` flag given something other than a DeepSpeed JSON config."""

import json
import logging
import shutil
from pathlib import Path

import pytest

from causalqwen_adapter.distill import CausalDistillConfig
from causalqwen_adapter.trainer import CausalSFTTrainer
from causalqwen_adapter.training.resume import missing_optimizer_state

from trainer_helpers import _args, _prompt_completion

REPO_ROOT = Path(__file__).resolve().parents[1]


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _rates(trainer) -> dict[int, float]:
    return {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}


@pytest.fixture
def run(sft_base, tmp_path):
    """Four steps, checkpoints at 2 and 4, then the final save into output_dir (as `causalqwen train` does)."""
    out = tmp_path / "out"
    full = CausalSFTTrainer(str(sft_base), args=_args(out, max_steps=4, save_strategy="steps", save_steps=2),
                            train_dataset=_prompt_completion())
    full.train()
    full.save_model()
    return full, out


def _resumed(sft_base, out, **overrides):
    args = _args(out, **{"max_steps": 4, "save_strategy": "steps", "save_steps": 2, **overrides})
    return CausalSFTTrainer(str(sft_base), args=args, train_dataset=_prompt_completion())


# --------------------------------------------------------------------------------------- optimizer and schedule


@pytest.mark.parametrize("how", ["path", "True"])
def test_a_checkpoint_without_optimizer_state_is_refused_naming_the_files_and_the_ways_out(sft_base, run, how):
    _, out = run
    for name in ("optimizer.pt", "scheduler.pt"):
        (out / "checkpoint-4" / name).unlink()
    resumed = _resumed(sft_base, out)
    with pytest.raises(ValueError) as err:
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-4") if how == "path" else True)
    message = str(err.value)
    assert f"{out / 'checkpoint-4'} has no optimizer.pt and no scheduler.pt" in message
    assert f"Resume from {out / 'checkpoint-2'}, which has them, or set resume_only_model=True" in message  # another checkpoint
    assert resumed.state.global_step == 0


def test_a_missing_scheduler_alone_is_named(sft_base, run):
    _, out = run
    (out / "checkpoint-4" / "scheduler.pt").unlink()
    with pytest.raises(ValueError, match=r"checkpoint-4 has no scheduler.pt: "):
        _resumed(sft_base, out).train(resume_from_checkpoint=str(out / "checkpoint-4"))


@pytest.mark.parametrize("save_only_model", [True, False])
def test_resume_only_model_resumes_the_heads_and_step_with_a_fresh_optimizer_and_schedule(sft_base, tmp_path, caplog,
                                                                                          save_only_model):
    out = tmp_path / "out"
    full = _resumed(sft_base, out, save_only_model=save_only_model)
    full.train()
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").exists() is not save_only_model
    if save_only_model:
        with pytest.raises(ValueError, match=r"checkpoint-2 has no optimizer.pt and no scheduler.pt.*save_only_model"
                                             r"=True.*No other checkpoint in .* has them: set resume_only_model"):
            _resumed(sft_base, out).train(resume_from_checkpoint=str(checkpoint))
    resumed = _resumed(sft_base, out, save_only_model=save_only_model, resume_only_model=True)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert "optimizer (its moments) and the learning-rate schedule start fresh" in caplog.text
    assert ("it has no optimizer.pt, scheduler.pt" in caplog.text) is save_only_model
    losses, expected = _losses(resumed), _losses(full)
    assert sorted(losses) == [1, 2, 3, 4]
    assert losses[3] == pytest.approx(expected[3], rel=1e-6)  # step 3 scores checkpoint-2's heads
    assert losses[4] != pytest.approx(expected[4], rel=1e-6)  # after a fresh Adam step
    # the schedule restarts: linear decay from the full rate at step 3, where the uninterrupted run was halfway
    assert _rates(full)[3] == pytest.approx(0.5 * 1e-2) and _rates(resumed)[3] == pytest.approx(1e-2)


def test_each_layout_s_optimizer_files_are_found(tmp_path):
    """As `_save_optimizer_and_scheduler` writes them: plain `optimizer.pt`; FSDP `optimizer.bin` (full state dict)
    or `optimizer_0/` (sharded); DeepSpeed `global_step*/`, with `scheduler.pt` unless its config names the scheduler."""
    def folder(name, *files):
        path = tmp_path / name
        for file in files:
            (path / file).parent.mkdir(parents=True, exist_ok=True)
            (path / file).write_bytes(b"x")
        return path

    assert missing_optimizer_state(folder("plain", "optimizer.pt", "scheduler.pt")) == []
    assert missing_optimizer_state(folder("fsdp-full", "optimizer.bin", "scheduler.pt"), "fsdp") == []
    assert missing_optimizer_state(folder("fsdp-dcp", "optimizer_0/.metadata", "scheduler.pt"), "fsdp") == []
    assert missing_optimizer_state(folder("fsdp-none", "scheduler.pt"), "fsdp") == ["optimizer.bin or optimizer_0/"]
    ds = folder("ds", "latest", "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert missing_optimizer_state(ds, "deepspeed", deepspeed_schedules=True) == []
    assert missing_optimizer_state(ds, "deepspeed", deepspeed_schedules=False) == ["scheduler.pt"]
    assert missing_optimizer_state(ds, None) == ["optimizer.pt", "scheduler.pt"]  # not DeepSpeed's layout
    plain = folder("plain-under-ds", "optimizer.pt", "scheduler.pt")
    assert missing_optimizer_state(plain, "deepspeed") == ["global_step*/ (DeepSpeed's state)"]


def test_under_deepspeed_a_checkpoint_without_its_files_is_refused_before_loading(sft_base, run):
    """The layout the resuming trainer reads decides (here a DeepSpeed run given a plain checkpoint); with
    `resume_only_model` too, since DeepSpeed resumes the heads from its own files."""
    _, out = run
    for only_model in (False, True):
        resumed = _resumed(sft_base, out, resume_only_model=only_model)
        resumed.is_deepspeed_enabled = True  # checked before anything DeepSpeed runs
        with pytest.raises(ValueError, match=r"checkpoint-4 has no global_step\*/" if not only_model else
                           r"checkpoint-4 has no DeepSpeed global_step\*/ folder.*pass it as the model"):
            resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))


# --------------------------------------------------------------------------------------- not a checkpoint


def test_the_final_adapter_folder_is_named_as_such_with_both_ways_on(sft_base, run):
    _, out = run
    with pytest.raises(ValueError) as err:
        _resumed(sft_base, out).train(resume_from_checkpoint=str(out))
    message = str(err.value)
    assert f"{out} is an adapter folder (a save of the heads alone), not a checkpoint" in message
    assert f"resume_from_checkpoint='{out / 'checkpoint-4'}'" in message  # the last complete one
    assert f"--model_name_or_path {out}" in message and f"CausalSFTTrainer('{out}', ...)" in message
    assert "stopped while saving" not in message


def test_an_adapter_folder_without_checkpoints_says_it_holds_none(sft_base, tmp_path):
    out = tmp_path / "out"
    trainer = _resumed(sft_base, out, max_steps=1, save_strategy="no")
    trainer.train()
    trainer.save_model()
    with pytest.raises(ValueError, match=rf"not a checkpoint.*checkpoint-N folders \({out} holds none\).*"
                                         rf"--model_name_or_path {out}"):
        _resumed(sft_base, out).train(resume_from_checkpoint=str(out))


# --------------------------------------------------------------------------------------- a damaged trainer state


@pytest.mark.parametrize("state", ["null", "{}", "[]", '{"global_step": 4, "no_such_field": 1}'])
def test_a_damaged_trainer_state_is_skipped_by_true_and_refused_by_path(sft_base, run, caplog, state):
    full, out = run
    (out / "checkpoint-4" / "trainer_state.json").write_text(state)
    with pytest.raises(ValueError, match=rf"checkpoint-4 is incomplete \(trainer_state.json .*"
                                         rf"resume_from_checkpoint={out / 'checkpoint-2'}"):
        _resumed(sft_base, out).train(resume_from_checkpoint=str(out / "checkpoint-4"))
    resumed = _resumed(sft_base, out)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert f"{out / 'checkpoint-4'} is incomplete (trainer_state.json" in caplog.text
    assert f"Resuming from {out / 'checkpoint-2'}" in caplog.text
    assert _losses(resumed) == _losses(full)
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4  # rewritten


# --------------------------------------------------------------------------------------- --deepspeed


YAML = REPO_ROOT / "recipes" / "configs" / "deepspeed_zero3.yaml"


@pytest.mark.parametrize("config_class, command", [("sft", "train"), ("distill", "distill")])
def test_an_accelerate_yaml_as_deepspeed_names_the_launch_command(tmp_path, config_class, command):
    from causalqwen_adapter.trainer import CausalSFTConfig

    config = {"sft": CausalSFTConfig, "distill": CausalDistillConfig}[config_class]
    with pytest.raises(ValueError) as err:
        config(str(tmp_path / "out"), deepspeed=str(YAML), use_cpu=True, bf16=False)
    message = str(err.value)
    assert "takes a DeepSpeed JSON config file" in message and "or a dict" in message
    assert f"accelerate launch --config_file {YAML} -m causalqwen_adapter.cli {command} " in message


def test_other_deepspeed_values_that_are_no_json_config_are_refused(tmp_path):
    from causalqwen_adapter.trainer import CausalSFTConfig

    (tmp_path / "broken.json").write_text('{"zero_optimization": ')
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "ds.yml").write_text("zero_optimization:\n  stage: 3\n")
    cases = {str(tmp_path / "missing.json"): "no such file", str(tmp_path / "broken.json"): "is not valid JSON",
             str(tmp_path / "list.json"): "holds a JSON list", str(tmp_path / "ds.yml"): "write the DeepSpeed config "
             "as JSON", str(tmp_path): "a folder"}
    for value, what in cases.items():
        with pytest.raises(ValueError, match="takes a DeepSpeed JSON config") as err:
            CausalSFTConfig(str(tmp_path / "out"), deepspeed=value, use_cpu=True, bf16=False)
        assert what in str(err.value), value


def test_the_shipped_deepspeed_json_and_what_transformers_takes_are_accepted(tmp_path):
    """`recipes/configs/deepspeed_zero3.json` parses as transformers' DeepSpeed config (ZeRO-3); a dict and inline
    JSON, which TrainingArguments also take, pass the check."""
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from causalqwen_adapter.trainer import CausalSFTConfig
    from causalqwen_adapter.training.arguments import check_deepspeed_config

    shipped = REPO_ROOT / "recipes" / "configs" / "deepspeed_zero3.json"
    try:
        args = CausalSFTConfig(str(tmp_path / "out"), deepspeed=str(shipped), use_cpu=True, bf16=False)
    except (ImportError, RuntimeError) as err:  # DeepSpeed that cannot initialise on this machine
        pytest.skip(f"DeepSpeed config not constructible here: {err}")
    assert isinstance(args.hf_deepspeed_config, HfTrainerDeepSpeedConfig) and args.hf_deepspeed_config.is_zero3()
    config = json.loads(shipped.read_text())
    check_deepspeed_config(config)
    check_deepspeed_config(json.dumps(config))
    shutil.copy(shipped, tmp_path / "ds_config")  # any name: a JSON file is what counts
    check_deepspeed_config(str(tmp_path / "ds_config"))
