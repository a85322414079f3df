"""push_to_hub, `causalqwen push` (causalqwen_adapter/cli/push.py) and the model card, against a fake Hub served on 127.0.0.1.

FakeHub implements the routes huggingface_hub 2.4 calls for create_repo, create_branch and upload_folder,
on both of its upload paths: the pipelined one (hf_xet installed, the default) and the legacy one
(create_commit: validate-yaml, preupload, LFS batch + PUT, NDJSON commit). It stores what was committed, so
the tests compare it byte for byte with the adapter folder and then load it back by repo id from an offline
cache laid out from the uploaded files.
"""

import base64
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import huggingface_hub
import huggingface_hub._upload_pipeline
import pytest
import torch
import transformers.utils.hub
import yaml
from huggingface_hub import CommitInfo, constants
from huggingface_hub.errors import HfHubHTTPError
from safetensors.torch import load as load_safetensors

import causalqwen_adapter.model_card as model_card
from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.adapter_io import adapter_file_names
from causalqwen_adapter.hub import (
    REMOTE_CODE_MODULES,
    adapter_upload_files,
    checkpoint_upload_files,
    snapshot_for_upload,
    upload_adapter_folder,
)
from causalqwen_adapter.tokenization_causalqwen import TOKENIZER_CONFIG
from causalqwen_adapter.trainer import CausalSFTTrainer

from test_trainer import _args, _prompt_completion

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_test_token"
BASE_ID = "someone/tiny-qwen2"  # the base's Hub id, served from an offline cache


# --------------------------------------------------------------------------------------- fake Hub


