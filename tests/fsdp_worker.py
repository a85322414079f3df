"""One rank of the 2-process FSDP2 check in test_fsdp.py (run as a script, not collected by pytest).

    python tests/fsdp_worker.py <base folder> <work folder> <rank> <world size>

Shards the model as accelerate's FSDP2 plugin does — `fully_shard` on every decoder layer (the transformer-layer
auto-wrap policy), on the input embedding, on the final norm (the tail), then on the root, which holds the heads —
on gloo, runs `forward(labels=...)` on this rank's half of the global batch, backward and one SGD step, and writes
the loss summed over ranks and the gathered full adapter state dict (rank 0) to <work folder>/result.pt.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.adapter_io import BASE_PREFIXES


def main(base: str, work: str, rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{work}/store")
    model = CausalQwenForCausalLM.from_base(base)  # deterministic: the same heads on every rank
    model.model.requires_grad_(False)
    batch = torch.load(f"{work}/batch.pt")
    rows = len(batch) // world
    local = batch[rank * rows : (rank + 1) * rows]

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.model.embed_tokens)
    fully_shard([model.model.norm], reshard_after_forward=False)
    fully_shard(model)
    # What the check is about: the vocabulary-sized W_A and the heads are sharded like any weight.
    sharded = {n: type(p).__name__ == "DTensor" for n, p in model.named_parameters()}
    assert sharded["action.weight"] and sharded["abduction.loc.weight"] and all(sharded.values()), sharded

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    # Every rank scores the same number of targets, so the mean of the ranks' means (what FSDP2's gradient
    # averaging computes) is the mean over the global batch.
    loss = model(input_ids=local, labels=local).loss
    loss.backward()
    optimizer.step()

    total = loss.detach().clone()
    dist.all_reduce(total)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        adapter = {k: v.clone() for k, v in state.items() if not k.startswith(BASE_PREFIXES)}
        torch.save({"loss": (total / world).item(), "adapter": adapter}, f"{work}/result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
