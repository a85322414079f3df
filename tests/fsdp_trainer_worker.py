"""One rank of the 2-process FSDP2 Trainer checks in test_fsdp.py (run as a script, not collected by pytest).

    python tests/fsdp_trainer_worker.py <base folder> <work folder> <scenario>

The environment is what `accelerate launch --config_file recipes/configs/fsdp2.yaml` gives each process, plus a
launcher's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Accelerate switches FSDP on only on accelerators
(on CPUs it stays MULTI_CPU whatever the plugin says); `fsdp_on_cpu` applies the launch environment's plugin as it
would on GPUs, so that the Trainer runs its own FSDP2 path: `fsdp2_prepare_model`, FSDP gradient clipping, FSDP
checkpoints and their resume. Scenarios:
- `resume`: CausalSFTTrainer trains 4 steps saving every 2, then a new trainer resumes from checkpoint-2 to step 4;
  rank 0 writes the gathered heads and logged losses of both, and checkpoint-2's file names, to <work>/resume.pt;
- `recipe`: `recipes/sft_ovr.py`'s `main` to its last line (train, card, save, digest, barrier, `trainer.end()`).
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

REPO_ROOT = Path(__file__).resolve().parents[1]


def fsdp_on_cpu() -> None:
    initialise = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        initialise(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = __init__


def gathered(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "heads": model.gathered_adapter_state_dict(),  # a collective: every rank calls it
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "fsdp": trainer.is_fsdp_enabled,
    }


def resume(base: str, work: Path) -> None:
    import ddp_worker

    full = ddp_worker.build(base, work / "run", "ovr", max_steps=4, save_strategy="steps", save_steps=2)
    full.train()
    uninterrupted = gathered(full)
    resumed = ddp_worker.build(base, work / "run", "ovr", max_steps=4, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(work / "run" / "checkpoint-2"))
    result = {"full": uninterrupted, "resumed": gathered(resumed),
              "checkpoint": sorted(p.name for p in (work / "run" / "checkpoint-2").iterdir())}
    if resumed.accelerator.is_main_process:
        torch.save(result, work / "resume.pt")
    resumed.accelerator.wait_for_everyone()


def recipe(base: str, work: Path) -> None:
    spec = importlib.util.spec_from_file_location("sft_ovr_recipe", REPO_ROOT / "recipes" / "sft_ovr.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(*module.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", base, "--dataset_name", str(work / "data.jsonl"), "--output_dir", str(work / "out"),
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--report_to", "none", "--bf16", "false",
        "--use_cpu", "true", "--logging_steps", "1", "--disable_tqdm", "true", "--dataloader_pin_memory", "false",
    ]))
    print("recipe finished", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    fsdp_on_cpu()
    {"resume": resume, "recipe": recipe}[sys.argv[3]](sys.argv[1], Path(sys.argv[2]))
    # Skip interpreter finalization, as tests/fsdp_worker.py does: a gloo thread may still hold work at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