class FakeHub:
    """Just enough of the Hub's HTTP API; `repos[repo_id][revision]` maps committed paths to their bytes."""

    def __init__(self, lfs_suffixes=(".safetensors",), fail_commit=False):
        self.lfs_suffixes = lfs_suffixes  # what preupload answers "lfs" for (the real Hub: .gitattributes)
        self.fail_commit = fail_commit
        self.requests = []  # (method, path) in arrival order
        self.repos = {}
        self.created = []  # create_repo payloads
        self.lfs = {}  # oid → bytes, from the LFS PUTs
        self.commits = []  # {"repo_id", "revision", "summary", "oid", "kinds": {path: "file" | "lfsFile"}}
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def route_names(self) -> set[str]:
        names = set()
        for method, path in self.requests:
            for name, pattern in ROUTES:
                if re.fullmatch(pattern, path) and method == name.split()[0]:
                    names.add(name)
        return names

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every reply sends Content-Length

            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                self._dispatch("POST")

            def do_PUT(self):
                self._dispatch("PUT")

            def do_GET(self):
                self._dispatch("GET")

            def do_HEAD(self):
                self._dispatch("HEAD")

            def _dispatch(self, method):
                url = urlparse(self.path)
                body = self._body()
                with hub._lock:
                    hub.requests.append((method, url.path))
                for name, pattern in ROUTES:
                    match = re.fullmatch(pattern, url.path)
                    if match and method == name.split()[0]:
                        # the token goes everywhere but the storage URL (an S3 presigned URL on the real Hub)
                        authorized = self.headers.get("authorization") == f"Bearer {TOKEN}"
                        if not authorized and not url.path.startswith("/lfs-upload/"):
                            return self._reply(401, {"error": "Invalid credentials in Authorization header"})
                        handler = getattr(self, "_" + name.split()[1].replace("-", "_"))
                        return handler(body, parse_qs(url.query), *map(unquote, match.groups()))
                self._reply(404, {"error": f"fake Hub has no route {method} {url.path}"})

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("transfer-encoding", ""):
                    data = b""
                    while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return data
                return self.rfile.read(int(self.headers.get("content-length") or 0))

            def _reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":  # a reply to HEAD has no body, or the connection's next reply is garbled
                    self.wfile.write(data)

            # ---- routes

            def _create_repo(self, body, query):
                payload = json.loads(body)
                repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
                hub.created.append(payload)
                if repo_id in hub.repos:
                    # the Hub answers 409 with the url, which create_repo(exist_ok=True) returns
                    url = f"{hub.endpoint}/{repo_id}"
                    return self._reply(409, {"error": "You already created this model repo", "url": url})
                hub.repos[repo_id] = {"main": {}}
                self._reply(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})

            def _create_branch(self, body, query, repo_id, branch):
                if repo_id not in hub.repos:
                    return self._reply(404, {"error": "Repository not found"})
                if branch in hub.repos[repo_id]:
                    return self._reply(409, {"error": "Reference already exists"})
                hub.repos[repo_id][branch] = dict(hub.repos[repo_id]["main"])
                self._reply(200, {})

            def _validate_yaml(self, body, query):
                yaml.safe_load(json.loads(body)["content"].split("---")[1])  # a YAML error fails the test
                self._reply(200, {"errors": [], "warnings": []})

            def _preupload(self, body, query, repo_id, revision):
                if repo_id not in hub.repos:
                    return self._reply(404, {"error": "Repository not found"})
                files = [
                    {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(hub.lfs_suffixes) else "regular",
                     "shouldIgnore": False, "oid": None}
                    for f in json.loads(body)["files"]
                ]
                self._reply(200, {"files": files, "commitOid": "0" * 40})

            def _tree(self, body, query, repo_id, revision):
                if repo_id not in hub.repos or revision not in hub.repos[repo_id]:
                    return self._reply(404, {"error": f"Revision not found: {revision}"})
                entries = [{"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                           for path, data in sorted(hub.repos[repo_id][revision].items())]
                self._reply(200, entries)

            def _resolve(self, body, query, repo_id, revision, path):
                """A committed file's bytes (GET) or only its headers (HEAD), as hf_hub_download reads them."""
                data = hub.repos.get(repo_id, {}).get(revision, {}).get(path)
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
                self.send_header("X-Repo-Commit", "0" * 40)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

            def _lfs_batch(self, body, query, repo_id):
                objects = []
                for obj in json.loads(body)["objects"]:
                    entry = {"oid": obj["oid"], "size": obj["size"]}
                    if obj["oid"] not in hub.lfs:
                        entry["actions"] = {"upload": {"href": f"{hub.endpoint}/lfs-upload/{obj['oid']}"}}
                    objects.append(entry)
                self._reply(200, {"transfer": "basic", "objects": objects})

            def _lfs_upload(self, body, query, oid):
                if hashlib.sha256(body).hexdigest() != oid:
                    return self._reply(400, {"error": "content does not match its oid"})
                hub.lfs[oid] = body
                self._reply(200, {})

            def _commit(self, body, query, repo_id, revision):
                if hub.fail_commit:
                    return self._reply(500, {"error": "Internal Error - We're working hard to fix this"})
                if repo_id not in hub.repos or revision not in hub.repos[repo_id]:
                    return self._reply(404, {"error": f"Revision not found: {revision}"})
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                header, files, kinds = lines[0]["value"], {}, {}
                for line in lines[1:]:
                    value = line["value"]
                    if line["key"] == "file":
                        files[value["path"]] = base64.b64decode(value["content"])
                    elif line["key"] == "lfsFile":
                        if value["oid"] not in hub.lfs:
                            return self._reply(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                        files[value["path"]] = hub.lfs[value["oid"]]
                    elif line["key"] == "deletedFile":
                        files[value["path"]] = None
                    else:
                        return self._reply(400, {"error": f"fake Hub does not handle {line['key']}"})
                    kinds[value["path"]] = line["key"]
                oid = hashlib.sha1(body).hexdigest()
                pr_url = None
                if query.get("create_pr") == ["1"]:
                    revision = f"refs/pr/{sum(r.startswith('refs/pr/') for r in hub.repos[repo_id]) + 1}"
                    hub.repos[repo_id][revision] = dict(hub.repos[repo_id]["main"])
                    pr_url = f"{hub.endpoint}/{repo_id}/discussions/{revision.rsplit('/', 1)[1]}"
                tree = hub.repos[repo_id][revision]
                for path, data in files.items():
                    if data is None:
                        if path not in tree:
                            return self._reply(404, {"error": f"cannot delete {path}: not in the repo"})
                        del tree[path]
                    else:
                        tree[path] = data
                hub.commits.append({"repo_id": repo_id, "revision": revision, "summary": header["summary"], "oid": oid,
                                    "kinds": kinds})
                self._reply(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid,
                                  "pullRequestUrl": pr_url})

        return Handler


_REPO = r"/?([^/]+/[^/]+?)"
ROUTES = [  # "METHOD name" → path pattern (groups: repo id, then revision/branch/oid)
    ("POST create-repo", r"/api/repos/create"),
    ("POST validate-yaml", r"/api/validate-yaml"),
    ("POST create-branch", rf"/api/models{_REPO}/branch/([^/]+)"),
    ("POST preupload", rf"/api/models{_REPO}/preupload/([^/]+)"),
    ("POST commit", rf"/api/models{_REPO}/commit/([^/]+)"),
    ("GET tree", rf"/api/models{_REPO}/tree/([^/]+)"),
    ("HEAD resolve", rf"{_REPO}/resolve/([^/]+)/(.+)"),
    ("GET resolve", rf"{_REPO}/resolve/([^/]+)/(.+)"),
    ("POST lfs-batch", rf"{_REPO}\.git/info/lfs/objects/batch"),
    ("PUT lfs-upload", r"/lfs-upload/([0-9a-f]{64})"),
]


# --------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def no_token(tmp_path, monkeypatch):
    """No token anywhere: env unset, token file in an empty HF_HOME."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))


def _serve(monkeypatch, xet: bool, **kwargs) -> FakeHub:
    hub = FakeHub(**kwargs)
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)  # HfApi() reads it when built
    # file URLs come from a template made from the endpoint at import (HF_ENDPOINT), as huggingface_hub makes it
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    # hf_xet installed → upload_folder takes the pipelined path; preupload must then answer "regular" only
    # (an "lfs" answer would need Xet storage). Disabled → the legacy path with LFS batch + PUT.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", not xet)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)  # TRL's trainers report usage to the endpoint
    # the Trainer creates repos through transformers' shared HfApi, which keeps the endpoint it was first built with
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)
    return hub


@pytest.fixture
def hub(monkeypatch, no_token):
    with _serve(monkeypatch, xet=False) as hub:
        yield hub


@pytest.fixture
def cache(tmp_path, tied_base, monkeypatch):
    """An offline Hub cache holding the base as BASE_ID, with a card declaring its license."""
    cache = tmp_path / "hub-cache"
    base = tmp_path / "base-with-card"
    shutil.copytree(tied_base, base)
    (base / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n# tiny base\n")
    _publish_files(cache, BASE_ID, _files(base), "a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # where the card looks for the base's license
    return cache


@pytest.fixture
def trained(tied_base, cache):
    """Heads moved off their init, named after the base's Hub id, with a training record."""
    model = CausalQwenForCausalLM.from_base(tied_base)
    with torch.no_grad():
        for p in (model.abduction.loc.bias, model.action.bias):
            p.add_(torch.randn_like(p) * 0.01)
    model.config.base_model_name_or_path = BASE_ID
    model.training_summary = {
        "hyperparameters": {"learning_rate": 2e-4, "num_train_epochs": 1, "per_device_train_batch_size": 8},
        "metrics": {"train_loss": 1.234567891, "ovr_prob_sum": 1.05},
        "datasets": ["someone/tiny-corpus"],
    }
    return model


def _publish_files(cache: Path, repo_id: str, files: dict[str, bytes], commit: str) -> None:
    """Lay files out the way huggingface_hub's cache stores a downloaded snapshot (as test_adapter_io does)."""
    snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit
    for name, data in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(data)
    (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text(commit)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _card(text: str) -> tuple[dict, str]:
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


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


# --------------------------------------------------------------------------------------- push_to_hub


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


# --------------------------------------------------------------------------------------- a trainer's push


def _push_trainer(sft_base, out, peft_config=None, **overrides):
    args = _args(out, **{"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "push_to_hub": True,
                         "hub_model_id": "user/tiny-causal", "hub_token": TOKEN, "hub_base_model_id": BASE_ID,
                         **overrides})
    return CausalSFTTrainer(str(sft_base), args=args, train_dataset=_prompt_completion(), peft_config=peft_config)


def _uploadable(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in adapter_upload_files(folder)}


@pytest.mark.parametrize("strategy, lora", [("every_save", False), ("checkpoint", True)])
def test_trainer_push_to_hub_uploads_loadable_adapters(hub, sft_base, tmp_path, strategy, lora):
    """`push_to_hub=True`: every push during training (the Trainer's copies only config and weights) and the one
    at the end upload a whole adapter folder (remote code, card, tokenizer pointer, backbone LoRA), and `output_dir`
    never gets the base's tokenizer files; with hub_strategy="checkpoint" the checkpoint pushed beside it keeps its
    code."""
    import peft

    out = tmp_path / "out"
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]) if lora \
        else None
    trainer = _push_trainer(sft_base, out, peft_config=peft_config, hub_strategy=strategy)
    trainer.train()
    trainer._finish_current_push()
    for job in trainer.push_in_progress.jobs if trainer.push_in_progress else []:
        job.result()  # a background push's error, raised
    main = hub.repos["user/tiny-causal"]["main"]
    in_training = [c for c in hub.commits if c["summary"].startswith("Training in progress")
                   and not c["summary"].endswith(", checkpoint")]
    assert in_training and in_training[0]["summary"] == "Training in progress, step 2"
    if strategy == "checkpoint":  # one queue: each save's commits land in the order they were made
        assert [c["summary"] for c in hub.commits[:2]] == ["Training in progress, step 2",
                                                           "Training in progress, step 2, checkpoint"]
    pushed = tmp_path / "pushed-in-training"  # what the repo held during training, as a folder
    for name, data in main.items():
        if not name.startswith("last-checkpoint/"):
            (pushed / name).parent.mkdir(parents=True, exist_ok=True)
            (pushed / name).write_bytes(data)
    step = int(in_training[-1]["summary"].rsplit(" ", 1)[1])
    assert json.loads(main["config.json"])["base_model_name_or_path"] == BASE_ID  # never the local folder
    assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == str(sft_base)
    loaded = CausalQwenForCausalLM.from_pretrained(pushed, base_model=sft_base)
    saved = load_safetensors((out / f"checkpoint-{step}" / "model.safetensors").read_bytes())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())
    lora_file = "lora/adapter_model.safetensors"
    assert (lora_file in main) == lora
    if lora:
        assert main[lora_file] == (out / f"checkpoint-{step}" / lora_file).read_bytes()
        assert getattr(loaded.model, "_hf_peft_config_loaded", False)
    assert json.loads(main["tokenizer_config.json"]) == TOKENIZER_CONFIG and "tokenization_causalqwen.py" in main

    commit = trainer.push_to_hub(dataset_name="tiny-pairs")
    assert hub.commits[-1]["summary"] == "End of training" and commit.oid == hub.commits[-1]["oid"]
    local = _uploadable(out)
    assert not {"tokenizer.json", "chat_template.jinja"} & set(_files(out))  # never the base's tokenizer
    assert json.loads(local["tokenizer_config.json"]) == TOKENIZER_CONFIG
    uploaded = {k: v for k, v in main.items() if not k.startswith("last-checkpoint/")}
    assert set(uploaded) == set(local)
    assert all(uploaded[k] == v for k, v in local.items() if k not in ("README.md", "config.json"))
    local_config = json.loads(local["config.json"])  # the base named by its Hub id, nothing else changed
    assert json.loads(uploaded["config.json"]) == {**local_config, "base_model_name_or_path": BASE_ID}
    card = main["README.md"].decode()
    local_card = local["README.md"].decode()  # output_dir's as it was, retargeted and naming the base's Hub id
    assert card == model_card.retarget_model_card(model_card.card_with_base(local_card, str(sft_base), BASE_ID),
                                                  "user/tiny-causal")
    assert model_card.LOCAL_BASE_NOTE in local_card and model_card.LOCAL_BASE_NOTE not in card
    assert str(sft_base) not in card and _card(card)[0]["base_model"] == BASE_ID
    assert 'AutoModelForCausalLM.from_pretrained("user/tiny-causal", trust_remote_code=True)' in card
    assert "tiny-pairs" in card
    assert not list(out.glob("_hub_push.*"))  # every snapshot removed once uploaded
    if strategy == "checkpoint":  # the main push's stale-file patterns never reach into the checkpoint
        assert "last-checkpoint/modeling_causalqwen.py" in main and "last-checkpoint/optimizer.pt" in main


