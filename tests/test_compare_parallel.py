"""`causalqwen compare --num_proc N`: the runs trained by N forked processes give the one-process comparison; a run
that fails in a process stops every process and the comparison with its error, the runs finished before it kept for
the next call; an error in the caller stops the processes too; bad settings are refused before anything runs."""

import json
import os

import pytest
from test_compare import argv, base_folder, tokenizer_dir, write_rows  # noqa: F401 (fixtures)
from test_compare_resume import without_time

from causalqwen_adapter.cli import compare
from causalqwen_adapter.comparison import runs as runs_module
from causalqwen_adapter.comparison.progress import PROGRESS_FILE


def recording(monkeypatch, folder, fail=None):
    """Each run's process id written to ``folder`` (the forked processes inherit the patch); the run ``fail`` (arm,
    seed, lr) raises."""
    train = runs_module.train_arm

    def recorded(base, arm, features, rows, train_labels, labels, eos, lr, steps, batch_rows, seed, *args, **kwargs):
        (folder / f"{arm}-{seed}-{lr}").write_text(str(os.getpid()))
        if (arm, seed, lr) == fail:
            raise ValueError("this run failed")
        return train(base, arm, features, rows, train_labels, labels, eos, lr, steps, batch_rows, seed, *args,
                     **kwargs)

    folder.mkdir()
    monkeypatch.setattr(runs_module, "train_arm", recorded)


def test_processes_give_the_one_process_comparison(base_folder, tokenizer_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    data = write_rows(tmp_path / "rows.jsonl")
    flags = ("--noise", "class:0.4")
    reference = compare.main(argv(base_folder, data, tmp_path / "one", *flags, tokenizer=tokenizer_dir))
    recording(monkeypatch, tmp_path / "pids")
    capsys.readouterr()
    parallel = compare.main(argv(base_folder, data, tmp_path / "two", *flags, "--num_proc", "2",
                                 tokenizer=tokenizer_dir))
    assert without_time(parallel) == without_time(reference)
    pids = {p.read_text() for p in (tmp_path / "pids").iterdir()}
    assert len(list((tmp_path / "pids").iterdir())) == 12 and len(pids) == 2 and str(os.getpid()) not in pids
    log = capsys.readouterr().out
    assert all(f"[{k}/12]" in log for k in range(1, 13))
    assert "2 processes of 1 thread(s)" in (tmp_path / "two" / "comparison.md").read_text()
    assert not (tmp_path / "two" / PROGRESS_FILE).exists()


def test_a_run_failing_in_a_process_stops_the_comparison_and_the_finished_runs_stay(base_folder, tokenizer_dir,  # noqa: F811
                                                                                   tmp_path, monkeypatch):
    data, out = write_rows(tmp_path / "rows.jsonl"), tmp_path / "out"
    recording(monkeypatch, tmp_path / "pids", fail=("softmax", 0, 1e-2))  # planned 8th of 12
    with pytest.raises(ValueError, match="this run failed"):
        compare.main(argv(base_folder, data, out, "--num_proc", "2", tokenizer=tokenizer_dir))
    assert not (out / "comparison.json").exists()
    kept = [json.loads(line) for line in (out / PROGRESS_FILE).read_text().splitlines()[1:]]
    keys = {(r["arm"], r["seed"], r["lr"]) for r in kept}
    planned = [(arm, seed, lr) for arm in ("ovr_candidates", "softmax") for seed in (0, 1, 2) for lr in (1e-3, 1e-2)]
    # the runs that ended before it started are kept: when the 8th starts, at most one of the 7 before it is under
    # way in the other process, lost with it when the processes stop at once
    assert keys <= set(planned[:7]) and len(keys) == len(kept) >= 6
    monkeypatch.undo()
    resumed = compare.main(argv(base_folder, data, out, "--num_proc", "2", tokenizer=tokenizer_dir))
    reference = compare.main(argv(base_folder, data, tmp_path / "reference", tokenizer=tokenizer_dir))
    assert without_time(resumed) == without_time(reference)


@pytest.mark.parametrize("flags, message", [(("--num_proc", "0"), "num_proc"),
                                            (("--num_proc", "2", "--threads", "2"), "pass --threads 1")])
def test_bad_process_settings_are_refused(base_folder, tokenizer_dir, tmp_path, capsys, flags, message):  # noqa: F811
    data = write_rows(tmp_path / "rows.jsonl")
    with pytest.raises(SystemExit) as exit_info:
        compare.main([*argv(base_folder, data, tmp_path / "out", tokenizer=tokenizer_dir), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_error_in_the_caller_stops_the_processes(base_folder, tokenizer_dir, tmp_path, monkeypatch):  # noqa: F811
    """The caller's `on_run` failing at the first run: the processes are stopped then, not left to train the rest
    until the interpreter exits."""
    recording(monkeypatch, tmp_path / "pids")
    data, out = write_rows(tmp_path / "rows.jsonl"), tmp_path / "out"

    def failing(self, run):
        raise OSError("the disk is full")

    monkeypatch.setattr(compare.RunLog, "add", failing)
    with pytest.raises(OSError, match="the disk is full"):
        compare.main(argv(base_folder, data, out, "--num_proc", "2", tokenizer=tokenizer_dir))
    started = len(list((tmp_path / "pids").iterdir()))
    assert started < 12
    for pid in {int(p.read_text()) for p in (tmp_path / "pids").iterdir()}:
        with pytest.raises(ProcessLookupError):  # the processes are gone
            os.kill(pid, 0)
    assert len(list((tmp_path / "pids").iterdir())) == started
