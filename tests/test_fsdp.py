"""Sharded training under FSDP2 (torch's `fully_shard`, as accelerate's FSDP2 plugin applies it) on 2 CPU
processes with gloo: the same loss and the same adapter tensors as one process on the same global batch, and the
gathered adapter loads through `AutoModelForCausalLM` with `trust_remote_code=True`."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM

from conftest import TINY_VOCAB

WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"


def test_fsdp2_step_matches_one_process(tied_base, tmp_path):
    batch = torch.randint(1, TINY_VOCAB - 1, (4, 12), generator=torch.Generator().manual_seed(0))
    torch.save(batch, tmp_path / "batch.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(tied_base), str(tmp_path), str(rank), "2"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180))
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the FSDP2 workers timed out")
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
    sharded = torch.load(tmp_path / "result.pt")

    # One process, the whole batch, the same step.
    model = CausalQwenForCausalLM.from_base(tied_base)
    model.model.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()

    assert sharded["loss"] == pytest.approx(loss.item(), rel=1e-5)
    expected = model.adapter_state_dict()
    assert set(sharded["adapter"]) == set(expected)
    moved = 0
    for key, value in expected.items():
        torch.testing.assert_close(sharded["adapter"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        moved += not torch.equal(value, CausalQwenForCausalLM.from_base(tied_base).adapter_state_dict()[key])
    assert moved > 0  # the step changed the heads

    # The gathered tensors are an adapter: saved as one, loaded as remote code.
    gathered = CausalQwenForCausalLM.from_base(tied_base)
    gathered.load_state_dict(sharded["adapter"], strict=False)
    gathered.save_pretrained(tmp_path / "adapter")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter", trust_remote_code=True)
    for key, value in loaded.adapter_state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=key)