def test_a_snapshot_for_upload_holds_what_the_trainer_uploads_whatever_saves_do_next(tmp_path):
    """The adapter's files of output_dir, frozen: a later save's swap, a rotated checkpoint or a staging folder
    appearing do not reach the snapshot a background upload reads, and the card it rewrites is its own. Nothing
    but the adapter's files goes in: not the Trainer's training_args.bin, a hidden file, a checkpoint."""
    out = tmp_path / "out"
    files = {"config.json": b"{}", "model.safetensors": b"heads v1", "README.md": b"card", "lora/adapter.bin": b"l"}
    skipped = {"checkpoint-2/model.safetensors": b"old", "_notes": b"x", ".out.abcdefgh.tmp/model.safetensors": b"s",
               ".gitattributes": b"*.safetensors lfs", "training_args.bin": b"args", ".env": b"HF_TOKEN=hf_x"}
    for name, data in {**files, **skipped}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    snapshot = snapshot_for_upload(out)
    assert snapshot.parent == out and snapshot.name.startswith("_hub_push.")
    (out / "model.new").write_bytes(b"heads v2")
    os.replace(out / "model.new", out / "model.safetensors")  # the next save swaps files in under the names
    shutil.rmtree(out / "checkpoint-2")  # rotation
    (snapshot / "README.md").write_text("retargeted")
    assert _files(snapshot) == {**files, "README.md": b"retargeted"}
    assert (out / "README.md").read_bytes() == b"card" and (out / "model.safetensors").read_bytes() == b"heads v2"
    # a killed process's snapshot goes with the next one; one still uploading in this process stays
    killed = out / "_hub_push.abcdefgh"
    (killed / "config.json").parent.mkdir()
    (killed / "config.json").write_bytes(b"{}")
    second = snapshot_for_upload(out)
    assert not killed.exists() and snapshot.is_dir() and second.is_dir()


