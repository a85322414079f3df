"""model.push_to_hub and `causalqwen push` (causalqwen_adapter/cli/push.py): what is uploaded, what a re-push removes
and keeps, the bad input refused before any request, the base a push names.

Every test runs against FakeHub (tests/fake_hub.py), a fake Hub served on 127.0.0.1 that stores what was committed,
so the tests compare it byte for byte with the adapter folder. What was uploaded is loaded back by repo id from an
offline cache laid out from the uploaded files.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub
import huggingface_hub._upload_pipeline
import pytest
import torch
from huggingface_hub import CommitInfo
from huggingface_hub.errors import HfHubHTTPError
from safetensors.torch import load as load_safetensors

import causalqwen_adapter.model_card as model_card
from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.adapter_io import adapter_file_names
from causalqwen_adapter.hub import (
    REMOTE_CODE_MODULES,
    upload_adapter_folder,
)
from causalqwen_adapter.tokenization_causalqwen import TOKENIZER_CONFIG

from fake_hub import BASE_ID, TOKEN, _card, _files, _publish_files, _serve


def _load_recipe():
    from causalqwen_adapter.cli import push

    return push


def _assert_is_the_adapter_folder(uploaded: dict, local: Path, repo_id: str) -> None:
    """The upload is the saved folder: same files, same bytes; the card differs only in naming the repo."""
    expected = _files(local)
    assert set(uploaded) == set(expected)
    for name, data in expected.items():
        if name != "README.md":
            assert uploaded[name] == data, name
    card = uploaded["README.md"].decode()
    assert card == model_card.retarget_model_card(expected["README.md"].decode(), repo_id)
    assert f'AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)' in card
    assert f'AutoTokenizer.from_pretrained("{repo_id}", trust_remote_code=True)' in card
    assert not [k for k in load_safetensors(uploaded["model.safetensors"]) if k.startswith("model.")]  # no base tensor


LOAD_BACK = textwrap.dedent(
    """
    import sys
    sys.modules["causalqwen_adapter"] = None  # loads as remote code only, like a user without the package
    import torch
    from transformers import AutoModelForCausalLM
    repo_id, input_ids, out, resaved = sys.argv[1], torch.load(sys.argv[2]), sys.argv[3], sys.argv[4]
    model = AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        torch.save(model(input_ids).logits, out)
    model.save_pretrained(resaved)  # remote code has no card template: it keeps the card it was loaded with
    """
)


def test_push_uploads_exactly_the_adapter_folder_and_loads_back(hub, trained, cache, tmp_path, input_ids):
    commit = trained.push_to_hub("user/tiny-causal", token=TOKEN)

    trained.save_pretrained(tmp_path / "tiny-causal")
    uploaded = hub.repos["user/tiny-causal"]["main"]
    _assert_is_the_adapter_folder(uploaded, tmp_path / "tiny-causal", "user/tiny-causal")
    [record] = hub.commits
    assert isinstance(commit, CommitInfo) and commit.oid == record["oid"] and commit.pr_url is None
    assert record["summary"] == "Upload CausalQwen adapter"
    assert record["kinds"] == {name: "lfsFile" if name == "model.safetensors" else "file" for name in uploaded}
    assert hub.route_names() == {"POST create-repo", "GET tree", "POST validate-yaml", "POST preupload",
                                 "POST lfs-batch", "PUT lfs-upload", "POST commit"}

    # what was uploaded loads by repo id, as remote code, from an offline cache laid out from the upload
    _publish_files(cache, "user/tiny-causal", uploaded, commit.oid)
    torch.save(input_ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home"),
           "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run([sys.executable, "-c", LOAD_BACK, "user/tiny-causal", tmp_path / "ids.pt",
                           tmp_path / "logits.pt", tmp_path / "resaved"], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), trained.eval()(input_ids).logits)
    resaved_card = (tmp_path / "resaved" / "README.md").read_text()
    assert resaved_card == model_card.retarget_model_card(uploaded["README.md"].decode(), "resaved")


def test_push_on_the_default_upload_path(monkeypatch, no_token, trained, tmp_path):
    """hf_xet installed (a huggingface_hub dependency on common platforms) → the pipelined upload; a bare repo
    name resolves to the token's namespace; `revision` is created as a branch; the token comes from HF_TOKEN."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    pipelined = []
    real_pipeline = huggingface_hub._upload_pipeline.pipelined_upload
    monkeypatch.setattr(huggingface_hub._upload_pipeline, "pipelined_upload",
                        lambda *a, **kw: pipelined.append(1) or real_pipeline(*a, **kw))
    with _serve(monkeypatch, xet=True, lfs_suffixes=()) as hub:
        commit = trained.push_to_hub("tiny-causal", private=True, revision="dev", commit_message="first heads")
    assert pipelined == ([1] if importlib.util.find_spec("hf_xet") else [])
    trained.save_pretrained(tmp_path / "tiny-causal")
    _assert_is_the_adapter_folder(hub.repos["user/tiny-causal"]["dev"], tmp_path / "tiny-causal", "user/tiny-causal")
    assert hub.repos["user/tiny-causal"]["main"] == {}
    assert hub.created == [{"name": "tiny-causal", "organization": None, "visibility": "private"}]
    assert [c["summary"] for c in hub.commits] == ["first heads"] and commit.oid == hub.commits[0]["oid"]
    assert "POST create-branch" in hub.route_names()


