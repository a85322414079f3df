"""One rank of the 2-process FSDP2 checks in test_fsdp.py (run as a script, not collected by pytest).

    python tests/fsdp_worker.py <work folder> <rank> <world size> <jobs as JSON>

Each job is a base folder, a wrap, the heads' options and a name; all run in one process group, one after the other
(the processes' start-up, most of a check's time, is paid once).

The environment is what `accelerate launch --config_file recipes/configs/fsdp2.yaml` gives each process (test_fsdp.py
builds it with accelerate's own launcher code). Accelerate switches FSDP on only on accelerators, so this worker
shards the model itself, as <wrap> says:
- `accelerate`: the step that `Accelerator.prepare` runs for FSDP2, `fsdp2_prepare_model`, with the plugin read from
  that environment: `fully_shard` on every decoder layer (the model's `_no_split_modules`), the input embedding, the
  tail, then the root, which holds the heads;
- `heads`: `fully_shard` on every decoder layer, then on each head module (abduction, action, thresholds: a size-based
  policy's choice, W_A being the largest tensor of the model), then on the root.
On gloo it runs `forward(labels=...)` on this rank's half of the global batch (<work folder>/<name>-batch.pt),
backward and one SGD step; gathers the adapter's tensors alone (checked against torch's full state dict); loads them
into a freshly sharded model, as a resumed run does, and scores the batch again. It writes the mean loss over ranks,
the gathered adapter and the resumed model's loss to <work folder>/<name>-result-<rank>.pt.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.adapter_io import BASE_PREFIXES
from causalqwen_adapter.training.checkpoints import load_adapter_tensors


def shard(model, wrap: str, rank: int):
    """The model sharded as <wrap> says (module docstring)."""
    if wrap == "accelerate":
        plugin = FullyShardedDataParallelPlugin()  # from the launch environment (FSDP_VERSION=2, auto-wrap policy, ...)
        assert plugin.fsdp_version == 2, "run through test_fsdp.py: it sets the environment accelerate launch would"
        # float32 here (gloo, compared with one process within float tolerance); the config's bf16 is for GPUs
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                      mixed_precision="no", is_main_process=rank == 0, device=torch.device("cpu"))
        model = fsdp2_prepare_model(accelerator, model)
        # the case the tied and LoRA action weights must read through: W_base sharded in a unit of its own
        assert isinstance(model.model.embed_tokens, FSDPModule)
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        for head in (model.abduction, model.action, model.ovr):
            fully_shard(head)
        fully_shard(model)
    # What the check is about: the vocabulary-sized W_A and the heads are sharded like any weight.
    sharded = {n: type(p).__name__ == "DTensor" for n, p in model.named_parameters()}
    assert sharded["abduction.loc.weight"] and all(sharded.values()), sharded
    return model


def main(work: str, rank: int, world: int, jobs: list[dict]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun sets them
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{work}/store")
    for job in jobs:
        run_job(job["base"], work, rank, world, job["wrap"], job["options"], job["name"])
    dist.barrier()
    dist.destroy_process_group()


def run_job(base: str, work: str, rank: int, world: int, wrap: str, options: dict, name: str) -> None:
    torch.manual_seed(0)  # as the Trainer seeds before building the model: the same heads on every rank (LoRA's A)
    model = CausalQwenForCausalLM.from_base(base, **options)
    # with fsdp_cpu_ram_efficient_loading, transformers reads the base on local rank 0 and broadcasts it (a rank
    # left with placeholders would copy them into its fresh W_A), and accelerate shards rank 0's whole model
    with safe_open(f"{base}/model.safetensors", "pt") as checkpoint:
        read_base = torch.equal(model.model.embed_tokens.weight, checkpoint.get_tensor("model.embed_tokens.weight"))
    model.model.requires_grad_(False)
    batch = torch.load(f"{work}/{name}-batch.pt")
    rows = len(batch) // world
    local = batch[rank * rows : (rank + 1) * rows]

    model = shard(model, wrap, rank)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    # Every rank scores the same number of targets, so the mean of the ranks' means (what FSDP2's gradient
    # averaging computes) is the mean over the global batch.
    loss = model(input_ids=local, labels=local).loss
    loss.backward()
    optimizer.step()

    total = loss.detach().clone()
    dist.all_reduce(total)
    # The adapter alone, gathered on every rank (what the trainer saves and the recipe's digest reads), equals the
    # adapter part of torch's own full state dict.
    adapter = model.gathered_adapter_state_dict()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert set(adapter) == {k for k in state if not k.startswith(BASE_PREFIXES)}
        for key, value in adapter.items():
            assert torch.equal(value, state[key]), key
        save_file(adapter, f"{work}/{name}-adapter.safetensors")
    dist.barrier()

    # Resuming: the saved whole tensors loaded into a fresh sharded model, each rank keeping its shard.
    torch.manual_seed(0)
    resumed = shard(CausalQwenForCausalLM.from_base(base, **options), wrap, rank)
    load_adapter_tensors(resumed, f"{work}/{name}-adapter.safetensors")
    reloaded = resumed.gathered_adapter_state_dict()
    for key, value in adapter.items():
        assert torch.equal(reloaded[key], value), key
    again = resumed(input_ids=local, labels=local).loss.detach()
    dist.all_reduce(again)

    torch.save({"loss": (total / world).item(), "adapter": adapter, "resumed_loss": (again / world).item(),
                "read_base": read_base},
               f"{work}/{name}-result-{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
    # Skip interpreter finalization: a gloo worker thread may still be freeing the barrier's work (which holds the
    # gathered tensors) and needs the GIL to do it; during finalization that thread is unwound and the process aborts
    # ("terminate called without an active exception", ~1 run in 10 on this machine). Everything is written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
