"""A fake Hugging Face Hub served on 127.0.0.1, and the fixtures of the Hub tests (tests/test_hub_*.py).

FakeHub implements the routes huggingface_hub 2.4 calls for create_repo, create_branch and upload_folder,
on both of its upload paths: the pipelined one (hf_xet installed, the default) and the legacy one
(create_commit: validate-yaml, preupload, LFS batch + PUT, NDJSON commit). It stores what was committed, so
the tests compare it byte for byte with the adapter folder and then load it back by repo id from an offline
cache laid out from the uploaded files. The fixtures (no_token, hub, cache, trained) reach the tests through
tests/conftest.py.
"""

import base64
import hashlib
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import pytest
import torch
import transformers.utils.hub
import yaml
from huggingface_hub import constants

from causalqwen_adapter import CausalQwenForCausalLM

TOKEN = "hf_test_token"
BASE_ID = "someone/tiny-qwen2"  # the base's Hub id, served from an offline cache


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
