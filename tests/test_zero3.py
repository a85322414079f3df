"""Sharded training under DeepSpeed ZeRO-3 on 2 CPU processes (gloo): every parameter partitioned, the losses read
W_A, b_A, b_noise and the thresholds inside the heads' forwards (where ZeRO-3 gathers them) and a tied or LoRA W_A
gathers the frozen embedding; one step equals one process on the same global batch. Then the Trainer under the shipped
`deepspeed_zero3.yaml` (fresh heads, resume, checkpoints, the best checkpoint, the recipe)."""

import json
import os
import sys
from pathlib import Path

import pytest
import sharded_trainer_worker
import torch
from safetensors.torch import load_file

from causalqwen_adapter import CausalQwenForCausalLM

from conftest import TINY_VOCAB, run_processes

pytest.importorskip("deepspeed")

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "zero3_worker.py"


@pytest.mark.parametrize("options", [{}, {"action_weight": "tied"}, {"action_weight": "lora", "action_lora_rank": 4},
                                     {"learnable_threshold": True}, {"ovr_candidates": None}],
                         ids=["full", "tied", "lora", "thresholds", "vocabulary"])
def test_zero3_step_matches_one_process(tied_base, tmp_path, options):
    batch = torch.randint(1, TINY_VOCAB - 1, (4, 12), generator=torch.Generator().manual_seed(0))
    torch.save(batch, tmp_path / "batch.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "DS_ACCELERATOR": "cpu"}
    argv = [sys.executable, str(WORKER), str(tied_base), str(tmp_path)]
    results = run_processes([([*argv, str(rank), "2", json.dumps(options)], env) for rank in range(2)],
                            what="the ZeRO-3 workers")
    for code, out, err in results:
        assert code == 0, out[-2000:] + err[-4000:]
    sharded = torch.load(tmp_path / "result.pt")

    torch.manual_seed(0)
    model = CausalQwenForCausalLM.from_base(tied_base, **options)
    initial = {k: v.clone() for k, v in model.adapter_state_dict().items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()

    assert sharded["loss"] == pytest.approx(loss.item(), rel=1e-5)
    expected = model.adapter_state_dict()
    assert set(sharded["adapter"]) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(sharded["adapter"][key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert any(not torch.equal(expected[k], initial[k]) for k in expected)  # the step changed the heads


# --------------------------------------------------------------------------------- the Trainer under ZeRO-3


def test_zero3_trainer_builds_fresh_heads_resumes_exactly_and_checkpoints_no_base(sft_base, tmp_path):
    """The Trainer under the shipped `deepspeed_zero3.yaml` (tests/sharded_trainer_worker.py): fresh heads copy the
    whole output layer although transformers builds models partitioned once accelerate registers ZeRO-3; 4 steps equal
    one process; resuming from checkpoint-2 continues exactly; DeepSpeed's checkpoint holds the trained tensors'
    partitions and optimizer, not the frozen base's (`frozen_param_fragments`)."""
    sharded_trainer_worker.run_ranks(sft_base, tmp_path, "zero3", "resume")
    files = sharded_trainer_worker.check_resumed_as_uninterrupted(sft_base, tmp_path)
    states = [name for name in files if name.endswith("model_states.pt")]
    assert len(states) == 2 and "scheduler.pt" in files and "model.safetensors" in files, files
    for name in states:
        saved = torch.load(tmp_path / "run" / "checkpoint-2" / name, weights_only=False, map_location="cpu")
        assert not saved.get("frozen_param_fragments"), name


def test_zero3_recipe_runs_to_its_last_line(sft_base, tmp_path):
    """recipes/sft_ovr.py under the Trainer's ZeRO-3: trains, writes the card and the adapter folder, and every rank
    prints the same digest of the gathered heads before the final barrier and `trainer.end()`."""
    sharded_trainer_worker.write_recipe_data(tmp_path)
    results = sharded_trainer_worker.run_ranks(sft_base, tmp_path, "zero3", "recipe")
    sharded_trainer_worker.check_recipe_ran(results, tmp_path)


def test_zero3_with_partitioned_loading_is_refused_with_the_setting_to_change(sft_base, tmp_path, monkeypatch):
    """zero3_init_flag true builds the base partitioned: fresh heads cannot copy its output layer, so the trainer
    refuses, naming the setting, before any training."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

    for key, value in sharded_trainer_worker.launch_environment(sharded_trainer_worker.CONFIG_FILES["zero3"]).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    args = CausalSFTConfig(str(tmp_path / "out"), report_to="none", max_steps=1, bf16=False)
    try:
        with pytest.raises(ValueError, match="zero3_init_flag true.*set zero3_init_flag: false"):
            CausalSFTTrainer(str(sft_base), args=args, train_dataset=None)
    finally:  # the arguments registered ZeRO-3 with transformers for this process: later tests load plain models
        unset_hf_deepspeed_config()
    assert not (tmp_path / "out").exists()


def test_zero3_trainer_loads_the_best_checkpoint_at_the_end(sft_base, tmp_path):
    """`load_best_model_at_end` under ZeRO-3: the heads after training are the best checkpoint's (here the first
    of two), read from its adapter file into the partitioned heads."""
    sharded_trainer_worker.run_ranks(sft_base, tmp_path, "zero3", "best")
    result = torch.load(tmp_path / "best.pt", weights_only=False)
    assert Path(result["best"]).name == "checkpoint-2"
    saved = load_file(Path(result["best"]) / "model.safetensors")
    last = load_file(tmp_path / "run" / "checkpoint-4" / "model.safetensors")
    for key, value in saved.items():
        torch.testing.assert_close(result["heads"][key], value, rtol=0, atol=0, msg=key)
    assert any(not torch.equal(saved[k], last[k]) for k in saved)  # the best is not simply the last
