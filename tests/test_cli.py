"""The `causalqwen` command line (causalqwen_adapter/cli/): the dispatcher, each subcommand's --help, one vocabulary of
flags with the old spellings still read, close matches for a misspelt flag, and the install line of a missing extra."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from causalqwen_adapter.cli import classify, distill, evaluate, extract_features, generate, prepare_base, push
from causalqwen_adapter.cli.main import COMMANDS, main
from causalqwen_adapter.cli.parsing import EXTRAS

from conftest import REPO_ROOT


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def _error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_help_lists_every_subcommand_with_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert f"  {name} " in out and command.summary in out
    assert set(COMMANDS) == {"train", "distill", "extract-features", "generate", "evaluate", "classify", "compare",
                             "push", "prepare-base"}
    assert main([]) == 0 and capsys.readouterr().out == out
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("causalqwen 0.")


def test_an_unknown_subcommand_names_the_close_one(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "Did you mean train?" in err


def test_the_dispatcher_imports_neither_trl_nor_datasets():
    """`causalqwen --help` works in a library-only install: the subcommands' modules load only when asked for."""
    code = ("import sys; from causalqwen_adapter.cli.main import main; main(['--help']); "
            "print('LOADED', sorted(m for m in ('trl', 'datasets', 'peft') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout and "commands:" in proc.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_subcommands_help_starts_with_its_own_options_and_an_example(capsys, name):
    out = _help(capsys, name, "--help")
    assert out.startswith(f"usage: causalqwen {name} ")
    description = out.split("\noptions:\n")[0]
    assert f"    causalqwen {name} " in description  # an example, indented as a command line
    first_flag = out.index("\n  --")
    own = {"train": "--model_name_or_path", "distill": "--model_name_or_path", "push": "--model_name_or_path",
           "extract-features": "--model_name_or_path", "generate": "--model_name_or_path", "prepare-base": "--output_dir",
           "evaluate": "--model_name_or_path", "classify": "--model_name_or_path",
           "compare": "--model_name_or_path"}[name]
    assert own in out[first_flag:]
    if name in ("train", "distill"):  # the hundreds of TrainingArguments come after the model, data and head options
        rest = out.index("every other option")
        for flag in ("--model_name_or_path", "--dataset_name", "--causal_size", "--output_dir"):
            assert first_flag <= out.index(f"\n  {flag} ", first_flag) < rest, flag
        assert out.index("  --adam_beta1 ") > rest


@pytest.mark.parametrize("name, words", [
    ("train", ["`text`", "`prompt`/`completion`", "`messages`", "<NUM>"]),
    ("evaluate", ["`text`", "`prompt`/`completion`", "`messages`"]),
    ("classify", ["`prompt`/`completion`", "label"]),
    ("compare", ["`prompt`/`completion`", "label", "first token"]),
    ("extract-features", ["`input_ids`", "text column"]),
])
def test_help_says_which_rows_the_data_must_hold(capsys, name, words):
    description = " ".join(_help(capsys, name, "--help").split("\noptions:\n")[0].split())
    for word in words:
        assert word in description


def test_old_spellings_parse_to_the_same_values_and_stay_out_of_help(tmp_path):
    pairs = [
        (evaluate, ["--models", "a", "b", "--dataset_name", "d", "--output_dir", "o", "--modes", "standard", "causal",
                    "--batch_size", "2"],
         ["--model_name_or_path", "a", "b", "--dataset_name", "d", "--output_dir", "o", "--inference_mode", "standard",
          "causal", "--per_device_eval_batch_size", "2"]),
        (classify, ["--model", "m", "--test_file", "t", "--validation_file", "v", "--output_dir", "o", "--mode=causal",
                    "--batch_size", "3"],
         ["--model_name_or_path", "m", "--dataset_name", "t", "--validation_dataset_name", "v", "--output_dir", "o",
          "--inference_mode=causal", "--per_device_eval_batch_size", "3"]),
        (extract_features, ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--batch_size", "5"],
         ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--per_device_eval_batch_size", "5"]),
        (distill, ["--model_name_or_path", "m", "--features", "f", "--eval_features", "e", "--output_dir", "o"],
         ["--model_name_or_path", "m", "--dataset_name", "f", "--eval_dataset_name", "e", "--output_dir", "o"]),
    ]
    for module, old, new in pairs:
        parser = module.make_parser()
        assert parser.parse(old) == parser.parse(new), module.__name__
        shown = parser.format_help()
        for alias in module.ALIASES:
            assert f"{alias} " not in shown and f"{alias}," not in shown, (module.__name__, alias)
    hf = classify.make_parser().parse(pairs[1][1])[0]
    assert (hf.model_name_or_path, hf.dataset_name, hf.inference_mode, hf.per_device_eval_batch_size) == \
        ("m", "t", "causal", 3)

    # argparse subcommands: the old positionals and dashed names
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    old = generate.parse_args([str(adapter), "--prompt", "hi", "--mode", "causal", "--max-new-tokens", "3",
                               "--no-chat", "--device", "cpu"])
    new = generate.parse_args(["--model_name_or_path", str(adapter), "--prompt", "hi", "--inference_mode", "causal",
                               "--max_new_tokens", "3", "--no_chat", "--device", "cpu"])
    assert vars(old) == vars(new) and new.inference_mode == "causal" and new.max_new_tokens == 3
    old = push.parse_args(["run", "me/x", "--token", "t", "--private", "--revision", "dev", "--commit-message", "m",
                           "--create-pr"])
    new = push.parse_args(["--model_name_or_path", "run", "--hub_model_id", "me/x", "--hub_token", "t",
                           "--hub_private_repo", "--hub_revision", "dev", "--commit_message", "m", "--create_pr"])
    assert vars(old) == vars(new) and new.hub_model_id == "me/x" and new.hub_private_repo
    old = prepare_base.parse_args(["build/b", "--wheel-dir", "w"])
    new = prepare_base.parse_args(["--output_dir", "build/b", "--wheel_dir", "w"])
    assert vars(old) == vars(new) and new.output_dir == Path("build/b")
    for module in (generate, push, prepare_base):
        shown = module.make_parser().format_help()
        assert "--mode " not in shown and "--token " not in shown and "--wheel-dir" not in shown


def test_a_positional_and_its_flag_together_are_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        generate.parse_args([str(tmp_path), "--model_name_or_path", str(tmp_path), "--prompt", "hi"])
    assert "give --model_name_or_path alone" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        push.parse_args(["--hub_model_id", "me/x"])
    assert "required: --model_name_or_path" in capsys.readouterr().err


@pytest.mark.parametrize("argv, meant", [
    (["train", "--model_name_or_path", "m", "--per_device_train_bach_size", "2"], "--per_device_train_batch_size"),
    (["generate", "--model_name_or_path", "m", "--promt", "hi"], "--prompt"),
    (["evaluate", "--model_name_or_path", "m", "--datset_name", "d", "--output_dir", "o"], "--dataset_name"),
    (["classify", "--model_name_or_path=m", "--coverge=0.9"], "--coverage"),
    (["push", "--model_name_or_path", "m", "--hub_model_di", "me/x"], "--hub_model_id"),
    (["distill", "--causal_sise", "8"], "--causal_size"),
])
def test_a_misspelt_flag_is_an_error_naming_the_close_match(capsys, argv, meant):
    """Before any required-flag complaint or loading: Python 3.11's argparse suggests nothing, HfArgumentParser
    raises a ValueError on unknown flags."""
    err = _error(capsys, *argv)
    assert "unrecognized arguments" in err and f"did you mean {meant}" in err
    assert "(default" not in err


def test_a_subcommand_needing_the_train_extra_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` fails as when it is not installed
    for name in ("train", "evaluate"):
        if name == "evaluate":
            monkeypatch.setitem(sys.modules, "datasets", None)
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        message = str(exit_info.value.code)
        assert message.startswith(f"causalqwen {name} needs ") and "not installed here" in message
        assert "pip install trl datasets peft accelerate" in message and 'pip install ".[train]"' in message
    assert "trl" in message or "datasets" in message
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert main(["--help"]) == 0  # the dispatcher itself needs neither


def test_the_extras_named_by_the_install_lines_are_pyprojects():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert list(EXTRAS["train"]) == extras["train"] and list(EXTRAS["plots"]) == extras["plots"]
    assert set(EXTRAS["demo"]) <= set(extras["demo"])
    assert pyproject["project"]["scripts"]["causalqwen"] == "causalqwen_adapter.cli.main:main"


def test_the_recipes_are_thin_entry_points_to_the_same_main():
    for recipe, module in (("sft_ovr", "train"), ("distill_heads", "distill"), ("extract_features", "extract_features"),
                           ("generate", "generate"), ("evaluate", "evaluate"), ("classify", "classify"),
                           ("push_to_hub", "push"), ("prepare_demo_base", "prepare_base")):
        text = (REPO_ROOT / "recipes" / f"{recipe}.py").read_text()
        assert f"from causalqwen_adapter.cli.{module} import main" in text and len(text.splitlines()) < 10


def _files_flags_cases(tmp: Path) -> list[tuple[list[str], list[str]]]:
    """(argv, what the one-paragraph error must say) for file and folder flags given wrong: a missing file, a folder
    where a file is meant, a file where a folder is meant, an accelerate YAML or broken JSON as --deepspeed."""
    base, data, empty, out = tmp / "base", tmp / "d.jsonl", tmp / "nodata", str(tmp / "out")
    base.mkdir(exist_ok=True)
    empty.mkdir(exist_ok=True)
    data.write_text('{"text": "a b", "prompt": "a", "completion": " b"}\n')
    (tmp / "accelerate.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n")
    (tmp / "broken.json").write_text('{"zero_optimization": {"stage": 3,}')
    train = ["train", "--model_name_or_path", str(base), "--dataset_name", str(data), "--output_dir", out]
    distill = ["distill", "--model_name_or_path", str(base), "--dataset_name", str(empty), "--output_dir", out]
    launch = "accelerate launch --config_file recipes/configs/deepspeed_zero3.yaml -m causalqwen_adapter.cli train"
    shipped = "such as recipes/configs/deepspeed_zero3.json"
    return [
        (train + ["--deepspeed", str(tmp / "missing.json")], ["missing.json': no such file", shipped, launch]),
        (train + ["--deepspeed", str(tmp / "accelerate.yaml")],
         ["is a YAML file", shipped, f"accelerate launch --config_file {tmp / 'accelerate.yaml'} -m causalqwen_adapter"
                                     ".cli train <the other flags, without --deepspeed>"]),
        (train + ["--deepspeed", str(tmp / "broken.json")], ["is not valid JSON (Expecting", shipped, launch]),
        (distill[:3] + ["--dataset_name", str(tmp / "f"), "--output_dir", out, "--deepspeed", str(empty)],
         ["nodata': a folder", "causalqwen_adapter.cli distill <the other flags>"]),
        (train[:3] + ["--dataset_name", str(tmp / "nope.jsonl"), "--output_dir", out],
         [f"--dataset_name '{tmp / 'nope.jsonl'}' was not found", "or the name of a dataset on the Hub"]),
        (train[:3] + ["--dataset_name", str(empty), "--output_dir", out],
         ["is a folder holding no data file datasets can read"]),
        (train + ["--config", str(tmp / "recipe.yaml")], ["recipe.yaml': no such file. --config takes a YAML file"]),
        (train + ["--config", str(tmp / "broken.json")], ["broken.json' is not valid YAML (", "--config takes a YAML"]),
        (train + ["--resume_from_checkpoint", str(tmp / "out" / "checkpoint-5")],
         ["checkpoint-5': no such folder. To resume a run, pass one of its checkpoint-N folders"]),
        (train[:-1] + [str(data)], [f"output_dir {data} is a file, not a folder"]),
        (distill, [f"{empty}: it holds no causalqwen_features.json, so it is not a feature store",
                   "causalqwen extract-features --output_dir"]),
        (["classify", "--model_name_or_path", str(base), "--dataset_name", str(data), "--validation_dataset_name",
          str(empty), "--output_dir", out], ["--validation_dataset_name", "holding no data file"]),
        (["evaluate", "--model_name_or_path", str(base), "--dataset_name", str(tmp / "held_out.csv"), "--output_dir",
          out], ["held_out.csv' was not found"]),
        (["evaluate", "--model_name_or_path", str(base), "--dataset_name", str(data), "--output_dir", str(data)],
         [f"--output_dir '{data}' is a file, not a folder", "Choose another --output_dir"]),
    ]


def test_a_wrong_file_or_folder_flag_is_a_usage_error_not_a_traceback(capsys, tmp_path):
    """Each is argparse's exit 2 with one `prog: error:` paragraph saying what was wrong and what to give, found
    before any model or data loads, and nothing is written."""
    for argv, says in _files_flags_cases(tmp_path):
        err = _error(capsys, *argv)
        assert "Traceback" not in err and f"causalqwen {argv[0]}: error: " in err, argv
        assert err.startswith("usage: ") and err.rstrip("\n").count("\n") == 1, err  # usage line + the error
        for words in says:
            assert words in err, (argv, words, err)
    assert not (tmp_path / "out").exists()


def test_an_adapter_out_of_reach_offline_is_one_error_line_naming_it(tmp_path):
    """`HF_HUB_OFFLINE=1` and a Hub id that is not cached: the command says which repository it could not load and
    exits 1, no traceback through transformers' hub code (an empty cache in tmp_path)."""
    code = "import sys; from causalqwen_adapter.cli.main import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "generate", "--model_name_or_path", "someone/not-cached",
                           "--prompt", "hi"], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1",
                               "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("causalqwen generate: error: cannot load the adapter 'someone/not-cached'")
