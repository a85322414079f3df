"""One rank of the 2-process DDP checks of test_trainer_loss.py (run as a script, not collected by pytest).

    python tests/ddp_worker.py <base folder> <work folder> <configuration>...

The environment is a launcher's (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the Trainer starts gloo DDP
itself. For each configuration (a name of CONFIGURATIONS), CausalSFTTrainer trains two steps of two examples per
process with the trainer's own DDP settings, and the first process saves the heads, the logged losses and what was
frozen to <work folder>/<configuration>.pt. `build` is also the single-process reference of the test.
"""

import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from causalqwen_adapter.numeric import add_num_token, encode_with_numbers
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

from conftest import PAIRS

# The configurations whose loss leaves parameters without a gradient; a learnable threshold where the loss cannot
# reach it too.
CONFIGURATIONS = {
    "ovr": dict(learnable_threshold=True),
    "ovr_vocabulary": dict(learnable_threshold=True, ovr_candidates=0),  # the OvR loss over every token
    "softmax": dict(objective="softmax", learnable_threshold=True),
    "softmax_loss_weight=0": dict(softmax_loss_weight=0.0),
    "numeric": dict(numeric=True),
}


def build(base, output_dir, name: str, evaluate: bool = False, **overrides) -> CausalSFTTrainer:
    """The trainer of configuration `name` on the test sentences (also its evaluation set if `evaluate`), as every rank
    builds it."""
    values = dict(
        bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_pin_memory=False, per_device_train_batch_size=2, learning_rate=1e-2, seed=0, max_steps=2,
        **CONFIGURATIONS[name],
    )
    values.update(overrides)
    tokenizer = AutoTokenizer.from_pretrained(base)
    if values.get("numeric"):
        # One row in eight holds a number: over two steps of 2 × 2 rows, some rank's batch has no <NUM> target
        # while the other's has one, and one step has none anywhere.
        values["num_token_id"] = len(tokenizer)
        add_num_token(tokenizer, values["num_token_id"])
        texts = [p + c for p, c in PAIRS]
        texts[3] = "a dog ran 12 times in the park"
        data = Dataset.from_list([encode_with_numbers(tokenizer, t, values["num_token_id"]) for t in texts])
    else:
        data = Dataset.from_dict({"prompt": [p for p, _ in PAIRS], "completion": [c for _, c in PAIRS]})
    return CausalSFTTrainer(str(base), args=CausalSFTConfig(str(output_dir), **values), train_dataset=data,
                            eval_dataset=data if evaluate else None, processing_class=tokenizer)


def result(trainer: CausalSFTTrainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "heads": {k: v.detach().clone() for k, v in model.adapter_state_dict().items()},
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "find_unused": trainer.args.ddp_find_unused_parameters,
    }


def main(base: str, work: str, names: list[str]) -> None:
    for name in names:
        trainer = build(base, Path(work) / name, name)
        assert trainer.accelerator.num_processes == 2, "run through test_trainer_loss.py: it sets the launch environment"
        trainer.train()
        if trainer.accelerator.is_main_process:
            torch.save(result(trainer), Path(work) / f"{name}.pt")
        trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    # Skip interpreter finalization, as tests/fsdp_worker.py does: a gloo thread may still hold work at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
