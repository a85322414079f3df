"""An adapter folder's tokenizer: AutoTokenizer and pipeline() on the folder give its base's tokenizer."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.numeric import NUM_TOKEN
from causalqwen_adapter.tokenization_causalqwen import TOKENIZER_CONFIG, is_adapter_tokenizer_config

TEXT = "the cat sat on the mat, and the dog"


@pytest.fixture(scope="module")
def adapter(sft_base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer") / "adapter"
    CausalQwenForCausalLM.from_base(str(sft_base)).save_pretrained(folder)
    return folder


def same_tokenizer(got, want):
    assert got.get_vocab() == want.get_vocab()
    assert got(TEXT).input_ids == want(TEXT).input_ids
    assert (got.eos_token, got.pad_token, got.chat_template) == (want.eos_token, want.pad_token, want.chat_template)


def test_auto_tokenizer_of_an_adapter_is_its_bases(adapter, sft_base):
    assert json.loads((adapter / "tokenizer_config.json").read_text()) == TOKENIZER_CONFIG
    assert not (adapter / "tokenizer.json").exists()  # the tokenizer itself stays the base's
    same_tokenizer(AutoTokenizer.from_pretrained(adapter, trust_remote_code=True),
                   AutoTokenizer.from_pretrained(sft_base))


def test_auto_tokenizer_asks_for_trust_remote_code(adapter):
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoTokenizer.from_pretrained(adapter, trust_remote_code=False)


def test_pipeline_on_an_adapter_folder_generates_what_the_model_does(adapter, sft_base):
    """`pipeline("text-generation", model=adapter)`, the Hub's snippet for a text-generation repo."""
    pipe = pipeline("text-generation", model=str(adapter), trust_remote_code=True, dtype=torch.float32)
    out = pipe(TEXT, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    model = AutoModelForCausalLM.from_pretrained(adapter, trust_remote_code=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert out == tokenizer.decode(expected, skip_special_tokens=True)


def test_a_numeric_adapters_tokenizer_has_num_at_its_row(sft_base, tmp_path):
    free_row = len(AutoTokenizer.from_pretrained(sft_base))  # the next id the tokenizer gives, a row it never writes
    model = CausalQwenForCausalLM.from_base(str(sft_base), numeric=True, num_token_id=free_row)
    model.save_pretrained(tmp_path / "numeric")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "numeric", trust_remote_code=True)
    assert tokenizer.convert_tokens_to_ids(NUM_TOKEN) == model.config.num_token_id
    assert tokenizer(f"x = {NUM_TOKEN}").input_ids[-1] == model.config.num_token_id


def test_a_tokenizer_the_user_saved_in_the_folder_is_kept(adapter, sft_base, tmp_path):
    """A save writes its tokenizer_config.json only where the folder has none of the user's: their tokenizer (with a
    token of their own) stays, and is what AutoTokenizer reads; the adapter's own is rewritten as before."""
    folder = tmp_path / "adapter"
    model = CausalQwenForCausalLM.from_base(str(sft_base))
    model.save_pretrained(folder)
    assert is_adapter_tokenizer_config(folder / "tokenizer_config.json")
    model.save_pretrained(folder)  # a save over its own file
    assert is_adapter_tokenizer_config(folder / "tokenizer_config.json")
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    tokenizer.add_tokens(["<mine>"])
    tokenizer.save_pretrained(folder)
    theirs = (folder / "tokenizer_config.json").read_bytes()
    model.save_pretrained(folder)
    assert (folder / "tokenizer_config.json").read_bytes() == theirs
    assert "<mine>" in AutoTokenizer.from_pretrained(folder).get_vocab()
    # and in a folder that is not yet an adapter's, beside other files of the user's
    other = tmp_path / "other"
    tokenizer.save_pretrained(other)
    theirs = {p.name: p.read_bytes() for p in other.iterdir()}
    model.save_pretrained(other)
    assert {name: (other / name).read_bytes() for name in theirs} == theirs


def test_the_tokenizer_loads_as_remote_code_alone(adapter, sft_base, tmp_path):
    """Where the package is not installed: the folder's own code gives the base's tokenizer."""
    script = (
        "import sys\n"
        "sys.modules['causalqwen_adapter'] = None\n"
        "from transformers import AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "print(tok(sys.argv[2]).input_ids)\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script, str(adapter), TEXT], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(AutoTokenizer.from_pretrained(sft_base)(TEXT).input_ids)


def test_a_base_folder_missing_here_is_named_with_the_way_out(adapter, sft_base, tmp_path):
    """An adapter saved on another machine names its base by that machine's folder: the error says to pass
    base_model=, which the tokenizer takes as the model does."""
    moved = tmp_path / "moved"
    shutil.copytree(adapter, moved)
    config = json.loads((moved / "config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "elsewhere" / "base")
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="base_model=") as error:
        AutoTokenizer.from_pretrained(moved, trust_remote_code=True)
    assert str(tmp_path / "elsewhere" / "base") in str(error.value)
    same_tokenizer(AutoTokenizer.from_pretrained(moved, trust_remote_code=True, base_model=str(sft_base)),
                   AutoTokenizer.from_pretrained(sft_base))