def test_trainer_push_to_hub_lands_after_the_pushes_in_flight(hub, sft_base, tmp_path, monkeypatch):
    """push_to_hub while a save's push is still uploading (slowed here; training's end waits for them, a call from
    a callback mid-training does not): the end's commit lands last, so the repo holds the final heads, not the older
    ones of the push in flight."""
    import time

    import causalqwen_adapter.hub as hub_module

    upload = hub_module.upload_adapter_folder

    def slow_for_saves(folder, repo_id, **kwargs):
        if kwargs.get("commit_message", "").startswith("Training in progress"):
            time.sleep(1.5)
        return upload(folder, repo_id, **kwargs)

    monkeypatch.setattr(hub_module, "upload_adapter_folder", slow_for_saves)
    out = tmp_path / "out"
    trainer = _push_trainer(sft_base, out, max_steps=6, save_steps=3)
    trainer.train()
    trainer._push_from_checkpoint(str(out / "checkpoint-3"))  # older heads, in flight
    trainer.push_to_hub()
    trainer._finish_current_push()  # whatever was in flight has landed too
    assert [c["summary"] for c in hub.commits][-2:] == ["Training in progress, step 6", "End of training"]
    assert hub.repos["user/tiny-causal"]["main"]["model.safetensors"] == (out / "model.safetensors").read_bytes()