@pytest.mark.parametrize("xet", [False, True], ids=["lfs", "default"])
def test_a_new_push_removes_a_stale_lora_and_keeps_other_files(monkeypatch, no_token, trained, xet):
    """An earlier push left lora/ and a remote-code module of an older version; the owner added a tokenizer, an
    Inference Endpoints handler and scripts. Re-pushing heads without backbone LoRA must remove lora/ (loading would
    apply it to the new heads) and the old module, and keep everything of the owner's."""
    owners = {"tokenizer.json": b"{}", "handler.py": b"class EndpointHandler: ...", "scripts/eval.py": b"# theirs",
              "last-checkpoint/modeling_causalqwen.py": b"# a trainer's checkpoint push", "cpu_kernel.txt": b"notes"}
    with _serve(monkeypatch, xet=xet, lfs_suffixes=(".safetensors",) if not xet else ()) as hub:
        trained.push_to_hub("user/tiny-causal", token=TOKEN)
        main = hub.repos["user/tiny-causal"]["main"]
        main.update({"lora/adapter_config.json": b"{}", "lora/adapter_model.safetensors": b"old",
                     "cpu_kernel.py": b"# compiled C, shipped by an older version", **owners})
        trained.push_to_hub("user/tiny-causal", token=TOKEN)
    main = hub.repos["user/tiny-causal"]["main"]
    assert not [p for p in main if p.startswith("lora/") or p == "cpu_kernel.py"]
    assert {k: main.get(k) for k in owners} == owners
    assert "modeling_causalqwen.py" in main and "model.safetensors" in main


def test_every_remote_code_module_is_one_a_push_can_replace():
    """A module added to the remote code must join hub.REMOTE_CODE_MODULES, or a later push of an adapter without it
    would leave it in the repo (harmless, not imported) and an older one would not be cleaned up."""
    code = {name.removesuffix(".py") for name in adapter_file_names() if name.endswith(".py")}
    assert code and code <= set(REMOTE_CODE_MODULES)


def test_a_push_keeps_the_repos_own_tokenizer(monkeypatch, no_token, trained, tmp_path):
    """The adapter's tokenizer_config.json (a pointer to the base's tokenizer) is uploaded where the repo has none, or
    has the adapter's; a tokenizer the owner uploaded to the repo stays, and re-pushes do not replace it."""
    with _serve(monkeypatch, xet=False) as hub:
        trained.push_to_hub("user/tiny-causal", token=TOKEN)
        main = hub.repos["user/tiny-causal"]["main"]
        pointer = main["tokenizer_config.json"]
        assert json.loads(pointer) == TOKENIZER_CONFIG
        trained.push_to_hub("user/tiny-causal", token=TOKEN)  # over its own: rewritten as it was
        assert hub.commits[-1]["kinds"].get("tokenizer_config.json") == "file" and main["tokenizer_config.json"] == pointer
        theirs = b'{"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 77}'
        main.update({"tokenizer_config.json": theirs, "tokenizer.json": b"{}"})
        trained.push_to_hub("user/tiny-causal", token=TOKEN)
        assert "tokenizer_config.json" not in hub.commits[-1]["kinds"]
        assert main["tokenizer_config.json"] == theirs and main["tokenizer.json"] == b"{}"
        assert "model.safetensors" in main and "tokenization_causalqwen.py" in main
    # a folder saved before adapters had the pointer, pushed over one: the pointer goes with the module it names
    with _serve(monkeypatch, xet=False) as hub:
        trained.push_to_hub("user/tiny-causal", token=TOKEN)
        older = tmp_path / "older"
        trained.save_pretrained(older)
        for name in ("tokenizer_config.json", "tokenization_causalqwen.py"):
            (older / name).unlink()
        upload_adapter_folder(older, "user/tiny-causal", token=TOKEN)
        main = hub.repos["user/tiny-causal"]["main"]
        assert "tokenizer_config.json" not in main and "tokenization_causalqwen.py" not in main


