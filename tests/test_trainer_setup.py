"""What CausalSFTTrainer builds from its arguments and data before training on a tiny random Qwen2 with a tiny
word-level tokenizer. The model argument's forms, the options an adapter keeps, learning rates by role, the
thresholds' calibration, precision and pinning, and the bad input it refuses (a data set with no target, a label
outside the vocabulary, a non-finite loss).
"""

import math

import pytest
import torch
from datasets import Dataset
from transformers import Qwen2ForCausalLM, TrainerCallback

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer
from causalqwen_adapter.training import (
    calibrate_threshold_on_features,
)

from trainer_helpers import _args, _prompt_completion


def test_model_argument_forms(sft_base, tmp_path):
    fresh = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, causal_size=16, gamma_init=3.0, b_noise_init=0.5, learnable_threshold=True),
        train_dataset=_prompt_completion(),
    ).model
    assert fresh.config.causal_size == 16 and fresh.config.gamma_init == 3.0
    assert torch.all(fresh.action.b_noise == 0.5) and isinstance(fresh.ovr.threshold, torch.nn.Parameter)
    assert fresh.action.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in fresh.model.parameters())

    base = Qwen2ForCausalLM.from_pretrained(str(sft_base))
    from_object = CausalSFTTrainer(base, args=_args(tmp_path), train_dataset=_prompt_completion()).model
    assert isinstance(from_object, CausalQwenForCausalLM)
    torch.testing.assert_close(from_object.action.weight, base.get_output_embeddings().weight)

    with pytest.raises(TypeError, match="CausalQwenForCausalLM"):
        CausalSFTTrainer(torch.nn.Linear(2, 2), args=_args(tmp_path), train_dataset=_prompt_completion())
    with pytest.raises(ValueError, match="peft_config"):
        CausalSFTTrainer(str(sft_base), args=_args(tmp_path, freeze_backbone=False), train_dataset=_prompt_completion())


def test_an_adapter_keeps_its_loss_and_distribution_options_unless_asked(sft_base, tmp_path):
    adapter = tmp_path / "softmax-adapter"
    CausalQwenForCausalLM.from_base(sft_base, objective="softmax", softmax_loss_weight=0.5,
                                    ovr_distribution="normalize").save_pretrained(adapter)
    kept = CausalSFTTrainer(str(adapter), args=_args(tmp_path / "a"), train_dataset=_prompt_completion()).model.config
    assert (kept.objective, kept.softmax_loss_weight, kept.ovr_distribution) == ("softmax", 0.5, "normalize")
    args = _args(tmp_path / "b", objective="ovr", ovr_distribution="accept", ovr_candidates=8)
    changed = CausalSFTTrainer(str(adapter), args=args, train_dataset=_prompt_completion()).model.config
    assert (changed.objective, changed.ovr_distribution, changed.ovr_candidates) == ("ovr", "accept", 8)
    assert kept.ovr_candidates == 16
    args = _args(tmp_path / "b0", objective="ovr", ovr_candidates=0)  # 0: the loss over the whole vocabulary
    assert CausalSFTTrainer(str(adapter), args=args, train_dataset=_prompt_completion()).model.config.ovr_candidates is None
    with pytest.raises(ValueError, match="ovr_distribution='sample': choose one of accept, accept_once, normalize"):
        CausalSFTTrainer(str(adapter), args=_args(tmp_path / "c", ovr_distribution="sample"),
                         train_dataset=_prompt_completion())
    # the threshold's reference is part of what the adapter's thresholds mean: fresh heads only
    same = CausalSFTTrainer(str(adapter), args=_args(tmp_path / "d", ovr_relative_threshold=True),
                            train_dataset=_prompt_completion()).model.config
    assert same.ovr_relative_threshold
    with pytest.raises(ValueError, match="ovr_relative_threshold=False but this adapter's thresholds were trained"):
        CausalSFTTrainer(str(adapter), args=_args(tmp_path / "e", ovr_relative_threshold=False),
                         train_dataset=_prompt_completion())
    assert not (tmp_path / "e").exists()


def test_learning_rates_by_role(sft_base, tmp_path):
    args = _args(tmp_path, learning_rate=1e-2, location_lr_ratio=1e-3, threshold_lr_ratio=0.5, learnable_threshold=True)
    trainer = CausalSFTTrainer(str(sft_base), args=args, train_dataset=_prompt_completion())
    optimizer = trainer.create_optimizer()
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    expected = {
        "abduction.loc.weight": 1e-5, "abduction.loc.bias": 1e-5, "action.weight": 1e-5,
        "abduction.scale.weight": 1e-2, "abduction.scale.bias": 1e-2, "action.b_noise": 1e-2,
        "action.bias": 1e-5, "ovr.threshold": 5e-3,
    }
    named = dict(trainer.model.named_parameters())
    assert {n for n, p in named.items() if p.requires_grad} == set(expected)
    for name, lr in expected.items():
        assert lr_of[id(named[name])] == pytest.approx(lr), name
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)  # what the Trainer logs as learning_rate
    trainer.train()  # the scheduler runs on these groups
    assert trainer.state.global_step > 0


