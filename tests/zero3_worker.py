"""One rank of the 2-process DeepSpeed ZeRO-3 check in test_zero3.py (run as a script, not collected by pytest).

    python tests/zero3_worker.py <base folder> <work folder> <rank> <world size> <heads options as JSON>

DeepSpeed's CPU accelerator over gloo: every parameter partitioned (no persistence threshold), `forward(labels=...)`
on this rank's half of the global batch, DeepSpeed's backward and one SGD step (no clipping, as in the one-process
reference), then the adapter's tensors alone gathered on every rank; rank 0 writes them and the loss to
<work folder>/result.pt.
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder  # noqa: E402

from causalqwen_adapter import CausalQwenForCausalLM  # noqa: E402


def main(base: str, work: str, rank: int, world: int, options: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{work}/store")
    # DeepSpeed's CPU backend would JIT-build its shared-memory all-reduce into ~/.cache/torch_extensions on every new
    # venv, behind a lock file that a killed build leaves for ever (CI hung on one); gloo alone is what is tested here.
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the group above
    torch.manual_seed(0)  # as the Trainer seeds before building the model: the same heads on every rank (LoRA's A)
    model = CausalQwenForCausalLM.from_base(base, **options)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    assert all(p.ds_tensor.numel() < p.numel() for p in model.parameters() if p.numel() > 1)  # partitioned
    batch = torch.load(f"{work}/batch.pt")
    rows = len(batch) // world
    local = batch[rank * rows : (rank + 1) * rows]
    loss = engine(input_ids=local, labels=local).loss
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    adapter = engine.module.gathered_adapter_state_dict()
    if rank == 0:
        torch.save({"loss": (total / world).item(), "adapter": adapter}, f"{work}/result.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as fsdp_worker.py: no interpreter finalization under a live gloo thread
