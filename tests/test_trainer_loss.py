"""CausalSFTTrainer's loss and gradients on a tiny random Qwen2 with a tiny word-level tokenizer.

The references are plain: the model's own forward with `labels` (the naive, materialised OvR loss), one big batch
for gradient accumulation, the cross entropy of loc_S for the softmax objective, a single process for DDP; the
parameters frozen are exactly those the loss never reaches.
"""

import os
import sys

import pytest
import torch
from transformers import TrainerCallback

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.trainer import CausalSFTTrainer
from causalqwen_adapter.training import (
    freeze_unreachable_parameters,
    unreachable_parameters,
)

from conftest import REPO_ROOT, free_port
from trainer_helpers import _args, _losses, _prompt_completion


class _GradCapture(TrainerCallback):
    """Gradients of the trainable tensors once accumulation is complete, before the optimizer step."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


HEAD_PARAMS = {"abduction.loc.weight", "abduction.loc.bias", "abduction.scale.weight", "abduction.scale.bias",
               "action.bias", "action.b_noise"}


@pytest.mark.parametrize(
    "heads, trained",
    [
        ({}, HEAD_PARAMS | {"action.weight"}),
        ({"learnable_threshold": True}, HEAD_PARAMS | {"action.weight", "ovr.threshold"}),
        ({"action_weight": "tied"}, HEAD_PARAMS),
        ({"action_weight": "lora", "action_lora_rank": 4}, HEAD_PARAMS | {"action.lora_A", "action.lora_B"}),
    ],
    ids=["full", "learnable-threshold", "tied", "lora"],
)
def test_compute_loss_matches_naive_forward(sft_base, tmp_path, heads, trained):
    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, per_device_train_batch_size=4, **heads), train_dataset=_prompt_completion()
    )
    model = trainer.model
    batch = next(iter(trainer.get_train_dataloader()))
    # completion-only masks and right padding are what is being checked
    assert (batch["labels"][batch["attention_mask"] == 1] == -100).any()
    assert (batch["attention_mask"] == 0).any()
    if "lora" in heads.get("action_weight", ""):
        with torch.no_grad():  # B starts at 0; a non-zero B·A makes the check see the low-rank path
            model.action.lora_B.normal_(std=0.01)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == trained
    params = [p for p in model.parameters() if p.requires_grad]

    loss = trainer.compute_loss(model, batch)
    grads = torch.autograd.grad(loss, params)
    reference = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    reference_grads = torch.autograd.grad(reference, params)

    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("micro_batch, accumulation", [(1, 4), (2, 2)])
def test_gradient_accumulation_matches_one_big_batch(sft_base, tmp_path, micro_batch, accumulation):
    data = _prompt_completion(4)  # completions of 2 to 5 tokens: micro-batches hold different target counts

    def grads_and_loss(name, **overrides):
        capture = _GradCapture()
        # Scales of the order of the logits: at the default 1e-5 the OvR gradients amplify the ulps by which padding
        # changes z (different batch compositions) by 1e5, which is conditioning, not accumulation.
        trainer = CausalSFTTrainer(
            str(sft_base), args=_args(tmp_path / name, max_steps=1, max_grad_norm=0.0, gamma_init=1.0,
                                      b_noise_init=0.1, **overrides),
            train_dataset=data, callbacks=[capture],
        )
        trainer.train()
        return capture.grads, _losses(trainer)[1]

    big, big_loss = grads_and_loss("big", per_device_train_batch_size=4, gradient_accumulation_steps=1)
    acc, acc_loss = grads_and_loss(
        "accumulated", per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation
    )
    assert big.keys() == acc.keys() and len(big) == 7
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-5, atol=1e-7, msg=name)
    assert acc_loss == pytest.approx(big_loss, rel=1e-5)


def test_softmax_objective_is_the_cross_entropy_of_loc_S(sft_base, tmp_path):
    trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, objective="softmax"), train_dataset=_prompt_completion())
    model = trainer.model
    assert model.config.objective == "softmax"
    batch = next(iter(trainer.get_train_dataloader()))
    loss = trainer.compute_loss(model, batch)
    with torch.no_grad():
        loc_S = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], inference_mode="compatible").logits
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    keep = targets != -100
    expected = torch.nn.functional.cross_entropy(loc_S[keep].double(), targets[keep])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert model.abduction.loc.weight.grad.abs().sum() > 0
    assert model.abduction.scale.weight.grad is None or model.abduction.scale.weight.grad.abs().sum() == 0


SCALE_PATH = ["abduction.scale.bias", "abduction.scale.weight", "action.b_noise"]
LOCATION_PATH = ["abduction.loc.bias", "abduction.loc.weight", "action.bias", "action.weight"]
NUM = 100  # <NUM> of the numeric configurations: a row of the tiny vocabulary


@pytest.mark.parametrize(
    "loss, heads, frozen",
    [
        ("sft", {}, []),
        ("sft", {"learnable_threshold": True}, []),
        ("sft", {"objective": "softmax", "learnable_threshold": True}, SCALE_PATH + ["ovr.threshold"]),
        ("sft", {"softmax_loss_weight": 0.0}, LOCATION_PATH),
        ("sft", {"softmax_loss_weight": 0.0, "action_weight": "lora", "action_lora_rank": 4},
         ["abduction.loc.bias", "abduction.loc.weight", "action.bias", "action.lora_A", "action.lora_B"]),
        ("sft", {"softmax_loss_weight": 0.0, "ovr_trains_location": True}, []),
        ("sft", {"numeric": True}, []),
        ("sft", {"numeric": True, "objective": "softmax"}, []),  # the numeric NLL reads the scale path
        ("sft", {"numeric": True, "softmax_loss_weight": 0.0}, ["action.bias", "action.weight"]),  # and loc_U
        ("sft", {"numeric": True, "numeric_loss_weight": 0.0}, ["numeric.bias", "numeric.log_scale", "numeric.weight"]),
        ("distill", {}, LOCATION_PATH),
        ("distill", {"ovr_trains_location": True, "learnable_threshold": True}, []),
    ],
    ids=["ovr", "ovr-learnable-threshold", "softmax", "softmax-weight-0", "softmax-weight-0-lora",
         "softmax-weight-0-ovr-trains-location", "numeric", "numeric-softmax", "numeric-softmax-weight-0",
         "numeric-loss-weight-0", "distill", "distill-ovr-trains-location"],
)
def test_frozen_parameters_are_exactly_those_the_loss_never_reaches(tied_base, loss, heads, frozen):
    """With every head parameter trainable, the loss gives the frozen ones no gradient (None or exact zeros) on any
    batch, and every other one a non-zero gradient on a batch that holds a <NUM> target; freezing them leaves the
    loss and the other gradients as they were."""
    if heads.get("numeric"):
        heads = {**heads, "num_token_id": NUM}
    model = CausalQwenForCausalLM.from_base(str(tied_base), gamma_init=0.5, b_noise_init=0.1, **heads)
    with torch.no_grad():
        if model.config.action_weight == "lora":
            model.action.lora_B.normal_(std=0.01)  # B = 0 at init gives A a zero gradient
        if model.config.learnable_threshold:
            model.ovr.threshold.normal_(std=0.5)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, NUM, (2, 9), generator=generator)
    ids[0, 4] = ids[0, 6] = NUM  # the second one's value is a target whose position sees the first one's input
    values = torch.zeros(ids.shape).masked_fill_(ids == NUM, 12.0)
    features = {"hidden_state": torch.randn(6, model.config.hidden_size, generator=generator),
                "topk_ids": torch.randint(0, NUM, (6, 4), generator=generator),
                "topk_probs": torch.rand(6, 4, generator=generator).softmax(-1)}

    def grads(with_number: bool):
        model.zero_grad(set_to_none=True)
        if loss == "distill":
            out = model(**features)
        else:
            batch = ids if with_number else ids.masked_fill(ids == NUM, 7)
            extra = {"numeric_values": values * (batch == NUM)} if model.config.numeric else {}
            out = model(input_ids=batch, labels=batch, **extra)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    assert sorted(unreachable_parameters(model, loss)) == sorted(frozen)
    for with_number in (True, False):
        _, all_grads = grads(with_number)
        for name in frozen:
            assert all_grads[name] is None or not all_grads[name].any(), name
    full_loss, all_grads = grads(True)
    for name, grad in all_grads.items():
        if name not in frozen:
            assert grad is not None and grad.any(), name
    assert sorted(freeze_unreachable_parameters(model, loss)) == sorted(frozen)
    frozen_loss, kept = grads(True)
    assert set(kept) == set(all_grads) - set(frozen)
    torch.testing.assert_close(frozen_loss, full_loss, rtol=1e-6, atol=0)
    for name, grad in kept.items():
        torch.testing.assert_close(grad, all_grads[name], rtol=1e-5, atol=1e-8, msg=name)


def test_ddp_step_matches_one_process_in_every_loss_configuration(sft_base, tmp_path):
    """Two CPU processes (gloo DDP, with the trainer's own find_unused_parameters) for each objective,
    softmax_loss_weight=0 and numeric heads: every step runs, and the heads equal one process accumulating the same
    two micro-batches (tests/ddp_worker.py)."""
    import ddp_worker
    from conftest import run_processes

    names = list(ddp_worker.CONFIGURATIONS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    results = run_processes(
        [([sys.executable, str(REPO_ROOT / "tests" / "ddp_worker.py"), str(sft_base), str(tmp_path), *names],
          {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(2)],
        cwd=REPO_ROOT, timeout=300, what="the DDP processes",
    )
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank}:\n{out[-2000:]}\n{err[-4000:]}"
    for name in names:
        ddp = torch.load(tmp_path / f"{name}.pt")
        single = ddp_worker.build(sft_base, tmp_path / f"{name}-single", name, gradient_accumulation_steps=2)
        single.train()
        reference = ddp_worker.result(single)
        assert ddp["find_unused"] == (name == "numeric"), name
        assert ddp["trainable"] == reference["trainable"], name
        assert sorted(ddp["losses"]) == sorted(reference["losses"]) == [1, 2], name
        for step, loss in reference["losses"].items():
            assert ddp["losses"][step] == pytest.approx(loss, rel=1e-5), (name, step)
        for key, value in reference["heads"].items():
            # Adam divides by √v: float rounding of the all-reduce shows up at 1e-6 relative in the smallest updates
            torch.testing.assert_close(ddp["heads"][key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
