"""What CausalSFTTrainer logs in training and evaluation on a tiny random Qwen2 with a tiny word-level tokenizer. The
OvR metrics, the warning when every OvR probability is ½, the evaluation harness's metrics of each mode, and
eval_loss as the mean over target tokens (the reference: the model's own loss, weighted by each batch's target
count).
"""


import pytest
import torch
from datasets import Dataset

from causalqwen_adapter.trainer import CausalSFTTrainer

from conftest import TOKENIZER_BASE_VOCAB as VOCAB
from trainer_helpers import _args, _prompt_completion


def test_logs_ovr_metrics_in_training_and_evaluation(sft_base, tmp_path):
    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, max_steps=2, learning_rate=0.0, gamma_init=4.0, ovr_threshold_init=0.0,
                                  ovr_relative_threshold=False, ovr_candidates=0),
        train_dataset=_prompt_completion(), eval_dataset=_prompt_completion(3),
    )
    trainer.train()
    assert trainer.model.config.ovr_candidates is None  # 0: the loss over the whole vocabulary
    first = trainer.state.log_history[0]
    for key in ("loss", "target_prob", "ovr_prob_sum", "units_mean_loc", "units_mean_scale", "num_tokens"):
        assert key in first, key
    # fresh heads: scale_U = softplus(b_scale) = gamma_init everywhere, and every P_k is near ½
    assert first["units_mean_scale"] == pytest.approx(4.0, rel=1e-5)
    assert 0 < first["target_prob"] < 1
    assert first["ovr_prob_sum"] == pytest.approx(VOCAB / 2, rel=0.1)
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_target_prob", "eval_ovr_prob_sum", "eval_units_mean_loc"} <= set(metrics)
    assert metrics["eval_units_mean_scale"] == pytest.approx(4.0, rel=1e-5)
    # the default loss, over 16 candidates and the target: Σ P over the 16 or 17 tokens it scores, each near ½
    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path / "candidates", max_steps=1, learning_rate=0.0, gamma_init=4.0,
                                  ovr_threshold_init=0.0, ovr_relative_threshold=False),
        train_dataset=_prompt_completion(),
    )
    trainer.train()
    first = trainer.state.log_history[0]
    assert "ovr_prob_sum" not in first and 16 * 0.4 < first["candidate_prob_sum"] < 17 * 0.6


@pytest.mark.parametrize("ovr_candidates", [16, 0])
def test_warns_once_when_every_ovr_probability_is_one_half(sft_base, tmp_path, caplog, ovr_candidates):
    """A scale far above the locations' spread (here from the start, as a too-fast scale path gets there) puts every
    P_k at ½: one warning naming the rates; heads at the default scale train without it."""
    from causalqwen_adapter.training import mixins

    def run(name, **heads):
        trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path / name, max_steps=2, learning_rate=1e-4,
                                                             ovr_candidates=ovr_candidates, **heads),
                                   train_dataset=_prompt_completion())
        with caplog.at_level("WARNING", logger=mixins.__name__):
            trainer.train()
        return trainer, [r for r in caplog.records if "Every OvR probability is ½" in r.getMessage()]

    trainer, warnings = run("saturated", gamma_init=1e4, b_noise_init=1e-6)
    assert [abs(h["target_prob"] - 0.5) < 1e-3 for h in trainer.state.log_history if "target_prob" in h] == [True] * 2
    assert len(warnings) == 1 and "learning_rate" in warnings[0].getMessage()
    caplog.clear()
    trainer, warnings = run("default")
    assert warnings == [] and abs(trainer.state.log_history[0]["target_prob"] - 0.5) > 0.01


def test_evaluation_logs_the_harness_metrics_of_each_mode(sft_base, tmp_path):
    from causalqwen_adapter.evaluation import evaluate

    trainer = CausalSFTTrainer(
        str(sft_base), args=_args(tmp_path, per_device_eval_batch_size=3, eval_inference_modes=["compatible", "causal"]),
        train_dataset=_prompt_completion(), eval_dataset=_prompt_completion(),
    )
    metrics = trainer.evaluate()
    expected = evaluate(trainer.model, list(trainer.get_eval_dataloader()), modes=("compatible", "causal"))
    for mode in ("compatible", "causal"):
        for name in ("top1_accuracy", "nll", "target_prob", "prob_sum_median", "ece_top1", "ece_top10", "num_tokens"):
            assert metrics[f"eval_{mode}_{name}"] == pytest.approx(expected[mode][name], rel=1e-6), (mode, name)
    # every completion token after the causal shift (the collator's labels), nothing else
    assert metrics["eval_causal_num_tokens"] == sum(
        (b["labels"][:, 1:] != -100).sum().item() for b in trainer.get_eval_dataloader()
    ) > 0
    with pytest.raises(ValueError, match="eval_inference_modes has unknown mode"):
        _args(tmp_path, eval_inference_modes=["greedy"])


def test_eval_loss_is_the_mean_over_target_tokens(sft_base, tmp_path):
    # completions of different lengths, one row per batch, and a row with nothing to score
    data = Dataset.from_dict({"text": ["hello", "the cat sat on the mat", "", "two plus two is four"]})
    trainer = CausalSFTTrainer(str(sft_base), args=_args(tmp_path, per_device_eval_batch_size=1),
                               train_dataset=data, eval_dataset=data)
    metrics = trainer.evaluate()
    total = count = 0.0
    for batch in trainer.get_eval_dataloader():
        with torch.no_grad():
            loss = trainer.model(**batch).loss.item()
        n = (batch["labels"][:, 1:] != -100).sum().item()
        total, count = total + loss * n, count + n
    assert count > 0
    assert metrics["eval_loss"] == pytest.approx(total / count, rel=1e-5)
