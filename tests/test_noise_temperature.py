"""bench/noise_temperature.py: the OvR mode read at several noise temperatures, beside the compatible mode."""

import importlib.util
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from causalqwen_adapter import CausalQwenForCausalLM
from causalqwen_adapter.data import batches, tokenize_for_evaluation
from causalqwen_adapter.evaluation import evaluate

SPEC = importlib.util.spec_from_file_location("noise_temperature",
                                              Path(__file__).resolve().parents[1] / "bench" / "noise_temperature.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def test_each_temperature_is_the_modes_own_reading(sft_base):
    """T = 0 in `standard` is the `causal` mode (no noise); a T far above the config's flattens every P_k, so the
    mode's next-token NLL comes to the compatible mode's; the compatible row is that mode."""
    torch.manual_seed(0)
    model = CausalQwenForCausalLM.from_base(str(sft_base)).eval()
    with torch.no_grad():  # heads off their start, so that the modes differ
        model.action.bias.normal_(std=1.0)
        model.abduction.scale.bias.fill_(-1.0)
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    rows = tokenize_for_evaluation(Dataset.from_dict({"text": ["the cat sat on the mat", "a dog ran to the cat"]}),
                                   tokenizer, max_length=32)
    got = {r["setting"]: r for r in bench.measure(model, rows, 0, "standard", [0.0, 1e6])}

    def reference(mode):
        return evaluate(model, batches(rows, 4, 0), (mode,))[mode]

    for setting, mode in (("compatible", "compatible"), ("standard, T = 0", "causal"),
                          ("standard, config T", "standard")):
        want = reference(mode)
        assert all(abs(got[setting][k] - want[k]) < 1e-9 for k in bench.METRICS), setting
    flat, compatible = got["standard, T = 1e+06"]["nll"], got["compatible"]["nll"]
    assert abs(flat - compatible) < 1e-3 < abs(got["standard, T = 0"]["nll"] - compatible)
    assert "| standard, T = 0 |" in bench.markdown(list(got.values()))