def test_trainer_push_to_hub_keeps_the_repos_own_tokenizer(hub, sft_base, tmp_path):
    """A repo whose owner uploaded a tokenizer: the trainer's pushes leave it, and keep the pointer in output_dir."""
    theirs = b'{"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 77}'
    hub.repos["user/tiny-causal"] = {"main": {"tokenizer_config.json": theirs}}
    trainer = _push_trainer(sft_base, tmp_path / "out", hub_strategy="end")
    trainer.train()
    trainer.push_to_hub()
    main = hub.repos["user/tiny-causal"]["main"]
    assert main["tokenizer_config.json"] == theirs and "model.safetensors" in main
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == TOKENIZER_CONFIG


# --------------------------------------------------------------------------------------- the recipe


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


# --------------------------------------------------------------------------------------- bad input


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


# --------------------------------------------------------------------------------------- the card


def test_card_metadata_snippet_and_training_record(trained, tmp_path):
    trained.save_pretrained(tmp_path / "my-adapter")
    text = (tmp_path / "my-adapter" / "README.md").read_text()
    meta, body = _card(text)
    assert meta["base_model"] == BASE_ID and meta["base_model_relation"] == "adapter"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"causalqwen", "ovr", "cauchy"} <= set(meta["tags"])
    assert meta["license"] == "apache-2.0"  # carried from the base's card (in the Hub cache)
    assert meta["datasets"] == ["someone/tiny-corpus"]
    assert body.startswith("\n# my-adapter\n")
    assert 'AutoModelForCausalLM.from_pretrained("my-adapter", trust_remote_code=True)' in body
    assert 'AutoTokenizer.from_pretrained("my-adapter", trust_remote_code=True)' in body  # the base's, by pointer
    for mode in ("compatible", "standard", "sampling", "causal"):
        assert f"| `{mode}` |" in body
    assert "| learning_rate | 0.0002 |" in body and "| train_loss | 1.23457 |" in body
    weights = tmp_path / "my-adapter" / "model.safetensors"
    parameters = sum(v.numel() for v in trained.adapter_state_dict().values())
    assert f"| adapter tensors | {parameters:,} parameters (float32), `model.safetensors` " in body
    assert f"({weights.stat().st_size:,} bytes) |" in body
    assert f"- torch {torch.__version__}" in body and f"- huggingface_hub {huggingface_hub.__version__}" in body
    trained.save_pretrained(tmp_path / "my-adapter")
    assert (tmp_path / "my-adapter" / "README.md").read_text() == text  # deterministic: no dates, no paths


