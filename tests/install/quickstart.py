"""A stranger's first hour, from the installed wheel (`make test-install`; not collected by pytest).

Run by the fresh venv's python from a folder outside the clone: the package must come from that venv's site-packages
and the `causalqwen` console script from its bin/. It builds a tiny random Qwen2 base (tied and untied) with a
word-level tokenizer, attaches heads, saves the adapter, loads it back with `AutoModelForCausalLM` +
`trust_remote_code`, generates in every inference mode, trains 5 steps with `causalqwen train` on a small JSONL and
generates with the result through `causalqwen generate`, and runs `causalqwen compare` on 30 labelled rows. Any problem
is an exception or a non-zero exit.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import causalqwen_adapter
from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.cauchy import INFERENCE_MODES

PAIRS = [("what is two plus two", " two plus two is four"), ("hello how are you", " i am fine thank you"),
         ("the sky is", " blue today"), ("a dog", " ran in the park"), ("the cat sat on", " the mat")]


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SystemExit(f"quickstart FAILED: {message}")


def tiny_base(folder: Path, tied: bool) -> Path:
    """A tiny random Qwen2 and a word-level tokenizer trained on PAIRS, saved together like a Hub base."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator([p + c for p, c in PAIRS], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "<|endoftext|>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(*argv: str) -> str:
    print("$", " ".join(argv), flush=True)
    proc = subprocess.run(argv, capture_output=True, text=True)
    check(proc.returncode == 0, f"`{' '.join(argv)}` exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                f"{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> None:
    start = time.perf_counter()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    package = Path(causalqwen_adapter.__file__).resolve()
    check(site in package.parents, f"causalqwen_adapter imported from {package}, not from this venv's {site}")
    script = Path(sys.executable).parent / "causalqwen"
    check(script.is_file(), f"no console script at {script}")
    print(f"causalqwen_adapter {causalqwen_adapter.__version__} from {package.parent}")

    work = Path(tempfile.mkdtemp(prefix="causalqwen-quickstart-"))
    os.chdir(work)  # nothing of the clone on the path
    for kind in ("tied", "untied"):
        base = tiny_base(work / f"base-{kind}", tied=kind == "tied")
        adapter = work / f"adapter-{kind}"
        fresh = CausalQwenForCausalLM.from_base(str(base))  # the README's first lines, by name
        report = fresh.verify_initialization(torch.tensor([[5, 6, 7, 8]]))  # an untied base's layer read back
        check(report["logits_diff"] < 1e-5, f"{kind} base: the fresh heads are not the base's logits: {report}")
        fresh.save_pretrained(adapter)
        files = sorted(p.name for p in adapter.iterdir())
        check("model.safetensors" in files and any(f.endswith(".py") for f in files),
              f"{adapter} lacks the weights or the remote code: {files}")
        model = AutoModelForCausalLM.from_pretrained(adapter, trust_remote_code=True).eval()
        check(type(model).__name__ == "CausalQwenForCausalLM", f"loaded {type(model).__name__}")
        ids = torch.tensor([[5, 6, 7]])
        for mode in INFERENCE_MODES:
            out = model.generate(ids, max_new_tokens=4, do_sample=False, inference_mode=mode)
            # 4 new tokens, fewer if the random base says end-of-text
            check(out.shape[0] == 1 and 3 < out.shape[1] <= 7, f"{kind} base, {mode} mode: shape {tuple(out.shape)}")
        print(f"{kind} base: saved, loaded with trust_remote_code, generated in {', '.join(INFERENCE_MODES)}")

    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS * 4))
    trained = work / "trained"
    print(run(str(script), "--help"))
    run(str(script), "train", "--model_name_or_path", str(work / "base-tied"), "--dataset_name", str(data),
        "--output_dir", str(trained), "--max_steps", "5", "--per_device_train_batch_size", "4",
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true")
    check((trained / "model.safetensors").is_file(), f"causalqwen train wrote no adapter: {sorted(trained.iterdir())}")
    answer = run(str(script), "generate", "--model_name_or_path", str(trained), "--prompt", "the cat sat on",
                 "--no_chat", "--max_new_tokens", "4", "--inference_mode", "standard", "--device", "cpu")
    check(answer.strip() != "", "causalqwen generate printed nothing")
    print(f"causalqwen generate: {answer.strip()!r}")

    # "do the heads help on my rows?": the paired comparison, two seeds, one step per run (the plots need the
    # `plots` extra, not installed here)
    # the word-level tokenizer alone: beside the base's config.json transformers reads it as a Qwen2Tokenizer, which
    # maps these words to nothing (tests/test_classify.py)
    tokenizer = work / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / "base-untied" / name, tokenizer / name)
    rows = work / "labelled.jsonl"
    words = " ".join(p for p, _ in PAIRS).split()
    rows.write_text("".join(json.dumps({"prompt": " ".join(words[(3 * n + k) % len(words)] for k in range(4)),
                                        "completion": [" blue", " mat", " four"][n % 3]}) + "\n" for n in range(30)))
    table = run(str(script), "compare", "--model_name_or_path", str(work / "base-untied"), "--dataset_name", str(rows),
                "--tokenizer", str(tokenizer), "--output_dir", str(work / "compare"), "--arms", "ovr_candidates",
                "softmax", "--lrs", "1e-3",
                "--seeds", "0", "1", "--max_steps", "1", "--per_device_train_batch_size", "4", "--no_plots",
                "--device", "cpu")
    check("| accuracy" in table and (work / "compare" / "comparison.json").is_file(),
          f"causalqwen compare printed no table:\n{table[-2000:]}")
    print("causalqwen compare: the paired table of 4 runs")
    print(f"quickstart passed in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
