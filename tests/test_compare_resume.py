"""`causalqwen compare` cut short and run again (causalqwen_adapter/comparison/progress.py): the finished runs are kept
as they end, the same command trains only the missing ones and gives an uninterrupted run's results; another
comparison's runs are refused before the base loads, --overwrite starts again."""

import json

import pytest
from test_compare import argv, base_folder, tokenizer_dir, write_rows  # noqa: F401 (fixtures)

from causalqwen_adapter.cli import compare
from causalqwen_adapter.comparison import runs as runs_module
from causalqwen_adapter.comparison.progress import PROGRESS_FILE

TIMELESS = ("seconds",)


class Killed(BaseException):
    """Stands for the end of the process (a signal, Ctrl-C): not an error the command would catch."""


def counting(monkeypatch, kill_at: int | None = None) -> list:
    """Count the runs trained; raise `Killed` when run `kill_at` (1-based) starts."""
    calls, train = [], runs_module.train_arm

    def counted(*args, **kwargs):
        calls.append(args[1])
        if kill_at is not None and len(calls) == kill_at:
            raise Killed
        return train(*args, **kwargs)

    monkeypatch.setattr(runs_module, "train_arm", counted)
    return calls


def cut_short(monkeypatch, base, tokenizer, tmp_path, kill_at: int, *flags):
    """(rows, output folder) of a comparison whose process ended as run `kill_at` started."""
    data, out = write_rows(tmp_path / "rows.jsonl"), tmp_path / "out"
    counting(monkeypatch, kill_at)
    with pytest.raises(Killed):
        compare.main(argv(base, data, out, *flags, tokenizer=tokenizer))
    monkeypatch.undo()
    return data, out


def without_time(out: dict) -> dict:
    return {"runs": [{k: v for k, v in run.items() if k not in TIMELESS} for run in out["runs"]],
            "per_seed": out["per_seed"], "chosen": out["chosen"], "table": out["table"]}


def test_a_comparison_cut_short_resumes_to_the_uninterrupted_results(base_folder, tokenizer_dir, tmp_path,  # noqa: F811
                                                                      monkeypatch, capsys):
    data = write_rows(tmp_path / "rows.jsonl")
    flags = ("--noise", "class:0.4")
    reference = compare.main(argv(base_folder, data, tmp_path / "reference", *flags, tokenizer=tokenizer_dir))
    assert not (tmp_path / "reference" / PROGRESS_FILE).exists()  # gone once comparison.json holds every run

    data, out = cut_short(monkeypatch, base_folder, tokenizer_dir, tmp_path, 6, *flags)
    lines = (out / PROGRESS_FILE).read_text().splitlines()
    assert len(lines) == 1 + 5 and not (out / "comparison.json").exists()  # what it was made from, 5 runs

    calls = counting(monkeypatch)
    capsys.readouterr()
    resumed = compare.main(argv(base_folder, data, out, *flags, tokenizer=tokenizer_dir))
    assert len(calls) == 12 - 5  # 2 arms × 2 rates × 3 seeds, 5 of them finished earlier
    log = capsys.readouterr().out
    assert "5 of 12 runs finished earlier" in log and log.count("(finished earlier") == 5
    assert without_time(resumed) == without_time(reference)
    assert without_time(json.loads((out / "comparison.json").read_text())) == \
        without_time(json.loads((tmp_path / "reference" / "comparison.json").read_text()))
    assert not (out / PROGRESS_FILE).exists()


def test_another_comparisons_runs_are_refused_and_overwrite_starts_again(base_folder, tokenizer_dir, tmp_path,  # noqa: F811
                                                                         monkeypatch, capsys):
    data, out = cut_short(monkeypatch, base_folder, tokenizer_dir, tmp_path, 3)
    before = (out / PROGRESS_FILE).read_text()

    loaded = []
    monkeypatch.setattr(compare.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a) or 1 / 0)
    with pytest.raises(SystemExit) as exit_info:  # other rates: not this comparison's runs
        compare.main(argv(base_folder, data, out, "--lrs", "1e-3", "3e-2", tokenizer=tokenizer_dir))
    assert exit_info.value.code == 2 and not loaded  # refused before the base loads
    err = capsys.readouterr().err
    assert "holds the finished runs of another comparison (it differs in lrs)" in err and "--overwrite" in err
    assert (out / PROGRESS_FILE).read_text() == before  # nothing lost

    monkeypatch.undo()
    calls = counting(monkeypatch)
    again = compare.main(argv(base_folder, data, out, "--lrs", "1e-3", "3e-2", "--overwrite", tokenizer=tokenizer_dir))
    assert len(calls) == 12 and {run["lr"] for run in again["runs"]} == {1e-3, 3e-2}
    assert not (out / PROGRESS_FILE).exists()


def test_a_line_cut_short_is_trained_again(base_folder, tokenizer_dir, tmp_path, monkeypatch):  # noqa: F811
    data, out = cut_short(monkeypatch, base_folder, tokenizer_dir, tmp_path, 4)
    text = (out / PROGRESS_FILE).read_text()
    (out / PROGRESS_FILE).write_text(text[: len(text) - 20])  # the process ended while writing its third run
    calls = counting(monkeypatch)
    compare.main(argv(base_folder, data, out, tokenizer=tokenizer_dir))
    assert len(calls) == 12 - 2
