"""Reading parameters under sharded training (FSDP2, DeepSpeed ZeRO-3).

Both engines hold each parameter as a shard and gather it only around its own module's forward. The heads therefore
compute everything that reads their parameters inside a forward (`HeadModule.read`); these two helpers cover the one
tensor that belongs to another module: the base's output embedding, frozen, that `tied` and `lora` action weights read.

Shipped as remote code: imports only the standard library and torch (DeepSpeed is only reached when it is the engine
that partitioned the parameter, so it is already imported).
"""

import contextlib
import sys

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support
    DTensor = ()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 shard (a DTensor) is all-gathered (a collective: every rank must call it), anything
    else is returned as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def is_partitioned(tensor: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 holds this parameter partitioned (whole or not at this moment)."""
    return hasattr(tensor, "ds_id")


def whole_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """A tensor's shape, or the whole shape of a ZeRO-3 partition (which may hold none of it here)."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def gathered(*params: torch.Tensor):
    """A context in which DeepSpeed ZeRO-3 partitioned parameters hold their whole value (read-only; every rank must
    enter it); a no-op for any other tensor."""
    # a parameter ZeRO-3 holds whole already (its module is running) is read as it is: gathering it again would
    # release it under that module on exit
    partitioned = [p for p in params if is_partitioned(p) and p.ds_status.name != "AVAILABLE"]
    if not partitioned:
        return contextlib.nullcontext()
    return sys.modules["deepspeed"].zero.GatheredParameters(partitioned, modifier_rank=None)


def gathered_tensors(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole, detached copies of the given tensors (FSDP2 shards all-gathered, ZeRO-3 partitions gathered), one at a
    time: only these tensors are ever gathered, never the rest of the model. Every rank must call it with the same
    names in the same order."""
    whole = {}
    for name, tensor in named.items():
        with gathered(tensor):
            whole[name] = full_tensor(tensor.detach()).clone()
    return whole


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor, without communication: an FSDP2 DTensor's local shard, a ZeRO-3 parameter's
    partition, anything else whole."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return getattr(tensor, "ds_tensor", tensor)


def distribute_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor every rank holds) laid out like ``param``: this rank's shard of it where ``param`` is
    an FSDP2 DTensor, else ``value`` itself."""
    if not isinstance(param, DTensor):
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(device=param.device, dtype=param.dtype)
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)  # no communication


class HeadModule(nn.Module):
    """A head whose parameters are also read beyond its plain forward (the losses, the decision scores).

    `module.read(fn, *tensors)` returns `fn(module, *tensors)` computed inside `module(...)`, so that FSDP2 and ZeRO-3
    have gathered the module's parameters (and hook their gradients) exactly as for its forward. Every subclass starts
    its `forward` with `if read is not None: return read(self, *args)`.
    """

    def read(self, fn, *tensors):
        return self(*tensors, read=fn)


__all__ = ["DTensor", "HeadModule", "distribute_like", "full_tensor", "gathered", "gathered_tensors",
           "local_shard"]
