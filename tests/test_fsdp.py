"""Sharded training under FSDP2 with the shipped `recipes/configs/fsdp2.yaml`, on 2 CPU processes with gloo: the
environment `accelerate launch` would give each process, accelerate's own FSDP2 model preparation, then the same
loss and the same adapter tensors as one process on the same global batch, and the gathered adapter loads through
`AutoModelForCausalLM` with `trust_remote_code=True`; then the Trainer's own FSDP2 path (resume, checkpoints, the
recipe). The launch configurations are checked against what the heads need."""

import json
import os
import sys
from pathlib import Path

import pytest
import sharded_trainer_worker
import test_architectures
import torch
from transformers import AutoModelForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.training.resume import missing_optimizer_state

from conftest import TINY_VOCAB, run_processes

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"
CONFIGS = REPO_ROOT / "recipes" / "configs"


def test_launch_configurations_keep_what_the_heads_need():
    from accelerate.commands.config.config_args import ClusterConfig

    fsdp = ClusterConfig.from_yaml_file(CONFIGS / "fsdp2.yaml")  # unknown keys are an error there
    assert fsdp.distributed_type == "FSDP" and fsdp.fsdp_config["fsdp_version"] == 2
    # the Trainer gathers the model at save time only under FULL_STATE_DICT: save_pretrained writes the adapter folder
    assert fsdp.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    # a large base is read once, by rank 0 (fresh heads still copy the real lm_head: the workers check it)
    assert fsdp.fsdp_config["fsdp_cpu_ram_efficient_loading"] is True
    zero3 = ClusterConfig.from_yaml_file(CONFIGS / "deepspeed_zero3.yaml")
    assert zero3.distributed_type == "DEEPSPEED" and zero3.deepspeed_config["zero_stage"] == 3
    # the base loads partitioned (fresh heads gather only its output layer: test_zero3.py); gathered 16-bit weights at
    # save time
    assert zero3.deepspeed_config["zero3_init_flag"] is True
    assert zero3.deepspeed_config["zero3_save_16bit_model"] is True


