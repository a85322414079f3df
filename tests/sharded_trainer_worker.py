"""One rank of the 2-process checks of CausalSFTTrainer under FSDP2 (test_fsdp.py) and DeepSpeed ZeRO-3
(test_zero3.py), run as a script, not collected by pytest:

    python tests/sharded_trainer_worker.py <base folder> <work folder> <fsdp2|zero3> <resume|resume_only_model|best|recipe>

The environment is what `accelerate launch --config_file recipes/configs/<fsdp2|deepspeed_zero3>.yaml` gives each
process (`launch_environment`, built by accelerate's own launcher code), plus a launcher's RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so that the Trainer runs its own sharded path: accelerate's preparation,
clipping, checkpoints and their resume. Two things differ from GPUs, and only in how the processes talk:
- FSDP2: accelerate switches FSDP on only on accelerators (on CPUs it stays MULTI_CPU whatever the plugin says);
  `fsdp_on_cpu` applies the launch environment's plugin as it would on GPUs;
- ZeRO-3: DeepSpeed's CPU accelerator, the Trainer's process group on gloo (`ddp_backend`), and `use_cpu` off (on, it
  would keep DeepSpeed off).
Scenarios:
- `resume`: 4 steps saving every 2, then a new trainer resumes from checkpoint-2 to step 4; rank 0 writes the gathered
  heads and logged losses of both, and checkpoint-2's files, to <work>/resume.pt;
- `resume_only_model`: the same, the resumed trainer with `resume_only_model` (heads and step from checkpoint-2, a
  fresh optimizer and schedule); rank 0 writes both runs' losses and learning rates to <work>/resume_only_model.pt;
- `best`: `load_best_model_at_end`, the first of two checkpoints the best; rank 0 writes the gathered heads after
  training and the best checkpoint's path to <work>/best.pt;
- `recipe`: `causalqwen train`'s `run` (causalqwen_adapter/cli/train.py) to its last line (train, card, save, digest, barrier, `trainer.end()`).
"""

import os
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "recipes" / "configs"
CONFIG_FILES = {"fsdp2": CONFIGS / "fsdp2.yaml", "zero3": CONFIGS / "deepspeed_zero3.yaml"}


