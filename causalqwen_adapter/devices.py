"""The device a recipe runs on: `--device auto|cpu|cuda|cuda:1|mps|...`, checked against what the machine has."""

import os

import torch

AUTO = "auto"


def available_devices() -> list[str]:
    """The devices this process can use: cpu, every CUDA device by index, mps (Apple) and xpu (Intel) when present."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        names += [f"xpu:{i}" for i in range(xpu.device_count())]
    return names


def _local_index() -> int | None:
    """The process's device index under a launcher (`accelerate launch`, `torchrun`: LOCAL_RANK), else None."""
    local = os.environ.get("LOCAL_RANK")
    return int(local) if local not in (None, "") else None


def resolve_device(spec: str | torch.device | None = AUTO) -> torch.device:
    """`spec` as a `torch.device`, or a ValueError naming it and the devices this machine has.

    `auto` (or None): CUDA when available, else MPS, else the CPU. A device type without an index (`auto`'s choice,
    `cuda`) is the process's own device under a launcher (`cuda:$LOCAL_RANK`, as accelerate's
    `PartialState().device`), the current one otherwise; `cuda:1` is that device.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == AUTO):
        if torch.cuda.is_available():
            spec = "cuda"
        elif "mps" in available_devices():
            spec = "mps"
        else:
            return torch.device("cpu")
    try:
        device = torch.device(spec.strip() if isinstance(spec, str) else spec)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device {spec!r} is not a device name: use auto, cpu, cuda, cuda:1, mps, ... "
                         f"(this machine has {', '.join(available_devices())})") from err
    if device.type == "cpu":
        return torch.device("cpu")
    backend = {"cuda": torch.cuda, "mps": getattr(torch.backends, "mps", None)}.get(device.type,
                                                                                  getattr(torch, device.type, None))
    available = available_devices()
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ValueError(f"--device {spec}: no {device.type} device on this machine (available: {', '.join(available)})")
    if device.type == "mps":
        return device
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    index = device.index
    if index is None:
        local = _local_index()
        index = local if local is not None else (backend.current_device() if hasattr(backend, "current_device") else 0)
    if not 0 <= index < count:
        raise ValueError(f"--device {spec}: {device.type}:{index} does not exist, this machine has {count} {device.type} "
                         f"device(s) (available: {', '.join(available)})")
    return torch.device(device.type, index)


def add_device_argument(parser) -> None:
    """The subcommands' `--device` flag on an argparse parser."""
    parser.add_argument("--device", default=AUTO, help=DEVICE_HELP)


DEVICE_HELP = ("Where the model runs: auto (CUDA if available, else MPS, else CPU), cpu, cuda, cuda:1, mps, ... Under "
               "a launcher a bare device type is each process's own device (cuda:$LOCAL_RANK).")


__all__ = ["DEVICE_HELP", "add_device_argument", "available_devices", "resolve_device"]