def test_push_as_a_pull_request(hub, trained):
    commit = trained.push_to_hub("user/tiny-causal", token=TOKEN, create_pr=True)
    repo = hub.repos["user/tiny-causal"]
    assert commit.pr_url.endswith("/discussions/1") and commit.pr_revision == "refs/pr/1"
    assert "model.safetensors" in repo["refs/pr/1"] and repo["main"] == {}


def test_recipe_uploads_the_adapter_files_as_they_are(hub, trained, tmp_path, capsys):
    run = tmp_path / "run"
    trained.save_pretrained(run)
    (run / "trainer_state.json").write_text("{}")  # a trainer's output folder: not part of the adapter
    (run / "checkpoint-10").mkdir()
    (run / "checkpoint-10" / "optimizer.pt").write_bytes(b"optimizer state")
    before = _files(run)

    commit = _load_recipe().main([str(run), "user/from-recipe", "--token", TOKEN, "--commit-message", "recipe"])

    uploaded = hub.repos["user/from-recipe"]["main"]
    assert set(uploaded) == set(before) - {"trainer_state.json", "checkpoint-10/optimizer.pt"}
    for name in uploaded:
        if name != "README.md":
            assert uploaded[name] == before[name], name
    card = uploaded["README.md"].decode()
    assert card == model_card.retarget_model_card(before["README.md"].decode(), "user/from-recipe")
    assert "| train_loss | 1.23457 |" in card  # the training record the card carries survives the push
    assert _files(run) == before  # the card was retargeted in a copy
    assert hub.commits[0]["summary"] == "recipe"
    out, err = capsys.readouterr()
    assert f"pushed {run} to {commit.commit_url}" in out and "checkpoint-10/optimizer.pt" in err


def test_recipe_takes_push_to_hubs_keyword_spellings(hub, trained, tmp_path):
    """`--commit_message` and `--create_pr` as well as `hf upload`'s dashed spellings, as the other recipes take both."""
    trained.save_pretrained(tmp_path / "run")
    commit = _load_recipe().main([str(tmp_path / "run"), "user/from-recipe", "--token", TOKEN, "--commit_message",
                                  "as keywords", "--create_pr"])
    assert commit.pr_revision == "refs/pr/1" and hub.commits[-1]["summary"] == "as keywords"
    assert "model.safetensors" in hub.repos["user/from-recipe"]["refs/pr/1"]


def test_recipe_refuses_what_is_not_an_adapter(hub, tied_base, trained, tmp_path, capsys):
    recipe = _load_recipe()
    with pytest.raises(SystemExit):
        recipe.main([str(tied_base), "user/x", "--token", TOKEN])
    assert "'qwen2' checkpoint, not a CausalQwen adapter" in capsys.readouterr().err

    trained.save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    tensors["model.norm.weight"] = torch.ones(32)  # a base tensor slipped in
    save_file(tensors, weights)
    with pytest.raises(SystemExit):
        recipe.main([str(tmp_path / "adapter"), "user/x", "--token", TOKEN])
    assert "unexpected ['model.norm.weight']" in capsys.readouterr().err
    assert hub.requests == []


def test_recipe_refuses_a_truncated_or_corrupt_file_and_links_before_any_request(hub, trained, tmp_path, capsys):
    recipe = _load_recipe()
    folder = tmp_path / "adapter"
    trained.save_pretrained(folder)
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    for broken, what in ((whole[:-100], "truncated"), (b"\xff" * 8 + whole[8:], "corrupt header")):
        weights.write_bytes(broken)
        with pytest.raises(SystemExit):
            recipe.main([str(folder), "user/x", "--token", TOKEN])
        assert "cannot be read" in capsys.readouterr().err, what
    weights.write_bytes(whole)
    outside = tmp_path / "secret.txt"
    outside.write_text("not for the Hub")
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").symlink_to(outside)
    with pytest.raises(SystemExit):
        recipe.main([str(folder), "user/x", "--token", TOKEN])
    assert "['generation_config.json'] are symbolic links" in capsys.readouterr().err
    assert hub.requests == []


