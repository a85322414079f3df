"""The adapter folder (docs/design.md, The adapter folder): what save_pretrained writes, what loads it, and what it refuses."""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.dynamic_module_utils import get_relative_imports

import causalqwen_adapter.adapter_io as adapter_io
from causalqwen_adapter import CausalQwenForCausalLM, dispatch

from conftest import TINY_VOCAB, kill_save_mid_swap, save_tiny_qwen2

ADAPTER_KEYS = {
    "abduction.loc.weight", "abduction.loc.bias", "abduction.scale.weight", "abduction.scale.bias",
    "action.weight", "action.bias", "action.b_noise",
}


@pytest.fixture
def trained_like(tiny_base):
    """Heads moved away from their initialisation, so a load that re-initialises would show."""
    model = CausalQwenForCausalLM.from_base(tiny_base)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and not name.endswith("b_noise"):
                p.add_(torch.randn_like(p) * 0.01)
    return model


def _outputs(model, input_ids):
    with torch.no_grad():
        out = model(input_ids)
    return {k: out[k] for k in ("logits", "loc_U", "scale_U", "loc_S", "scale_S")}


def test_folder_holds_only_adapter_tensors_and_remote_code(trained_like, tmp_path):
    trained_like.save_pretrained(tmp_path / "adapter")
    folder = tmp_path / "adapter"
    assert {p.name for p in folder.iterdir()} == {
        "config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer_config.json",
        "configuration_causalqwen.py", "modeling_causalqwen.py", "cauchy.py", "losses.py", "candidate_loss.py",
        "model_card.py", "heads.py", "adapter_io.py", "adapter_folder.py", "base_loading.py", "generation.py",
        "lm_loss.py", "dispatch.py", "sharding.py", "tokenization_causalqwen.py", "numeric.py",
    }
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert set(f.keys()) == ADAPTER_KEYS
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "causalqwen"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_causalqwen.CausalQwenConfig",
        "AutoModel": "modeling_causalqwen.CausalQwenModel",
        "AutoModelForCausalLM": "modeling_causalqwen.CausalQwenForCausalLM",
    }
    assert config["base_model_name_or_path"] == str(trained_like.config.base_model_name_or_path)
    assert config["text_config"]["model_type"] == "qwen2"
    # the remote code imports nothing of this package, but for sharing (push_to_hub), which asks for it
    for name in ("configuration_causalqwen.py", "modeling_causalqwen.py", "cauchy.py", "losses.py", "candidate_loss.py",
                 "model_card.py", "heads.py", "adapter_io.py", "adapter_folder.py", "base_loading.py", "generation.py",
                 "lm_loss.py", "dispatch.py", "sharding.py", "tokenization_causalqwen.py", "numeric.py"):
        text = (folder / name).read_text().replace("from causalqwen_adapter.hub import push_adapter", "")
        assert "causalqwen_adapter" not in text, name


NATIVE_CODE = re.compile(
    r"^\s*(import|from)\s+(ctypes|subprocess|cffi)\b|cpp_extension|load_library|CDLL|#include|TORCH_LIBRARY"
    r"|torch\.compile\(|_inductor", re.M)
UPLOAD_CODE = re.compile(r"HfApi|upload_folder|upload_file|create_repo|create_commit")
# an import of the package's kernels (kernels/), relative or absolute
KERNELS_IMPORT = re.compile(r"^\s*(from|import)\s+(causalqwen_adapter)?\.*kernels\b|^\s*from\s+(causalqwen_adapter|\.+)\s+"
                            r"import\s+[^\n#]*\bkernels\b", re.M)
KERNEL_FILES = {p.name for p in (Path(adapter_io.__file__).parent / "kernels").glob("*.py")}


def test_the_folder_ships_no_native_code(trained_like, tmp_path):
    """Remote code is plain PyTorch: no C or C++ source, no library, no file of the CPU kernels, and no Python file
    that imports ctypes or subprocess, loads a library, builds an extension, calls torch.compile, or imports the
    package's kernels; and no Hub upload code (sharing belongs to the installed package)."""
    folder = tmp_path / "adapter"
    trained_like.save_pretrained(folder)
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".json", ".safetensors", ".md", ".py"}
    assert not [p.name for p in files if p.name.startswith("cpu_kernel") or p.name in KERNEL_FILES or "csrc" in p.parts]
    for path in (p for p in files if p.suffix == ".py"):
        text = path.read_text()
        assert not NATIVE_CODE.search(text), (path.name, NATIVE_CODE.search(text).group(0))
        assert not UPLOAD_CODE.search(text), (path.name, UPLOAD_CODE.search(text).group(0))
        assert not KERNELS_IMPORT.search(text), (path.name, KERNELS_IMPORT.search(text).group(0))
        assert not [name for name in get_relative_imports(path) if name.split(".")[0] == "kernels"], path.name