# (how the model is sharded, head options): accelerate's own FSDP2 wrap (layers, the input embedding as a unit of its
# own, the root with the heads) with each action weight on a tied base, whose `tied` and `lora` W_A is the sharded
# embedding; and each head module a unit of its own, learnable thresholds included. The OvR loss is over candidates
# (the default) but in the vocabulary case.
# The shipped config loads the base on rank 0 (cpu_ram_efficient_loading); the last case has every rank read it.
FSDP2_CASES = {
    "accelerate-full": ("accelerate", {}, {}),
    "accelerate-tied": ("accelerate", {"action_weight": "tied"}, {}),
    "accelerate-lora": ("accelerate", {"action_weight": "lora", "action_lora_rank": 4}, {}),
    "heads-as-units": ("heads", {"learnable_threshold": True}, {}),
    "heads-as-units-vocabulary": ("heads", {"ovr_candidates": None}, {}),  # the OvR loss over every token
    "every-rank-loads": ("accelerate", {"causal_size": 24}, {"FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}),
}


def run_fsdp2(work: Path, jobs: list[tuple], launch: dict | None = None) -> dict:
    """tests/fsdp_worker.py on 2 gloo processes over the jobs (name, base folder, wrap, heads options, global batch),
    all in one launch with the extra environment `launch`; returns each job's results, rank 0's then rank 1's."""
    for name, *_, batch in jobs:
        torch.save(batch, work / f"{name}-batch.pt")
    spec = json.dumps([{"name": name, "base": str(base), "wrap": wrap, "options": options}
                       for name, base, wrap, options, _ in jobs])
    env = {**os.environ, **sharded_trainer_worker.launch_environment(CONFIGS / "fsdp2.yaml"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO_ROOT), **(launch or {})}
    results = run_processes([([sys.executable, str(WORKER), str(work), str(rank), "2", spec], env) for rank in range(2)],
                            what="the FSDP2 workers")
    for code, out, err in results:
        assert code == 0, out[-2000:] + err[-4000:]
    return {name: [torch.load(work / f"{name}-result-{rank}.pt") for rank in range(2)] for name, *_ in jobs}


def check_step_matches_one_process(base: Path, options: dict, batch: torch.Tensor, ranks: list, work: Path) -> None:
    """The sharded step (`ranks`: both ranks' results) against one process on the whole batch: the same loss, the same
    adapter after the step, the same loss once resumed; the gathered adapter saves as one and loads as remote code."""
    sharded, other_rank = ranks
    assert sharded["read_base"] and other_rank["read_base"]  # fresh heads copied the real lm_head on every rank
    for key, value in sharded["adapter"].items():  # every rank gathers the same whole tensors (the recipe's digest)
        assert torch.equal(other_rank["adapter"][key], value), key

    def fresh():  # seeded as in the worker (LoRA's A is random)
        torch.manual_seed(0)
        return CausalQwenForCausalLM.from_base(base, **options)

    # One process, the whole batch, the same step.
    model = fresh()
    model.model.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()

    assert sharded["loss"] == pytest.approx(loss.item(), rel=1e-5)
    # the adapter loaded back into a sharded model scores as the trained one does on one process
    assert sharded["resumed_loss"] == pytest.approx(model(input_ids=batch, labels=batch).loss.item(), rel=1e-5)
    expected = model.adapter_state_dict()
    assert set(sharded["adapter"]) == set(expected)
    moved = 0
    for key, value in expected.items():
        torch.testing.assert_close(sharded["adapter"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        moved += not torch.equal(value, fresh().adapter_state_dict()[key])
    assert moved > 0  # the step changed the heads

    # The gathered tensors are an adapter: saved as one, loaded as remote code.
    gathered = fresh()
    gathered.load_state_dict(sharded["adapter"], strict=False)
    gathered.save_pretrained(work / "adapter")
    loaded = AutoModelForCausalLM.from_pretrained(work / "adapter", trust_remote_code=True)
    for key, value in loaded.adapter_state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("case", list(FSDP2_CASES))
def test_fsdp2_step_matches_one_process(tied_base, tmp_path, case):
    wrap, options, launch = FSDP2_CASES[case]
    batch = torch.randint(1, TINY_VOCAB - 1, (4, 12), generator=torch.Generator().manual_seed(0))
    results = run_fsdp2(tmp_path, [(case, tied_base, wrap, options, batch)], launch)
    check_step_matches_one_process(tied_base, options, batch, results[case], tmp_path)


def test_fsdp2_step_on_every_architecture(tmp_path):
    """Each supported base architecture (tests/test_architectures.py's tiny configurations) under accelerate's own
    FSDP2 wrap, each decoder layer a unit (the backbone's `_no_split_modules`), against one process; on the tied ones
    also with `tied` action weights, W_A read from the embedding sharded in a unit of its own. One launch runs every
    job."""
    jobs = []
    for arch, make in test_architectures.CONFIGS.items():
        base = test_architectures._save_base(tmp_path / arch, make())
        batch = torch.randint(3, test_architectures.VOCAB, (4, 10), generator=torch.Generator().manual_seed(0))
        jobs.append((arch, base, "accelerate", {}, batch))
        if arch in test_architectures.TIED:
            jobs.append((f"{arch}-tied", base, "accelerate", {"action_weight": "tied"}, batch))
    results = run_fsdp2(tmp_path, jobs)
    for name, base, _, options, batch in jobs:
        work = tmp_path / f"{name}-one-process"
        work.mkdir()
        check_step_matches_one_process(base, options, batch, results[name], work)


# ------------------------------------------------------------------------------------ the Trainer under FSDP2


def test_fsdp2_trainer_resumes_as_an_uninterrupted_run_and_checkpoints_no_base(sft_base, tmp_path):
    """The Trainer's own FSDP2 path (tests/sharded_trainer_worker.py): 4 steps equal one process; resuming from
    checkpoint-2 continues exactly; a checkpoint holds the adapter and the optimizer of the trained tensors, never the
    gathered base (the Trainer's `pytorch_model_fsdp.bin`)."""
    sharded_trainer_worker.run_ranks(sft_base, tmp_path, "fsdp2", "resume")
    files = sharded_trainer_worker.check_resumed_as_uninterrupted(sft_base, tmp_path)
    assert not [name for name in files if name.startswith("pytorch_model")], files
    assert {"model.safetensors", "optimizer.bin", "scheduler.pt", "trainer_state.json"} <= set(files)
    assert missing_optimizer_state(tmp_path / "run" / "checkpoint-2", "fsdp") == []  # what a resume checks for


def test_fsdp2_resume_only_model_takes_the_heads_and_starts_the_optimizer_fresh(sft_base, tmp_path):
    """`resume_only_model` under the Trainer's FSDP2 path: checkpoint-2's heads, a fresh optimizer and schedule."""
    sharded_trainer_worker.run_ranks(sft_base, tmp_path, "fsdp2", "resume_only_model")
    sharded_trainer_worker.check_resumed_only_model(tmp_path)


def test_fsdp2_recipe_runs_to_its_last_line(sft_base, tmp_path):
    """recipes/sft_ovr.py under the Trainer's FSDP2: trains, writes the card and the adapter folder, and every rank
    prints the same digest of the gathered heads before the final barrier and `trainer.end()`."""
    sharded_trainer_worker.write_recipe_data(tmp_path)
    results = sharded_trainer_worker.run_ranks(sft_base, tmp_path, "fsdp2", "recipe")
    sharded_trainer_worker.check_recipe_ran(results, tmp_path)