def test_card_of_fresh_heads_on_a_local_base(tied_base, tmp_path):
    base = tmp_path / "local-base"
    shutil.copytree(tied_base, base)
    (base / "README.md").write_text("---\nlicense: mit\n---\n# a local base\n")
    CausalQwenForCausalLM.from_base(base).save_pretrained(tmp_path / "adapter")
    meta, body = _card((tmp_path / "adapter" / "README.md").read_text())
    assert "base_model" not in meta and "base_model_relation" not in meta  # the Hub accepts Hub ids only
    assert meta["license"] == "mit" and "datasets" not in meta
    assert 'AutoTokenizer.from_pretrained("adapter", trust_remote_code=True)' in body and "## Training" not in body
    # the card reads the head fields from the config it is saved with
    assert "| OvR threshold | -0.6931 (fixed), relative: compared with log softmax(loc_S) |" in body and "| initial scale γ₀ / `b_noise` | 0.005 / 0.01 |" in body
    assert ("| training loss | OvR over each position's 16 most likely tokens and the target + 1.0 × the softmax "
            "cross-entropy of loc_S |") in body
    # the default acceptance (accept_once), the vocabulary's size, what it is for and what it needs
    assert "(`ovr_distribution=\"accept_once\"`)" in body and "replaced once by a fresh draw" in body
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    assert f"scores `S` over the {vocab}-entry vocabulary" in body
    assert "## Intended use and limitations" in body and "they tie an ordinary softmax head" in body
    url = model_card._project_url()  # the package's metadata has none yet: the card names it without a dead link
    assert "Requires `transformers>=5.20,<5.25`" in body
    assert ("Made with `causalqwen-adapter`" if url is None else f"[causalqwen-adapter]({url})") in body
    assert model_card.LOCAL_BASE_NOTE in body
    for choice, text in (("normalize", "(`ovr_distribution=\"normalize\"`) the returned `logits` are `log P_k`"),
                         ("accept", "(`ovr_distribution=\"accept\"`) the returned `logits` are `loc_S + log P_k`")):
        CausalQwenForCausalLM.from_base(base, ovr_distribution=choice, gamma_init=0.5).save_pretrained(tmp_path / choice)
        _, body = _card((tmp_path / choice / "README.md").read_text())
        assert text in body and "0.5 / 0.01" in body


def test_a_local_data_file_is_never_card_metadata(trained, tmp_path):
    """A training file's name (`data/train.jsonl` reads as a repo id) stays in the training record, out of the
    `datasets:` metadata the Hub links to dataset repos."""
    trained.training_summary = {**trained.training_summary, "datasets": ["data/train.jsonl", "someone/tiny-corpus"]}
    trained.save_pretrained(tmp_path / "a")
    meta, body = _card((tmp_path / "a" / "README.md").read_text())
    assert meta["datasets"] == ["someone/tiny-corpus"] and "`data/train.jsonl`" in body


@pytest.mark.parametrize("problem", ["no template", "no jinja2", "render error"])
def test_the_card_never_fails_a_save(tied_base, tmp_path, monkeypatch, caplog, problem):
    fresh = CausalQwenForCausalLM.from_base(tied_base)
    fresh.save_pretrained(tmp_path / "first")
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "first")
    if problem == "no template":  # what a model loaded as remote code sees: transformers copies only .py files
        monkeypatch.setattr(model_card, "TEMPLATE_NAME", "absent.md.j2")
    elif problem == "no jinja2":  # huggingface_hub renders with jinja2 but does not depend on it
        monkeypatch.setitem(sys.modules, "jinja2", None)
    else:
        monkeypatch.setattr(model_card, "_safetensors_summary", lambda path: 1 / 0)

    fresh.save_pretrained(tmp_path / "fresh")
    assert (tmp_path / "fresh" / "config.json").exists() and not (tmp_path / "fresh" / "README.md").exists()
    assert "saved without a model card" in caplog.text

    loaded.save_pretrained(tmp_path / "again")
    card = (tmp_path / "again" / "README.md")
    if problem == "render error":
        assert not card.exists()
    else:  # keeps the card it was loaded with, naming its new folder
        first = (tmp_path / "first" / "README.md").read_text()
        assert card.read_text() == model_card.retarget_model_card(first, "again")


