"""bench/evidence_next_token.py when a seed dies after training: the log names the stage it died in, the trained
adapter survives with its marker, and the next invocation only evaluates it, giving the record an uninterrupted run
gives; each stage's peak resident set is measured."""

import json
import resource
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import evidence_next_token as next_token  # noqa: E402
import evidence_preregistered as driver  # noqa: E402

TIMES = ("seconds", "train_seconds", "cpu_seconds", "evaluate_seconds", "train_peak_rss_mib", "evaluate_peak_rss_mib",
         "commit")


def test_a_death_in_the_evaluation_is_resumed_from_the_evaluation(sft_base, tmp_path, monkeypatch):
    import causalqwen_adapter.evaluation as evaluation

    # the reference: the same seed, never interrupted
    fresh = next_token.run_seeds([0], str(sft_base), tmp_path / "fresh.json", tmp_path / "fresh-work", steps=2,
                                 log=lambda _: None)["0"]
    assert not (tmp_path / "fresh-work" / "seed-0").exists()  # the adapter goes once the record is written
    # measured per stage (VmHWM reset at each stage's start). The reset lowers what getrusage reports too, so its
    # ru_maxrss now bounds the last stage's peak (the evaluation's) and says nothing of the training's
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert 0 < fresh["train_peak_rss_mib"] and 0 < fresh["evaluate_peak_rss_mib"] <= peak + 1

    out, workdir, lines = tmp_path / "next-token.json", tmp_path / "work", []

    def dying(*args, **kwargs):  # stands in for a death the process cannot report (a signal, the OOM killer)
        raise SystemExit(137)

    monkeypatch.setattr(evaluation, "evaluate", dying)
    with pytest.raises(SystemExit):
        next_token.run_seeds([0], str(sft_base), out, workdir, steps=2, log=lines.append)
    assert lines[-1].startswith("seed 0: evaluating")  # the last line logged is the stage it died in
    assert driver.load(out, next_token.DECLARATION) == {}  # no record of a seed that did not finish
    marker = json.loads((workdir / "seed-0" / next_token.TRAINED_MARKER).read_text())
    assert marker["seed"] == 0 and marker["steps"] == 2 and marker["train_seconds"] > 0

    # the next invocation evaluates the adapter already trained: no training, the marker's training time
    monkeypatch.undo()
    monkeypatch.setattr(next_token.demo, "train_heads", lambda *a, **k: pytest.fail("trained again"))
    resumed = next_token.run_seeds([0], str(sft_base), out, workdir, steps=2, log=lines.append)["0"]
    assert any(line.startswith("seed 0: reusing the adapter trained earlier") for line in lines)
    assert resumed["train_seconds"] == marker["train_seconds"] and resumed["seconds"] > resumed["train_seconds"]
    assert {k: v for k, v in resumed.items() if k not in TIMES} == {k: v for k, v in fresh.items() if k not in TIMES}
    assert not (workdir / "seed-0").exists()


def test_an_adapter_of_other_steps_is_trained_again(sft_base, tmp_path, monkeypatch):
    folder = tmp_path / "work" / "seed-0"
    folder.mkdir(parents=True)
    (folder / next_token.TRAINED_MARKER).write_text(json.dumps(
        {"seed": 0, "steps": 5, "base": str(sft_base), "train_seconds": 1.0, "train_cpu_seconds": 1.0,
         "train_peak_rss_mib": 1.0}))
    calls = []

    def train(base, tokenizer, steps, out, seed):
        calls.append((steps, seed))
        out.mkdir(parents=True)

    monkeypatch.setattr(next_token.demo, "train_heads", train)
    lines = []
    trained = next_token.train_or_reuse(0, str(sft_base), None, 2, folder, lines.append)
    assert calls == [(2, 0)] and trained["steps"] == 2 and "training again" in lines[0]
    assert json.loads((folder / next_token.TRAINED_MARKER).read_text()) == trained


def test_the_record_names_the_commit_that_trained_the_adapter(sft_base, tmp_path, monkeypatch):
    """HEAD when a seed's training starts, kept in the marker: a commit made while the seed runs, or before a resumed
    evaluation, is not the code that trained it."""
    heads = iter(["aaaaaaa", "bbbbbbb", "ccccccc"])
    monkeypatch.setattr(next_token, "_commit", lambda: next(heads))
    train = next_token.demo.train_heads
    monkeypatch.setattr(next_token.demo, "train_heads", lambda *a, **k: (next(heads), train(*a, **k)))
    record = next_token.run_seeds([0], str(sft_base), tmp_path / "out.json", tmp_path / "work", steps=1,
                                  log=lambda _: None)["0"]
    assert record["commit"] == "aaaaaaa"
