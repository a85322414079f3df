"""`causalqwen compare --device`: the base extracts the features and the heads train on the device; the feature cache,
the splits and the metrics stay on the CPU. On a CUDA device (`make test-gpu`) the features, the trained heads and
their scores equal the CPU's within float32 rounding and the command runs end to end; on any machine, a device
setting that cannot work is refused before anything is written."""

import pytest
import torch
from test_compare import _features, argv, base_folder, tokenizer_dir, write_rows  # noqa: F401 (fixtures)
from transformers import AutoModelForCausalLM

from causalqwen_adapter.classification import LabelSet, label_scores
from causalqwen_adapter.cli import compare
from causalqwen_adapter.comparison.arms import ARMS
from causalqwen_adapter.comparison.runs import check_num_proc
from causalqwen_adapter.comparison.training import RecipeRates, train_arm
from causalqwen_adapter.modeling_causalqwen import CausalQwenForCausalLM

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu)")


def test_a_device_the_machine_lacks_is_refused_before_anything_is_written(base_folder, tokenizer_dir,  # noqa: F811
                                                                          tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    data = write_rows(tmp_path / "rows.jsonl")
    with pytest.raises(SystemExit) as exit_info:
        compare.main([*argv(base_folder, data, tmp_path / "out", tokenizer=tokenizer_dir), "--device", "cuda"])
    assert exit_info.value.code == 2 and "no cuda device on this machine" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_auto_is_cuda_else_the_cpu_and_mps_is_refused(monkeypatch):
    """`auto` never picks MPS (the loss accumulates in float64, which MPS lacks), and an MPS asked for is refused with
    what to pass instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)  # a Mac: the package's auto would pick it
    assert compare.compare_device("auto") == torch.device("cpu")
    monkeypatch.setattr(compare, "resolve_device", lambda spec: torch.device("mps"))
    with pytest.raises(ValueError, match="MPS does not support: pass --device cpu"):
        compare.compare_device("mps")


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps"])
def test_processes_on_an_accelerator_are_refused(device):
    """A forked process cannot use the parent's CUDA context: --num_proc > 1 is for the CPU (checked on the device's
    name, whether or not this machine has it)."""
    with pytest.raises(ValueError, match="pass --num_proc 1"):
        check_num_proc(2, 1, device)
    check_num_proc(1, 1, device)  # one process trains the runs one after another on it
    check_num_proc(2, 1, "cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arm", ["ovr_candidates", "softmax", "gce", "ovr_alone_absolute_logistic"])
def test_a_run_on_cuda_trains_the_cpus_heads(base_folder, arm):  # noqa: F811
    """The same run (features on the CPU, the heads on each device): the heads' updates and the label scores of the
    test rows agree within float32 rounding (the package's loss runs its Triton kernels on the GPU, torch on the
    CPU). The updates are compared as wholes: Adam moves a weight whose gradient is near 0 by ±lr whichever sign
    rounding gives it, so single elements may differ by 2·lr per step."""
    features, labels = None, LabelSet([" a", " b", " c"], [10, 11, 12])
    trained, initial = {}, None
    for device in ("cpu", "cuda"):
        base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32).to(device).eval()
        features = features or _features(base, n=40)
        if initial is None:
            fresh = CausalQwenForCausalLM.from_base(base, **ARMS[arm]["heads"])
            initial = {n: t.detach().clone() for n, t in fresh.named_parameters()
                       if not n.startswith(fresh.base_model_prefix + ".")}
        rows = torch.arange(32)
        model = train_arm(base, arm, features, rows, features["label"].tolist(), labels, 2, 1e-3, 4, 8, 0,
                          RecipeRates())
        heads = {name: t.detach().cpu() for name, t in model.named_parameters()
                 if not name.startswith(model.base_model_prefix + ".")}
        trained[device] = heads, label_scores(model, features["z"][32:], labels, label_columns=True)
        assert all(t.device.type == device for n, t in model.named_parameters()
                   if not n.startswith(model.base_model_prefix + "."))
    (cpu_heads, cpu_scores), (gpu_heads, gpu_scores) = trained["cpu"], trained["cuda"]
    assert cpu_heads.keys() == gpu_heads.keys()
    for name in cpu_heads:
        on_cpu, on_gpu = cpu_heads[name] - initial[name], gpu_heads[name] - initial[name]
        assert (on_gpu - on_cpu).norm() <= 1e-2 * on_cpu.norm() + 1e-7, name
    for field in ("loc", "log_partition", "log_P", "x"):
        a, b = getattr(gpu_scores, field), getattr(cpu_scores, field)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.device.type == "cpu"
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=field)


@pytest.mark.gpu
@needs_cuda
def test_compare_runs_end_to_end_on_cuda(base_folder, tokenizer_dir, tmp_path):  # noqa: F811
    """The command on the GPU: every run trained, the table says where it ran, and the features it cached came back
    to the CPU equal to the CPU's extraction within rounding."""
    data = write_rows(tmp_path / "rows.jsonl")
    outs = {}
    for device in ("cuda", "cpu"):
        outs[device] = compare.main([*argv(base_folder, data, tmp_path / device, tokenizer=tokenizer_dir),
                                     "--device", device, "--no_plots"])
        assert f"on {device}" in (tmp_path / device / "comparison.md").read_text()
    assert [(r["arm"], r["seed"], r["lr"]) for r in outs["cuda"]["runs"]] == \
        [(r["arm"], r["seed"], r["lr"]) for r in outs["cpu"]["runs"]]
    on_gpu, on_cpu = (torch.load(tmp_path / d / "features" / "features.pt") for d in ("cuda", "cpu"))
    assert on_gpu.keys() == on_cpu.keys() and all(t.device.type == "cpu" for t in on_gpu.values())
    for name in ("z", "z_label"):
        torch.testing.assert_close(on_gpu[name], on_cpu[name], rtol=1e-4, atol=1e-4, msg=name)
    assert torch.equal(on_gpu["label"], on_cpu["label"])
