"""Shared fixtures: tiny random Qwen2 checkpoints saved to disk, and the real demo base when built."""

import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# the Hub tests' fixtures (tests/test_hub_*.py), kept beside the fake Hub they serve; conftest makes them reachable
from fake_hub import cache, hub, no_token, trained  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_BASE = Path(os.environ.get("CAUSALQWEN_DEMO_BASE", REPO_ROOT / "build" / "demo-base"))

TINY_VOCAB = 128
TINY_HIDDEN = 32


def decision_scores_float64(loc_S, scale_S, threshold, relative, distribution):
    """The OvR modes' logits from docs/design.md's formulas, directly, in float64: P = ½ + atan(x)/π, q ∝ r·(1 − A + P)
    (a zero scale floored at float32's smallest normal, as cauchy.ovr_standardize does)."""
    loc, scale = loc_S.double(), scale_S.double().clamp_min(torch.finfo(torch.float32).tiny)
    log_r = torch.log_softmax(loc, -1)
    # P = ½ + atan(x)/π written as atan2(1, −x)/π: the same number, but ½ + atan(x) would round the tail P < 1e-17
    # to 0 even in float64
    x = ((log_r if relative else loc) - threshold.double()) / scale
    P = torch.atan2(torch.ones_like(x), -x) / math.pi
    if distribution == "normalize":
        return P.log()
    if distribution == "accept":
        return loc + P.log()
    r = log_r.exp()
    accepted = (r * P).sum(-1, keepdim=True)
    return log_r + (1 - accepted + P).log()


def tiny_qwen2_config(**overrides) -> Qwen2Config:
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=TINY_VOCAB - 1,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def save_tiny_qwen2(folder: Path, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**overrides)).eval()
    if not model.config.tie_word_embeddings:
        # untied: give lm_head values of its own so a mix-up with the embedding would show
        with torch.no_grad():
            model.lm_head.weight.normal_(std=0.05)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=["tied", "untied"])
def tiny_base(request, tmp_path_factory) -> Path:
    tied = request.param == "tied"
    return save_tiny_qwen2(tmp_path_factory.mktemp(f"tiny-base-{request.param}"), tie_word_embeddings=tied)


@pytest.fixture(scope="session")
def tied_base(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-base"), tie_word_embeddings=True)


# cpu always; cuda where a CUDA device is present, marked `gpu` so that `make test-gpu` (`pytest -m gpu`) selects it
DEVICES = [pytest.param("cpu", id="cpu")]
if torch.cuda.is_available():
    DEVICES.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each device the tests run on: the CPU, and the current CUDA device when there is one."""
    return torch.device(request.param)


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(1, TINY_VOCAB - 1, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def demo_base() -> Path:
    if not (DEMO_BASE / "config.json").exists():
        pytest.skip(f"real demo base not built at {DEMO_BASE}: run `make test-real`")
    return DEMO_BASE


# A tiny Qwen2 saved with a word-level tokenizer trained on these sentences (trainer and distillation tests).
TOKENIZER_BASE_VOCAB = 128

PAIRS = [
    ("what is two plus two", " two plus two is four"),
    ("hello how are you", " i am fine thank you"),
    ("the sky is", " blue today"),
    ("a dog", " ran in the park"),
    ("the cat sat on", " the mat"),
    ("cats and dogs", " are friends"),
    ("hello", " how are you today"),
    ("two plus two", " is four"),
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on the test sentences, with a chat template."""
    words = [p + c for p, c in PAIRS] + ["user assistant system"]
    special = ["<unk>", "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=special))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_base_with_tokenizer(folder: Path) -> Path:
    """A tiny Qwen2 and a word-level tokenizer trained on the test sentences, saved together like a Hub base."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=TOKENIZER_BASE_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        # A pad id would zero its embedding row, i.e. a row of W_A with scale_S = 0; the base stays generic.
        pad_token_id=None,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def sft_base(tmp_path_factory) -> Path:
    return build_tiny_base_with_tokenizer(tmp_path_factory.mktemp("trainer-tiny-base"))


def modes_not_plain(folder: Path) -> dict[str, str]:
    """The entries of `folder` (itself included) whose permission bits differ from what a plain `mkdir` / `open()`
    gives under the process's umask: {relative path: "got 0o…, plain 0o…"}."""
    umask = os.umask(0)
    os.umask(umask)
    wrong = {}
    for path in (folder, *folder.rglob("*")):
        mode, plain = path.stat().st_mode & 0o777, (0o777 if path.is_dir() else 0o666) & ~umask
        if mode != plain:
            wrong[path.relative_to(folder).as_posix()] = f"got {mode:#o}, plain {plain:#o}"
    return wrong


def free_port() -> int:
    """A TCP port free on this machine now, for a distributed job's MASTER_PORT."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_processes(commands: list[tuple[list[str], dict]], *, cwd=None, timeout: float = 180,
                  what: str = "the processes") -> list[tuple[int, str, str]]:
    """Start every (argv, env) at once (the ranks of one distributed job), wait for all; (return code, stdout, stderr)
    each. On timeout every process group is killed and the test fails: a rank that waits forever is a failure."""
    procs = [subprocess.Popen(argv, env={**env, "PYTHONFAULTHANDLER": "1"}, cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for argv, env in commands]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        waiting = procs[len(results):]
        for proc in waiting:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints where every thread waits
        tails = []
        for proc in waiting:
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            tails.append(f"--- process {procs.index(proc)} ---\n{(out + err)[-3000:]}")
        for proc in procs:  # children of a finished rank too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"{what} timed out after {timeout:.0f} s (a process waited for another, or for a lock)\n"
                    + "\n".join(tails))
    return results


KILL_MID_SWAP = """
import os, sys
import torch
from causalqwen_adapter import CausalQwenForCausalLM
import causalqwen_adapter.adapter_io as m
model = CausalQwenForCausalLM.from_base(sys.argv[1])
with torch.no_grad():
    model.action.b_noise.add_(1.0)  # the new save differs from the old
real, calls = os.replace, []
def die(src, dst):
    calls.append(dst)
    if len(calls) == 3:
        os.kill(os.getpid(), 9)
    real(src, dst)
m.os.replace = die
model.save_pretrained(sys.argv[2])
"""


def kill_save_mid_swap(base: Path, folder: Path) -> None:
    """Save fresh heads of `base` over the adapter in `folder` in another process, killed (SIGKILL, no chance to undo)
    at its third file move: config.json and one file set aside, the new file not yet in."""
    proc = subprocess.run([sys.executable, "-c", KILL_MID_SWAP, str(base), str(folder)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
