"""Loading an adapter by Hub id: the remote code names the transformers range it runs on before anything else can
fail, and an id the Hub does not have gets transformers' own answer (FakeHub, tests/fake_hub.py).
"""


import pytest
from huggingface_hub import constants

from causalqwen_adapter import CausalQwenForCausalLM


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