def test_card_written_before_the_weights_counts_the_model(trained, tmp_path):
    """The trainer writes the card into output_dir at each checkpoint, before output_dir holds any weights."""
    (tmp_path / "output").mkdir()
    model_card.write_model_card(trained, tmp_path / "output")
    _, body = _card((tmp_path / "output" / "README.md").read_text())
    parameters = sum(v.numel() for v in trained.adapter_state_dict().values())
    assert f"| adapter tensors | {parameters:,} parameters (float32) |" in body
    assert body.startswith("\n# output\n") and "| train_loss | 1.23457 |" in body


def test_retarget_model_card_changes_only_the_names():
    text = ('---\ntags: [x]\n---\n\n# run-3\n\nAutoModelForCausalLM.from_pretrained("run-3", trust_remote_code=True)\n'
            'AutoTokenizer.from_pretrained("run-3")\n')
    out = model_card.retarget_model_card(text, "user/run-3")
    assert out == text.replace("# run-3", "# user/run-3").replace('"run-3", trust', '"user/run-3", trust')
    assert model_card.retarget_model_card("# a card of someone else\n", "user/x") == "# a card of someone else\n"


# --------------------------------------------------------------------------------------- what a push never uploads


def _uploaded_bytes(hub) -> dict[str, bytes]:
    return {f"{repo}@{rev}/{name}": data for repo, revs in hub.repos.items() for rev, files in revs.items()
            for name, data in files.items()}


def _plant_secrets(out: Path, tmp_path: Path) -> bytes:
    """What a user's output_dir may hold beside the adapter: links to a key and a private folder, a hidden .env, a
    private data file. Returns the secret bytes none of which may reach the Hub."""
    secret = b"-----BEGIN OPENSSH PRIVATE KEY----- not for the hub"
    private = tmp_path / "private"
    private.mkdir()
    (private / "id_rsa").write_bytes(secret)
    (private / "records.jsonl").write_bytes(secret)
    (out / "notes.txt").symlink_to(private / "id_rsa")
    (out / "data").symlink_to(private, target_is_directory=True)
    (out / ".env").write_bytes(secret)
    (out / "train-private.jsonl").write_bytes(secret)
    return secret


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint", "all_checkpoints", "end"])
def test_trainer_pushes_upload_the_adapter_and_nothing_else(hub, sft_base, tmp_path, strategy):
    """Links in output_dir (to a key, to a private folder), hidden and private files and the Trainer's
    training_args.bin (a pickle holding hub_token) never reach the Hub, at a save's push or the end's; the token is
    in no uploaded byte, checkpoints included."""
    out = tmp_path / "out"
    trainer = _push_trainer(sft_base, out, hub_strategy=strategy)
    trainer.train()
    secret = _plant_secrets(out, tmp_path)
    if strategy != "end":
        trainer._push_from_checkpoint(str(out / "checkpoint-4"))
        trainer._finish_current_push()
    trainer.push_to_hub()
    main = hub.repos["user/tiny-causal"]["main"]
    top = {name for name in main if "/" not in name or name.startswith("lora/")}
    assert top == set(adapter_upload_files(out)) and "training_args.bin" not in top
    assert {"config.json", "model.safetensors", "README.md", "modeling_causalqwen.py"} <= top
    for name, data in _uploaded_bytes(hub).items():
        assert secret not in data and TOKEN.encode() not in data, name
    if strategy in ("checkpoint", "all_checkpoints"):  # the checkpoint keeps what a resume needs, the token redacted
        prefix = "last-checkpoint/" if strategy == "checkpoint" else "checkpoint-4/"
        assert {prefix + n for n in ("optimizer.pt", "trainer_state.json", "training_args.bin")} <= set(main)
        assert torch.load(out / "checkpoint-4" / "training_args.bin", weights_only=False).hub_token is None
    assert trainer.args.hub_token == TOKEN  # the run's own arguments keep it
    assert not list(out.glob("_hub_push.*"))


@pytest.mark.parametrize("link", ["tokenizer_config.json", "lora"])
def test_a_link_among_the_adapters_files_is_refused_before_any_request(hub, sft_base, tmp_path, link):
    out = tmp_path / "out"
    trainer = _push_trainer(sft_base, out, hub_strategy="end")
    trainer.train()
    trainer.save_model()
    private = tmp_path / "private"
    private.mkdir()
    (private / "id_rsa").write_bytes(b"secret")
    if link == "lora":
        (out / "lora").symlink_to(private, target_is_directory=True)
    else:
        (out / link).unlink()
        (out / link).symlink_to(private / "id_rsa")
    commits = len(hub.commits)
    with pytest.raises(ValueError, match="symbolic link.*Nothing was uploaded"):
        snapshot_for_upload(out)
    if link == "tokenizer_config.json":  # kept by the save as the user's own, refused by the push
        with pytest.raises(ValueError, match="symbolic link.*Nothing was uploaded"):
            trainer.push_to_hub()
    assert len(hub.commits) == commits and not list(out.glob("_hub_push.*"))


