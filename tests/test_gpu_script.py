"""bench/gpu.py runs on the CPU (`--device cpu`) through the same code a lent GPU runs: the sharded launches, the decode
and loss comparisons, at tiny sizes. A broken script would otherwise be found only with a GPU's minutes running."""

import sys

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import gpu  # noqa: E402

loss_bench = sys.modules["loss"]  # bench/loss.py, which gpu.py imports


def test_decode_part_prints_every_variant_against_the_base(sft_base, capsys):
    gpu.decode(sft_base, [1, 2], new_tokens=3, rounds=1, device=torch.device("cpu"))
    out = capsys.readouterr().out
    for variant in ("base", "compatible", "standard", "standard (eager)", "causal", "sampling"):
        # the rows as decode.print_rows writes them: batch size, variant, rates and their ratios to the base's
        rows = [line for line in out.splitlines() if line[7:31].strip() == variant and line[:5].strip() in ("1", "2")]
        assert [row[:5].strip() for row in rows] == ["1", "2"], (variant, out)
        assert f"  {variant:<24} peak" in out  # the per-variant memory and kernels line (NaN off CUDA)


def test_loss_part_times_every_variant_and_their_ratios(monkeypatch, capsys):
    monkeypatch.setattr(loss_bench, "V", 640)  # the loss bench's head shape, read when each step is built
    monkeypatch.setattr(loss_bench, "C", 24)
    gpu.loss([32, 300], rounds=2, repeat=1, device=torch.device("cpu"), dtype="float32", chunk_factors=(2, 4))
    out = capsys.readouterr().out
    assert torch.get_default_dtype() == torch.float32  # restored after build_step set it
    for variant in ("a", "d", "v"):
        assert f"N=32 ({variant}) " in out
    assert "N=32 d/a time " in out and "N=32 v/a time " in out
    # (d) at twice its planned chunk (150 tokens on the CPU at N = 300) where that is fewer chunks, never where not
    assert "N=300: (d×2) in chunks of 300 tokens (1 chunks)" in out and "N=300 (d×2) (d), chunks of 300" in out
    assert "N=300 d×2/d time " in out and "N=300 d×2/a time " in out
    assert "(d×4)" not in out and "N=32 (d×2)" not in out
    assert "(l)" not in out.split("===")[-1]  # Liger's Triton kernels only on a GPU: never silently left out
    assert "skipped loss (l) Liger-Kernel: " in out.split("===")[0]


def test_the_run_has_one_deadline_and_says_what_it_skipped(monkeypatch, capsys):
    """--deadline bounds the whole run: parts (and loss sizes, rounds, launches) that would start after it are
    skipped and listed with their reason at the end, and subprocesses get at most what is left."""
    deadline = gpu.Deadline(5)
    assert 1 <= deadline.timeout(240) <= 5 and deadline.allows("anything") and not deadline.skipped
    spent = gpu.Deadline(0)
    gpu.loss([32], rounds=2, repeat=1, device=torch.device("cpu"), dtype="float32", deadline=spent)
    out = capsys.readouterr().out
    assert "skipped loss N=32: the --deadline of 0 s is spent" in out and "N=32 (a)" not in out
    assert any(s.startswith("loss (l) Liger-Kernel: ") for s in spent.skipped)

    monkeypatch.setattr(sys, "argv", ["gpu.py", "--device", "cpu", "--parts", "sharded", "loss", "--deadline", "0",
                                      "--base", "unused"])
    gpu.main()
    out = capsys.readouterr().out
    assert "skipped sharded: the --deadline of 0 s is spent" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("skipped: ") and "sharded: the --deadline" in summary and "loss: the --deadline" in summary


def test_the_gpu_extra_installs_the_comparison_targets():
    """`pip install .[gpu]` brings Liger-Kernel (the loss comparison) and DeepSpeed (the ZeRO-3 step) with Triton."""
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"triton", "liger-kernel", "deepspeed"} <= set(extras["gpu"])


@pytest.mark.slow
def test_sharded_part_trains_and_saves_under_each_launch_config(sft_base, tmp_path, capsys):
    pytest.importorskip("deepspeed")
    gpu.sharded_steps(sft_base, tmp_path, timeout=240, device=torch.device("cpu"))
    out = capsys.readouterr().out
    for config in ("fsdp2.yaml", "deepspeed_zero3.yaml"):
        assert f"{config}: ok" in out, out
        assert (tmp_path / config / "model.safetensors").is_file()


def test_cpu_runs_refuse_the_tests_part(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--device", "cpu", "--parts", "tests"])
    with pytest.raises(SystemExit, match="leave out the tests part"):
        gpu.main()
