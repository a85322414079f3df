"""Classification through the LM (causalqwen_adapter.classification, causalqwen_adapter/cli/classify.py) against naive references."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.classification import (
    abstention_threshold,
    accuracy_coverage_curve,
    auroc,
    classification_metrics,
    fpr_at_tpr,
    label_scores,
    label_set,
    macro_f1,
    prompt_hidden_states,
    rejection_scores,
    tokenize_prompts,
)
from causalqwen_adapter.cli import classify

from conftest import decision_scores_float64
from test_evaluation import _naive_ece

LABELS = [" blue", " mat", " park", " friends"]
ROWS = [  # prompts of the tiny tokenizer's words, labels among LABELS
    ("the sky is", " blue"), ("the cat sat on", " mat"), ("a dog ran in the", " park"), ("cats and dogs are", " friends"),
    ("the sky is blue today", " blue"), ("the cat sat on the", " mat"), ("a dog", " park"), ("cats and dogs", " friends"),
    ("hello how are you", " blue"), ("two plus two is", " mat"), ("the dog sat on the", " park"), ("i am", " friends"),
]


@pytest.fixture(scope="module")
def tokenizer_dir(sft_base, tmp_path_factory) -> Path:
    """The tiny base's tokenizer alone: beside the base's config.json, transformers 5 loads it as a Qwen2Tokenizer
    (from the config's model_type), which maps these words to nothing."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(sft_base / name, folder / name)
    return folder


def _rows(pairs):
    return [{"prompt": p, "completion": c} for p, c in pairs]


def _adapter(base, seed=0, **heads):
    """Heads moved off their init (scales, noise, locations), so that P_k and the rules differ from the base's."""
    model = CausalQwenForCausalLM.from_base(base, dtype=torch.float32, **heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in (model.abduction.scale.weight, model.abduction.loc.weight, model.action.bias):
            param.add_(0.3 * torch.randn(param.shape, generator=generator))
        model.abduction.scale.bias.fill_(-1.0)
        model.action.b_noise.uniform_(0.1, 0.5, generator=generator)
    return model.eval()


# ---------------------------------------------------------------------------------------------- label sets


def test_label_set_takes_first_tokens(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    labels = label_set(tokenizer, LABELS + [" blue"], 128)
    assert labels.labels == LABELS  # repeats dropped, order kept
    assert labels.token_ids == [tokenizer.convert_tokens_to_ids(w.strip()) for w in LABELS]


def test_label_set_refuses_what_it_cannot_score(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(ValueError, match=r"' the mat' and ' the park' share their first token 'the'"):
        label_set(tokenizer, [" the mat", " the park"], 128)
    with pytest.raises(ValueError, match=r"label ' zebra' is absent from the tokenizer"):
        label_set(tokenizer, [" blue", " zebra"], 128)
    with pytest.raises(ValueError, match=r"needs two or more .*one class"):
        label_set(tokenizer, [" blue", " blue"], 128)
    with pytest.raises(ValueError, match=r"label '' has no token"):
        label_set(tokenizer, [" blue", ""], 128)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary of 5"):
        label_set(tokenizer, LABELS, 5)
    labels = label_set(tokenizer, LABELS, 128)
    with pytest.raises(ValueError, match=r"completion ' today' is not in the label set"):
        tokenize_prompts(tokenizer, _rows([("the sky is", " today")]), labels)
    with pytest.raises(ValueError, match=r"row 0: .*prompt is empty"):
        tokenize_prompts(tokenizer, _rows([("", " blue")]), labels)


# ---------------------------------------------------------------------------------------------- scores


@pytest.mark.parametrize("kind, label_columns", [("adapter", False), ("adapter", True), ("absolute", True),
                                                  ("base", False)])
def test_label_scores_match_the_full_forward(sft_base, tokenizer_dir, kind, label_columns):
    """z at the prompt's end → label logits, log-partition and log P_k equal a whole forward of each prompt alone,
    P_k from the design's formula in float64; with `label_columns` (scale_S at the labels' columns alone) too, and
    for absolute, learnable thresholds (`absolute`: one C_k per token, each its own)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    base = Qwen2ForCausalLM.from_pretrained(sft_base, dtype=torch.float32).eval()
    model = base
    if kind != "base":
        model = _adapter(base, **({} if kind == "adapter" else dict(ovr_relative_threshold=False,
                                                                    learnable_threshold=True)))
        with torch.no_grad():
            model.ovr.threshold.add_(0.5 * torch.randn(model.ovr.threshold.shape))
    labels = label_set(tokenizer, LABELS, 128)
    prompts, targets = tokenize_prompts(tokenizer, _rows(ROWS), labels)
    assert targets == [LABELS.index(c) for _, c in ROWS]
    z = prompt_hidden_states(model.model, prompts, batch_size=5)  # batches of unequal lengths, right-padded
    scores = label_scores(model, z, labels, chunk_size=4, label_columns=label_columns)
    ids = labels.token_ids
    for n, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt]), inference_mode="standard") if kind != "base" else \
                model(input_ids=torch.tensor([prompt]))
        loc = (out.loc_S if kind != "base" else out.logits)[0, -1].double()
        torch.testing.assert_close(scores.loc[n].double(), loc[ids], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scores.log_partition[n].double(), torch.logsumexp(loc, 0), rtol=1e-5, atol=1e-5)
        if kind != "base":
            log_P = decision_scores_float64(out.loc_S[0, -1], out.scale_S[0, -1], model.ovr.threshold,
                                            model.config.ovr_relative_threshold, "normalize")
            torch.testing.assert_close(scores.log_P[n].double(), log_P[ids], rtol=1e-4, atol=1e-6)
    if kind == "base":
        assert scores.log_P is None and scores.rules() == ("softmax",)
        with pytest.raises(ValueError, match="ovr rule needs OvR probabilities"):
            scores.decide("ovr")
    # the rules and the rejection scores, row by row
    reject = rejection_scores(scores)
    for n in range(len(prompts)):
        loc = scores.loc[n].double()
        soft = torch.softmax(loc, 0)
        pred, conf = scores.decide("softmax")
        assert pred[n].item() == int(loc.argmax()) and math.isclose(conf[n].item(), soft.max().item(), rel_tol=1e-5)
        vocab = torch.exp(loc - scores.log_partition[n].double())
        assert math.isclose(reject["softmax_vocab_top"][n].item(), vocab.max().item(), rel_tol=1e-4)
        assert math.isclose(reject["softmax_vocab_label_mass"][n].item(), vocab.sum().item(), rel_tol=1e-4)
        assert math.isclose(reject["energy"][n].item(), math.log(sum(math.exp(v) for v in loc.tolist())), rel_tol=1e-5)
        assert reject["max_logit"][n].item() == scores.loc[n].max().item()
        if kind != "base":
            P = scores.log_P[n].double().exp()
            pred, conf = scores.decide("ovr")
            assert pred[n].item() == int(P.argmax()) and math.isclose(conf[n].item(), P.max().item(), rel_tol=1e-5)
            assert math.isclose(reject["ovr_max_prob"][n].item(), P.max().item(), rel_tol=1e-5)


# ---------------------------------------------------------------------------------------------- metrics


def _naive_macro_f1(pred, target):
    classes = sorted(set(pred) | set(target))
    total = 0.0
    for k in classes:
        tp = sum(1 for p, t in zip(pred, target) if p == k and t == k)
        fp = sum(1 for p, t in zip(pred, target) if p == k and t != k)
        fn = sum(1 for p, t in zip(pred, target) if p != k and t == k)
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        total += 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return total / len(classes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_naive_loops(seed):
    generator = torch.Generator().manual_seed(seed)
    n, k = 97, 5
    target = torch.randint(0, k, (n,), generator=generator)
    pred = torch.where(torch.rand(n, generator=generator) < 0.6, target, torch.randint(0, k + 1, (n,), generator=generator))
    confidence = torch.rand(n, generator=generator, dtype=torch.float64)
    validation = torch.rand(41, generator=generator, dtype=torch.float64)
    P, T, C = pred.tolist(), target.tolist(), confidence.tolist()
    hits = [float(p == t) for p, t in zip(P, T)]

    # the threshold keeps at least 90 % of the validation rows, and is the largest that does
    threshold = abstention_threshold(validation, 0.9)
    kept = sum(v >= threshold for v in validation.tolist())
    assert kept >= 0.9 * 41 and sum(v > threshold for v in validation.tolist()) < 0.9 * 41

    metrics = classification_metrics(pred, target, confidence, threshold)
    assert metrics["accuracy"] == pytest.approx(sum(hits) / n, abs=1e-12)
    assert metrics["macro_f1"] == pytest.approx(_naive_macro_f1(P, T), abs=1e-12)
    assert metrics["ece"] == pytest.approx(_naive_ece(C, hits), abs=1e-12)
    keep = [i for i in range(n) if C[i] >= threshold]
    assert metrics["coverage"] == pytest.approx(len(keep) / n, abs=1e-12)
    assert metrics["selective_accuracy"] == pytest.approx(sum(hits[i] for i in keep) / len(keep), abs=1e-12)
    rejected = [i for i in range(n) if C[i] < threshold]
    assert metrics["rejected_accuracy"] == pytest.approx(sum(hits[i] for i in rejected) / len(rejected), abs=1e-12)

    curve = accuracy_coverage_curve(confidence, torch.tensor(hits), points=10)
    order = sorted(range(n), key=lambda i: -C[i])
    for c, acc in zip(curve["coverage"], curve["accuracy"]):
        m = math.ceil(c * n)
        assert acc == pytest.approx(sum(hits[i] for i in order[:m]) / m, abs=1e-12)
    assert curve["area"] == pytest.approx(sum(curve["accuracy"]) / 10, abs=1e-12)
    assert macro_f1(torch.tensor([0, 0]), torch.tensor([0, 0])) == 1.0
    with pytest.raises(ValueError, match="coverage must be in"):
        abstention_threshold(validation, 0.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_open_set_metrics_match_naive_loops(seed):
    generator = torch.Generator().manual_seed(seed)
    known = torch.randint(0, 12, (37,), generator=generator).double() / 4  # ties within and across the groups
    unknown = torch.randint(0, 10, (23,), generator=generator).double() / 4
    pairs = [(a, b) for a in known.tolist() for b in unknown.tolist()]
    expected = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)
    assert auroc(known, unknown) == pytest.approx(expected, abs=1e-12)
    assert auroc(known + 10, unknown) == 1.0 and auroc(known, unknown + 10) == 0.0
    # the largest threshold accepting 95 % of the known rows, then the unknown rows it accepts
    candidates = sorted(set(known.tolist()), reverse=True)
    t = next(c for c in candidates if sum(v >= c for v in known.tolist()) >= 0.95 * 37)
    assert fpr_at_tpr(known, unknown, 0.95) == pytest.approx(sum(v >= t for v in unknown.tolist()) / 23, abs=1e-12)
    with pytest.raises(ValueError, match="no unknown class"):
        auroc(known, known[:0])


# ---------------------------------------------------------------------------------------------- the recipe


def _write(path: Path, pairs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(pairs)))
    return str(path)


def test_classify_recipe_writes_what_it_measured(sft_base, tokenizer_dir, tmp_path):
    base = Qwen2ForCausalLM.from_pretrained(sft_base, dtype=torch.float32)
    adapter = _adapter(base, seed=3)
    adapter.save_pretrained(tmp_path / "adapter")
    test_file = _write(tmp_path / "test.jsonl", ROWS)
    validation_file = _write(tmp_path / "validation.jsonl", ROWS[::-1][:7])
    out = tmp_path / "out"
    results = classify.run(classify.ClassifyArguments(
        model_name_or_path=str(tmp_path / "adapter"), dataset_name=test_file, validation_dataset_name=validation_file, output_dir=str(out),
        dtype="float32", device="cpu", tokenizer=str(tokenizer_dir), coverage=0.8))
    assert json.loads((out / "metrics.json").read_text()) == json.loads(json.dumps(results))
    assert (out / "metrics.md").read_text().count("\n") == 4  # header, rule, ovr, softmax
    for name in ("reliability.png", "accuracy_coverage.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["labels"] == sorted(LABELS)

    # the same figures from one whole forward per prompt
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = [tokenizer.convert_tokens_to_ids(w.strip()) for w in sorted(LABELS)]

    def naive(pairs):
        rows = []
        for prompt, completion in pairs:
            with torch.no_grad():
                o = adapter(input_ids=torch.tensor([tokenizer(prompt).input_ids]), inference_mode="standard")
            log_P = decision_scores_float64(o.loc_S[0, -1], o.scale_S[0, -1], adapter.ovr.threshold, True, "normalize")
            P, loc = log_P[ids].exp(), o.loc_S[0, -1, ids].double()
            rows.append((sorted(LABELS).index(completion), P, torch.softmax(loc, 0)))
        return rows

    for rule, column in (("ovr", 1), ("softmax", 2)):
        test_rows = naive(ROWS)
        hits = [float(int(r[column].argmax()) == r[0]) for r in test_rows]
        conf = [r[column].max().item() for r in test_rows]
        validation_conf = sorted(r[column].max().item() for r in naive(ROWS[::-1][:7]))
        threshold = validation_conf[math.floor(0.2 * 7)]
        metrics = results["rules"][rule]
        assert metrics["accuracy"] == pytest.approx(sum(hits) / len(hits))
        assert metrics["ece"] == pytest.approx(_naive_ece(conf, hits), abs=1e-5)
        assert metrics["threshold"] == pytest.approx(threshold, rel=1e-4)
        assert metrics["coverage"] == pytest.approx(sum(c >= threshold for c in conf) / len(conf))
        if rule == "ovr":
            assert metrics["none_accepted"] == pytest.approx(sum(r[1].max().item() <= 0.5 for r in test_rows) / len(test_rows))

    # a base: the softmax rule only
    results = classify.run(classify.ClassifyArguments(model_name_or_path=str(sft_base), dataset_name=test_file, output_dir=str(out),
                                                       dtype="float32", device="cpu", tokenizer=str(tokenizer_dir), plots=False,
                                                       overwrite=True))
    assert list(results["rules"]) == ["softmax"] and "coverage" not in results["rules"]["softmax"]
    assert json.loads((out / "metrics.json").read_text())["rules"] == json.loads(json.dumps(results))["rules"]
    # --no_plots with --overwrite: the first run's plots, which these metrics do not show, are gone
    assert not (out / "reliability.png").exists() and not (out / "accuracy_coverage.png").exists()


def test_classify_recipe_refuses_bad_label_sets(sft_base, tokenizer_dir, tmp_path):
    test_file = _write(tmp_path / "test.jsonl", [("the sky is", " the mat"), ("a dog", " the park")])
    with pytest.raises(ValueError, match="share their first token"):
        classify.run(classify.ClassifyArguments(model_name_or_path=str(sft_base), dataset_name=test_file, output_dir=str(tmp_path),
                                                 dtype="float32", device="cpu", tokenizer=str(tokenizer_dir)))
    one_class = _write(tmp_path / "one.jsonl", [("the sky is", " blue"), ("a dog", " blue")])
    with pytest.raises(ValueError, match="one class"):
        classify.run(classify.ClassifyArguments(model_name_or_path=str(sft_base), dataset_name=one_class, output_dir=str(tmp_path),
                                                 dtype="float32", device="cpu", tokenizer=str(tokenizer_dir)))


# ---------------------------------------------------------------------------------------------- careless input


def _arguments(model, test_file, out, **overrides):
    return classify.ClassifyArguments(model_name_or_path=str(model), dataset_name=str(test_file), output_dir=str(out),
                                      **{"dtype": "float32", "device": "cpu", "plots": False, **overrides})


def test_compatible_mode_scores_an_adapter_by_loc_S_alone(sft_base, tokenizer_dir):
    """In compatible mode an adapter is a softmax over loc_S (its logits at init are the base's): the base's scores
    exactly while the heads are fresh, and no OvR probabilities."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    base = Qwen2ForCausalLM.from_pretrained(sft_base, dtype=torch.float32).eval()
    labels = label_set(tokenizer, LABELS, 128)
    prompts, _ = tokenize_prompts(tokenizer, _rows(ROWS), labels)
    z = prompt_hidden_states(base.model, prompts)
    fresh = CausalQwenForCausalLM.from_base(base, dtype=torch.float32).eval()
    got, want = label_scores(fresh, z, labels, inference_mode="compatible"), label_scores(base, z, labels)
    assert got.log_P is None and got.rules() == ("softmax",)
    torch.testing.assert_close(got.loc, want.loc, rtol=1e-5, atol=1e-5)
    trained = _adapter(base, seed=1)  # moved heads: loc_S of a whole forward in compatible mode
    got = label_scores(trained, z, labels, inference_mode="compatible")
    for n, prompt in enumerate(prompts):
        with torch.no_grad():
            loc = trained(input_ids=torch.tensor([prompt]), inference_mode="compatible").loc_S[0, -1]
        torch.testing.assert_close(got.loc[n], loc[labels.token_ids], rtol=1e-5, atol=1e-5)


def test_classify_refuses_to_write_over_an_earlier_run_before_loading_a_model(sft_base, tokenizer_dir, tmp_path,
                                                                              monkeypatch, capsys):
    test_file = _write(tmp_path / "test.jsonl", ROWS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.md").write_text("the user's own table\n")
    (out / "notes.txt").write_text("mine\n")

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the output folder was checked")

    monkeypatch.setattr(classify, "load_model", no_model)
    with pytest.raises(FileExistsError, match=rf"{out} already holds metrics.md .*pass overwrite=True \(--overwrite\)"):
        classify.run(_arguments(sft_base, test_file, out, tokenizer=str(tokenizer_dir)))
    with pytest.raises(SystemExit) as exit_info:  # the command line: argparse's error, no traceback
        classify.main(["--model", str(sft_base), "--test_file", test_file, "--output_dir", str(out)], prog="causalqwen classify")
    assert exit_info.value.code == 2 and "already holds metrics.md" in capsys.readouterr().err
    assert (out / "metrics.md").read_text() == "the user's own table\n" and sorted(p.name for p in out.iterdir()) == [
        "metrics.md", "notes.txt"]
    monkeypatch.undo()
    classify.run(_arguments(sft_base, test_file, out, tokenizer=str(tokenizer_dir), overwrite=True))
    assert (out / "metrics.md").read_text().startswith("| model | rule |") and (out / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("flag", ["--batch_size", "--per_device_eval_batch_size"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_classify_refuses_a_batch_size_below_one_as_a_usage_error(sft_base, tmp_path, capsys, flag, value):
    test_file = _write(tmp_path / "test.jsonl", ROWS)
    with pytest.raises(SystemExit) as exit_info:
        classify.main(["--model_name_or_path", str(sft_base), "--dataset_name", test_file, "--output_dir",
                       str(tmp_path / "out"), flag, value], prog="causalqwen classify")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"causalqwen classify: error: per_device_eval_batch_size must be a positive integer, got {value}" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("row, message", [
    ({"prompt": "the sky is", "completion": None}, r"row 1 \(counting from 0\): `completion` is None \(NoneType\), "
                                                   r"not text: every row needs the label"),
    ({"prompt": None, "completion": " blue"}, r"row 1 \(counting from 0\): `prompt` is None \(NoneType\)"),
])
def test_classify_names_the_row_of_a_missing_value(sft_base, tokenizer_dir, tmp_path, row, message):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [_rows(ROWS)[0], row, *_rows(ROWS)[1:]]))
    with pytest.raises(ValueError, match=rf"{data}, " + message):
        classify.run(_arguments(sft_base, data, tmp_path / "out", tokenizer=str(tokenizer_dir)))
    assert not (tmp_path / "out").exists()


def test_classify_names_the_row_of_a_numeric_label(sft_base, tokenizer_dir, tmp_path):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": k}) + "\n" for p, k in [("the sky is", 1), ("a dog", 2)]))
    with pytest.raises(ValueError, match=r"row 0 \(counting from 0\): `completion` is 1 \(int\), not text: every row "
                                         r"needs the label, as text with its leading space \(e.g. ' 1', not 1\)"):
        classify.run(_arguments(sft_base, data, tmp_path / "out", tokenizer=str(tokenizer_dir)))


@pytest.mark.parametrize("name, content", [("header.csv", "prompt,completion\n"), ("empty.json", "[]\n"),
                                           ("blank.jsonl", "\n" * 5000)])
def test_classify_names_a_data_file_of_no_rows(sft_base, tokenizer_dir, tmp_path, name, content):
    data = tmp_path / name
    data.write_text(content)
    with pytest.raises(ValueError, match=rf"{data} holds no rows"):
        classify.run(_arguments(sft_base, data, tmp_path / "out", tokenizer=str(tokenizer_dir)))
    assert not (tmp_path / "out").exists()


def test_classify_says_a_base_folder_holds_no_tokenizer(sft_base, tmp_path):
    bare = tmp_path / "bare-base"
    bare.mkdir()
    for path in sft_base.iterdir():  # the weights and config, not the tokenizer
        if path.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(path, bare / path.name)
    test_file = _write(tmp_path / "test.jsonl", ROWS)
    message = rf"--model_name_or_path '{bare}' holds no tokenizer .*pass --tokenizer"
    with pytest.raises(ValueError, match=message):
        classify.run(_arguments(bare, test_file, tmp_path / "out"))
    adapter = tmp_path / "adapter"
    CausalQwenForCausalLM.from_base(str(bare)).save_pretrained(adapter)
    with pytest.raises(ValueError, match=rf"the adapter's base '{bare}' holds no tokenizer .*pass --tokenizer"):
        classify.run(_arguments(adapter, test_file, tmp_path / "out"))
    assert not (tmp_path / "out").exists()