def test_a_checkpoints_links_are_left_out(tmp_path, caplog):
    checkpoint = tmp_path / "out" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"heads")
    (checkpoint / "notes.txt").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(b"secret")
    assert checkpoint_upload_files(checkpoint) == ["model.safetensors"]
    assert "notes.txt is a symbolic link: not uploaded" in caplog.text


def test_all_checkpoints_reach_the_hub_though_rotation_deletes_them_first(hub, sft_base, tmp_path, monkeypatch):
    """hub_strategy="all_checkpoints", save_total_limit=1, hub_always_push: each checkpoint's upload is queued
    behind slow ones and rotation deletes the folder before it runs; the snapshot taken at the save still holds it."""
    import time

    import causalqwen_adapter.hub as hub_module

    upload = hub_module.upload_snapshot

    def slow(snapshot, repo_id, **kwargs):
        time.sleep(0.5)
        return upload(snapshot, repo_id, **kwargs)

    monkeypatch.setattr(hub_module, "upload_snapshot", slow)
    out = tmp_path / "out"
    trainer = _push_trainer(sft_base, out, max_steps=6, hub_strategy="all_checkpoints", save_total_limit=1,
                            hub_always_push=True)
    trainer.train()
    assert not trainer._failed_pushes
    main = hub.repos["user/tiny-causal"]["main"]
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-6"]
    for step in (2, 4, 6):
        assert f"checkpoint-{step}/model.safetensors" in main and f"checkpoint-{step}/optimizer.pt" in main


def test_a_failed_background_push_warns_at_once_and_at_the_end_of_training(monkeypatch, no_token, sft_base, tmp_path,
                                                                           caplog):
    with _serve(monkeypatch, xet=False, fail_commit=True):
        trainer = _push_trainer(sft_base, tmp_path / "out", hub_strategy="every_save", hub_always_push=True)
        trainer.train()
    failures = trainer._failed_pushes
    assert len(failures) == 2 and all("Training in progress" in f and "500" in f for f in failures)
    assert caplog.text.count("pushing to the Hub failed") == 2
    assert "2 of this run's pushes to the Hub failed" in caplog.text and "trainer.push_to_hub()" in caplog.text


# --------------------------------------------------------------------------------------- the base a push names


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


def test_a_trainer_on_a_local_base_refuses_push_to_hub_before_training(hub, sft_base, tmp_path):
    with pytest.raises(ValueError, match="is a folder on this machine.*--hub_base_model_id"):
        _push_trainer(sft_base, tmp_path / "out", hub_base_model_id=None)
    assert hub.requests == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("version, outcome", [("4.57.1", "refused"), ("5.30.0", "warned"), ("5.23.0", "quiet")])
def test_the_remote_code_names_the_transformers_range_it_runs_on(monkeypatch, version, outcome):
    """The first remote module an Auto class imports checks the version before anything can fail on a missing name."""
    import importlib.util
    import warnings

    import transformers

    import causalqwen_adapter.configuration_causalqwen as configuration

    monkeypatch.setattr(transformers, "__version__", version)
    spec = importlib.util.spec_from_file_location("causalqwen_adapter._version_probe", configuration.__file__)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if outcome == "refused":
            with pytest.raises(ImportError, match=rf"needs transformers>=5.20,<5.25, and transformers {version}"):
                spec.loader.exec_module(module)
            return
        spec.loader.exec_module(module)
    said = [str(w.message) for w in caught if "transformers" in str(w.message)]
    assert (said == []) == (outcome == "quiet")
    if outcome == "warned":
        assert "tested on transformers>=5.20,<5.25" in said[0]


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


def test_an_adapter_id_the_hub_does_not_have_gets_transformers_answer(hub, monkeypatch):
    """A mistyped Hub id: transformers' own message (not "an interrupted save"), and offline the offline one."""
    with pytest.raises(OSError) as raised:
        CausalQwenForCausalLM.from_pretrained("user/no-such-adapter")
    assert "interrupted" not in str(raised.value) and "user/no-such-adapter" in str(raised.value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    requests = len(hub.requests)
    with pytest.raises(OSError, match="offline|couldn't connect|cached files"):
        CausalQwenForCausalLM.from_pretrained("user/no-such-adapter")
    assert len(hub.requests) == requests  # not a single request offline
