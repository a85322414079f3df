"""What a run resumes from: which `checkpoint-N` folders are complete (`checkpoint_problem`,
`last_complete_checkpoint`), an explicit `resume_from_checkpoint` checked (`check_resumable`: not an adapter folder,
not a half-written checkpoint), and the optimizer and schedule state each layout writes (`missing_optimizer_state`).
`AdapterCheckpointMixin.train` (checkpoints.py) calls them before the Trainer loads anything."""

import json
import os
import re
from pathlib import Path

from transformers.trainer import OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME, TRAINER_STATE_NAME, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_NAME

from ..adapter_io import is_adapter_folder


def checkpoint_problem(folder: Path) -> str | None:
    """Why a run cannot resume from `folder`, or None. The Trainer writes a checkpoint's `trainer_state.json` last, so
    a run killed while saving leaves the adapter files (or some of them) without it; a damaged one (`null`, `{}`)
    would fail inside the Trainer."""
    for name in ("config.json", SAFE_WEIGHTS_NAME, TRAINER_STATE_NAME):
        if not (folder / name).is_file():
            return f"no {name}"
    try:
        state = json.loads((folder / TRAINER_STATE_NAME).read_text())
    except (OSError, ValueError):
        return f"{TRAINER_STATE_NAME} is unreadable"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return f"{TRAINER_STATE_NAME} holds {json.dumps(state)[:40]}, not a trainer state with a global_step"
    try:
        TrainerState(**state)
    except (TypeError, ValueError) as err:
        return f"{TRAINER_STATE_NAME} is not a trainer state this transformers reads ({err})"
    return None


def checkpoint_folders(output_dir) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir`, by N."""
    pattern = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")
    found = [p for p in Path(output_dir).iterdir() if pattern.fullmatch(p.name) and p.is_dir()] \
        if os.path.isdir(output_dir) else []
    return sorted(found, key=lambda p: int(pattern.fullmatch(p.name).group(1)))


def complete_checkpoints(output_dir) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir` a run can resume from, by N."""
    return [path for path in checkpoint_folders(output_dir) if checkpoint_problem(path) is None]


def last_complete_checkpoint(output_dir) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The `checkpoint-N` folder of `output_dir` with the highest N that a run can resume from (None if there is
    none), and the incomplete ones after it with what they lack."""
    incomplete = []
    for path in reversed(checkpoint_folders(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, incomplete[::-1]
        incomplete.append((path, problem))
    return None, incomplete[::-1]


def missing_optimizer_state(folder: Path, sharding: str | None = None, deepspeed_schedules: bool = False) -> list[str]:
    """What of the optimizer and schedule state a resume would load is not in the checkpoint `folder`, as each
    layout writes it (`_save_optimizer_and_scheduler`): DeepSpeed's `global_step*/` (its optimizer, and its scheduler
    when its config names one), FSDP's `optimizer.bin` or `optimizer_0/`, else `optimizer.pt`; and `scheduler.pt`
    unless DeepSpeed holds the scheduler. The Trainer's own test of what is there, for the last two."""
    if sharding == "deepspeed":
        missing = [] if any(p.is_dir() for p in folder.glob("global_step*")) else ["global_step*/ (DeepSpeed's state)"]
    else:
        found = (folder / OPTIMIZER_NAME).is_file() or (folder / OPTIMIZER_NAME_BIN).is_file() or any(
            p.is_dir() and OPTIMIZER_NAME_BIN.split(".")[0] in p.name for p in folder.iterdir())
        missing = [] if found else ["optimizer.bin or optimizer_0/" if sharding == "fsdp" else OPTIMIZER_NAME]
    if not (sharding == "deepspeed" and deepspeed_schedules) and not (folder / SCHEDULER_NAME).is_file():
        missing.append(SCHEDULER_NAME)
    return missing


def resume_advice(output_dir) -> str:
    """What to resume from after training stopped: the last checkpoint a run can resume from, or that there is none."""
    last, _ = last_complete_checkpoint(output_dir)
    if last is None:
        return f"train again: there is no checkpoint to resume from in {output_dir}"
    return f"resume from {last} (resume_from_checkpoint={str(last)!r})"


def from_the_heads(folder: Path, trainer: str) -> str:
    """How to train on from the heads of the adapter folder `folder` (a checkpoint is one too), with a fresh run."""
    return (f"to train on from its heads with a fresh optimizer, pass it as the model (--model_name_or_path {folder}, "
            f"or {trainer}({str(folder)!r}, ...)) without resume_from_checkpoint")


def check_resumable(checkpoint: Path, trainer: str = "CausalSFTTrainer") -> None:
    """Refuse an explicit `resume_from_checkpoint` that is not a checkpoint (a run's final adapter folder, its
    `output_dir`) or that a killed run left incomplete, naming what to pass."""
    if not checkpoint.is_dir():  # the Trainer would say "Can't find a valid checkpoint", naming neither
        raise FileNotFoundError(f"resume_from_checkpoint {str(checkpoint)!r}: "
                                f"{'a file' if checkpoint.exists() else 'no such folder'}. To resume a run, pass one "
                                f"of its {PREFIX_CHECKPOINT_DIR}-N folders (in its output_dir)")
    if not (checkpoint / TRAINER_STATE_NAME).exists() and not re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-\d+",
                                                                          checkpoint.name):
        last, _ = last_complete_checkpoint(checkpoint)
        what = "an adapter folder (a save of the heads alone)" if is_adapter_folder(checkpoint) else "a folder"
        run = (f"resume the run from its last complete checkpoint, resume_from_checkpoint={str(last)!r}" if last else
               f"resume a run, pass one of its {PREFIX_CHECKPOINT_DIR}-N folders ({checkpoint} holds none)")
        heads = f"; or, {from_the_heads(checkpoint, trainer)}" if is_adapter_folder(checkpoint) else ""
        raise ValueError(f"{checkpoint} is {what}, not a checkpoint: it has no {TRAINER_STATE_NAME} (the step, the "
                         f"schedule's position) to resume from. To {run}{heads}")
    problem = checkpoint_problem(checkpoint)
    if problem is None:
        return
    last, _ = last_complete_checkpoint(checkpoint.parent)
    what = (f"pass resume_from_checkpoint={last}, the last complete checkpoint in {checkpoint.parent}" if last else
            f"{checkpoint.parent} holds no complete checkpoint: train without resume_from_checkpoint")
    raise ValueError(f"{checkpoint} is incomplete ({problem}): it is not a checkpoint the trainer finished writing (a "
                     f"run stopped while saving, or a damaged file, leaves it so), so training cannot resume from it; "
                     f"{what}")