def test_round_trip_is_bit_exact(trained_like, tmp_path, input_ids):
    trained_like.save_pretrained(tmp_path / "adapter")
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")
    for key, value in trained_like.adapter_state_dict().items():
        assert torch.equal(loaded.adapter_state_dict()[key], value), key
    assert torch.all(loaded.action.b_noise == loaded.config.b_noise_init)  # a bare nn.Parameter survives transformers' init
    before, after = _outputs(trained_like.eval(), input_ids), _outputs(loaded, input_ids)
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_learnable_threshold_is_saved(tied_base, tmp_path, input_ids):
    model = CausalQwenForCausalLM.from_base(tied_base, learnable_threshold=True, ovr_threshold_init=0.5)
    assert model.ovr.threshold.shape == (TINY_VOCAB,) and torch.all(model.ovr.threshold == 0.5)
    with torch.no_grad():
        model.ovr.threshold.normal_()
    model.save_pretrained(tmp_path / "a")
    assert set(load_file(tmp_path / "a" / "model.safetensors")) == ADAPTER_KEYS | {"ovr.threshold"}
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "a")
    assert torch.equal(loaded.ovr.threshold, model.ovr.threshold)


def test_save_into_existing_folder_keeps_other_files(trained_like, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    trained_like.save_pretrained(folder)
    trained_like.save_pretrained(folder)  # and again, over the first save
    assert (folder / "trainer_state.json").exists() and (folder / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["causalqwen_adapter"] = None  # any import of the package now fails
    try:
        import causalqwen_adapter
    except ImportError:
        pass
    else:
        raise SystemExit("causalqwen_adapter is importable")
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    adapter, input_ids, out = sys.argv[1], torch.load(sys.argv[2]), sys.argv[3]
    lm = AutoModelForCausalLM.from_pretrained(adapter, trust_remote_code=True)
    base = AutoModel.from_pretrained(adapter, trust_remote_code=True)
    assert type(lm).__module__.startswith("transformers_modules"), type(lm).__module__
    with torch.no_grad():
        a, b = lm(input_ids), base(input_ids)
    torch.save({"lm": {k: a[k] for k in ("logits", "loc_U", "scale_U", "loc_S", "scale_S")},
                "model": {k: b[k] for k in ("loc_U", "scale_U", "loc_S", "scale_S")},
                "class": type(base).__name__}, out)
    """
)


def _run_isolated(script: str, *args, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_MODULES_CACHE": str(Path(args[-1]).parent / "modules"), **(env or {})}
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=Path(args[-1]).parent)


def test_remote_code_loads_without_the_package(trained_like, tmp_path, input_ids):
    trained_like.save_pretrained(tmp_path / "adapter")
    torch.save(input_ids, tmp_path / "ids.pt")
    proc = _run_isolated(REMOTE_SCRIPT, tmp_path / "adapter", tmp_path / "ids.pt", tmp_path / "out.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    expected = _outputs(trained_like.eval(), input_ids)
    assert got["class"] == "CausalQwenModel"
    for key, value in expected.items():
        assert torch.equal(got["lm"][key], value), key
        if key != "logits":
            assert torch.equal(got["model"][key], value), key


def _generate_and_train(model, input_ids):
    """Every inference mode's greedy tokens and scores, then one training step's loss and head gradients."""
    import torch

    result = {}
    model.eval()
    for mode in ("compatible", "standard", "sampling", "causal"):
        torch.manual_seed(0)  # the sampling mode's noise
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=3,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True,
                                 inference_mode=mode)
        result[mode] = (out.sequences, torch.stack(out.scores))
    model.train()
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    result["loss"] = loss.detach()
    result["grads"] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return result


def _decode_as_a_large_model(model, set_attribute):
    """The decode path of a W_A large enough for the decode operators, so that they are asked for."""
    import sys

    set_attribute(sys.modules[type(model.action).__module__], "_FUSED_MIN_NUMEL", 0)


NO_COMPILER_SCRIPT = inspect.getsource(_generate_and_train) + inspect.getsource(_decode_as_a_large_model) + textwrap.dedent(
    """
    import logging, shutil, sys
    sys.modules["causalqwen_adapter"] = None  # any import of the package now fails: its operators are not registered
    import torch
    from transformers import AutoModelForCausalLM
    assert not any(map(shutil.which, ("cc", "c++", "gcc", "g++", "clang", "ninja"))), "a compiler on PATH"
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    adapter, input_ids, out = sys.argv[1], torch.load(sys.argv[2]), sys.argv[3]
    model = AutoModelForCausalLM.from_pretrained(adapter, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert not any(hasattr(torch.ops.causalqwen, n) for n in ("cauchy_linear", "ovr_scores", "loss_tile"))
    _decode_as_a_large_model(model, setattr)
    result = _generate_and_train(model, input_ids)
    result["log"] = [m for m in messages if "causalqwen::" in m]
    try:  # sharing needs the package: the folder carries no upload code
        model.push_to_hub("user/tiny", token="hf_x")
    except ImportError as err:
        result["push"] = str(err)
    torch.save(result, out)
    """
)


def test_remote_code_without_a_compiler_runs_the_torch_reference(trained_like, tmp_path, input_ids, monkeypatch):
    """The Hub's view: the adapter folder loaded by transformers in a process where the package is not importable and
    no compiler or ninja is on PATH. Every inference mode generates and a training step runs, with the results of
    the package's torch reference, and the log says once per operator that the torch code runs."""
    trained_like.save_pretrained(tmp_path / "adapter")
    torch.save(input_ids, tmp_path / "ids.pt")
    (tmp_path / "empty").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env.update(PATH=str(tmp_path / "empty"), HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = subprocess.run([sys.executable, "-c", NO_COMPILER_SCRIPT, str(tmp_path / "adapter"), str(tmp_path / "ids.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")

    monkeypatch.setattr(dispatch, "_operator", lambda name: None)  # the package's reference path, whatever this CPU has
    model = CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")
    _decode_as_a_large_model(model, monkeypatch.setattr)
    want = _generate_and_train(model, input_ids)
    for mode in ("compatible", "standard", "sampling", "causal"):
        assert torch.equal(got[mode][0], want[mode][0]), mode
        torch.testing.assert_close(got[mode][1], want[mode][1])
    torch.testing.assert_close(got["loss"], want["loss"])
    assert got["grads"].keys() == want["grads"].keys() and want["grads"]
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, msg=name)
    said = [m.split(" on ")[0] for m in got["log"]]  # once per operator: "<name> on cpu <dtype> tensors: ..."
    assert sorted(said) == ["block_logsumexp", "candidate_term", "cauchy_linear", "ovr_scores"], got["log"]
    assert all("the torch code (no causalqwen::" in m for m in got["log"]), got["log"]
    assert "not installed here" in got["push"] and "pip install ." in got["push"]


COMPILES_NOTHING_SCRIPT = inspect.getsource(_generate_and_train) + inspect.getsource(_decode_as_a_large_model) + (
    textwrap.dedent(
        """
        import sys
        sys.modules["causalqwen_adapter"] = None  # the remote code alone: none of the package's operators
        import torch
        from torch._dynamo.utils import counters
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
        _decode_as_a_large_model(model, setattr)
        result = _generate_and_train(model, torch.load(sys.argv[2]))
        result["dynamo"] = {key: dict(value) for key, value in counters.items()}
        torch.save(result, sys.argv[3])
        """
    )
)


def test_remote_code_compiles_nothing_and_writes_nothing_outside_its_folder(trained_like, tmp_path, input_ids):
    """The Hub's view where a compiler is on PATH (this machine's own): every mode generates, on the decode path of a
    large model, and a training step runs, without one frame handed to torch.compile and without a file written to
    the caches where TorchInductor, Triton or PyTorch's extensions would build."""
    trained_like.save_pretrained(tmp_path / "adapter")
    torch.save(input_ids, tmp_path / "ids.pt")
    caches = {name: tmp_path / "caches" / name for name in
              ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR")}
    proc = _run_isolated(COMPILES_NOTHING_SCRIPT, tmp_path / "adapter", tmp_path / "ids.pt", tmp_path / "out.pt",
                         env={name: str(path) for name, path in caches.items()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert not got["dynamo"].get("frames"), got["dynamo"]
    # (importing torch._dynamo, as transformers does, creates TorchInductor's cache folder, empty)
    assert not [path for path in (tmp_path / "caches").rglob("*") if not path.is_dir()]
    assert set(got) >= {"compatible", "standard", "sampling", "causal", "loss"}


def _publish_to_offline_cache(cache: Path, repo_id: str, folder: Path, commit: str) -> None:
    """Lay a folder out the way huggingface_hub's cache stores a downloaded repo snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def test_loads_by_hub_id_from_the_offline_cache(tiny_base, tmp_path, input_ids):
    cache = tmp_path / "hub"
    _publish_to_offline_cache(cache, "someone/tiny-qwen2", tiny_base, "a" * 40)
    model = CausalQwenForCausalLM.from_base(tiny_base)
    model.config.base_model_name_or_path = "someone/tiny-qwen2"  # as if built from the Hub id
    model.save_pretrained(tmp_path / "adapter")
    _publish_to_offline_cache(cache, "someone/tiny-causal-adapter", tmp_path / "adapter", "b" * 40)
    torch.save(input_ids, tmp_path / "ids.pt")
    proc = _run_isolated(REMOTE_SCRIPT, "someone/tiny-causal-adapter", tmp_path / "ids.pt", tmp_path / "out.pt",
                         env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    expected = _outputs(model.eval(), input_ids)
    for key, value in expected.items():
        assert torch.equal(got["lm"][key], value), key


# ------------------------------------------------------------------ bad input


def test_base_with_other_hidden_or_vocab_size_is_refused(tied_base, tmp_path):
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(tmp_path / "adapter")
    wide = save_tiny_qwen2(tmp_path / "wide", hidden_size=48)
    with pytest.raises(ValueError, match="hidden_size 48, the adapter expects 32: pass the base the adapter"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter", base_model=wide)
    big_vocab = save_tiny_qwen2(tmp_path / "vocab", vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size 256, the adapter expects 128"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter", base_model=big_vocab)


def test_base_of_another_architecture_is_refused(tied_base, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "llama")
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="is a 'llama' model, the adapter was built on a 'qwen2' base: pass the base"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter", base_model=tmp_path / "llama")


def test_missing_weights_file_is_refused(tied_base, tmp_path):
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "model.safetensors").unlink()
    with pytest.raises(OSError, match="has no model.safetensors"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")


def test_corrupt_weights_file_is_refused(tied_base, tmp_path):
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(OSError, match="corrupt"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_weights_file_with_wrong_keys_is_refused(tied_base, tmp_path, change):
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "model.safetensors"
    tensors = load_file(weights)
    if change == "missing":
        del tensors["action.b_noise"]
        match = r"missing \['action.b_noise'\]"
    elif change == "unexpected":
        tensors["model.norm.weight"] = torch.ones(32)
        match = r"unexpected \['model.norm.weight'\]"
    else:
        tensors["action.bias"] = torch.zeros(TINY_VOCAB + 1)
        match = "action.bias has shape"
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=match):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "adapter")


def test_a_plain_base_is_not_an_adapter(tied_base):
    with pytest.raises(ValueError, match="'qwen2' checkpoint, not a CausalQwen adapter.*from_base"):
        CausalQwenForCausalLM.from_pretrained(tied_base)


def test_save_to_an_existing_file_is_refused(tied_base, tmp_path):
    target = tmp_path / "adapter"
    target.write_text("not a folder")
    with pytest.raises(FileExistsError, match="existing file"):
        CausalQwenForCausalLM.from_base(tied_base).save_pretrained(target)
    assert target.read_text() == "not a folder"


def test_interrupted_save_leaves_nothing_that_loads_wrong(tied_base, tmp_path, monkeypatch):
    model = CausalQwenForCausalLM.from_base(tied_base)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    # a new folder: interrupted while writing tensors → no folder at all, no staging left
    monkeypatch.setattr(adapter_io, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    # an existing adapter: a failure while swapping files in → every file back as it was, and it loads
    model.save_pretrained(tmp_path / "old")
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}
    with torch.no_grad():
        model.action.b_noise.add_(1.0)  # the new save differs
    real_replace = os.replace
    calls = []

    def replace_then_die(src, dst):
        calls.append(dst)
        if len(calls) == 4:  # config.json aside, two files already swapped
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(adapter_io.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path / "old")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == before
    CausalQwenForCausalLM.from_pretrained(tmp_path / "old")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    # killed mid-swap (no chance to undo): config.json went aside first, so the folder refuses to load
    kill_save_mid_swap(tied_base, tmp_path / "old")
    with pytest.raises(OSError, match="no config.json"):
        CausalQwenForCausalLM.from_pretrained(tmp_path / "old")



def test_save_without_a_base_reference_is_refused(tied_base, tmp_path):
    model = CausalQwenForCausalLM.from_base(tied_base)
    model.config.base_model_name_or_path = ""
    with pytest.raises(ValueError, match="base_model_name_or_path is empty"):
        model.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_auto_config_reads_the_adapter(tied_base, tmp_path):
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(tmp_path / "adapter")
    config = AutoConfig.from_pretrained(tmp_path / "adapter", trust_remote_code=True)
    assert config.model_type == "causalqwen" and config.get_text_config(decoder=True).model_type == "qwen2"


FIXTURE_ADAPTERS = Path(__file__).parent / "fixtures" / "adapters-v0"


@pytest.mark.parametrize("name", ["plain", "lora"])
def test_adapter_saved_before_the_restructuring_loads_the_same(name, tmp_path):
    """tests/fixtures/adapters-v0 was saved by the code of commit 0ede8e0~1 (before the model owned its losses and
    modeling split by role), heads perturbed from their initialisation. Its own remote code, run through
    AutoModelForCausalLM, is the reference: today's package must read the folder into the same heads."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / name
    shutil.copytree(FIXTURE_ADAPTERS / name, folder)  # the remote-code loader writes nothing there, but be safe
    base = save_tiny_qwen2(tmp_path / "base", tie_word_embeddings=False)
    new = CausalQwenForCausalLM.from_pretrained(folder, base_model=str(base))
    old = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, base_model=str(base))
    assert type(old).__module__.startswith("transformers_modules")  # the folder's own (old) code
    stored = load_file(folder / "model.safetensors")
    new_state = new.adapter_state_dict()
    assert set(stored) == set(new_state)
    for key, value in stored.items():
        torch.testing.assert_close(new_state[key], value, rtol=0, atol=0)
    ids = torch.randint(1, TINY_VOCAB - 1, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for mode in ("compatible", "standard", "causal"):
            got, want = new(ids, inference_mode=mode), old(ids, inference_mode=mode)
            for field in ("loc_U", "scale_U", "loc_S", "scale_S"):
                if getattr(want, field) is None or (mode, field) == ("compatible", "scale_U"):
                    assert getattr(got, field) is None  # compatible scores with loc_S alone: no scale path
                else:
                    torch.testing.assert_close(getattr(got, field), getattr(want, field), msg=f"{mode} {field}")
            if mode != "compatible":  # saved before relative thresholds: P_k still compares loc_S with C_k
                torch.testing.assert_close(new.ovr(got.loc_S, got.scale_S), old.ovr(want.loc_S, want.scale_S),
                                           msg=f"{mode} standardized scores")
        assert new.config.ovr_relative_threshold is False
        # compatible mode is the base's softmax in both
        torch.testing.assert_close(new(ids, inference_mode="compatible").logits,
                                   old(ids, inference_mode="compatible").logits)


@pytest.mark.parametrize("heads", [{}, {"action_weight": "tied"}, {"action_weight": "lora"},
                                   {"learnable_threshold": True}, {"numeric": True, "num_token_id": 3}])
def test_adapter_tensors_are_the_state_dict_outside_the_backbone(tiny_base, heads):
    # read from the head modules alone: the same names and tensors as the whole state_dict filtered
    model = CausalQwenForCausalLM.from_base(tiny_base, **heads)
    whole = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.startswith(adapter_io.BASE_PREFIXES)}
    own = model._adapter_tensors()
    assert list(own) == list(whole) and all(own[k] is whole[k] for k in whole)
    assert model.adapter_keys() == set(whole)


def test_config_from_dict_without_options_is_the_parents(tied_base):
    config = CausalQwenForCausalLM.from_base(tied_base, learnable_threshold=True).config
    saved = config.to_dict()
    loaded = type(config).from_dict(dict(saved))
    via_parent = type(config).from_dict(dict(saved), return_unused_kwargs=False)  # any option: the parent's path
    assert loaded.to_dict() == via_parent.to_dict() == saved
    legacy = {k: v for k, v in saved.items() if k != "ovr_relative_threshold"}
    assert type(config).from_dict(legacy).ovr_relative_threshold is False