def test_push_without_a_token_fails_before_any_request(hub, tied_base, tmp_path, capsys):
    model = CausalQwenForCausalLM.from_base(tied_base)
    with pytest.raises(ValueError, match="no Hugging Face token .*HF_TOKEN.*hf auth login"):
        model.push_to_hub("user/tiny-causal")
    model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(SystemExit):
        _load_recipe().main([str(tmp_path / "adapter"), "user/tiny-causal"])
    assert "no Hugging Face token" in capsys.readouterr().err
    assert hub.requests == []


@pytest.mark.parametrize("repo_id", ["not a/valid//id", "user/name with spaces", "user/-dash"])
def test_invalid_repo_id_fails_before_any_request(hub, tied_base, repo_id):
    with pytest.raises(ValueError, match="is not a valid Hub repo id"):
        CausalQwenForCausalLM.from_base(tied_base).push_to_hub(repo_id, token=TOKEN)
    assert hub.requests == []


def test_pull_request_on_a_branch_fails_before_any_request(hub, tied_base):
    with pytest.raises(ValueError, match="against main; drop revision='dev'"):
        CausalQwenForCausalLM.from_base(tied_base).push_to_hub("user/x", token=TOKEN, revision="dev", create_pr=True)
    assert hub.requests == []


def test_failed_commit_raises_and_nothing_reports_success(monkeypatch, no_token, trained, tmp_path, capsys):
    trained.save_pretrained(tmp_path / "adapter")
    # the legacy path: the pipelined one retries a 500 on commit with backoff (about 20 s) before raising the same
    with _serve(monkeypatch, xet=False, fail_commit=True) as hub:
        with pytest.raises(HfHubHTTPError, match="500"):
            trained.push_to_hub("user/tiny-causal", token=TOKEN)
        with pytest.raises(HfHubHTTPError, match="500"):
            _load_recipe().main([str(tmp_path / "adapter"), "user/tiny-causal", "--token", TOKEN])
    assert hub.repos["user/tiny-causal"]["main"] == {} and hub.commits == []
    assert "POST commit" in hub.route_names()  # it failed at the very end, the tensors already uploaded
    assert "pushed" not in capsys.readouterr().out


def test_a_local_base_is_never_pushed_as_is(hub, tied_base, tmp_path):
    """An adapter on a local folder: model.push_to_hub refuses before any request, naming the argument; with
    base_model_id the pushed config and card name the Hub id, the model keeps its own base."""
    model = CausalQwenForCausalLM.from_base(tied_base)
    with pytest.raises(ValueError, match=r"is a folder on this machine.*base_model_id=.*Nothing was uploaded"):
        model.push_to_hub("user/tiny-causal", token=TOKEN)
    for bad in (str(tied_base), "not a repo id!"):
        with pytest.raises(ValueError, match="base_model_id=.*Hub id of the base"):
            model.push_to_hub("user/tiny-causal", token=TOKEN, base_model_id=bad)
    assert hub.requests == []
    model.push_to_hub("user/tiny-causal", token=TOKEN, base_model_id=BASE_ID)
    main = hub.repos["user/tiny-causal"]["main"]
    assert json.loads(main["config.json"])["base_model_name_or_path"] == BASE_ID
    meta, body = _card(main["README.md"].decode())
    assert meta["base_model"] == BASE_ID and meta["base_model_relation"] == "adapter"
    assert str(tied_base) not in body and model_card.LOCAL_BASE_NOTE not in body
    assert f"[{BASE_ID}](https://huggingface.co/{BASE_ID})" in body
    assert model.config.base_model_name_or_path == str(tied_base)


def test_causalqwen_push_names_the_base_by_its_hub_id_or_refuses(hub, tied_base, tmp_path, capsys):
    folder = tmp_path / "adapter"
    CausalQwenForCausalLM.from_base(tied_base).save_pretrained(folder)
    push = _load_recipe()
    with pytest.raises(SystemExit):
        push.main(["--model_name_or_path", str(folder), "--hub_model_id", "user/tiny-causal", "--hub_token", TOKEN])
    said = capsys.readouterr().err
    assert "is a folder on this machine" in said and "--base_model_id" in said and "Nothing was uploaded" in said
    assert hub.requests == []
    push.main(["--model_name_or_path", str(folder), "--hub_model_id", "user/tiny-causal", "--hub_token", TOKEN,
               "--base_model_id", BASE_ID])
    main = hub.repos["user/tiny-causal"]["main"]
    assert json.loads(main["config.json"])["base_model_name_or_path"] == BASE_ID
    assert _card(main["README.md"].decode())[0]["base_model"] == BASE_ID and str(tied_base) not in main["README.md"].decode()
    assert json.loads((folder / "config.json").read_text())["base_model_name_or_path"] == str(tied_base)  # as it was
