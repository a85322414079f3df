"""The package on each device the machine has (the `device` fixture: the CPU, and CUDA where present, those runs
marked `gpu`; `make test-gpu` runs them): the training loss and its gradients, the decode head, the OvR modes' scores,
generate() in every mode, the quantiles of calibration and evaluation, and the recipes' `--device` flag. Every
reference is float64 on the same device. On CUDA the decode kernels are the compiled ones (the CPU's are tested in
test_generation.py)."""

import importlib.util
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM, heads
from causalqwen_adapter.cauchy import cauchy_linear, fuse_noise
from causalqwen_adapter.devices import available_devices, resolve_device
from causalqwen_adapter.evaluation import EvaluationAccumulator
from causalqwen_adapter.features import extract_features
from causalqwen_adapter.training import calibrate_threshold_on_features

from conftest import PAIRS, TINY_VOCAB, decision_scores_float64

DISTRIBUTIONS = ["accept", "accept_once", "normalize"]


def _kernels(monkeypatch, device: torch.device) -> None:
    """On CUDA the tiny models take the compiled decode kernels too (they are what runs on a real model there)."""
    if device.type == "cuda":
        monkeypatch.setattr(heads, "_FUSED_MIN_NUMEL", 0)


def _away_from_init(model: CausalQwenForCausalLM) -> CausalQwenForCausalLM:
    """Heads away from init, so that every term and path of the math has a say."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in (model.abduction.scale.weight, model.action.bias):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        model.action.weight[0].copy_(torch.randn(model.action.weight.shape[1], generator=generator) * 0.05)
        model.action.b_noise.copy_(torch.rand(model.action.b_noise.shape, generator=generator) * 0.95 + 0.05)
        if model.config.learnable_threshold:
            model.ovr.threshold.add_(torch.randn(model.ovr.threshold.shape, generator=generator) * 0.3)
    return model


# --------------------------------------------------------------------------------------- training loss


def _naive_training_loss(model, params: dict, input_ids, labels):
    """forward(labels=...)'s loss from docs/design.md (Training losses) in float64, materialised: softmax_loss_weight ×
    CE(loc_S) + Σ_k −log(1 − P_k) + [−log P_y + log(1 − P_y)], the OvR term reaching the locations only with
    ovr_trains_location, the log-partition of relative thresholds a constant."""
    config = model.config
    with torch.no_grad():
        z = model.model(input_ids).last_hidden_state.double()
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
    keep = targets != -100
    z, y = z[keep], targets[keep]
    loc_U = z @ params["abduction.loc.weight"].T + params["abduction.loc.bias"]
    scale_U = F.softplus(z @ params["abduction.scale.weight"].T + params["abduction.scale.bias"])
    scale_U = scale_U + params["action.b_noise"].abs()
    W, b = params["action.weight"], params["action.bias"]
    loc_S = loc_U @ W.T + b
    loss = config.softmax_loss_weight * F.cross_entropy(loc_S, y)
    if not config.ovr_trains_location:
        loc_U, W, b = loc_U.detach(), W.detach(), b.detach()
    loc_o = loc_U @ W.T + b
    if config.ovr_relative_threshold:
        loc_o = loc_o - torch.logsumexp(loc_o, -1, keepdim=True).detach()
    threshold = params.get("ovr.threshold", model.ovr.threshold.double())
    x = (loc_o - threshold) / (scale_U @ W.abs().T)
    log_P = torch.log(torch.atan2(torch.ones_like(x), -x) / math.pi)
    log_not_P = torch.log(torch.atan2(torch.ones_like(x), x) / math.pi)
    if config.ovr_candidates is None:  # every token of the vocabulary
        ovr = -log_not_P.sum(-1) - log_P.gather(1, y[:, None]).squeeze(1) + log_not_P.gather(1, y[:, None]).squeeze(1)
    else:  # the top-k of loc_S and the target, each once
        member = torch.zeros_like(x, dtype=torch.bool).scatter_(1, loc_S.detach().topk(config.ovr_candidates).indices, True)
        is_target = F.one_hot(y, x.shape[1]).bool()
        ovr = (torch.where(is_target, -log_P, -log_not_P) * (member | is_target)).sum(-1)
    return loss + ovr.mean()


@pytest.mark.parametrize(
    "options",
    [{}, {"ovr_candidates": None}] + [
        {"ovr_trains_location": True, "ovr_relative_threshold": False, "ovr_threshold_init": 0.0,
         "learnable_threshold": True, "softmax_loss_weight": 0.5, "ovr_candidates": k} for k in (5, None)],
    ids=["default", "vocabulary", "trains-location-absolute-learnable", "vocabulary-trains-location-absolute-learnable"],
)
def test_training_loss_and_gradients_match_float64(tied_base, input_ids, device, options):
    model = _away_from_init(CausalQwenForCausalLM.from_base(tied_base, gamma_init=0.5, **options)).to(device)
    ids = input_ids.to(device)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that carries no target
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = model(input_ids=ids, labels=labels)
    assert out.loss.device.type == device.type
    grads = torch.autograd.grad(out.loss, list(trainable.values()), allow_unused=True)

    reference_params = {n: p.detach().double().requires_grad_() for n, p in trainable.items()}
    reference = _naive_training_loss(model, reference_params, ids, labels)
    reference_grads = torch.autograd.grad(reference, list(reference_params.values()), allow_unused=True)
    torch.testing.assert_close(out.loss.double(), reference, rtol=1e-5, atol=0)
    for name, got, want in zip(trainable, grads, reference_grads):
        want = torch.zeros_like(reference_params[name]) if want is None else want
        got = torch.zeros_like(want) if got is None else got.double()
        assert got.device.type == device.type, name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item(), msg=name)


# --------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_decode_head_matches_float64_cauchy_linear(tied_base, device, monkeypatch, rows, dtype):
    _kernels(monkeypatch, device)
    model = _away_from_init(CausalQwenForCausalLM.from_base(tied_base, gamma_init=0.5)).to(device, dtype)
    generator = torch.Generator().manual_seed(rows)
    z = torch.randn(rows, model.config.hidden_size, generator=generator).to(device, dtype)
    W, b = model.action.weight.double(), model.action.bias.double()
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        loc_U, scale_U = model.abduction(z)
        for mode, temperature in (("standard", 0.7), ("causal", 1.0)):
            loc_S, scale_S = model.action(loc_U, scale_U, mode, temperature)
            assert loc_S.device.type == device.type and loc_S.dtype == dtype
            fused_loc, fused_scale = fuse_noise(loc_U.double(), scale_U.double(), model.action.b_noise.double(), mode,
                                                temperature)
            want_loc, want_scale = cauchy_linear(fused_loc, fused_scale, W, b)
            torch.testing.assert_close(loc_S.double(), want_loc, **tolerance)
            torch.testing.assert_close(scale_S.double(), want_scale, **tolerance)


@pytest.mark.parametrize("relative,threshold", [(True, -2.0), (False, 0.5)], ids=["relative", "absolute"])
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_ovr_decision_scores_match_float64(tied_base, input_ids, device, monkeypatch, distribution, relative,
                                           threshold):
    _kernels(monkeypatch, device)
    model = CausalQwenForCausalLM.from_base(tied_base, gamma_init=1.0, b_noise_init=0.1, ovr_threshold_init=threshold,
                                            ovr_relative_threshold=relative, ovr_distribution=distribution)
    model = _away_from_init(model).to(device).eval()
    with torch.no_grad():
        for mode in ("standard", "causal"):
            out = model(input_ids.to(device), inference_mode=mode)
            expected = decision_scores_float64(out.loc_S, out.scale_S, model.ovr.threshold, relative, distribution)
            assert out.logits.device.type == device.type
            torch.testing.assert_close(out.logits.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def padded_batch():
    ids = torch.randint(1, TINY_VOCAB - 1, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :3] = mask[1, :3] = 0  # left padding, as generation wants it
    ids[2, :1] = mask[2, :1] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_generate_in_every_mode(tiny_base, padded_batch, device, monkeypatch):
    _kernels(monkeypatch, device)
    batch = {k: v.to(device) for k, v in padded_batch.items()}
    base = Qwen2ForCausalLM.from_pretrained(tiny_base).to(device).eval()
    model = CausalQwenForCausalLM.from_base(tiny_base).to(device).eval()
    greedy = dict(max_new_tokens=8, do_sample=False)
    # compatible is the base at init, token for token
    assert torch.equal(model.generate(**batch, **greedy, inference_mode="compatible"), base.generate(**batch, **greedy))

    model = _away_from_init(model)
    for mode in ("compatible", "standard", "causal"):
        with_cache = model.generate(**batch, **greedy, inference_mode=mode)
        assert with_cache.device.type == device.type and with_cache.shape == (3, 7 + 8)
        assert torch.equal(with_cache, model.generate(**batch, **greedy, inference_mode=mode, use_cache=False)), mode
    for sharing in ("step", "sequence"):  # the sampling mode's noise is drawn on the device, seeded
        runs = []
        for _ in range(2):
            torch.manual_seed(0)
            runs.append(model.generate(**batch, max_new_tokens=8, do_sample=True, inference_mode="sampling",
                                       noise_sharing=sharing))
        assert torch.equal(*runs), sharing


def test_trainer_step_on_the_device(sft_base, device, tmp_path):
    """One CausalSFTTrainer step (float32, SGD) on the device equals the update computed on the CPU from the same heads
    and batch. (tests/test_train_recipe.py runs the README's command, bf16 where supported, on each device too.)"""
    from datasets import Dataset

    from causalqwen_adapter.trainer import CausalSFTConfig, CausalSFTTrainer

    args = CausalSFTConfig(
        str(tmp_path), use_cpu=device.type == "cpu", bf16=False, max_steps=1, per_device_train_batch_size=4,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, logging_steps=1, seed=0,
        gamma_init=0.5, b_noise_init=0.1, location_lr_ratio=1.0,
    )
    data = Dataset.from_dict({"prompt": [p for p, _ in PAIRS[:4]], "completion": [c for _, c in PAIRS[:4]]})
    trainer = CausalSFTTrainer(str(sft_base), args=args, train_dataset=data)
    assert trainer.args.device.type == device.type
    reference = CausalQwenForCausalLM.from_base(str(sft_base), gamma_init=0.5, b_noise_init=0.1)
    reference.load_state_dict(trainer.model.adapter_state_dict(), strict=False)
    batch = {k: v.cpu() for k, v in next(iter(trainer.get_train_dataloader())).items()}  # the one batch: every row
    loss = reference(**batch).loss
    loss.backward()
    trainer.train()

    assert next(trainer.model.parameters()).device.type == device.type
    assert trainer.state.log_history[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    trained = trainer.model.adapter_state_dict()
    for name, param in reference.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(trained[name].cpu(), (param - 0.5 * param.grad).detach(), rtol=1e-5, atol=1e-6,
                                       msg=name)


# --------------------------------------------------------------------------------------- quantiles


def _quantile_spy(monkeypatch) -> list:
    """torch.quantile, checking that its levels are a tensor on the data's device (CUDA refuses CPU levels)."""
    calls, quantile = [], torch.quantile

    def spy(data, q, *args, **kwargs):
        assert torch.is_tensor(q) and q.device == data.device, (data.device, getattr(q, "device", None))
        calls.append(data.device)
        return quantile(data, q, *args, **kwargs)

    monkeypatch.setattr(torch, "quantile", spy)
    return calls


def test_threshold_calibration_runs_on_the_data_device(tied_base, device, monkeypatch):
    model = CausalQwenForCausalLM.from_base(tied_base, ovr_relative_threshold=False).to(device)
    z = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    linspace, levels = torch.linspace, []

    def created(*args, **kwargs):  # the levels are created where the data is (on the CPU too, where both are CPU)
        levels.append(kwargs.get("device"))
        return linspace(*args, **kwargs)

    monkeypatch.setattr(torch, "linspace", created)
    calls = _quantile_spy(monkeypatch)
    threshold = calibrate_threshold_on_features(model, z)
    assert calls == [z.device] and [torch.device(d) if d is not None else None for d in levels] == [z.device]
    assert math.isfinite(threshold) and model.ovr.threshold.item() == pytest.approx(threshold)


def test_evaluation_quantiles_on_the_scores_device(device, monkeypatch):
    calls = _quantile_spy(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(12, TINY_VOCAB, generator=generator).to(device)
    log_P = F.logsigmoid(torch.randn(12, TINY_VOCAB, generator=generator)).to(device)
    targets = torch.randint(0, TINY_VOCAB, (12,), generator=generator).to(device)
    accumulator = EvaluationAccumulator("standard")
    accumulator.update(scores, targets, log_P)
    metrics = accumulator.compute()
    assert calls and metrics["num_tokens"] == 12
    expected = torch.quantile(log_P.double().logsumexp(-1).exp().cpu(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    assert [metrics["prob_sum_p10"], metrics["prob_sum_median"], metrics["prob_sum_p90"]] == pytest.approx(
        expected.tolist(), rel=1e-6)


# --------------------------------------------------------------------------------------- recipes' --device


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert "cpu" in available_devices()
    auto = resolve_device("auto")
    if torch.cuda.is_available():
        assert auto.type == "cuda" and resolve_device("cuda") == auto
        count = torch.cuda.device_count()
        with pytest.raises(ValueError, match=rf"cuda:{count} does not exist, this machine has {count} cuda device"):
            resolve_device(f"cuda:{count}")
    else:
        assert resolve_device(None) == auto == torch.device("cpu") or auto.type == "mps"
        with pytest.raises(ValueError, match=r"--device cuda: no cuda device on this machine \(available: cpu"):
            resolve_device("cuda")
        with pytest.raises(ValueError, match=r"--device cuda:1: no cuda device on this machine"):
            resolve_device("cuda:1")
    with pytest.raises(ValueError, match=r"--device 'gpu' is not a device name: use auto, cpu, cuda"):
        resolve_device("gpu")


def test_resolve_device_under_a_launcher_is_the_local_device(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.device_count() > 1:
        assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)


def _load_recipe(name: str):
    """The module of the subcommand `name` (causalqwen_adapter/cli/)."""
    return importlib.import_module(f"causalqwen_adapter.cli.{name}")


@pytest.fixture(scope="module")
def sft_adapter(sft_base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("device-adapter")
    CausalQwenForCausalLM.from_base(sft_base).save_pretrained(folder)
    return folder


def test_generate_recipe_on_the_device(sft_base, sft_adapter, device, capsys):
    recipe = _load_recipe("generate")
    common = [str(sft_adapter), "--prompt", "the cat sat on", "--no-chat", "--mode", "compatible", "--max-new-tokens",
              "4", "--dtype", "float32"]
    recipe.main([*common, "--device", str(device)])
    written = capsys.readouterr().out.strip()
    assert written  # the base's greedy continuation, streamed
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    base = Qwen2ForCausalLM.from_pretrained(sft_base).to(device)
    inputs = tokenizer("the cat sat on", return_tensors="pt").to(device)
    expected = base.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs.input_ids.shape[1]:]
    assert written == tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_generate_recipe_refuses_a_device_the_machine_lacks(sft_adapter, capsys):
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(SystemExit) as exit_info:
        _load_recipe("generate").main([str(sft_adapter), "--prompt", "hello", "--device", missing])
    assert exit_info.value.code == 2
    assert f"--device {missing}:" in capsys.readouterr().err


def test_evaluate_recipe_on_the_device(sft_base, sft_adapter, device, tmp_path):
    recipe = _load_recipe("evaluate")
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"text": p + c}) + "\n" for p, c in PAIRS))

    def run(where, out):
        return recipe.run(recipe.EvaluationArguments(
            model_name_or_path=[str(sft_base), str(sft_adapter)], dataset_name=str(data), output_dir=str(out),
            dtype="float32", inference_mode=["compatible", "standard"], device=where))

    results = run(str(device), tmp_path / "device")
    reference = results if device.type == "cpu" else run("cpu", tmp_path / "cpu")
    for name, per_mode in reference.items():
        for mode, metrics in per_mode.items():
            for metric, value in metrics.items():
                # A rank metric moves by a whole pair where two tokens' signals tie within the devices' rounding
                # (on 16 tokens one pair of 63 is 0.016): the AUROCs may differ by two pairs, the rest by rounding.
                tol = dict(abs=2.5 / 63) if metric.startswith("auroc_") else dict(rel=1e-4, abs=1e-6)
                assert results[name][mode][metric] == pytest.approx(value, **tol), (name, mode, metric)
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"--device {missing}:"):
        run(missing, tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


def test_extract_features_on_the_device(sft_base, device, tmp_path):
    texts = [p + c for p, c in PAIRS[:4]]

    def extract(where, folder):
        return extract_features(str(sft_base), texts, tmp_path / folder, top_k=4, dtype=torch.float32, device=where)

    store = extract(device, "device")
    assert len(store) > 0
    reference = store if device.type == "cpu" else extract("cpu", "cpu")
    torch.testing.assert_close(store["hidden_state"], reference["hidden_state"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(store["topk_probs"], reference["topk_probs"], rtol=1e-4, atol=1e-6)
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"--device {missing}:"):
        extract(missing, "missing")
    assert not (tmp_path / "missing").exists()
