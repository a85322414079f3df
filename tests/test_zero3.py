"""Sharded training under DeepSpeed ZeRO-3 on 2 CPU processes (gloo): every parameter partitioned, the losses read
W_A, b_A, b_noise and the thresholds inside the heads' forwards (where ZeRO-3 gathers them) and a tied or LoRA W_A
gathers the frozen embedding; one step equals one process on the same global batch."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

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
