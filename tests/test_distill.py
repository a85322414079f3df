"""Offline feature distillation (docs/design.md, Offline distillation): the top-K MSE, feature extraction, CausalDistillTrainer, recipes.

References are plain: the float64 OvR probabilities of the whole vocabulary gathered at the top-K ids, the teacher run
on each sequence alone, and a hand-written SGD step.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.distill import CausalDistillConfig, CausalDistillTrainer
from causalqwen_adapter.features import FEATURES_CONFIG_NAME, extract_features, features_info, load_features
from causalqwen_adapter.losses import DecisionHead, log_partition, topk_mse_loss

from conftest import PAIRS, TINY_HIDDEN, TINY_VOCAB, save_tiny_qwen2

REPO_ROOT = Path(__file__).resolve().parents[1]
SEQUENCES = [[5, 9, 17, 3, 44, 60, 2], [7, 8], [100, 101, 102, 103, 104], [12], [30, 31, 32, 33]]


def _naive_topk_mse(loc_U, scale_U, weight, bias, b_noise, threshold, ids, probs, tail_weight=0.0, relative=False):
    """Full-vocabulary scores in float64, then gather (and a mask for the tail): the obvious implementation.
    `relative` thresholds compare with loc_S − logsumexp(loc_S), the log-partition a reference without gradient."""
    scale = scale_U + b_noise.abs()
    loc_S = loc_U @ weight.T + bias
    scale_S = scale @ weight.abs().T
    if relative:
        loc_S = loc_S - loc_S.logsumexp(-1, keepdim=True).detach()
    P = 0.5 + torch.atan((loc_S - threshold) / scale_S) / math.pi
    mse = ((P.gather(1, ids) - probs) ** 2).sum(1).mean()
    outside = torch.ones_like(P, dtype=torch.bool).scatter_(1, ids, False)
    tail = (-torch.log1p(-P) * outside).sum(1).mean()
    return mse + tail_weight * tail, P


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory):
    # No pad id: transformers would zero its embedding row, a degenerate row of W_A (scale_S = 0) whose floored
    # scale makes the naive float64 reference's gradient NaN; real Qwen2 bases have no zero row.
    folder = save_tiny_qwen2(tmp_path_factory.mktemp("distill-base"), seed=3, pad_token_id=None)
    return folder, Qwen2ForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def features(tiny_teacher, tmp_path_factory):
    folder, teacher = tiny_teacher
    out = tmp_path_factory.mktemp("features") / "store"
    extract_features(teacher, Dataset.from_dict({"input_ids": SEQUENCES}), out, top_k=6, batch_size=2)
    return out


def _args(output_dir, **overrides) -> CausalDistillConfig:
    values = dict(
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_pin_memory=False, per_device_train_batch_size=8, seed=0,
    )
    values.update(overrides)
    return CausalDistillConfig(str(output_dir), **values)


# --------------------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("tail_weight", [0.0, 0.7])
@pytest.mark.parametrize("learnable_threshold", [False, True])
def test_topk_mse_and_gradients_match_float64_reference(learnable_threshold, tail_weight, relative):
    g = torch.Generator().manual_seed(0)
    N, C, V, K = 7, 5, 40, 4
    loc_U = torch.randn(N, C, generator=g, requires_grad=True)
    scale_U = (torch.rand(N, C, generator=g) + 0.1).requires_grad_()
    weight = torch.randn(V, C, generator=g, requires_grad=True)
    bias = torch.randn(V, generator=g, requires_grad=True)
    b_noise = torch.randn(C, generator=g, requires_grad=True)
    threshold = (torch.randn(V, generator=g) if learnable_threshold else torch.tensor(0.3)).requires_grad_(learnable_threshold)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    probs = torch.softmax(torch.randn(N, K, generator=g), -1)
    tensors = [loc_U, scale_U, weight, bias, b_noise, threshold]

    # tiles smaller than the problem, so the kernel's chunking is exercised
    head = DecisionHead(*tensors[2:])
    offset = log_partition(loc_U, head, chunk_size=3) if relative else None
    loss, stats = topk_mse_loss(loc_U, scale_U, head, ids, probs, tail_weight=tail_weight, chunk_size=3,
                                threshold_offset=offset)
    grads = torch.autograd.grad(loss, [t for t in tensors if t.requires_grad])

    ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]
    ref, P = _naive_topk_mse(*ref_inputs, ids, probs.double(), tail_weight, relative)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_inputs if t.requires_grad])
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-7)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    picked = P.gather(1, ids)
    assert stats["top1_match"].item() == pytest.approx((picked.argmax(1) == 0).double().mean().item())
    assert stats["topk_prob_sum"].item() == pytest.approx(picked.sum(1).mean().item(), rel=1e-5)
    if tail_weight:
        assert stats["ovr_prob_sum"].item() == pytest.approx(P.sum(1).mean().item(), rel=1e-5)
    else:
        assert "ovr_prob_sum" not in stats


def test_topk_mse_rejects_bad_shapes_and_ids():
    loc = torch.zeros(3, 4)
    weight = torch.randn(10, 4)
    with pytest.raises(ValueError, match=r"topk_ids and topk_probs \[N, K\] for 3 positions"):
        topk_mse_loss(loc, loc + 1, DecisionHead(weight, None, torch.zeros(4), 0.0), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        topk_mse_loss(loc, loc + 1, DecisionHead(weight, None, torch.zeros(4), 0.0), torch.full((3, 2), 10), torch.zeros(3, 2))


# --------------------------------------------------------------------------------------- extraction


def test_extracted_rows_equal_the_teacher_run_on_each_sequence_alone(tiny_teacher, features):
    _, teacher = tiny_teacher
    stored = load_features(features)
    assert len(stored) == sum(map(len, SEQUENCES))
    row = 0
    with torch.no_grad():
        for seq in SEQUENCES:  # batched with right padding at extraction; alone here
            ids = torch.tensor([seq])
            z = teacher.model(input_ids=ids).last_hidden_state[0]
            probs = torch.softmax(teacher.lm_head(z).double(), -1)
            top_p, top_i = probs.topk(6, -1)
            got = stored[row : row + len(seq)]
            torch.testing.assert_close(got["hidden_state"], z, rtol=1e-5, atol=1e-5)
            assert torch.equal(got["topk_ids"].long(), top_i)
            torch.testing.assert_close(got["topk_probs"].double(), top_p, rtol=1e-5, atol=1e-7)
            row += len(seq)
    info = features_info(features)
    assert (info["hidden_size"], info["vocab_size"], info["top_k"], info["num_tokens"], info["num_sequences"]) == (
        TINY_HIDDEN, TINY_VOCAB, 6, len(stored), len(SEQUENCES))


def test_extracts_from_texts_with_the_teachers_tokenizer(sft_base, tmp_path):
    texts = [p + c for p, c in PAIRS[:3]]
    stored = extract_features(str(sft_base), texts, tmp_path / "f", top_k=3, max_length=4, feature_dtype="float16")
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    lengths = [min(len(tokenizer(t)["input_ids"]), 4) for t in texts]
    assert len(stored) == sum(lengths)
    assert stored.features["hidden_state"].feature.dtype == "float16"
    teacher = Qwen2ForCausalLM.from_pretrained(sft_base)
    with torch.no_grad():
        z = teacher.model(input_ids=torch.tensor([tokenizer(texts[0])["input_ids"][:4]])).last_hidden_state[0]
    torch.testing.assert_close(stored[: lengths[0]]["hidden_state"].float(), z, rtol=1e-3, atol=1e-3)


def test_existing_folder_is_refused_or_replaced_whole(tiny_teacher, tmp_path):
    _, teacher = tiny_teacher
    out = tmp_path / "store"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    data = Dataset.from_dict({"input_ids": SEQUENCES[:2]})
    with pytest.raises(FileExistsError, match="overwrite=True"):
        extract_features(teacher, data, out, top_k=2)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(FileExistsError, match="is not a feature store"):  # someone else's folder: never replaced
        extract_features(teacher, data, out, top_k=2, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    extract_features(teacher, data, out, top_k=2)  # an empty folder is fine
    extract_features(teacher, data, out, top_k=3, overwrite=True)  # a store extract_features wrote: replaced whole
    assert json.loads((out / FEATURES_CONFIG_NAME).read_text())["top_k"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # no staging folder left behind


def test_failure_midway_leaves_no_folder(tiny_teacher, tmp_path):
    _, teacher = tiny_teacher

    def texts():
        yield {"input_ids": [1, 2, 3]}
        raise RuntimeError("corpus read error")

    from datasets import IterableDataset

    data = IterableDataset.from_generator(texts)
    with pytest.raises(RuntimeError, match="corpus read error"):
        extract_features(teacher, data, tmp_path / "store", top_k=2, batch_size=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs, data, error",
    [
        ({"top_k": 0}, None, r"top_k must be an integer in \[1, 128\]"),
        ({"top_k": TINY_VOCAB + 1}, None, r"top_k must be an integer in \[1, 128\]"),
        ({"feature_dtype": "bfloat16"}, None, "feature_dtype must be one of float32, float16"),
        ({"batch_size": 0}, None, "batch_size must be a positive integer"),
        ({}, {"prompt": ["a"]}, r"no 'text' or 'input_ids' column \(columns: \['prompt'\]\)"),
        ({}, {"input_ids": [[]]}, "holds no token"),
    ],
    ids=["top-k-0", "top-k-over-vocab", "feature-dtype", "batch-size", "no-text-column", "empty"],
)
def test_bad_extraction_arguments(tiny_teacher, tmp_path, kwargs, data, error):
    _, teacher = tiny_teacher
    dataset = Dataset.from_dict(data or {"input_ids": SEQUENCES})
    with pytest.raises(ValueError, match=error):
        extract_features(teacher, dataset, tmp_path / "store", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_teacher_must_be_a_supported_base(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="'bert' checkpoint, an encoder .bidirectional attention.: CausalQwen heads"):
        extract_features(str(tmp_path / "bert"), ["a"], tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_load_features_refuses_other_folders(tmp_path):
    Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(FileNotFoundError, match="not a feature store written by extract_features"):
        load_features(tmp_path / "plain")


# --------------------------------------------------------------------------------------- training


def test_one_sgd_step_matches_the_hand_computed_update(tiny_teacher, features, tmp_path):
    folder, _ = tiny_teacher
    trainer = CausalDistillTrainer(
        str(folder),
        args=_args(tmp_path, optim="sgd", learning_rate=0.5, max_steps=1, max_grad_norm=0.0, weight_decay=0.0,
                   lr_scheduler_type="constant", per_device_train_batch_size=64),
        train_dataset=str(features),
    )
    model = trainer.model
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # The reference: the same heads, the whole store as one batch, autograd through the naive loss.
    ref = CausalQwenForCausalLM.from_base(str(folder), gamma_init=model.config.gamma_init,
                                        b_noise_init=model.config.b_noise_init)
    rows = load_features(features)[:]
    loc_U, scale_U = ref.abduction(rows["hidden_state"])
    params = dict(ref.named_parameters())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    # float64 past the heads: in float32, ½ + atan(x)/π rounds the tail's tiny P_k to multiples of 6e-8
    assert not ref.config.ovr_trains_location  # the default: the locations get no gradient
    loc_U = loc_U.detach()
    ref_loss, _ = _naive_topk_mse(
        loc_U.double(), scale_U.double(), ref.action.weight.detach().double(), ref.action.bias.detach().double(),
        ref.action.b_noise.double(), ref.ovr.threshold.double(), rows["topk_ids"].long(), rows["topk_probs"].double(),
        ref.config.distill_tail_weight, ref.config.ovr_relative_threshold,
    )
    assert ref.config.distill_tail_weight > 0  # the default: the tail term is part of the update
    grads = torch.autograd.grad(ref_loss, [params[n] for n in trainable], allow_unused=True)
    grads = {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(trainable, grads)}
    trainer.train()

    # the location path, which the loss never reaches without ovr_trains_location, is frozen
    assert sorted(trainable) == ["abduction.scale.bias", "abduction.scale.weight", "action.b_noise"]
    assert trainer.state.log_history[0]["loss"] == pytest.approx(ref_loss.item(), rel=1e-5)
    assert {"tail_loss", "ovr_prob_sum", "top1_match"} <= set(trainer.state.log_history[0])
    after = model.state_dict()
    for name in trainable:
        torch.testing.assert_close(after[name], before[name] - 0.5 * grads[name].float(), rtol=1e-5, atol=1e-6)
    for name in ("abduction.loc.weight", "abduction.loc.bias", "action.weight", "action.bias"):
        assert torch.equal(after[name], before[name]), name  # the locations keep the teacher's ranking
    assert not torch.equal(after["action.b_noise"], before["action.b_noise"])  # the scale path learns
    for name, value in before.items():  # the backbone never moves
        if name.startswith("model."):
            assert torch.equal(after[name], value), name


def test_gradient_accumulation_matches_one_big_batch(tiny_teacher, features, tmp_path):
    folder, _ = tiny_teacher
    common = dict(optim="sgd", learning_rate=0.5, max_steps=1, max_grad_norm=0.0, lr_scheduler_type="constant")
    runs = []
    for batch, accumulation in ((8, 1), (4, 2)):
        trainer = CausalDistillTrainer(
            str(folder), args=_args(tmp_path / f"{batch}", per_device_train_batch_size=batch,
                                    gradient_accumulation_steps=accumulation, **common),
            train_dataset=str(features),
        )
        trainer.train()
        runs.append(trainer.model.adapter_state_dict())
    for name in runs[0]:
        torch.testing.assert_close(runs[0][name], runs[1][name], rtol=1e-5, atol=1e-6)


def test_training_lowers_the_loss_saves_and_resumes(tiny_teacher, features, tmp_path):
    folder, _ = tiny_teacher
    # The top-K MSE alone: with the tail term the random tiny teacher's near-uniform top-K leaves nothing to gain (the
    # update with the tail term is checked exactly in test_one_sgd_step_matches_the_hand_computed_update).
    args = dict(action_weight="tied", distill_tail_weight=0.0, learning_rate=0.1, num_train_epochs=12,
                save_strategy="steps", save_steps=6,
                eval_strategy="epoch", per_device_train_batch_size=8)
    trainer = CausalDistillTrainer(str(folder), args=_args(tmp_path / "run", **args), train_dataset=str(features),
                                   eval_dataset=str(features))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert losses[-1] < 0.8 * losses[0]
    assert {"eval_top1_match", "eval_topk_prob_sum"} <= set(evals[-1])
    trainer.save_model()

    checkpoint = tmp_path / "run" / "checkpoint-6"
    assert set(load_file(checkpoint / "model.safetensors")) == trainer.model.adapter_keys()
    reloaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "run")
    rows = load_features(features)[:]
    with torch.no_grad():
        want = trainer.model(hidden_state=rows["hidden_state"], topk_ids=rows["topk_ids"],
                             topk_probs=rows["topk_probs"], distill_loss=True).loss
        loc_U, scale_U = reloaded.abduction(rows["hidden_state"])
        head = DecisionHead(reloaded.action.effective_weight(), reloaded.action.bias, reloaded.action.b_noise,
                            reloaded.ovr.threshold)
        offset = log_partition(loc_U, head) if reloaded.config.ovr_relative_threshold else None
        got, _ = topk_mse_loss(loc_U, scale_U, head, rows["topk_ids"], rows["topk_probs"], threshold_offset=offset)
    torch.testing.assert_close(got, want)
    readme = (tmp_path / "run" / "README.md").read_text()
    assert "distillation" in readme and "top1_match" in readme

    resumed = CausalDistillTrainer(str(folder), args=_args(tmp_path / "run", **args), train_dataset=str(features),
                                   eval_dataset=str(features))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for name, value in trainer.model.adapter_state_dict().items():
        torch.testing.assert_close(resumed.model.adapter_state_dict()[name], value)


def test_features_of_another_base_are_refused(features, tmp_path):
    wide = save_tiny_qwen2(tmp_path / "wide", hidden_size=48)
    with pytest.raises(ValueError, match="hidden states of size 32, the model's base has hidden_size 48"):
        CausalDistillTrainer(str(wide), args=_args(tmp_path / "out"), train_dataset=str(features))
    small = save_tiny_qwen2(tmp_path / "small", vocab_size=16)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 16\)"):
        CausalDistillTrainer(str(small), args=_args(tmp_path / "out", ovr_candidates=4), train_dataset=str(features))
    with pytest.raises(ValueError, match=r"lacks the feature columns \['hidden_state', 'topk_ids', 'topk_probs'\]"):
        CausalDistillTrainer(str(wide), args=_args(tmp_path / "out"), train_dataset=Dataset.from_dict({"text": ["a"]}))
    with pytest.raises(ValueError, match="remove_unused_columns=True would drop the feature columns"):
        _args(tmp_path / "out", remove_unused_columns=True)


def test_a_teacher_named_relatively_is_the_same_base(tiny_teacher, tmp_path, monkeypatch):
    """A store extracted with `folder` relative to the working directory belongs to an adapter whose base is the
    same folder by its absolute path; another base is warned about."""
    import logging as std_logging

    from transformers.utils import logging as hf_logging

    folder, _ = tiny_teacher
    monkeypatch.chdir(folder.parent)
    extract_features(folder.name, Dataset.from_dict({"input_ids": SEQUENCES[:2]}), tmp_path / "store", top_k=3)
    assert features_info(tmp_path / "store")["teacher_name_or_path"] == str(folder.resolve())

    records = []
    handler = std_logging.Handler()
    handler.emit = records.append
    hf_logging.get_logger("causalqwen_adapter.features").addHandler(handler)
    try:
        CausalDistillTrainer(str(folder), args=_args(tmp_path / "a"), train_dataset=tmp_path / "store")
        assert not [r for r in records if "extracted with" in r.getMessage()]
        other = save_tiny_qwen2(tmp_path / "other", seed=3, pad_token_id=None)  # same shapes, another folder
        CausalDistillTrainer(str(other), args=_args(tmp_path / "b"), train_dataset=tmp_path / "store")
        assert [r for r in records if "extracted with" in r.getMessage()]
    finally:
        hf_logging.get_logger("causalqwen_adapter.features").removeHandler(handler)


# --------------------------------------------------------------------------------------- recipes


def test_cli_extract_then_distill(sft_base, tmp_path):
    """`causalqwen extract-features` then `causalqwen distill`, as `python -m causalqwen_adapter.cli` runs them."""
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": p + c}) + "\n" for p, c in PAIRS))
    cli = [sys.executable, "-m", "causalqwen_adapter.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}  # this checkout's package, from any folder
    subprocess.run(
        [*cli, "extract-features", "--model_name_or_path", str(sft_base),
         "--dataset_name", str(data), "--output_dir", str(tmp_path / "feats"), "--top_k", "4", "--dtype", "float32"],
        check=True, cwd=tmp_path, env=env,
    )
    assert features_info(tmp_path / "feats")["top_k"] == 4
    subprocess.run(
        [*cli, "distill", "--model_name_or_path", str(sft_base),
         "--dataset_name", str(tmp_path / "feats"), "--output_dir", str(tmp_path / "adapter"), "--max_steps", "3",
         "--action_weight", "tied", "--use_cpu", "--report_to", "none", "--save_strategy", "no"],
        check=True, cwd=tmp_path, env=env,
    )
    model = CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")
    assert model.config.action_weight == "tied"
    assert model.config.base_model_name_or_path == str(sft_base)


def test_fresh_heads_start_from_the_vocabulary_losss_scale(tiny_teacher, features, tmp_path):
    """The tail term sums over every token: fresh heads for distillation start at γ₀ = 1e-5 and b_noise 1e-6 (the SFT
    defaults over candidates are 0.005 and 0.01) unless the arguments set them."""
    folder, _ = tiny_teacher
    trainer = CausalDistillTrainer(str(folder), args=_args(tmp_path / "a"), train_dataset=str(features))
    assert (trainer.model.config.gamma_init, trainer.model.config.b_noise_init) == (1e-5, 1e-6)
    assert torch.all(trainer.model.action.b_noise == 1e-6)
    softplus = torch.nn.functional.softplus(trainer.model.abduction.scale.bias.detach())
    torch.testing.assert_close(softplus, torch.full_like(softplus, 1e-5))
    trainer = CausalDistillTrainer(str(folder), args=_args(tmp_path / "b", gamma_init=0.01), train_dataset=str(features))
    assert trainer.model.config.gamma_init == 0.01


def test_liger_kernels_are_refused(sft_base, tmp_path):
    with pytest.raises(ValueError, match="use_liger_kernel is not supported"):
        CausalDistillTrainer(str(sft_base), args=_args(tmp_path / "out", use_liger_kernel=True))
    assert not (tmp_path / "out").exists()
