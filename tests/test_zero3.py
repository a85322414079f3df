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
from causalqwen_adapter.training.resume import missing_optimizer_state

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
    """The Trainer under the shipped `deepspeed_zero3.yaml` (tests/sharded_trainer_worker.py; zero3_init_flag true):
    the base loads partitioned and fresh heads copy its gathered output layer; 4 steps equal one process (whose heads
    copied the whole base's); resuming from checkpoint-2 continues exactly; DeepSpeed's checkpoint holds the trained
    tensors' partitions and optimizer, not the frozen base's (`frozen_param_fragments`)."""
    sharded_trainer_worker.run_ranks(sft_base, tmp_path, "zero3", "resume")
    files = sharded_trainer_worker.check_resumed_as_uninterrupted(sft_base, tmp_path)
    assert torch.load(tmp_path / "resume.pt", weights_only=False)["full"]["base_partitioned_at_load"] is True
    states = [name for name in files if name.endswith("model_states.pt")]
    assert len(states) == 2 and "scheduler.pt" in files and "model.safetensors" in files, files
    assert missing_optimizer_state(tmp_path / "run" / "checkpoint-2", "deepspeed") == []  # what a resume checks for
    for name in states:
        saved = torch.load(tmp_path / "run" / "checkpoint-2" / name, weights_only=False, map_location="cpu")
        assert not saved.get("frozen_param_fragments"), name


def test_zero3_resume_only_model_takes_the_heads_and_starts_the_optimizer_fresh(sft_base, tmp_path):
    """`resume_only_model` under the Trainer's ZeRO-3 path: checkpoint-2's heads, a fresh optimizer and schedule."""
    sharded_trainer_worker.run_ranks(sft_base, tmp_path, "zero3", "resume_only_model")
    sharded_trainer_worker.check_resumed_only_model(tmp_path)


def test_zero3_with_the_base_loaded_whole_trains_the_same(sft_base, tmp_path):
    """zero3_init_flag false: every rank reads the whole base (transformers would build it partitioned once ZeRO-3 is
    registered, whatever the flag), and the run equals one process and resumes exactly as with the flag true."""
    sharded_trainer_worker.run_ranks(sft_base, tmp_path, "zero3", "resume", ACCELERATE_DEEPSPEED_ZERO3_INIT="false")
    sharded_trainer_worker.check_resumed_as_uninterrupted(sft_base, tmp_path)
    assert torch.load(tmp_path / "resume.pt", weights_only=False)["full"]["base_partitioned_at_load"] is False


def test_absolute_thresholds_on_a_partitioned_base_are_refused_with_the_ways_out(sft_base):
    """Calibrating absolute thresholds runs the backbone before training: on a ZeRO-3 partitioned base it is
    refused, naming both ways out."""
    from causalqwen_adapter import CausalQwenForCausalLM
    from causalqwen_adapter.training.calibration import check_can_calibrate

    model = CausalQwenForCausalLM.from_base(str(sft_base))
    check_can_calibrate(model)  # a whole base: calibrated as usual
    next(model.model.parameters()).ds_id = 0  # what deepspeed.zero.Init marks a partitioned parameter with
    with pytest.raises(ValueError, match="zero3_init_flag true.*--ovr_threshold_init.*zero3_init_flag: false"):
        check_can_calibrate(model)


def test_zero3_recipe_runs_to_its_last_line(sft_base, tmp_path):
    """recipes/sft_ovr.py under the Trainer's ZeRO-3: trains, writes the card and the adapter folder, and every rank
    prints the same digest of the gathered heads before the final barrier and `trainer.end()`; from a base, then from
    the adapter it wrote."""
    sharded_trainer_worker.write_recipe_data(tmp_path)
    results = sharded_trainer_worker.run_ranks(sft_base, tmp_path, "zero3", "recipe")
    sharded_trainer_worker.check_recipe_ran(results, tmp_path)
    # and again from the adapter folder it wrote: its base loads partitioned, its heads from the folder
    again = tmp_path / "again"
    again.mkdir()
    sharded_trainer_worker.write_recipe_data(again)
    results = sharded_trainer_worker.run_ranks(tmp_path / "out", again, "zero3", "recipe")
    sharded_trainer_worker.check_recipe_ran(results, again)


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