def test_fresh_threshold_is_calibrated_on_data_unless_given(sft_base, tmp_path):
    # relative thresholds (the default) start at log ½ by design: nothing to calibrate
    relative = CausalSFTTrainer(str(sft_base), args=_args(tmp_path), train_dataset=_prompt_completion()).model
    assert relative.config.ovr_relative_threshold and relative.ovr.threshold.item() == pytest.approx(math.log(0.5))
    with pytest.raises(ValueError, match="chooses an absolute threshold"):
        calibrate_threshold_on_features(relative, torch.zeros(4, relative.config.hidden_size))
    # absolute thresholds are calibrated on the first training rows
    trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, ovr_relative_threshold=False),
                               train_dataset=_prompt_completion())
    model = trainer.model
    threshold = model.config.ovr_threshold_init
    assert torch.equal(model.ovr.threshold, torch.tensor(threshold))
    # naive reference: the agreement of every candidate threshold, on the same positions
    batches = list(trainer._calibration_batches())
    with torch.no_grad():
        z = torch.cat([
            model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state[
                torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[:, 1:] != -100]
            for b in batches
        ]).double()
        loc_S = z @ model.action.weight.double().T + model.action.bias.double()
        gamma, noise = model.config.gamma_init, model.config.b_noise_init  # uniform scale_U' = γ₀ + |b_noise|
        scale_S = (gamma + abs(noise)) * model.action.weight.double().abs().sum(-1)

        def agreement(c):
            return (((loc_S - c) / scale_S).argmax(-1) == loc_S.argmax(-1)).double().mean().item()

        candidates = torch.quantile(loc_S.max(-1).values, torch.linspace(0, 0.95, 20, dtype=torch.float64)).tolist()
    assert agreement(threshold) == pytest.approx(max(agreement(c) for c in candidates))
    assert agreement(threshold) >= agreement(0.0)
    given = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, ovr_threshold_init=-1.5, ovr_relative_threshold=False),
                             train_dataset=_prompt_completion())
    assert given.model.config.ovr_threshold_init == -1.5 and given.model.ovr.threshold.item() == -1.5


def test_learnable_absolute_thresholds_are_calibrated_in_place(sft_base, tmp_path):
    # one learnable threshold per token: the calibration fills the parameter (a leaf) without recording a graph
    trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, ovr_relative_threshold=False, learnable_threshold=True),
                               train_dataset=_prompt_completion())
    threshold = trainer.model.ovr.threshold
    assert isinstance(threshold, torch.nn.Parameter) and threshold.requires_grad and threshold.grad_fn is None
    assert torch.equal(threshold, torch.full_like(threshold, trainer.model.config.ovr_threshold_init))


def test_precision_and_pinning_follow_the_device(tmp_path):
    args = CausalSFTConfig(str(tmp_path), report_to="none")
    assert args.bf16 == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert args.dataloader_pin_memory == torch.cuda.is_available()
    assert CausalSFTConfig(str(tmp_path), report_to="none", bf16=False, dataloader_pin_memory=False).bf16 is False


@pytest.mark.parametrize(
    "data, max_length",
    [
        # the only label is at position 0, which no position predicts
        (Dataset.from_dict({"input_ids": [[5, 16, 31, 2]], "labels": [[5, -100, -100, -100]]}), None),
        # completions truncated away: TRL drops the fully masked examples and nothing is left
        (Dataset.from_dict({"prompt": ["what is two plus two is four"], "completion": [" four"]}), 3),
    ],
    ids=["only-position-0", "truncated-away"],
)
def test_dataset_without_targets_fails_before_training(sft_base, tmp_path, data, max_length):
    with pytest.raises(ValueError, match="no trainable target token"):
        CausalSFTTrainer(str(sft_base), args=_args(tmp_path, max_length=max_length), train_dataset=data)


def test_label_outside_vocabulary_fails_before_training(sft_base, tmp_path):
    data = Dataset.from_dict({"input_ids": [[5, 16, 31, 2], [5, 16, 31, 2]], "labels": [[5, 16, 31, 2], [5, 16, 500, 2]]})
    with pytest.raises(ValueError, match=r"example 1 has label 500, outside the model's vocabulary \[0, 128\)"):
        CausalSFTTrainer(str(sft_base), args=_args(tmp_path), train_dataset=data)


def test_non_finite_loss_stops_training_naming_the_step(sft_base, tmp_path):
    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                with torch.no_grad():
                    model.abduction.loc.weight[0, 0] = float("nan")

    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, max_steps=5), train_dataset=_prompt_completion(), callbacks=[Poison()]
    )
    with pytest.raises(FloatingPointError, match="training loss is nan at step 3"):
        trainer.train()
    assert trainer.state.global_step == 2