def launch_environment(config_file: Path) -> dict:
    """The environment `accelerate launch --config_file <config_file>` gives each training process (FSDP_*,
    ACCELERATE_*), built by accelerate's own launcher code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as `launch_command` sets it
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}


def run_ranks(base: Path, work: Path, engine: str, scenario: str, **overrides: str) -> list[tuple[int, str, str]]:
    """Both ranks of this worker (float32: gloo here, and one process is the reference); fails on a rank's error.
    `overrides`: launch-environment variables that differ from the shipped config's."""
    from conftest import free_port, run_processes

    env = {**os.environ, **launch_environment(CONFIG_FILES[engine]), **overrides, "ACCELERATE_MIXED_PRECISION": "no",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu"}
    argv = [sys.executable, str(Path(__file__).resolve()), str(base), str(work), engine, scenario]
    results = run_processes([(argv, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(2)],
                            cwd=REPO_ROOT, timeout=300, what=f"the {engine} trainer workers ({scenario})")
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank}:\n{out[-2000:]}\n{err[-4000:]}"
    return results


def check_resumed_as_uninterrupted(base: Path, work: Path) -> dict:
    """The `resume` scenario's result, checked: 4 sharded steps equal one process accumulating the same micro-batches;
    resumed from checkpoint-2 (adapter tensors, the optimizer's moments, the schedule), steps 3 and 4 are the
    uninterrupted run's. Returns checkpoint-2's files and their sizes."""
    import pytest

    import ddp_worker

    result = torch.load(work / "resume.pt", weights_only=False)
    full, resumed = result["full"], result["resumed"]
    assert full["sharded"] and resumed["sharded"]
    assert sorted(resumed["losses"]) == sorted(full["losses"]) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed["losses"][step] == pytest.approx(full["losses"][step], rel=1e-6), step
    for key, value in full["heads"].items():
        torch.testing.assert_close(resumed["heads"][key], value, rtol=1e-6, atol=1e-7, msg=key)

    single = ddp_worker.build(base, work / "single", "ovr", max_steps=4, gradient_accumulation_steps=2)
    single.train()
    reference = ddp_worker.result(single)
    for step, loss in reference["losses"].items():
        assert full["losses"][step] == pytest.approx(loss, rel=1e-5), step
    for key, value in reference["heads"].items():
        # Adam divides by √v: float rounding of the gradient reduction shows up at 1e-6 relative in the smallest steps
        torch.testing.assert_close(full["heads"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    return result["checkpoint"]


def check_resumed_only_model(work: Path) -> None:
    """The `resume_only_model` scenario's result: step 3 scores checkpoint-2's heads (the uninterrupted run's loss),
    at the fresh schedule's first rate (the uninterrupted run was halfway down), and step 4 follows a fresh Adam step."""
    import pytest

    logged = torch.load(work / "resume_only_model.pt", weights_only=False)
    full, resumed = logged["full"], logged["resumed"]
    assert sorted(resumed["loss"]) == [1, 2, 3, 4]
    assert resumed["loss"][3] == pytest.approx(full["loss"][3], rel=1e-6)
    assert resumed["loss"][4] != pytest.approx(full["loss"][4], rel=1e-6)
    assert full["learning_rate"][3] == pytest.approx(0.5e-2) and resumed["learning_rate"][3] == pytest.approx(1e-2)


def check_recipe_ran(results: list[tuple[int, str, str]], work: Path) -> None:
    """The `recipe` scenario ran to its last line on both ranks, which printed the same digest of the gathered heads;
    the adapter folder loads as remote code and its card names the data."""
    import re

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    stdout = "".join(out for _, out, _ in results)
    digests = dict(re.findall(r"rank (\d)/2: adapter sha256 ([0-9a-f]{64})", stdout))
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"], stdout[-2000:]
    assert stdout.count("recipe finished") == 2
    loaded = AutoModelForCausalLM.from_pretrained(work / "out", trust_remote_code=True)
    assert set(load_file(work / "out" / "model.safetensors")) == set(loaded.adapter_state_dict())
    assert "data.jsonl" in (work / "out" / "README.md").read_text()


def write_recipe_data(work: Path) -> None:
    import json

    from conftest import PAIRS

    with open(work / "data.jsonl", "w") as f:
        for prompt, completion in PAIRS:
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")


def fsdp_on_cpu() -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    initialise = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        initialise(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = __init__


def deepspeed_on_cpu() -> dict:
    import deepspeed
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    # as tests/zero3_worker.py: no JIT build of DeepSpeed's shared-memory all-reduce; gloo is what is tested
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    return {"use_cpu": False, "ddp_backend": "gloo"}


BUILT_FROM = {}  # whether the base the heads were built on was partitioned (ZeRO-3 zero3_init_flag) when they were


def record_base_partitioning() -> None:
    from causalqwen_adapter import CausalQwenForCausalLM

    from_base = CausalQwenForCausalLM.from_base.__func__

    def spy(cls, base, **kwargs):
        BUILT_FROM["partitioned"] = hasattr(base.get_output_embeddings().weight, "ds_id")
        return from_base(cls, base, **kwargs)

    CausalQwenForCausalLM.from_base = classmethod(spy)


def gathered(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "base_partitioned_at_load": BUILT_FROM.get("partitioned"),
        "heads": model.gathered_adapter_state_dict(),  # a collective: every rank calls it
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        # every parameter a shard: an FSDP2 DTensor or a ZeRO-3 partition (not a DDP replica)
        "sharded": all(type(p).__name__ == "DTensor" or hasattr(p, "ds_tensor") for p in model.parameters()),
    }


def resume(base: str, work: Path, device_args: dict) -> None:
    import ddp_worker

    options = dict(max_steps=4, save_strategy="steps", save_steps=2, **device_args)
    full = ddp_worker.build(base, work / "run", "ovr", **options)
    full.train()
    uninterrupted = gathered(full)
    resumed = ddp_worker.build(base, work / "run", "ovr", **options)
    resumed.train(resume_from_checkpoint=str(work / "run" / "checkpoint-2"))
    checkpoint = work / "run" / "checkpoint-2"
    result = {"full": uninterrupted, "resumed": gathered(resumed),
              "checkpoint": {str(p.relative_to(checkpoint)): p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()}}
    if resumed.accelerator.is_main_process:
        torch.save(result, work / "resume.pt")
    resumed.accelerator.wait_for_everyone()


def resume_only_model(base: str, work: Path, device_args: dict) -> None:
    """`resume_only_model`: 4 steps saving every 2, then a new trainer resumes checkpoint-2's heads with a fresh
    optimizer and schedule; rank 0 writes both runs' losses and learning rates to <work>/resume_only_model.pt."""
    import ddp_worker

    options = dict(max_steps=4, save_strategy="steps", save_steps=2, **device_args)
    full = ddp_worker.build(base, work / "run", "ovr", **options)
    full.train()
    resumed = ddp_worker.build(base, work / "run", "ovr", resume_only_model=True, **options)
    resumed.train(resume_from_checkpoint=str(work / "run" / "checkpoint-2"))
    logged = {name: {key: {h["step"]: h[key] for h in trainer.state.log_history if key in h}
                     for key in ("loss", "learning_rate")} for name, trainer in (("full", full), ("resumed", resumed))}
    if resumed.accelerator.is_main_process:
        torch.save(logged, work / "resume_only_model.pt")
    resumed.accelerator.wait_for_everyone()


def best(base: str, work: Path, device_args: dict) -> None:
    """`load_best_model_at_end` with the first checkpoint the best (greater eval loss is better, and it falls)."""
    import ddp_worker

    trainer = ddp_worker.build(base, work / "run", "ovr", evaluate=True, max_steps=4, save_strategy="steps", save_steps=2,
                               eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                               metric_for_best_model="eval_loss", greater_is_better=True, **device_args)
    trainer.train()
    result = {**gathered(trainer), "best": trainer.state.best_model_checkpoint}
    if trainer.accelerator.is_main_process:
        torch.save(result, work / "best.pt")
    trainer.accelerator.wait_for_everyone()


def recipe(base: str, work: Path, device_args: dict) -> None:
    from causalqwen_adapter.cli import train as module

    flags = [f"--{k}={v}" for k, v in device_args.items()] or ["--use_cpu", "true"]
    module.run(*module.make_parser().parse_args_and_config(args=[
        "--model_name_or_path", base, "--dataset_name", str(work / "data.jsonl"), "--output_dir", str(work / "out"),
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--report_to", "none", "--bf16", "false",
        "--logging_steps", "1", "--disable_tqdm", "true", "--dataloader_pin_memory", "false", *flags,
    ]))
    print("recipe finished", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    engine, scenario = sys.argv[3], sys.argv[4]
    if engine == "fsdp2":
        fsdp_on_cpu()
        device_args = {}
    else:
        device_args = deepspeed_on_cpu()
    record_base_partitioning()
    {"resume": resume, "resume_only_model": resume_only_model, "best": best, "recipe": recipe}[scenario](sys.argv[1], Path(sys.argv[2]), device_args)
    # Skip interpreter finalization, as tests/fsdp_worker.py does: a gloo thread may still hold work at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
